"""From a manifest and the arrays Orbax read back to the saved tree.

Both Orbax integrations (`pz_persist.orbax_v0`, `pz_persist.orbax_v1`) read
arrays their own way but share everything around it, which lives here:
deciding where each array goes (`read_targets`), refusing a load that could only
succeed by silently changing values (`check_loadable`), checking that what was
read is what the manifest promised and undoing storage substitutions
(`values`), and decoding the tree (`decode`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from pz_persist import arrays as arrays_lib
from pz_persist import checksums as checksums_lib
from pz_persist import encoding
from pz_persist import errors
from pz_persist import manifest as manifest_lib
from pz_persist import sharding as sharding_lib

def check_loadable(
    manifest: manifest_lib.Manifest, where: str, refs: Collection[int] | None = None
) -> None:
  """Refuses, before reading anything, a load that would change values.

  A 64-bit ``jax.Array`` loaded while ``jax_enable_x64`` is off would be cast
  to 32 bits by JAX without a word; that is exactly the silent change this
  library exists to prevent.
  """
  if jax.config.jax_enable_x64:
    return
  for index, spec in enumerate(manifest.arrays):
    if refs is not None and index not in refs:
      continue
    if spec.kind == "jax" and spec.dtype in _X64_DTYPES:
      raise errors.PzPersistError(
          f"{where}: {spec.path} is a {spec.dtype} jax.Array, but"
          " jax_enable_x64 is off, so JAX would silently cast it to 32 bits."
          " Call jax.config.update('jax_enable_x64', True) before loading."
      )


_X64_DTYPES = frozenset({"float64", "int64", "uint64", "complex128"})


def read_targets(
    manifest: manifest_lib.Manifest,
    target: sharding_lib.Target = None,
    refs: Collection[int] | None = None,
) -> dict[str, jax.sharding.Sharding | None]:
  """Where each stored array to read goes (None: NumPy), by storage key."""
  placed = sharding_lib.placements(manifest, target)
  return {
      spec.key: placed[index]
      for index, spec in enumerate(manifest.arrays)
      if spec.is_stored and (refs is None or index in refs)
  }


def _check_read(spec: arrays_lib.ArraySpec, value: Any, where: str) -> None:
  shape, dtype = tuple(np.shape(value)), np.dtype(value.dtype)
  if shape != spec.shape or dtype != spec.storage_dtype:
    raise errors.ManifestError(
        f"{where}: {spec.path} (key {spec.key}) should be"
        f" {spec.storage_dtype}{list(spec.shape)} by the manifest, but the"
        f" stored array is {dtype}{list(shape)}."
    )


def values(
    manifest: manifest_lib.Manifest,
    stored: Mapping[str, Any],
    *,
    where: str,
    target: sharding_lib.Target = None,
    refs: Collection[int] | None = None,
    verify: bool = False,
) -> list[Any]:
  """The saved arrays, from what Orbax read back, aligned with the manifest.

  Checks each against the manifest (and, with ``verify``, its stored bytes
  against their recorded checksums), undoes storage substitutions, restores
  kinds and weak types, and makes the zero-size arrays (which are not stored)
  where ``target`` puts them. Arrays not in ``refs`` (when given) are None.

  Raises:
    IntegrityError: with ``verify``, some arrays' bytes do not match their
      checksums; it names every such array (``damaged`` lists them).
  """
  placed = sharding_lib.placements(manifest, target)
  damaged = []
  result = []
  for index, spec in enumerate(manifest.arrays):
    if refs is not None and index not in refs:
      result.append(None)
    elif not spec.is_stored:
      result.append(arrays_lib.empty_array(spec, placed[index]))
    elif spec.key not in stored:
      raise errors.ManifestError(
          f"{where}: the array of {spec.path} (key {spec.key}) is missing."
      )
    else:
      _check_read(spec, stored[spec.key], where)
      if verify and spec.checksums is not None:
        found = checksums_lib.check(stored[spec.key], spec.checksums)
        if found.mismatched:
          damaged.append(describe_damage(spec, found))
      result.append(arrays_lib.from_storage(stored[spec.key], spec))
  raise_if_damaged(damaged, where=where)
  return result


def raise_if_damaged(damaged: Sequence[str], *, where: str) -> None:
  """Raises `IntegrityError` listing ``damaged`` (lines from `describe_damage`)."""
  if damaged:
    raise errors.IntegrityError(
        f"{where}: {len(damaged)} array(s) do not match the checksums recorded"
        " when they were saved (the files were damaged or changed after"
        " saving):\n  " + "\n  ".join(damaged),
        damaged=tuple(damaged),
    )


def describe_damage(spec: arrays_lib.ArraySpec, found: checksums_lib.Check) -> str:
  """One line naming a damaged array: label, tree path, damaged slices."""
  who = spec.describe()
  slices = ", ".join(
      "[" + ", ".join(f"{a}:{b}" for a, b in index) + "]"
      for index in found.mismatched[:4]
  )
  more = f" and {len(found.mismatched) - 4} more" if len(found.mismatched) > 4 else ""
  return f"{who} (key {spec.key}): slice(s) {slices}{more} differ"


def assemble(
    manifest: manifest_lib.Manifest, stored: Mapping[str, Any], *, where: str
) -> Any:
  """The saved tree, from its manifest and everything Orbax read back."""
  return decode(manifest, values(manifest, stored, where=where), where=where)


def decode(manifest: manifest_lib.Manifest, values: Sequence[Any], *, where: str) -> Any:
  """The saved tree, from its manifest and its arrays (see `values`)."""
  return encoding.decode(
      manifest.tree, manifest.variables, values, root=errors.Location(where, "tree"),
      labels=[spec.label for spec in manifest.arrays],
  )


def abstract_tree(manifest: manifest_lib.Manifest, *, where: str) -> Any:
  """The saved tree with ``jax.ShapeDtypeStruct`` in place of every array."""
  # NumPy scalars have no abstract form of their own: a 0-d struct stands in.
  values = [spec.abstract() for spec in manifest.arrays]
  return encoding.decode(
      manifest.tree,
      manifest.variables,
      values,
      abstract=True,
      root=errors.Location(where, "tree"),
      labels=[spec.label for spec in manifest.arrays],
  )
