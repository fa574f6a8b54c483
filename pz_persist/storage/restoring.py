"""From a manifest and its arrays to the saved tree (`decode`), or to its
abstract form (`abstract_tree`). Reading the arrays is `pz_persist.storage.reader`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from pz_persist import errors
from pz_persist.format import decode as decode_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.storage import reader
from pz_persist.storage import sharding as sharding_lib


def assemble(
    manifest: manifest_lib.Manifest, stored: Mapping[str, Any], *, where: str
) -> Any:
  """The saved tree, from its manifest and its stored arrays (by storage key,
  as `pz_persist.storage.reader` returns them before conversion)."""
  placed = sharding_lib.placements(manifest, None)
  return decode(
      manifest, reader.values(manifest, stored, where=where, placed=placed), where=where
  )


def decode(manifest: manifest_lib.Manifest, values: Sequence[Any], *, where: str) -> Any:
  """The saved tree, from its manifest and its arrays (see
  `pz_persist.storage.reader.values`)."""
  return decode_lib.decode(
      manifest.tree, manifest.variables, values, root=errors.Location(where, "tree"),
      labels=[spec.label for spec in manifest.arrays],
  )


def abstract_tree(manifest: manifest_lib.Manifest, *, where: str) -> Any:
  """The saved tree with ``jax.ShapeDtypeStruct`` in place of every array."""
  # NumPy scalars have no abstract form of their own: a 0-d struct stands in.
  values = [spec.abstract() for spec in manifest.arrays]
  return decode_lib.decode(
      manifest.tree,
      manifest.variables,
      values,
      abstract=True,
      root=errors.Location(where, "tree"),
      labels=[spec.label for spec in manifest.arrays],
  )
