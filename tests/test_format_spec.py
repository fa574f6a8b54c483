"""The format specification (docs/format-spec.md) says what the code enforces.

Why: the specification is normative for anyone writing another reader or
writer, and it was written from `pz_persist/format/`; when the code gains a
node type, an array-entry field, a format version or a limit, this fails
until the page says so too.
"""

from __future__ import annotations

import os
import re

from conftest import REPO

from pz_persist.format import array_specs
from pz_persist.format import checksum_records
from pz_persist.format import manifest
from pz_persist.format import nodes

with open(os.path.join(REPO, "docs", "format-spec.md"), encoding="utf-8") as _f:
  SPEC = _f.read()


def _section(number: int) -> str:
  return SPEC.split(f"\n## {number}. ")[1].split("\n## ")[0]


def test_current_format_version():
  assert f"Current manifest format: **{manifest.FORMAT_VERSION}**" in SPEC
  versions = re.findall(r"^\| (\d+) \|", _section(9), re.M)
  assert [int(v) for v in versions] == list(range(1, manifest.FORMAT_VERSION + 1))


def test_every_node_type_and_its_fields():
  table = _section(4)
  for tag, node_type in nodes.NODE_TYPES.items():
    row = next((line for line in table.splitlines()
                if line.startswith("|") and f"`{tag}`" in line.split("|")[1]), None)
    assert row is not None, f"node type {tag!r} is not in the specification"
    for field in node_type.field_names:
      assert f"`{field}`" in row, f"{tag}: field {field!r} missing from its row"
  assert str(nodes.MAX_DEPTH) in table
  assert all(f"`{impl}`" in table for impl in nodes.PRNG_IMPLS)


def test_manifest_fields_and_limits():
  fields = _section(2)
  for name in manifest._FIELDS:  # noqa: SLF001 (the set the reader enforces)
    assert f"| `{name}` |" in fields, name
  assert f"{manifest.MAX_MANIFEST_BYTES // 2**20} MiB" in fields
  assert "2^24" in fields and manifest.MAX_MANIFEST_NODES == 2**24
  assert f"objects than one per {manifest.MIN_BYTES_PER_OBJECT} bytes" in fields
  assert f"deeper than {manifest.MAX_JSON_DEPTH} levels" in fields


def test_array_entry_fields_dtypes_and_checksums():
  entries = _section(3)
  spec = array_specs.ArraySpec(
      key="00000_w", shape=(2,), dtype="uint4", kind="jax", weak_type=True, path="p",
      label="w", checksums=(checksum_records.ShardChecksum(((0, 2),), "0" * 32),))
  for name in spec.to_json():
    assert f"| `{name}` |" in entries, name
  for kind in array_specs.ARRAY_KINDS:
    assert f'`"{kind}"`' in entries, kind
  assert f"`{checksum_records.ALGORITHM}`" in entries or \
      f'"{checksum_records.ALGORITHM}"' in entries
  assert f"at most {array_specs.MAX_RANK}" in entries
  for name, (stored, _) in array_specs._SUBSTITUTES.items():  # noqa: SLF001
    assert f"`{name}`" in entries and f"`{stored}`" in entries, name


def test_file_names():
  assert f"`{manifest.MANIFEST_FILENAME}`" in SPEC
  assert f"`{manifest.FILE_DIGESTS_FILENAME}`" in SPEC
