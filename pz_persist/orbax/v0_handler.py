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

The arrays are written by Orbax's own ``PyTreeCheckpointHandler`` (TensorStore,
OCDBT, async, multi-process), as a flat ``{key: array}`` tree, so plain Orbax
without pz_persist still restores them; the manifest written beside them by
the primary process is what rebuilds the Penzai tree. Loads into one process
(host memory or one device) read the same files through the same TensorStore
specs, but straight into their final buffers (`pz_persist.storage.direct_read`).
Every read goes through `pz_persist.storage.reader`, which every other loader uses too.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from pz_persist import progress as progress_lib
from pz_persist import sharding as sharding_lib
from pz_persist.format import checksum_records
from pz_persist.format import encode
from pz_persist.format import manifest as manifest_lib
from pz_persist.storage import checksums
from pz_persist.storage import direct_write
from pz_persist.storage import file_digests
from pz_persist.storage import object_store
from pz_persist.storage import opening
from pz_persist.storage import reader
from pz_persist.storage import restoring

DEFAULT_CHUNK_BYTES = 4 * 2**20
"""Arrays are stored in chunks of about this size, so that a process reading
a shard decodes little beyond it (one whole-array chunk would be decoded in
full by every process that reads any part of it)."""

DEFAULT_READ_BATCH_BYTES = reader.DEFAULT_READ_BATCH_BYTES
LOAD_PROGRESS_DELAY = reader.LOAD_PROGRESS_DELAY


def encode_manifest(tree: Any) -> tuple[manifest_lib.Manifest, dict[str, Any]]:
  """Validates and encodes ``tree``; returns its manifest and stored arrays.

  The manifest records a checksum of every stored array (per distinct shard);
  in a multi-process save every process must call this, in the same order.
  """
  manifest, stored = encode_unhashed(tree)
  return with_checksums(manifest, checksums.compute(stored)), stored


def encode_unhashed(tree: Any) -> tuple[manifest_lib.Manifest, dict[str, Any]]:
  """Validates and encodes ``tree``: its manifest without checksums yet (see
  `with_checksums`), and its stored arrays. Reads no array's bytes."""
  encoded = encode.encode(tree)
  manifest = manifest_lib.Manifest(
      tree=encoded.tree, variables=tuple(encoded.variables), arrays=tuple(encoded.arrays)
  )
  return manifest, encoded.stored_arrays()


