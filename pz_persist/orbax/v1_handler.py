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
handler: give Penzai trees another name. To choose where arrays go, or to
skip checksum verification, pass `pz_persist.PenzaiRestore` as the abstract
checkpointable::

  ocp.load_checkpointables(path, {"model": pzp.PenzaiRestore(sharding=rules)})

The abstract tree ``ocp.checkpointables_metadata`` returns is accepted too
(its arrays may carry one ``sharding`` for all).

The on-disk layout is the same as the v0 handler's, written by the same
writer (`pz_persist.storage.writing.writer`): Orbax's own v1 pytree handler writes the
arrays, the primary process writes the manifest once the directory exists and
the file digests once the arrays are final. Loading is the v0 handler's restore, whose arrays are read by the one
array reader every loader goes through (`pz_persist.storage.reading.reader.read_arrays`): the
same containment, size, stored-metadata, allocation and checksum checks as
`pz_persist.load`, and the same direct reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from collections.abc import Callable
from typing import Any
from typing import TypeVar

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz

from pz_persist import errors
from pz_persist.orbax import v0_handler
from pz_persist.storage import orbax_seam
from pz_persist.storage import stores
from pz_persist.storage.writing import writer

_T = TypeVar("_T")

_PENZAI_LEAF_TYPES = (
    pz.nx.NamedArrayBase,
    pz.AbstractVariableValue,
    pz.AbstractVariableSlot,
    pz.AbstractVariable,
)


_FLATTEN_SAFE_DEPTH = 500
"""Containers JAX's flatten may walk nested: well under the interpreter's
recursion limit, and far past what any checkpoint holds."""


def _unflattenable(tree: object) -> bool:
  """Whether ``tree``'s lists, tuples and dicts hold themselves or nest past
  `_FLATTEN_SAFE_DEPTH`, found without recursion.

  Why: JAX's flatten of such a tree raises a SystemError from inside its C++
  walk and leaves the thread's recursion count behind, so every later call
  in that thread raised RecursionError (Orbax's v1 save asks every handler
  `is_handleable` in the caller's thread). Such a tree is claimed instead,
  so the save refuses it by name (`pz_persist.format.encode`).
  """
  stack: list[tuple[Any, int, frozenset[int]]] = [(tree, 0, frozenset())]
  while stack:
    node, depth, above = stack.pop()
    kind = type(node)
    if kind not in (list, tuple, dict):
      continue
    if id(node) in above or depth > _FLATTEN_SAFE_DEPTH:
      return True
    inner = above | {id(node)}
    for child in node.values() if kind is dict else node:
      stack.append((child, depth + 1, inner))
  return False


def holds_penzai_values(tree: object) -> bool:
  """Whether ``tree`` holds a NamedArray, a variable, its value or its slot
  (or cannot be flattened safely: `_unflattenable`)."""
  if _unflattenable(tree):
    return True
  try:
    leaves = jax.tree_util.tree_leaves(
        tree, is_leaf=lambda x: isinstance(x, _PENZAI_LEAF_TYPES)
    )
  except Exception:  # pylint: disable=broad-exception-caught
    return False  # Not a pytree at all: not ours.
  return any(isinstance(leaf, _PENZAI_LEAF_TYPES) for leaf in leaves)


