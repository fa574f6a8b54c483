"""A digest of every file of a checkpoint item, written once it is complete.

Array checksums (`pz_persist.checksums`) say *which label* is damaged, but only
catch damage that changes the bytes an array decodes to. A flipped bit in
compressed framing, in Orbax's index files or in an unused byte may not; a
digest of every file catches all of them, and says *which file*. The digests
are written by the primary process after Orbax has finalized the item (so the
multi-process OCDBT merge is included) and cost one read of the freshly written
files, from the page cache. `pz_persist.verify` checks both. (Orbax's
``commit_success.txt`` marker, a timestamp written after the item is complete
on file systems without atomic rename, is not covered: it holds no data.)

Layout of ``pz_persist.files.json``::

  {"format": "pz_persist.files", "algorithm": "xxh3_128",
   "files": {"relative/path": [size_in_bytes, "hexdigest"], ...}}
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

from etils import epath

from pz_persist import checksums
from pz_persist import directories
from pz_persist import errors

FILENAME = "pz_persist.files.json"
MAX_BYTES = 64 * 2**20
"""Larger digest files are refused before parsing."""

_FORMAT = "pz_persist.files"


def _files(directory: str) -> list[str]:
  """Relative paths of the item's files (not the digest file, not temporaries)."""
  found = []
  for root, _, names in os.walk(directory):
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), directory)
      if rel == FILENAME or (name.startswith(".") and name.endswith(".tmp")):
        continue
      found.append(rel.replace(os.sep, "/"))
  return sorted(found)


def write(directory: epath.Path) -> None:
  """Records the size and digest of every file in ``directory`` (local only)."""
  if not directories.is_local(directory):
    return  # Remote stores checksum their objects themselves.
  root = os.fspath(directory)
  files = {
      rel: [os.path.getsize(os.path.join(root, rel)),
            checksums.file_digest(os.path.join(root, rel))]
      for rel in _files(root)
  }  # fmt: skip
  data = json.dumps(
      {"format": _FORMAT, "algorithm": checksums.ALGORITHM, "files": files},
      separators=(",", ":"),
  ).encode()
  tmp = os.path.join(root, f".{FILENAME}.{uuid.uuid4().hex}.tmp")
  with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(root, FILENAME))


def check(directory: epath.Path) -> tuple[int, list[str]] | None:
  """Compares every recorded file with its digest.

  Returns:
    ``(files checked, problems)``, one problem line per missing, resized or
    changed file; None if the item has no digest file (written by an older
    pz_persist, or on a remote store).
  """
  root = os.fspath(directory)
  path = os.path.join(root, FILENAME)
  if not directories.is_local(directory) or not os.path.isfile(path):
    return None
  with open(path, "rb") as f:
    raw = f.read(MAX_BYTES + 1)
  recorded = _parse(raw, where=path)
  problems = []
  for rel, (size, digest) in recorded.items():
    full = os.path.join(root, rel)
    if not os.path.isfile(full):
      problems.append(f"{full}: missing")
    elif os.path.getsize(full) != size:
      problems.append(f"{full}: {os.path.getsize(full)} bytes, {size} when saved")
    elif checksums.file_digest(full) != digest:
      problems.append(f"{full}: contents changed since it was saved")
  return len(recorded), problems


def _parse(raw: bytes, *, where: str) -> dict[str, tuple[int, str]]:
  """Parses and validates a digest file; any flaw is a `ManifestError`."""
  if len(raw) > MAX_BYTES:
    raise errors.ManifestError(f"{where}: over the {MAX_BYTES}-byte limit.")
  try:
    data: Any = json.loads(raw)
  except (ValueError, RecursionError) as e:
    raise errors.ManifestError(f"{where}: not valid JSON: {e}") from None
  if (
      not isinstance(data, dict)
      or data.get("format") != _FORMAT
      or data.get("algorithm") != checksums.ALGORITHM
      or not isinstance(data.get("files"), dict)
  ):
    raise errors.ManifestError(f"{where}: not a pz_persist file digest list.")
  files = {}
  for rel, entry in data["files"].items():
    parts = rel.split("/")
    if (
        not rel or rel.startswith("/") or ".." in parts or "\0" in rel
        or not isinstance(entry, list) or len(entry) != 2
        or type(entry[0]) is not int or not isinstance(entry[1], str)
    ):  # fmt: skip
      raise errors.ManifestError(f"{where}: invalid entry for {rel!r}.")
    files[rel] = (entry[0], entry[1])
  return files
