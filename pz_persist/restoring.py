"""From a manifest and the arrays Orbax read back to the saved tree.

Both Orbax integrations (`pz_persist.orbax_v0`, `pz_persist.orbax_v1`) read
arrays their own way but share everything around it, which lives here:
deciding where each array goes (`placements`), refusing a load that could only
succeed by silently changing values (`check_loadable`), checking that what was
read is what the manifest promised, undoing storage substitutions, and
decoding the tree (`assemble`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from pz_persist import arrays as arrays_lib
from pz_persist import encoding
from pz_persist import errors
from pz_persist import manifest as manifest_lib

Placement = jax.sharding.Sharding | None
"""Where an array is restored: a sharding for a jax.Array, None for NumPy."""


def default_sharding() -> jax.sharding.Sharding:
  """Where a jax.Array goes when the caller did not say: the first local device."""
  return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def check_loadable(manifest: manifest_lib.Manifest, where: str) -> None:
  """Refuses, before reading anything, a load that would change values.

  A 64-bit ``jax.Array`` loaded while ``jax_enable_x64`` is off would be cast
  to 32 bits by JAX without a word; that is exactly the silent change this
  library exists to prevent.
  """
  if jax.config.jax_enable_x64:
    return
  for spec in manifest.arrays:
    if spec.kind == "jax" and spec.dtype in _X64_DTYPES:
      raise errors.PzPersistError(
          f"{where}: {spec.path} is a {spec.dtype} jax.Array, but"
          " jax_enable_x64 is off, so JAX would silently cast it to 32 bits."
          " Call jax.config.update('jax_enable_x64', True) before loading."
      )


_X64_DTYPES = frozenset({"float64", "int64", "uint64", "complex128"})


def placements(
    manifest: manifest_lib.Manifest,
    sharding: jax.sharding.Sharding | None = None,
) -> dict[str, Placement]:
  """Where each stored array is read to, by storage key."""
  target = sharding or default_sharding()
  return {
      spec.key: (target if spec.kind == "jax" else None)
      for spec in manifest.arrays
      if spec.is_stored
  }


def _check_read(spec: arrays_lib.ArraySpec, value: Any, where: str) -> None:
  shape, dtype = tuple(np.shape(value)), np.dtype(value.dtype)
  if shape != spec.shape or dtype != spec.storage_dtype:
    raise errors.ManifestError(
        f"{where}: {spec.path} (key {spec.key}) should be"
        f" {spec.storage_dtype}{list(spec.shape)} by the manifest, but the"
        f" stored array is {dtype}{list(shape)}."
    )


def assemble(
    manifest: manifest_lib.Manifest,
    stored: Mapping[str, Any],
    *,
    where: str,
    sharding: jax.sharding.Sharding | None = None,
) -> Any:
  """Rebuilds the saved tree from the arrays read back by Orbax.

  Args:
    manifest: The checkpoint item's manifest.
    stored: The arrays Orbax restored, by storage key.
    where: The checkpoint path, for error messages.
    sharding: Where zero-size ``jax.Array`` values (which are not stored) go.
  """
  return assemble_parts(
      manifest.tree,
      manifest.variables,
      manifest.arrays,
      stored,
      where=where,
      sharding=sharding,
  )


def assemble_parts(
    tree: dict[str, Any],
    variables: Sequence[Any],
    specs: Sequence[arrays_lib.ArraySpec],
    stored: Mapping[str, Any],
    *,
    where: str,
    sharding: jax.sharding.Sharding | None = None,
) -> Any:
  """`assemble` for a tree node, variables table and array specs."""
  values = []
  for spec in specs:
    if not spec.is_stored:
      values.append(arrays_lib.empty_array(spec, sharding or default_sharding()))
      continue
    if spec.key not in stored:
      raise errors.ManifestError(
          f"{where}: the array of {spec.path} (key {spec.key}) is missing."
      )
    value = stored[spec.key]
    _check_read(spec, value, where)
    values.append(arrays_lib.from_storage(value, spec))
  return encoding.decode(tree, variables, values, root=f"{where}: tree")


def abstract_tree(manifest: manifest_lib.Manifest, *, where: str) -> Any:
  """The saved tree with ``jax.ShapeDtypeStruct`` in place of every array."""
  # NumPy scalars have no abstract form of their own: a 0-d struct stands in.
  values = [spec.abstract() for spec in manifest.arrays]
  return encoding.decode(
      manifest.tree,
      manifest.variables,
      values,
      abstract=True,
      root=f"{where}: tree",
  )
