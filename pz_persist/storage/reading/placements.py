"""Where each array of a checkpoint is read to, and how many bytes that puts here.

The plan of a read (`pz_persist.storage.reading.reader`): each array's sharding, from
one sharding for all, `pz_persist.sharding.AxisRules` (by the axis names the
manifest records), or a sharding per array (a load into a model, which knows
where each of its arrays is); and the bytes this process's devices will hold,
which `pz_persist.safety.limits` caps before anything is read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax

from pz_persist import sharding as sharding_lib
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import manifest_queries

PerArray = Mapping[int, jax.sharding.Sharding | None]
"""Where each array goes, by its index in the manifest: its own sharding, or
None for a NumPy array on the host; arrays not in it go to the first device.
For a load into a model (`pz_persist.load_model` with ``into=``), which knows
where each of its arrays is."""


def placements(
    manifest: manifest_lib.Manifest, target: sharding_lib.Target | PerArray
) -> list[jax.sharding.Sharding | None]:
  """Where each array of the manifest goes: a sharding, or None for NumPy."""
  if not isinstance(target, Mapping):
    sharding_lib.check_target(target)  # Every read's ``sharding=`` passes here.
  if isinstance(target, Mapping):
    default = sharding_lib.default_sharding()
    return [
        target.get(index, default) if spec.kind == "jax" else None
        for index, spec in enumerate(manifest.arrays)
    ]
  if not isinstance(target, sharding_lib.AxisRules):
    sharding = target or sharding_lib.default_sharding()
    return [sharding if spec.kind == "jax" else None for spec in manifest.arrays]
  names = manifest_queries.axis_names(manifest)
  result: list[jax.sharding.Sharding | None] = []
  for index, spec in enumerate(manifest.arrays):
    if spec.kind != "jax":
      result.append(None)
      continue
    dims = names.get(index, (None,) * len(spec.shape))
    result.append(target.sharding(dims, spec.shape, what=_describe(spec)))
  return result


def _describe(spec: arrays_lib.ArraySpec) -> str:
  return f"{spec.path} (label {spec.label!r})" if spec.label else spec.path


def local_bytes(spec: arrays_lib.ArraySpec, sharding: jax.sharding.Sharding | None) -> int:
  """Bytes of one array that this process's devices hold (None: NumPy)."""
  if sharding is None:
    return spec.nbytes
  devices = set(sharding.addressable_devices)
  elements = sum(
      math.prod(len(range(*s.indices(n))) for s, n in zip(index, spec.shape))
      for device, index in sharding.devices_indices_map(spec.shape).items()
      if device in devices
  )
  return elements * spec.np_dtype.itemsize


def shard_bytes(manifest: manifest_lib.Manifest, target: sharding_lib.Target) -> int:
  """Bytes of the arrays this process's devices hold after a restore."""
  return sum(
      local_bytes(spec, sharding)
      for spec, sharding in zip(manifest.arrays, placements(manifest, target))
  )
