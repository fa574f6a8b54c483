"""Orbax's v1 API learns to save and load Penzai values.

Orbax v1 (``orbax.checkpoint.v1``) has no public per-leaf extension point; its
supported one is a ``CheckpointableHandler`` registered with the handler
registry. `PenzaiCheckpointableHandler` is registered globally when pz_persist
is imported. It claims any checkpointable that holds Penzai values, so::

  from orbax.checkpoint import v1 as ocp
  import pz_persist  # registers the handler

  ocp.save_checkpointables(path, {"model": params})
  loaded = ocp.load_checkpointables(path)["model"]  # no abstract state needed

Loading finds the handler again from the type string Orbax stores in the
checkpoint's metadata; checkpoints written through the v0 API or by
`pz_persist.save` are recognized too. Note that v1's default checkpointable
name, ``"state"`` (used by ``ocp.save``), is bound to Orbax's stock pytree
handler: give Penzai trees another name.

The on-disk layout is the same as the v0 handler's: Orbax's own pytree handler
writes the arrays, the primary process writes the manifest once the directory
exists.
"""

from __future__ import annotations

from typing import Any, Awaitable

import jax
import numpy as np
from orbax.checkpoint import v1 as ocp_v1
# Orbax exports no accessor for the active v1 Context; handlers are built by
# Orbax inside it, so read it once there (orbax-checkpoint is pinned).
from orbax.checkpoint.experimental.v1._src.context.context import get_context
from penzai import pz

from pz_persist import manifest as manifest_lib
from pz_persist import orbax_v0
from pz_persist import restoring
from pz_persist import safety
from pz_persist import sharding as sharding_lib

_PENZAI_LEAF_TYPES = (
    pz.nx.NamedArrayBase,
    pz.AbstractVariableValue,
    pz.AbstractVariableSlot,
    pz.AbstractVariable,
)


def holds_penzai_values(tree: Any) -> bool:
  """Whether ``tree`` holds a NamedArray, a variable, its value or its slot."""
  try:
    leaves = jax.tree_util.tree_leaves(
        tree, is_leaf=lambda x: isinstance(x, _PENZAI_LEAF_TYPES)
    )
  except Exception:  # pylint: disable=broad-exception-caught
    return False  # Not a pytree at all: not ours.
  return any(isinstance(leaf, _PENZAI_LEAF_TYPES) for leaf in leaves)


class PenzaiCheckpointableHandler(
    ocp_v1.handlers.CheckpointableHandler[Any, None]
):
  """Orbax v1 ``CheckpointableHandler`` for trees holding Penzai values.

  Loading needs no abstract checkpointable: pass None (or nothing). Arrays are
  placed on the first local device (``jax.Array``) or returned as NumPy arrays,
  as they were saved.
  """

  def __init__(self, *, context: ocp_v1.Context | None = None):
    self._context = context if context is not None else get_context()

  def _arrays_handler(self) -> ocp_v1.handlers.PyTreeHandler:
    return ocp_v1.handlers.PyTreeHandler(context=self._context)

  def _is_primary(self) -> bool:
    return ocp_v1.multihost.is_primary_host(
        self._context.multiprocessing_options.primary_host
    )

  async def save(
      self, directory: Any, checkpointable: Any
  ) -> Awaitable[None]:
    manifest, stored = orbax_v0.encode_manifest(checkpointable)
    arrays_saved = (
        await self._arrays_handler().save(directory, stored) if stored else None
    )
    is_primary = self._is_primary()

    async def finish() -> None:
      if arrays_saved is not None:
        await arrays_saved
      path = await directory.await_creation()
      if is_primary:
        manifest_lib.write(path, manifest)

    return finish()

  async def load(
      self, directory: Any, abstract_checkpointable: None = None
  ) -> Awaitable[Any]:
    del abstract_checkpointable  # Everything needed is in the manifest.
    safety.check_contained(directory)
    manifest = manifest_lib.read(directory)
    where = str(directory)
    restoring.check_loadable(manifest, where)
    targets = restoring.read_targets(manifest)
    spec_by_key = {spec.key: spec for spec in manifest.arrays}
    safety.check_allocation(
        [spec_by_key[key] for key in targets],
        {key: sharding_lib.local_bytes(spec_by_key[key], t) for key, t in targets.items()},
        where=where,
    )
    abstract = {
        key: (
            np.ndarray
            if target is None
            else jax.ShapeDtypeStruct(
                spec_by_key[key].shape,
                spec_by_key[key].storage_dtype,
                sharding=target,
            )
        )
        for key, target in targets.items()
    }
    arrays_loaded = (
        await self._arrays_handler().load(directory, abstract) if abstract else None
    )

    async def finish() -> Any:
      stored = await arrays_loaded if arrays_loaded is not None else {}
      return restoring.assemble(manifest, stored, where=where)

    return finish()

  async def metadata(self, directory: Any) -> Any:
    safety.check_contained(directory)
    return restoring.abstract_tree(
        manifest_lib.read(directory), where=str(directory)
    )

  def is_handleable(self, checkpointable: Any) -> bool:
    return holds_penzai_values(checkpointable)

  def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool:
    return abstract_checkpointable is None


def register() -> None:
  """Registers the handler with Orbax v1's global registry (idempotent)."""
  registry = ocp_v1.handlers.global_registry()
  if any(
      handler is PenzaiCheckpointableHandler
      for handler, _ in registry.get_all_entries()
  ):
    return
  ocp_v1.handlers.register_handler(
      PenzaiCheckpointableHandler,
      secondary_typestrs=[orbax_v0.PenzaiCheckpointHandler.typestr()],
  )
