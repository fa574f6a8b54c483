"""Orbax's stable (v0) API learns to save and restore Penzai values.

`PenzaiCheckpointHandler` is an ordinary Orbax ``AsyncCheckpointHandler`` with
its own argument classes, `PenzaiSave` and `PenzaiRestore`, registered with
``ocp.args``. So everything in Orbax that takes handler arguments takes them
too: ``ocp.Checkpointer``, ``ocp.AsyncCheckpointer``, ``ocp.CheckpointManager``
(inside ``ocp.args.Composite``). Because the handler is also registered by its
type string, ``CheckpointManager.restore(step)`` with no arguments at all finds
it again from the checkpoint's own metadata, and restores Penzai values with no
template::

  import orbax.checkpoint as ocp
  import pz_persist as pzp

  with ocp.CheckpointManager(directory) as mngr:
    mngr.save(step, args=ocp.args.Composite(params=pzp.PenzaiSave(params)))
    mngr.wait_until_finished()
    restored = mngr.restore(step).params  # NamedArrays, labels, metadata back.

Saving is `pz_persist.storage.writing.writer`'s, as for every save: the arrays are
written in Orbax's own layout (by Orbax's ``PyTreeCheckpointHandler``:
TensorStore, OCDBT, async, multi-process; or, for one process, by
`pz_persist.storage.writing.direct_write`, file for file the same), as a flat
``{key: array}`` tree, so plain Orbax without pz_persist still restores them;
the manifest written beside them by the primary process is what rebuilds the
Penzai tree. This handler only adapts Orbax's calls to the writer's. Loads into one process
(host memory or one device) read the same files through the same TensorStore
specs, but straight into their final buffers (`pz_persist.storage.reading.direct_read`).
Every read goes through `pz_persist.storage.reading.reader`, which every other loader uses too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from pz_persist import deprecations
from pz_persist import progress as progress_lib
from pz_persist import sharding as sharding_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.storage import stores
from pz_persist.storage.reading import opening
from pz_persist.storage.reading import reader
from pz_persist.storage.reading import restoring
from pz_persist.storage.writing import writer

# Former spellings of names `storage.writing.writer` and `storage.reading.reader` own now.
__getattr__ = deprecations.module_getattr(__name__, {
    "DEFAULT_CHUNK_BYTES": "pz_persist.storage.writing.writer.DEFAULT_CHUNK_BYTES",
    "DEFAULT_READ_BATCH_BYTES": "pz_persist.storage.reading.reader.DEFAULT_READ_BATCH_BYTES",
    "LOAD_PROGRESS_DELAY": "pz_persist.storage.reading.reader.LOAD_PROGRESS_DELAY",
    "SETTLE_SECONDS": "pz_persist.storage.writing.writer.SETTLE_SECONDS",
    "encode_manifest": "pz_persist.storage.writing.writer.encode_hashed",
    "with_checksums": "pz_persist.storage.writing.writer.with_checksums",
})


TYPESTR = "pz_persist.orbax_v0.PenzaiCheckpointHandler"
"""What checkpoints call this handler: its module path when it was first
released, kept by `PenzaiCheckpointHandler.typestr` wherever the class lives."""


class PenzaiCheckpointHandler(ocp.AsyncCheckpointHandler):
  """Orbax v0 handler for trees holding Penzai values (see module docstring).

  Save with `PenzaiSave`; restore with `PenzaiRestore` (or with no arguments
  where Orbax allows it). Options configure the underlying Orbax array
  handler and default to Orbax's own defaults, except two chosen for speed:

  * ``use_compression=False``: Orbax's default zstd saves about 6% of the
    space of trained float weights (their low mantissa bits are noise) and
    halves save and restore speed; checkpoints written compressed (by older
    versions, or with ``use_compression=True``) still load.
  * ``direct_writes=True``: saves by one process of arrays each whole in host
    memory or on one device (the usual single-machine save) write Orbax's
    files themselves (`pz_persist.storage.writing.direct_write`): the same layout,
    without Orbax's per-array Python (about 1.5 ms per array). Sharded,
    multi-process, compressed, zarr3 and object-store saves go through
    Orbax's ``PyTreeCheckpointHandler``.
  * ``direct_reads=True``: loads into one process and onto host memory or a
    single device read each array straight into its final buffer
    (`pz_persist.storage.reading.direct_read`); loads onto a mesh or across processes go
    through Orbax's restore. Both read the same files through the same
    TensorStore specs.
  """

  @classmethod
  def typestr(cls) -> str:
    """The name Orbax records for this handler in every checkpoint it writes.

    Fixed rather than derived from the class's module (Orbax's default):
    checkpoints hold this name and `CheckpointManager.restore(step)` finds the
    handler by it, so moving the class between modules must not orphan them.
    """
    return TYPESTR

  def __init__(
      self,
      *,
      use_ocdbt: bool = True,
      use_zarr3: bool = False,
      use_compression: bool = False,
      save_concurrent_gb: int | None = None,
      restore_concurrent_gb: int | None = None,
      multiprocessing_options: ocp.options.MultiprocessingOptions | None = None,
      chunk_byte_size: int | None = writer.DEFAULT_CHUNK_BYTES,
      read_batch_bytes: int = reader.DEFAULT_READ_BATCH_BYTES,
      direct_reads: bool = True,
      direct_writes: bool = True,
  ):
    if multiprocessing_options is None:  # Orbax's default, one per handler.
      multiprocessing_options = ocp.options.MultiprocessingOptions()
    self._read_options = reader.ReadOptions(
        read_batch_bytes=read_batch_bytes,
        direct_reads=direct_reads,
        use_ocdbt=use_ocdbt,
        use_zarr3=use_zarr3,
        restore_concurrent_gb=restore_concurrent_gb,
        multiprocessing_options=multiprocessing_options,
    )
    self._arrays = ocp.PyTreeCheckpointHandler(
        use_ocdbt=use_ocdbt,
        use_zarr3=use_zarr3,
        use_compression=use_compression,
        save_concurrent_gb=save_concurrent_gb,
        restore_concurrent_gb=restore_concurrent_gb,
        multiprocessing_options=multiprocessing_options,
    )
    self._writer = writer.Writer(
        _OrbaxArrays(self._arrays, chunk_byte_size),
        writer.WriteOptions(
            chunk_byte_size=chunk_byte_size, direct_writes=direct_writes,
            use_ocdbt=use_ocdbt, use_zarr3=use_zarr3, use_compression=use_compression,
            primary_host=multiprocessing_options.primary_host,
        ),
    )

  async def async_save(
      self,
      directory: epath.Path,
      args: PenzaiSave,
  ) -> list[ocp.future.Future]:
    """Starts saving (`pz_persist.storage.writing.writer.Writer.start`); arrays are
    copied off the devices before this returns, hashed in the background."""
    stores.normalise(directory)  # Refused here: Orbax's own entry points skip open_path.
    return await self._writer.start(directory, args.encoded)

  def save(self, directory: epath.Path, args: PenzaiSave) -> None:
    """Saves synchronously (`pz_persist.storage.writing.writer.Writer.write`)."""
    stores.normalise(directory)  # Refused here: Orbax's own entry points skip open_path.
    self._writer.write(directory, args.encoded)

  def cancel(self) -> bool:
    """Stops the background work of the last `async_save`; returns whether
    every array write it started has ended (`pz_persist.storage.writing.writer.Writer.cancel`,
    for `pz_persist.save`'s cleanup)."""
    return self._writer.cancel()

  def restore(
      self,
      directory: epath.Path,
      args: PenzaiRestore | None = None,
  ) -> Any:
    """Restores the saved tree; needs no template.

    Opened through `pz_persist.storage.reading.opening` like every read: under the shared
    lock, and read again if a save replaced the checkpoint meanwhile.
    """
    args = args or PenzaiRestore()
    return opening.read(
        directory,
        lambda opened: restoring.read_tree(
            opened, sharding=args.sharding, verify=args.verify,
            progress=args.progress, options=self._read_options,
        ),
        item_directory=True,
    )

  def metadata(self, directory: epath.Path) -> Any:
    """The saved tree with ``jax.ShapeDtypeStruct`` leaves; reads no arrays."""
    return opening.read(directory, abstract_tree, item_directory=True)

  def finalize(self, directory: epath.Path) -> None:
    """Orbax's finalize of the arrays, then the file digests."""
    self._writer.finalize(directory)

  def close(self) -> None:
    self._arrays.close()


class _OrbaxArrays:
  """Orbax's ``PyTreeCheckpointHandler`` as the writer's `writer.ArrayWriter`:
  each stored array in chunks of about ``chunk_byte_size``."""

  def __init__(self, handler: ocp.PyTreeCheckpointHandler, chunk_byte_size: int | None):
    self._handler = handler
    self._chunk_byte_size = chunk_byte_size

  def _args(self, stored: dict[str, Any]) -> ocp.args.PyTreeSave:
    options = ocp.SaveArgs(chunk_byte_size=self._chunk_byte_size)
    return ocp.args.PyTreeSave(stored, save_args=dict.fromkeys(stored, options))

  async def async_save(self, directory: epath.Path, stored: dict[str, Any]) -> list[Any]:
    return await self._handler.async_save(directory, args=self._args(stored)) or []

  def save(self, directory: epath.Path, stored: dict[str, Any]) -> None:
    self._handler.save(directory, args=self._args(stored))

  def finalize(self, directory: epath.Path) -> None:
    self._handler.finalize(directory)


def abstract_tree(opened: opening.OpenItem) -> Any:
  """The tree of an opened item with ``jax.ShapeDtypeStruct`` leaves."""
  return restoring.abstract_tree(opened.manifest, where=str(opened.item))


@ocp.args.register_with_handler(PenzaiCheckpointHandler, for_save=True)
@dataclasses.dataclass
class PenzaiSave(ocp.args.CheckpointArgs):
  """Orbax save arguments for a tree holding Penzai values.

  The tree is validated and encoded when the arguments are built, so a tree
  that cannot be saved raises `pz_persist.errors.EncodingError` right here,
  before Orbax creates any directory. No array is read here: the checksums
  are computed by the handler as it saves (in the background of an async
  save), from the same host copies.

  Attributes:
    item: Any tree pz_persist saves: NamedArrays, Parameter / StateVariable
      values (mutable or frozen), arrays, scalars, strings, None, containers.
    encoded: The tree's manifest (without checksums yet) and the arrays
      Orbax writes (`pz_persist.storage.writing.writer.encode`).
  """

  item: object
  encoded: writer.Encoded = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    self.encoded = writer.encode(self.item)

  @property
  def manifest(self) -> manifest_lib.Manifest:
    """The tree's manifest, without checksums yet."""
    return self.encoded.manifest

  @property
  def stored_arrays(self) -> dict[str, Any]:
    """The ``{key: array}`` tree Orbax writes."""
    return self.encoded.stored


@ocp.args.register_with_handler(PenzaiCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class PenzaiRestore(ocp.args.CheckpointArgs):
  """Orbax restore arguments for a tree saved with `PenzaiSave`.

  Attributes:
    sharding: Where ``jax.Array`` values are placed: one ``Sharding`` for all,
      or `pz_persist.AxisRules` mapping axis names to mesh axes; defaults to
      the first local device. NumPy arrays are restored as NumPy arrays.
    verify: Check the bytes read against the checksums recorded at save time
      (about 0.1 s per GiB; see `pz_persist.load`).
    progress: None (default): a bar on stderr, if it is a terminal or in a
      notebook, for loads taking over `pz_persist.storage.reading.reader.LOAD_PROGRESS_DELAY`
      seconds; True: always; False: never; or a function called as
      ``progress(done, total)`` with the bytes read (`pz_persist.progress`).
  """

  sharding: sharding_lib.Target = None
  verify: bool = True
  progress: progress_lib.Progress = None
