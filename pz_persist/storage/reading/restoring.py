"""From an opened item to the saved tree (`read_tree`), from a manifest and its
arrays to the tree (`decode`), or to its abstract form (`abstract_tree`).
Reading the arrays is `pz_persist.storage.reading.reader`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pz_persist import errors
from pz_persist import progress as progress_lib
from pz_persist import sharding as sharding_lib
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import decode as decode_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.storage.reading import opening
from pz_persist.storage.reading import reader


def read_tree(
    opened: opening.OpenItem,
    *,
    sharding: sharding_lib.Target = None,
    verify: bool = True,
    progress: progress_lib.Progress = None,
    options: reader.ReadOptions | None = None,
) -> Any:
  """The saved tree of an item opened by `pz_persist.storage.reading.opening.read`:
  every array read (`reader.read_arrays`), then the tree decoded.

  What `pz_persist.load`, `load_model(path)` and the Orbax handlers' restore
  share; the arguments are `pz_persist.load`'s.
  """
  directory, manifest = opened.item, opened.manifest
  with progress_lib.tracking(progress, f"loading {directory}",
                             delay=reader.LOAD_PROGRESS_DELAY) as tracker:
    values = reader.read_arrays(
        directory, manifest, sharding=sharding, verify=verify, tracker=tracker,
        options=options or reader.ReadOptions(), snapshot=opened.snapshot,
    )
  return decode(manifest, values, where=str(directory))


def decode(manifest: manifest_lib.Manifest, values: Sequence[Any], *, where: str) -> Any:
  """The saved tree, from its manifest and its arrays (see
  `pz_persist.storage.reading.reader.values`)."""
  tree, variables, tables = manifest.decodable()
  return decode_lib.decode(
      tree, variables, values, root=errors.Location(where, "tree"),
      labels=[spec.label for spec in manifest.arrays],
      format_version=manifest.format_version, writer=manifest.writer, tables=tables,
  )


def abstract_tree(manifest: manifest_lib.Manifest, *, where: str) -> Any:
  """The saved tree with ``jax.ShapeDtypeStruct`` in place of every array."""
  # NumPy scalars have no abstract form of their own: a 0-d struct stands in.
  values = arrays_lib.abstract_values(manifest.arrays)
  tree, variables, tables = manifest.decodable()
  return decode_lib.decode(
      tree,
      variables,
      values,
      abstract=True,
      root=errors.Location(where, "tree"),
      labels=[spec.label for spec in manifest.arrays],
      format_version=manifest.format_version, writer=manifest.writer, tables=tables,
  )
