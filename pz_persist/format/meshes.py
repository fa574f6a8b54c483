"""Device meshes and named shardings as what they mean, never as devices.

A ``jax.sharding.Mesh`` holds devices, which belong to one process on one
machine; Penzai's ``sharding_util.ConstrainShardingByName`` and
``ConstrainSharding`` layers hold one (or ``NamedSharding``\\ s over one). What
a mesh means is its axis names, their sizes and their types, so that is what
a checkpoint keeps (the ``mesh`` node); a ``NamedSharding`` is such a mesh
and a ``PartitionSpec`` (the ``named_sharding`` and ``partition_spec``
nodes).

On load the mesh is rebuilt (`rebuild`): as the mesh the caller passed
(``load(path, mesh=...)``, `using`), which must have the saved axis names; or
else over the devices at hand, the first ``prod(sizes)`` of ``jax.devices()``,
refused clearly if there are fewer. Abstract loads (``inspect``) rebuild a
``jax.sharding.AbstractMesh``, which needs no devices.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any
from typing import TypeGuard

import jax
from jax.sharding import AbstractMesh
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from pz_persist import errors
from pz_persist.format import json_types

_given: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar(
    "pz_persist_mesh", default=None
)


@contextlib.contextmanager
def using(mesh: Mesh | None) -> Iterator[None]:
  """Rebuilds saved meshes as ``mesh`` within the block (``mesh=`` of a load)."""
  if mesh is not None and not isinstance(mesh, Mesh):
    raise errors.ArgumentTypeError(
        f"mesh= takes a jax.sharding.Mesh, not {type(mesh).__name__}."
    )
  token = _given.set(mesh)
  try:
    yield
  finally:
    _given.reset(token)


def is_mesh(obj: object) -> TypeGuard[Mesh | AbstractMesh]:
  """A concrete or abstract mesh (both saved as a ``mesh`` node)."""
  return isinstance(obj, (Mesh, AbstractMesh))


def mesh_fields(mesh: Mesh | AbstractMesh, where: str) -> json_types.JSONObject:
  """The ``mesh`` node's fields: ``axes`` (``[name, size]`` pairs) and
  ``axis_types`` (``"Explicit"``, ``"Auto"``, ``"Manual"``)."""
  names = tuple(mesh.axis_names)
  bad = [name for name in names if not isinstance(name, str)]
  if bad:
    raise errors.EncodingError(
        f"{where}: mesh axis name {bad[0]!r:.60} is not a string; name mesh axes"
        " with strings to save the mesh."
    )
  sizes = [int(mesh.shape[name]) for name in names]
  return {
      "axes": [[name, size] for name, size in zip(names, sizes)],
      "axis_types": [str(t.name) for t in mesh.axis_types],
  }


def spec_entries(spec: PartitionSpec, where: str) -> list[json_types.JSON]:
  """A ``PartitionSpec`` as JSON: one entry per dimension, ``None``, a mesh
  axis name, or a list of them."""
  if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
    raise errors.EncodingError(
        f"{where}: {spec!r:.80} has unreduced or reduced axes, which"
        " pz_persist does not save; save the PartitionSpec of its dimensions."
    )
  entries: list[json_types.JSON] = []
  for entry in spec:
    if entry is None or isinstance(entry, str):
      entries.append(entry)
    elif isinstance(entry, tuple) and all(isinstance(name, str) for name in entry):
      entries.append(list(entry))
    else:  # PartitionSpec.UNCONSTRAINED, or a name that is not a string.
      raise errors.EncodingError(
          f"{where}: {spec!r:.80} holds {entry!r:.40}; only None, mesh axis names"
          " and tuples of them can be saved."
      )
  return entries


def refuse_sharding(obj: object, where: str) -> None:
  """Refuses other ``jax.sharding.Sharding``\\ s, which name devices."""
  if isinstance(obj, jax.sharding.Sharding) and not isinstance(obj, NamedSharding):
    raise errors.EncodingError(
        f"{where}: a {type(obj).__name__} names devices, which are never saved;"
        " only a NamedSharding (a mesh's axis names and sizes, and a"
        " PartitionSpec) can be. Use NamedSharding(mesh, PartitionSpec(...))."
    )


def decode_spec(entries: object, where: str) -> PartitionSpec:
  if not isinstance(entries, list) or not all(
      entry is None or isinstance(entry, str)
      or (isinstance(entry, list) and all(isinstance(name, str) for name in entry))
      for entry in entries
  ):
    raise errors.ManifestError(f"{where}: malformed PartitionSpec {entries!r:.100}.")
  return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))


def rebuild(axes: Any, axis_types: Any, where: str, *, abstract: bool) -> Mesh | AbstractMesh:
  """The mesh a ``mesh`` node describes: abstract, the mesh passed to the
  load (`using`), or one over the first devices at hand."""
  if not (
      isinstance(axes, list) and isinstance(axis_types, list) and len(axes) == len(axis_types)
      and all(isinstance(name, str) and type(size) is int and size > 0 for name, size in axes)
      and len({name for name, _ in axes}) == len(axes)
  ):
    raise errors.ManifestError(f"{where}: malformed mesh {axes!r:.100}.")
  kinds = jax.sharding.AxisType
  if not all(isinstance(t, str) and t in kinds.__members__ for t in axis_types):
    raise errors.ManifestError(
        f"{where}: mesh axis types {axis_types!r:.100} are not among"
        f" {', '.join(kinds.__members__)}."
    )
  names = tuple(name for name, _ in axes)
  sizes = tuple(size for _, size in axes)
  types = tuple(kinds[t] for t in axis_types)
  shown = ", ".join(f"{name}={size}" for name, size in axes)
  if abstract:
    return AbstractMesh(sizes, names, axis_types=types)
  given = _given.get()
  if given is not None:
    if tuple(given.axis_names) != names:
      raise errors.MeshError(
          f"{where}: the saved mesh has axes ({shown}); the mesh passed has"
          f" {tuple(given.axis_names)}. Pass a mesh with the saved axis names,"
          f" in that order, e.g. jax.make_mesh({sizes}, {names})."
      )
    return given
  devices = jax.devices()
  needed = math.prod(sizes)
  if needed > len(devices):
    raise errors.MeshError(
        f"{where}: the saved mesh ({shown}) needs {needed} devices; this process"
        f" has {len(devices)} ({devices[0].platform}). Pass mesh= a"
        " jax.sharding.Mesh with the same axis names over the devices you"
        f" have, e.g. jax.make_mesh(({', '.join('1' for _ in sizes)}{',' if len(sizes) == 1 else ''}),"
        f" {names})."
    )
  return jax.make_mesh(sizes, names, axis_types=types, devices=devices[:needed])
