"""Reading and writing a checkpoint's manifest as JSON, for tests that edit it.

Tests that forge or damage manifests edit the typed JSON of formats 2 and 3
(``tree``, ``variables``, one object per array); `read` gives a manifest in
that layout whatever format it was written in (a format 4 manifest is
parsed and written out again as format 2, or 3 if its keys are leaf names),
and `write` writes what it is given. Formats 2 and 3 are read for ever, so
their checks are what these tests exercise; format 4's own cases are in
``tests/hostile/test_compact.py``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from pz_persist.format import manifest as manifest_lib


def expanded(data: bytes, where: str = "manifest") -> dict:
  """The JSON of a manifest's bytes, in the layout of formats 2 and 3."""
  raw = json.loads(data)
  if not isinstance(raw, dict) or not isinstance(raw.get("format_version"), int) or (
      raw["format_version"] < manifest_lib.FIRST_COMPACT_FORMAT):
    return raw
  parsed = manifest_lib.Manifest.loads(data, where=where)
  older = dataclasses.replace(
      parsed, format_version=manifest_lib.FIRST_FORMAT_WITH_LEAF_KEYS if parsed.leaf_keys else 2)
  return json.loads(older.dumps())


def read(file: pathlib.Path | str) -> dict:
  """The manifest at ``file`` (a ``pz_persist.json``), as `expanded` says."""
  path = pathlib.Path(file)
  return expanded(path.read_bytes(), str(path))


def write(file: pathlib.Path | str, data: dict, **dumps_args) -> None:
  pathlib.Path(file).write_text(json.dumps(data, **dumps_args))
