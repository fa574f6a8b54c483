"""Axis rules: restore every array straight onto a device mesh, by axis name.

Penzai's named axes are exactly the logical partitioning information other
libraries lose (Flax's boxed params, Orbax's template-bound shardings). With
`AxisRules` a user says once which axis names go to which mesh axes, and each
array is read directly into its shards (Orbax reads, on each process, only the
slices its devices hold), with no template and no full copy on one host.

Only named axes are sharded: positional axes (the prefix of a NamedArray, or
arrays outside NamedArrays such as a layer's own constants) are replicated, and
so are axes without a rule. (Penzai's ``name_to_name_sharding`` builds its
partition spec from dimension 0 and so shards the wrong dimension of a
NamedArray with positional prefix axes; here each named axis is mapped to the
data dimension it actually occupies.)

Example::

  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  rules = pzp.AxisRules(mesh, {"heads": "model", "embedding": "data"})
  model = pzp.load_model(path, sharding=rules)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from collections.abc import Mapping
from typing import Any

import jax

from pz_persist import errors

MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class AxisRules:
  """Which mesh axes each named axis is sharded over.

  Attributes:
    mesh: The device mesh. Build it with ``jax.sharding.Mesh(devices, names)``:
      ``jax.make_mesh`` now makes Explicit axes, on which Penzai's layers fail.
    rules: ``{axis name: mesh axis, tuple of mesh axes, or None}``. Axis names
      without a rule, and positional axes, are replicated.
  """

  mesh: jax.sharding.Mesh
  # Keys Any, not Hashable: Mapping's keys are invariant, so a user's
  # dict[str, str] would not pass as a Mapping[Hashable, ...].
  rules: Mapping[Any, MeshAxes]

  def __post_init__(self):
    for name, mesh_axes in self.rules.items():
      for axis in _as_tuple(mesh_axes):
        if axis not in self.mesh.shape:
          raise errors.ArgumentError(
              f"rule for axis {name!r} names mesh axis {axis!r}; the mesh has"
              f" {list(self.mesh.shape)}."
          )

  def replicated(self) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

  def sharding(
      self, dim_names: tuple[Hashable, ...], shape: tuple[int, ...], *, what: str
  ) -> jax.sharding.NamedSharding:
    """The sharding of an array whose dimension ``i`` is named ``dim_names[i]``
    (None for a positional dimension).

    Raises:
      PzPersistError: a dimension the mesh axes do not divide, or one mesh axis
        used for two dimensions; the message names ``what`` and the axis.
    """
    spec: list[MeshAxes] = []
    used: dict[str, Hashable] = {}
    for name, size in zip(dim_names, shape):
      mesh_axes = _as_tuple(self.rules.get(name)) if name is not None else ()
      for axis in mesh_axes:
        if axis in used:
          raise errors.PzPersistError(
              f"{what}: axes {used[axis]!r} and {name!r} are both mapped to"
              f" mesh axis {axis!r}; one array can use a mesh axis once."
          )
        used[axis] = name
      parts = math.prod(self.mesh.shape[a] for a in mesh_axes)
      if size % parts:
        raise errors.PzPersistError(
            f"{what}: axis {name!r} has size {size}, which mesh axes"
            f" {mesh_axes} ({parts} devices) do not divide."
        )
      spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*spec))


def _as_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
  if mesh_axes is None:
    return ()
  return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


Target = jax.sharding.Sharding | AxisRules | None
"""Where arrays go: one sharding for all, axis rules, or None (first device)."""


def check_target(target: object) -> None:
  """Refuses a ``sharding=`` that is not a `Target`, before anything is read.

  Why: a string (``"cpu"``) or a mesh given there reached the reader, which
  failed with ``AttributeError: 'str' object has no attribute
  'addressable_devices'``, naming neither the option nor what it takes.

  Raises:
    ArgumentTypeError: naming the type given and the types accepted.
  """
  if target is not None and not isinstance(target, (jax.sharding.Sharding, AxisRules)):
    raise errors.ArgumentTypeError(
        f"sharding={target!r:.100} is a {type(target).__name__}; give a"
        " jax.sharding.Sharding (e.g. jax.sharding.SingleDeviceSharding(jax.devices('cpu')[0])),"
        " a pz_persist.AxisRules, or None for the default."
    )


def default_sharding() -> jax.sharding.Sharding:
  """Where a jax.Array goes when the caller did not say: the first local device."""
  return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
