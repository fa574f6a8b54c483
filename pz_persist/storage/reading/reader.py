"""Reading a checkpoint item's arrays: the one read path every loader shares.

`pz_persist.load`, `load_model` (both forms), `diff`, `verify`, the Orbax v0
handler and, through it, the Orbax v1 handler all read arrays through
`read_arrays`; the mutable-variable ``TypeHandler``, whose arrays Orbax's own
type handler reads inside Orbax's event loop, goes through the same checks
(`plan`, `verify_checksums`, `values`, `read_failure`). So a guarantee added
here holds for every one of them. In order, a read:

1. refuses what could only load by silently changing values (`check_loadable`);
2. decides where each array goes and how many bytes this process allocates
   for it, and refuses sizes beyond the allocation limit (`plan`);
3. checks the stored metadata (shapes, dtypes, chunk shapes) against the
   manifest before any array data is allocated: the direct path checks what
   TensorStore opened, or for a small array read as its raw chunk
   (`pz_persist.storage.reading.raw_chunks`) that its ``.zarray`` is byte for byte the
   one TensorStore writes for the manifest's shape and dtype; the Orbax path
   checks what Orbax's metadata says;
4. reads the arrays, either straight into their final buffers
   (`pz_persist.storage.reading.direct_read`: one process, host memory or single
   devices; small arrays stored as one raw chunk as key-value entries of the
   item's OCDBT store, many at once) or through Orbax's restore in batches
   of bounded size (meshes, several processes), each process reading only
   its own shards;
5. checks the bytes read against the manifest's checksums (one `_Verifier`
   for both paths: on the direct path as each array is read, on a pool of
   threads, overlapped with the next reads and with its copy to its device
   (`pz_persist.storage.reading.streaming`); batch by batch on the Orbax path);
6. undoes storage substitutions and restores kinds and weak types (`values`).

All of it runs inside `pz_persist.storage.integrity.containment.files_unchanged`: TensorStore opens
the files by path, so what it read is only returned if no file of the item
was swapped (for a link out of the checkpoint, say) while it read.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from pz_persist import errors
from pz_persist import progress as progress_lib
from pz_persist import sharding as sharding_lib
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.safety import bounded_json
from pz_persist.safety import limits
from pz_persist.storage.integrity import checksums as checksums_lib
from pz_persist.storage.integrity import containment
from pz_persist.storage.integrity import orbax_metadata_checks
from pz_persist.storage.reading import batching
from pz_persist.storage.reading import direct_read
from pz_persist.storage.reading import host_memory
from pz_persist.storage.reading import page_locking
from pz_persist.storage.reading import placements
from pz_persist.storage.reading import streaming

DEFAULT_READ_BATCH_BYTES = 64 * 2**20
"""Arrays are read in batches of about this many bytes (of this process's
shards). Reading every array at once keeps the read buffer and the final
array of each alive together, doubling peak memory; batches bound that to
one batch."""

LOAD_PROGRESS_DELAY = 1.0
"""Seconds a load takes before its automatic progress bar appears: loads are
frequent and mostly quick, and a bar for each would bury what they print."""


@dataclasses.dataclass(frozen=True)
class ReadOptions:
  """How arrays are read (what `pz_persist.PenzaiCheckpointHandler` was
  configured with; the defaults are its defaults).

  Attributes:
    read_batch_bytes: Bytes (of this process's shards) read per Orbax
      restore call; see `DEFAULT_READ_BATCH_BYTES`.
    direct_reads: Read straight into the final buffers where that applies
      (`pz_persist.storage.reading.direct_read.applies`); False always reads through Orbax.
    use_ocdbt: Orbax's layout, for checkpoints whose metadata does not say.
    use_zarr3: Likewise.
    restore_concurrent_gb: Orbax's limit on bytes read at once.
    multiprocessing_options: Orbax's, for reads across processes.
  """

  read_batch_bytes: int = DEFAULT_READ_BATCH_BYTES
  direct_reads: bool = True
  use_ocdbt: bool = True
  use_zarr3: bool = False
  restore_concurrent_gb: int | None = None
  multiprocessing_options: ocp.options.MultiprocessingOptions = dataclasses.field(
      default_factory=ocp.options.MultiprocessingOptions
  )

  def orbax_handler(self) -> ocp.PyTreeCheckpointHandler:
    """Orbax's handler of the flat ``{key: array}`` tree, for reading it."""
    return ocp.PyTreeCheckpointHandler(
        use_ocdbt=self.use_ocdbt,
        use_zarr3=self.use_zarr3,
        restore_concurrent_gb=self.restore_concurrent_gb,
        multiprocessing_options=self.multiprocessing_options,
    )


def read_arrays(
    directory: epath.Path,
    manifest: manifest_lib.Manifest,
    *,
    sharding: sharding_lib.Target | placements.PerArray = None,
    refs: Collection[int] | None = None,
    verify: bool = True,
    to_host: bool = False,
    tracker: progress_lib.Tracker | None = None,
    options: ReadOptions = ReadOptions(),
    snapshot: containment.Snapshot | None = None,
) -> list[Any]:
  """Reads arrays of the manifest, all of them or those indexed by ``refs``.

  Args:
    directory: The item directory (holding the manifest and Orbax's files).
    manifest: Its manifest, already read and validated.
    sharding: Where ``jax.Array`` values go: one ``Sharding``,
      `pz_persist.AxisRules`, a `pz_persist.storage.reading.placements.PerArray` mapping
      (each array's own placement, by manifest index), or None for the
      first local device. Arrays saved as NumPy arrays stay NumPy arrays.
    refs: Indices into ``manifest.arrays`` to read (default: all).
    verify: Check the bytes read against the manifest's checksums (the
      default, so that no caller reads unchecked bytes by omission).
    to_host: Read every array as a NumPy array (for checking).
    tracker: Told the bytes to read, then each array's or batch's.
    options: How to read (see `ReadOptions`).
    snapshot: The containment check `pz_persist.storage.reading.opening` already made of
      ``directory``; it stands for the check before the read (the one after
      it is always made: what was read is returned only if no file changed).

  Returns:
    A list aligned with ``manifest.arrays``: each array as it was saved
    (kind, dtype, weak type restored), or None where not requested.

  Raises:
    IntegrityError: arrays do not match their checksums (all of them named),
      or their files cannot be read (named by label and tree path).
    ManifestError: a stored array's shape or dtype is not the manifest's.
    UnsafeCheckpointError: the arrays would exceed the allocation limit, or
      a file of ``directory`` changed while it was read.
    ArgumentError: ``PZ_PERSIST_PAGE_LOCKING`` is neither on nor off.
  """
  # Checked by every load, whatever its devices: a bad value set on a CPU
  # machine is named there, not first on the GPU job it was meant for.
  page_locking.switched_on()
  stored: dict[str, Any] = {}
  try:
    with containment.files_unchanged(directory, before=snapshot):
      where = str(directory)
      read = plan(manifest, where=where, sharding=sharding, refs=refs, to_host=to_host)
      if tracker is not None:
        tracker.grow(sum(read.sizes.values()))
      if read.wanted:
        # Before Orbax or a direct read parses it, with no limits.
        bounded_json.check_orbax_metadata(directory)
        verifier = _Verifier(where, enabled=verify, order=[spec.key for spec in read.wanted])
        if options.direct_reads and direct_read.applies(read.targets):
          stored = _read_directly(directory, read, verifier, tracker)
        else:
          _check_orbax_readable(manifest, where)
          stored = _read_through_orbax(directory, read, verifier, tracker, options)
        verifier.raise_if_damaged()
      return values(manifest, stored, where=where, placed=read.placed, refs=refs)
  except BaseException:
    # Refused after the read (a file changed, say): the error's traceback
    # holds this frame, and must not hold every array read with it.
    stored.clear()
    raise


@dataclasses.dataclass(frozen=True)
class Plan:
  """A read, decided and checked before anything is allocated.

  Attributes:
    manifest: The manifest read from.
    where: The item directory, for messages.
    refs: The manifest indices to read (None: all).
    placed: Where each array of the manifest goes (aligned with its arrays;
      None: a NumPy array).
    targets: Where each stored array to read goes, by storage key.
    sizes: Bytes this process allocates for each, by storage key.
    wanted: The specs of the stored arrays to read, in manifest order.
  """

  manifest: manifest_lib.Manifest
  where: str
  refs: Collection[int] | None
  placed: Sequence[jax.sharding.Sharding | None]
  targets: Mapping[str, jax.sharding.Sharding | None]
  sizes: Mapping[str, int]
  wanted: Sequence[arrays_lib.ArraySpec]


def plan(
    manifest: manifest_lib.Manifest,
    *,
    where: str,
    sharding: sharding_lib.Target | placements.PerArray = None,
    refs: Collection[int] | None = None,
    to_host: bool = False,
) -> Plan:
  """Decides where each array goes; refuses, before anything is allocated, a
  load that would change values (`check_loadable`) or exceed the allocation
  limit (`pz_persist.safety.limits.check_allocation`)."""
  check_loadable(manifest, where, refs)
  placed = placements.placements(manifest, sharding)
  targets = {
      spec.key: None if to_host else placed[index]
      for index, spec in enumerate(manifest.arrays)
      if spec.is_stored and (refs is None or index in refs)
  }
  wanted = [spec for spec in manifest.arrays if spec.key in targets]
  # Once per distinct shape, dtype and target: a sharding's device map costs
  # microseconds, and a tree of many small arrays repeats a few shapes.
  distinct: dict[tuple[Any, ...], int] = {}
  sizes = {}
  for spec in wanted:
    target = targets[spec.key]
    shape_of = (spec.shape, spec.dtype, target)
    if shape_of not in distinct:
      distinct[shape_of] = _local_bytes(spec, target, where)
    sizes[spec.key] = distinct[shape_of]
  limits.check_allocation(wanted, sizes, where=where)
  return Plan(manifest, where, refs, placed, targets, sizes, wanted)


def _local_bytes(
    spec: arrays_lib.ArraySpec, target: jax.sharding.Sharding | None, where: str
) -> int:
  """`placements.local_bytes`, refusing a sharding that cannot hold the array
  (JAX's own error names neither the array nor a way out)."""
  try:
    return placements.local_bytes(spec, target)
  except ValueError as e:
    raise errors.ArgumentError(
        f"{where}: sharding= cannot place {spec.describe()}, of shape"
        f" {list(spec.shape)}: {str(e).splitlines()[0][:300].rstrip('.')}. To shard a whole tree,"
        " pass pz_persist.AxisRules (arrays whose axes the rules do not name are"
        " replicated), or load into a model whose arrays are already placed"
        " (pz_persist.load_into)."
    ) from None


def check_loadable(
    manifest: manifest_lib.Manifest, where: str, refs: Collection[int] | None = None
) -> None:
  """Refuses, before reading anything, a load that would change values.

  A 64-bit ``jax.Array`` loaded while ``jax_enable_x64`` is off would be cast
  to 32 bits by JAX without a word; that is exactly the silent change this
  library exists to prevent.
  """
  if jax.config.jax_enable_x64:  # type: ignore[attr-defined]  # JAX sets flags at run time.
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


def _read_directly(
    directory: epath.Path,
    read: Plan,
    verifier: _Verifier,
    tracker: progress_lib.Tracker | None,
) -> dict[str, Any]:
  """The direct path: each array read into a host buffer, then checked on
  other threads and copied to its device while the next ones are read
  (`pz_persist.storage.reading.streaming.Placer`; on CPU, adopted without a
  copy)."""

  def on_placed(spec: arrays_lib.ArraySpec) -> None:
    if tracker is not None:
      tracker.advance(read.sizes[spec.key])

  check = verifier.check if verifier.enabled else None
  with streaming.Placer(read.targets, check, on_placed=on_placed) as placer:
    try:
      direct_read.read(
          directory,
          read.wanted,
          where=read.where,
          on_read=placer.take,
          buffer_for=placer.buffer_for,
      )
    except errors.ArrayReadError as e:
      raise read_failure(read.manifest, [e.key], read.where, e.cause) from e.cause
    placer.finish()
    # Before anything placed is used, and inside the placer, which drops
    # what it placed when left on an error (nothing bound here either: the
    # error's traceback would hold it).
    verifier.raise_if_damaged()
    return placer.finish()


def _check_orbax_readable(manifest: manifest_lib.Manifest, where: str) -> None:
  """Refuses the Orbax path for an item Orbax's ``PyTreeCheckpointHandler``
  saved through pz_persist's type handler (array keys that are leaf names):
  Orbax's own tree of that item names the variables, not their arrays, so a
  restore by key cannot find them; a direct read (one process, onto the host
  or one device) reads their files by name.
  """
  if manifest.leaf_keys:
    raise errors.PzPersistError(
        f"{where}: its variables were saved leaf by leaf by Orbax's"
        " PyTreeCheckpointHandler (pz_persist's type handler), which pz_persist reads"
        " into one process, onto the host or one device, only. Load it without a"
        " sharding over several devices (then place it with jax.device_put), restore"
        " it with ocp.PyTreeCheckpointer().restore(path, item=model), or save it"
        " again with pz_persist.save to shard it on load."
    )


def _read_through_orbax(
    directory: epath.Path,
    read: Plan,
    verifier: _Verifier,
    tracker: progress_lib.Tracker | None,
    options: ReadOptions,
) -> dict[str, Any]:
  """The Orbax path: batches of Orbax restores, each process reading only
  its own shards of each array, each batch checked once read."""
  handler = options.orbax_handler()
  try:
    orbax_metadata_checks.check_stored_metadata(
        read.wanted, orbax_metadata_checks.read_stored_metadata(handler, directory), where=read.where
    )
    specs = {spec.key: spec for spec in read.wanted}
    batches = list(batching.batches(
        read.targets, read.sizes.__getitem__, options.read_batch_bytes
    ))
    stored = {}
    for batch in batches:
      restored = _restore(handler, directory, read, batch, whole=len(batches) == 1)
      for key in batch:
        if key in restored:
          verifier.check(specs[key], restored[key])
      stored.update(restored)
      host_memory.release_freed()
      if tracker is not None:
        tracker.advance(sum(read.sizes[key] for key in batch))
    return stored
  finally:
    handler.close()


def _restore(
    handler: ocp.PyTreeCheckpointHandler,
    directory: epath.Path,
    read: Plan,
    batch: list[str],
    *,
    whole: bool,
) -> dict[str, Any]:
  """One Orbax restore of the arrays of ``batch`` (storage keys)."""
  restore_args = {
      key: (
          ocp.RestoreArgs(restore_type=np.ndarray)
          if read.targets[key] is None
          else ocp.ArrayRestoreArgs(restore_type=jax.Array, sharding=read.targets[key])
      )
      for key in batch
  }
  if whole and read.refs is None:
    args = ocp.args.PyTreeRestore(restore_args=restore_args)
  else:  # Only some arrays: Orbax reads no others.
    args = ocp.args.PyTreeRestore(
        item=dict.fromkeys(batch, np.ndarray),
        restore_args=restore_args,
        partial_restore=True,
    )
  try:
    return dict(handler.restore(directory, args=args))
  except (KeyboardInterrupt, MemoryError):
    raise
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise read_failure(read.manifest, batch, read.where, e) from e


class _Verifier:
  """Checks arrays against the checksums recorded when they were saved.

  The one place both read paths (and the ``TypeHandler``'s) check bytes: it
  collects every damaged array so that the error names all of them, in
  ``order`` (storage keys; the manifest's): checks run on several threads,
  and a damaged checkpoint must give the same report on every load.
  """

  def __init__(self, where: str, *, enabled: bool = True, order: Sequence[str] = ()):
    self._where = where
    self.enabled = enabled
    self._rank = {key: rank for rank, key in enumerate(order)}
    self._damaged: list[tuple[int, str]] = []
    self._lock = threading.Lock()

  def check(self, spec: arrays_lib.ArraySpec, array: Any) -> None:
    """Records ``array`` as damaged if its bytes are not the saved ones;
    safe to call from several threads at once (the direct path checks on a
    pool of threads)."""
    if not self.enabled or spec.checksums is None:
      return
    found = checksums_lib.check(array, spec.checksums)
    if found.mismatched:
      rank = self._rank.get(spec.key, len(self._rank))
      with self._lock:
        self._damaged.append((rank, describe_damage(spec, found)))

  def raise_if_damaged(self) -> None:
    ranked = sorted(self._damaged, key=lambda damage: damage[0])  # Stable.
    raise_if_damaged([line for _, line in ranked], where=self._where)


def verify_checksums(
    specs: Sequence[arrays_lib.ArraySpec], stored: Mapping[str, Any], *, where: str
) -> None:
  """Checks the arrays of ``specs`` read into ``stored`` (by storage key)
  against their checksums, for readers whose arrays Orbax read (the
  ``TypeHandler``).

  Raises:
    IntegrityError: naming every damaged array.
  """
  verifier = _Verifier(where)
  for spec in specs:
    if spec.key in stored:
      verifier.check(spec, stored[spec.key])
  verifier.raise_if_damaged()


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


def values(
    manifest: manifest_lib.Manifest,
    stored: Mapping[str, Any],
    *,
    where: str,
    placed: Sequence[jax.sharding.Sharding | None],
    refs: Collection[int] | None = None,
) -> list[Any]:
  """The saved arrays, from what was read (``stored``, by storage key),
  aligned with the manifest.

  Undoes storage substitutions, restores kinds and weak types, and makes the
  zero-size arrays (which are not stored) where ``placed`` (aligned with the
  manifest's arrays) puts them. Arrays not in ``refs`` (when given) are None.
  Shapes and dtypes were checked against the stored metadata before reading,
  and bytes by the verifier as they were read: neither is checked again here.

  Raises:
    ManifestError: an array to read was not read (Orbax returned none).
  """
  result: list[Any] = []
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
      result.append(arrays_lib.from_storage(stored[spec.key], spec))
  return result


def read_failure(
    manifest: manifest_lib.Manifest, keys: list[str], where: str, error: BaseException
) -> errors.IntegrityError:
  """A clear error for stored arrays that Orbax / TensorStore cannot read.

  TensorStore's message names the storage key it failed on; it is mapped
  back to the label and tree path the user knows.
  """
  text = str(error)
  specs = [spec for spec in manifest.arrays if spec.key in keys]
  named = [spec for spec in specs if spec.key in text] or specs
  more = f" and {len(named) - 5} more" if len(named) > 5 else ""
  who = ", ".join(spec.describe() for spec in named[:5]) + more
  detail = (text.strip().splitlines() or [type(error).__name__])[0][:400]
  return errors.IntegrityError(
      f"{where}: cannot read the stored array(s) of {who}: the checkpoint's"
      f" files are damaged or incomplete ({type(error).__name__}: {detail})",
      damaged=tuple(f"{spec.describe()} (key {spec.key}): cannot be read"
                    for spec in named),
  )