def with_checksums(
    manifest: manifest_lib.Manifest,
    sums: dict[str, tuple[checksum_records.ShardChecksum, ...]],
) -> manifest_lib.Manifest:
  """``manifest`` with the checksums of its stored arrays recorded."""
  return dataclasses.replace(manifest, arrays=tuple(
      dataclasses.replace(spec, checksums=sums[spec.key]) if spec.key in sums else spec
      for spec in manifest.arrays
  ))


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
    files themselves (`pz_persist.storage.direct_write`): the same layout,
    without Orbax's per-array Python (about 1.5 ms per array). Sharded,
    multi-process, compressed, zarr3 and object-store saves go through
    Orbax's ``PyTreeCheckpointHandler``.
  * ``direct_reads=True``: loads into one process and onto host memory or a
    single device read each array straight into its final buffer
    (`pz_persist.storage.direct_read`); loads onto a mesh or across processes go
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
      chunk_byte_size: int | None = DEFAULT_CHUNK_BYTES,
      read_batch_bytes: int = DEFAULT_READ_BATCH_BYTES,
      direct_reads: bool = True,
      direct_writes: bool = True,
  ):
    if multiprocessing_options is None:  # Orbax's default, one per handler.
      multiprocessing_options = ocp.options.MultiprocessingOptions()
    self._primary_host = multiprocessing_options.primary_host
    self._chunk_byte_size = chunk_byte_size
    self._direct_writes = direct_writes
    self._layout = {
        "use_ocdbt": use_ocdbt, "use_zarr3": use_zarr3, "use_compression": use_compression,
    }
    self._read_options = reader.ReadOptions(
        read_batch_bytes=read_batch_bytes,
        direct_reads=direct_reads,
        use_ocdbt=use_ocdbt,
        use_zarr3=use_zarr3,
        restore_concurrent_gb=restore_concurrent_gb,
        multiprocessing_options=multiprocessing_options,
    )
    self._started: list[ocp.future.Future] = []  # Of the last async_save.
    self._direct: list[_DirectWork] = []  # Its direct write, if it makes one.
    self._orbax_writes = False  # Whether it had Orbax's handler write arrays.
    # Directory -> whether its save wrote arrays, for `finalize` (which would
    # otherwise ask the store: a request or more on gs:// and s3://).
    self._wrote_arrays: dict[str, bool] = {}
    self._arrays = ocp.PyTreeCheckpointHandler(
        use_ocdbt=use_ocdbt,
        use_zarr3=use_zarr3,
        use_compression=use_compression,
        save_concurrent_gb=save_concurrent_gb,
        restore_concurrent_gb=restore_concurrent_gb,
        multiprocessing_options=multiprocessing_options,
    )

  def _save_args(self, stored: dict[str, Any]) -> ocp.args.PyTreeSave:
    options = ocp.SaveArgs(chunk_byte_size=self._chunk_byte_size)
    return ocp.args.PyTreeSave(stored, save_args=dict.fromkeys(stored, options))

  def _is_primary(self) -> bool:
    return ocp.multihost.is_primary_host(self._primary_host)

  def _write_manifest(
      self,
      directory: epath.Path,
      manifest: manifest_lib.Manifest,
      copies: checksums.HostCopies,
  ) -> None:
    """Hashes the host copies (every process: the digests are exchanged)
    and writes the manifest with them (the primary process)."""
    manifest = with_checksums(manifest, copies.digests(exchange=str(directory)))
    if self._is_primary():
      manifest_lib.write(directory, manifest)

  async def _hash_and_write_manifest(
      self,
      directory: epath.Path,
      manifest: manifest_lib.Manifest,
      copies: checksums.HostCopies,
  ) -> None:
    self._write_manifest(directory, manifest, copies)

  async def async_save(
      self,
      directory: epath.Path,
      args: PenzaiSave,
  ) -> list[ocp.future.Future]:
    """Starts saving; arrays are copied off the devices before this returns.

    Why the checksums are computed in the background: hashing every array
    (and, with several processes, exchanging the digests) would hold the
    training loop for as long again as Orbax's own blocking part. Only host
    copies of what this process hashes are taken here (on the CPU backend,
    views of the arrays' own buffers: nothing is copied); hashing them and
    writing the manifest is a commit future of its own, which Orbax awaits
    (with the arrays' futures) before `finalize`.
    """
    object_store.check_supported(directory)  # Orbax's own entry points skip as_path.
    manifest, stored = args.manifest, args.stored_arrays
    futures: list[ocp.future.Future] = []
    self._started, self._direct, self._orbax_writes = futures, [], False
    self._wrote_arrays[os.fspath(directory)] = bool(stored)
    if self._writes_directly(directory, stored):
      copies = checksums.host_copies(stored)
      work = _DirectWork()
      self._direct.append(work)

      async def write_directly() -> None:
        if not work.begin():  # Abandoned before it began.
          raise concurrent.futures.CancelledError()
        try:
          self._save_directly(directory, manifest, stored, copies, stop=work.stop)
        finally:
          work.ended.set()

      futures.append(ocp.future.CommitFutureAwaitingContractedSignals(
          write_directly(), name="pz_persist_arrays_and_manifest"
      ))
      return futures
    if stored:  # Orbax refuses an empty tree; a tree of scalars has no arrays.
      self._orbax_writes = True
      futures.extend(
          await self._arrays.async_save(directory, args=self._save_args(stored)) or []
      )
    copies = checksums.host_copies(stored)
    futures.append(
        ocp.future.CommitFutureAwaitingContractedSignals(
            self._hash_and_write_manifest(directory, manifest, copies),
            name="pz_persist_manifest",
        )
    )
    return futures

  def _writes_directly(self, directory: Any, stored: dict[str, Any]) -> bool:
    return bool(stored) and self._direct_writes and isinstance(
        directory, epath.Path
    ) and direct_write.applies(stored, directory=directory, **self._layout)

  def _save_directly(
      self,
      directory: epath.Path,
      manifest: manifest_lib.Manifest,
      stored: dict[str, Any],
      copies: checksums.HostCopies,
      stop: threading.Event | None = None,
  ) -> None:
    """Writes the arrays (TensorStore's threads) while this thread hashes
    them, then commits them, Orbax's metadata files and the manifest.

    Every write it started has ended when it returns or raises, even when
    hashing was stopped (``stop``, set by `cancel`) or a write failed: see
    `pz_persist.storage.direct_write.settle`.
    """
    started = direct_write.start(
        directory, stored, copies.whole_arrays(), chunk_byte_size=self._chunk_byte_size
    )
    try:
      hashed = with_checksums(manifest, copies.digests(stop=stop))
      started.finish()
    finally:
      direct_write.settle(started.writes)
    manifest_lib.write(directory, hashed)

  def cancel(self) -> bool:
    """Stops the background work of the last `async_save`; returns whether
    every array write it started has ended.

    For a save interrupted or failed midway (see `pz_persist.save`, whose
    cleanup needs to know whether a write may still land): its futures are
    not returned to pz_persist by Orbax's checkpointer. A direct write stops
    hashing and waits for the writes it already issued (at most
    `SETTLE_SECONDS`); writes Orbax's own handler issued cannot be followed
    from here, so a save that had Orbax write arrays returns False.
    """
    for started in self._started:
      started.cancel()
    ended = [work.abandon(SETTLE_SECONDS) for work in self._direct]  # Each one stopped.
    return all(ended) and not self._orbax_writes

  def save(self, directory: epath.Path, args: PenzaiSave) -> None:
    """Saves synchronously."""
    object_store.check_supported(directory)  # Orbax's own entry points skip as_path.
    manifest, stored = args.manifest, args.stored_arrays
    copies = checksums.host_copies(stored)
    self._started, self._direct, self._orbax_writes = [], [], False
    self._wrote_arrays[os.fspath(directory)] = bool(stored)
    if self._writes_directly(directory, stored):
      self._save_directly(directory, manifest, stored, copies)
      return
    if stored:
      self._orbax_writes = True
      self._arrays.save(directory, args=self._save_args(stored))
    self._write_manifest(directory, manifest, copies)

  def restore(
      self,
      directory: epath.Path,
      args: PenzaiRestore | None = None,
  ) -> Any:
    """Restores the saved tree; needs no template.

    Opened through `pz_persist.storage.opening` like every read: under the shared
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
    wrote_arrays = self._wrote_arrays.pop(os.fspath(directory), None)
    if wrote_arrays is None:  # Not saved by this handler: look.
      wrote_arrays = (directory / "_METADATA").exists() or any(
          directory.glob("ocdbt.process_*"))
    if wrote_arrays:
      self._arrays.finalize(directory)
    if self._is_primary():  # Every file is final now: record their digests.
      file_digests.write(directory)

  def close(self) -> None:
    self._arrays.close()


SETTLE_SECONDS = 120.0
"""How long `PenzaiCheckpointHandler.cancel` waits for a direct write's
issued writes to end: far above what the rest of a local write takes; only
there so that a hung disk cannot hang the interrupted save for ever."""


class _DirectWork:
  """One direct write running in Orbax's background thread: how `cancel`
  stops it and learns that it ended.

  The thread may not have begun when the save is abandoned (Orbax's thread
  then never runs it): `begin` and `abandon` agree under a lock on which of
  the two came first, so `ended` is set in both cases.
  """

  def __init__(self) -> None:
    self.stop = threading.Event()
    self.ended = threading.Event()
    self._lock = threading.Lock()
    self._began = False

  def begin(self) -> bool:
    """Called by the work as it starts; False if it was abandoned already."""
    with self._lock:
      if self.stop.is_set():
        self.ended.set()
        return False
      self._began = True
      return True

  def abandon(self, timeout: float) -> bool:
    """Stops the work; True once it ended (within ``timeout`` seconds)."""
    with self._lock:
      self.stop.set()
      if not self._began:
        self.ended.set()  # It will not begin now.
    return self.ended.wait(timeout)


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
    manifest: The tree's manifest, without checksums yet (computed).
    stored_arrays: The ``{key: array}`` tree Orbax writes (computed).
  """

  item: Any
  manifest: manifest_lib.Manifest = dataclasses.field(
      init=False, repr=False, compare=False
  )
  stored_arrays: dict[str, Any] = dataclasses.field(
      init=False, repr=False, compare=False
  )

  def __post_init__(self):
    self.manifest, self.stored_arrays = encode_unhashed(self.item)


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
      notebook, for loads taking over `pz_persist.storage.reader.LOAD_PROGRESS_DELAY`
      seconds; True: always; False: never; or a function called as
      ``progress(done, total)`` with the bytes read (`pz_persist.progress`).
  """

  sharding: sharding_lib.Target = None
  verify: bool = True
  progress: progress_lib.Progress = None