class PenzaiCheckpointableHandler(
    ocp_v1.handlers.CheckpointableHandler[Any, Any]
):
  """Orbax v1 ``CheckpointableHandler`` for trees holding Penzai values.

  Loading needs no abstract checkpointable: pass None (or nothing), and arrays
  are placed on the first local device (``jax.Array``) or returned as NumPy
  arrays, as they were saved; or pass `pz_persist.PenzaiRestore` (or the
  abstract tree `metadata` returns) to place them elsewhere. Loading is
  `pz_persist.orbax.v0_handler.PenzaiCheckpointHandler.restore`.
  """

  def __init__(self, *, context: ocp_v1.Context | None = None):
    # Built by Orbax inside the caller's Context: read it once here.
    self._context = context if context is not None else orbax_seam.active_v1_context()

  def _arrays_handler(self) -> ocp_v1.handlers.PyTreeHandler:
    return ocp_v1.handlers.PyTreeHandler(context=self._context)

  async def save(
      self, directory: Any, checkpointable: Any
  ) -> Awaitable[None]:
    """Starts saving through `pz_persist.storage.writing.writer`, with Orbax's v1
    ``PyTreeHandler`` writing the arrays (it finalizes them inside its own
    awaitable); the manifest and the file digests follow, as for every save."""
    stores.normalise(directory.path)  # Refused here: Orbax's entry points skip open_path.
    encoded = writer.encode(checkpointable)
    arrays_saved = (
        await self._arrays_handler().save(directory, encoded.stored)
        if encoded.stored else None
    )
    return self._writer().finish_after(encoded, arrays_saved, directory.await_creation)

  def _writer(self) -> writer.Writer:
    """The one writer, told the primary process of this handler's Context;
    its arrays are Orbax's v1 ``PyTreeHandler``'s (`finish_after`)."""
    return writer.Writer(
        None,
        writer.WriteOptions(
            direct_writes=False,
            primary_host=self._context.multiprocessing_options.primary_host,
        ),
    )

  def _v0_handler(self) -> v0_handler.PenzaiCheckpointHandler:
    """The v0 handler, configured from this handler's v1 Context.

    Why v0: its restore is pz_persist's one hardened read path; a second copy
    here would drift from it (it did: it skipped the checksums).
    """
    options = self._context.multiprocessing_options
    return v0_handler.PenzaiCheckpointHandler(
        multiprocessing_options=ocp.options.MultiprocessingOptions(
            primary_host=options.primary_host,
            active_processes=options.active_processes,
            barrier_sync_key_prefix=options.barrier_sync_key_prefix,
        )
    )

  async def _in_v0_handler(
      self, call: Callable[[v0_handler.PenzaiCheckpointHandler], _T]
  ) -> _T:
    """Runs ``call`` with a v0 handler, in a worker thread.

    Why a thread: the v0 restore is synchronous and may run Orbax's own event
    loop, which cannot start inside the running one. JAX's ``enable_x64``
    context is thread-local, so the caller's is carried over.
    """
    x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]  # JAX sets flags at run time.

    def run() -> _T:
      handler = self._v0_handler()
      try:
        with jax.enable_x64(x64):
          return call(handler)
      finally:
        handler.close()

    return await asyncio.to_thread(run)

  async def load(
      self, directory: Any, abstract_checkpointable: Any = None
  ) -> Awaitable[Any]:
    """Starts loading; the tree needs no abstract checkpointable.

    Args:
      directory: The checkpointable's directory.
      abstract_checkpointable: None; or `pz_persist.PenzaiRestore` to say
        where arrays go (``sharding``) and whether to check checksums; or the
        abstract tree `metadata` returns, whose ``jax.ShapeDtypeStruct``
        leaves may carry one sharding for every array.
    """
    path = epath.Path(directory)
    args = _restore_args(abstract_checkpointable, where=str(path))
    # Read now, not in the returned awaitable: Orbax turns any error raised
    # there into a NoEntryError ("incompatible handler"), which would hide an
    # IntegrityError or UnsafeCheckpointError behind a misleading message.
    tree = await self._in_v0_handler(lambda handler: handler.restore(path, args))

    async def loaded() -> Any:
      return tree

    return loaded()

  async def metadata(self, directory: Any) -> Any:
    path = epath.Path(directory)
    return await self._in_v0_handler(lambda handler: handler.metadata(path))

  def is_handleable(self, checkpointable: object) -> bool:
    return holds_penzai_values(checkpointable)

  def is_abstract_handleable(self, abstract_checkpointable: object) -> bool:
    return (
        abstract_checkpointable is None
        or isinstance(abstract_checkpointable, v0_handler.PenzaiRestore)
        or holds_penzai_values(abstract_checkpointable)
    )


def _restore_args(abstract: object, *, where: str) -> v0_handler.PenzaiRestore:
  """The v0 restore arguments an abstract checkpointable stands for.

  Why only one sharding from an abstract tree: the checkpoint describes
  itself, so the tree only says where arrays go; pz_persist places arrays
  by one sharding or by axis name (`pz_persist.AxisRules`), not leaf by leaf.

  Raises:
    PzPersistError: the abstract tree's arrays name several shardings.
  """
  if abstract is None:
    return v0_handler.PenzaiRestore()
  if isinstance(abstract, v0_handler.PenzaiRestore):
    return abstract
  shardings = {
      leaf.sharding
      for leaf in jax.tree_util.tree_leaves(abstract)
      if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None
  }
  if len(shardings) > 1:
    raise errors.PzPersistError(
        f"{where}: the abstract checkpointable places arrays on"
        f" {len(shardings)} different shardings; pz_persist places them by one"
        " sharding or by axis name. Pass pz_persist.PenzaiRestore(sharding="
        "pz_persist.AxisRules(mesh, rules)) instead."
    )
  return v0_handler.PenzaiRestore(sharding=shardings.pop() if shardings else None)


LEGACY_TYPESTR = "pz_persist.orbax_v1.PenzaiCheckpointableHandler"
"""What v1 checkpoints written before pz_persist's modules moved into
subpackages call `PenzaiCheckpointableHandler`."""


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
      # Orbax v1 names a handler by its module path, which pz_persist moved:
      # checkpoints written before the move still name the old one.
      secondary_typestrs=[v0_handler.TYPESTR, LEGACY_TYPESTR],
  )
