"""Checksums of stored arrays: computed when saving, checked when loading.

A checkpoint is often the only copy of days of training, and it is copied,
uploaded and downloaded. Bit rot or a truncated copy must be *reported*, not
turned silently into a model with wrong weights. So every stored array carries
a fast hash (xxHash3, 128 bits, over ``10 GiB/s`` on one core) of its bytes as
stored, in the manifest.

Why per shard: an array sharded over several processes is never whole in any
of them, so each process hashes the shards it owns (one per distinct slice,
whichever replica sits on the lowest-numbered device) and the hashes are
gathered so the manifest, written once, holds all of them. A reader checks
every recorded slice that lies within what it has read: all of them when it
reads whole arrays, its own part when it reads shards.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import itertools
import os
import stat
import threading
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import xxhash
from orbax.checkpoint import multihost as ocp_multihost

from pz_persist.format.checksum_records import Index
from pz_persist.format.checksum_records import ShardChecksum
from pz_persist.format.checksum_records import full_index
from pz_persist.storage.integrity import hashing_threads

_DIGEST_BYTES = 16  # xxh3_128

TILE_BYTES = 16 * 2**20
"""An array held whole that is larger than this gets one checksum per tile of
at most this many bytes along its leading axis (rows ``[k*r, (k+1)*r)``, ``r``
a power of two, every other dimension whole), not one over the whole array.

Why: a reader of a slice (`pz_persist.open`'s ``read``) must hash every
recorded slice it touches; with one digest per array, verifying one row of a
2 GiB embedding meant reading the whole table. Tiles along the leading axis are
contiguous in C order, so hashing them costs what hashing the whole array
costs, and they still cut the array into a grid (`checksum_records.tiles`), so
every reader that checks whole arrays checks them all. The direct write stores
such arrays in chunks that divide a tile (`pz_persist.storage.writing.direct_write`), so
the tiles a slice overlaps are exactly the chunks read."""

def c_order_bytes(data: Any) -> np.ndarray:
  """An array's bytes in C order, as a flat uint8 array (a view when it is
  contiguous already): ml_dtypes (bfloat16, float8...) have no buffer format
  of their own. What is hashed here and what the direct write stores."""
  return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def digest_of(data: Any) -> str:
  """The hex digest of an array's C-order bytes."""
  return xxhash.xxh3_128_hexdigest(c_order_bytes(data).data)


def file_digest(path: str, *, chunk_bytes: int = 2**20) -> str:
  """The hex digest of a regular file's bytes, read in chunks (bounded memory).

  One buffer, small enough to stay in the CPU cache, is reused for every
  chunk: reading into fresh 16 MiB ``bytes`` objects was 4x slower (each
  allocation maps new pages, and each chunk leaves the cache before it is
  hashed). The file is opened without following a link and without blocking,
  and the opened file itself must be a regular file, so a file swapped for a
  link, FIFO or device after any earlier check is refused, not read.

  Raises:
    OSError: the file cannot be opened, or is not a regular file (``EINVAL``).
  """
  hasher = xxhash.xxh3_128()
  buffer = memoryview(bytearray(chunk_bytes))
  flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
  fd = os.open(path, flags)
  with open(fd, "rb", buffering=0) as f:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
      raise OSError(errno.EINVAL, "not a regular file", path)
    while read := f.readinto(buffer):
      hasher.update(buffer[:read])
  return hasher.hexdigest()


def tile_rows(shape: tuple[int, ...], itemsize: int) -> int | None:
  """Rows per checksum tile of a whole array of ``shape`` (`TILE_BYTES`), or
  None when it gets one checksum (small, a scalar, or a single row)."""
  if not shape or shape[0] < 2 or itemsize <= 0:
    return None
  row_bytes = itemsize
  for n in shape[1:]:
    row_bytes *= int(n)
  if row_bytes == 0 or row_bytes * shape[0] <= TILE_BYTES:
    return None
  # A power of two: Orbax chunks a tile by divisors of its dimensions
  # (`direct_write`), and a prime number of rows would leave one-row chunks.
  rows = 1 << max(0, (TILE_BYTES // row_bytes).bit_length() - 1)
  return rows if rows < shape[0] else None


def tile_indices(index: Index, rows: int | None) -> list[Index]:
  """``index`` cut into tiles of ``rows`` along its first dimension (itself
  when ``rows`` is None)."""
  if rows is None or not index:
    return [index]
  (start, stop), rest = index[0], index[1:]
  return [((at, min(at + rows, stop)), *rest) for at in range(start, stop, rows)]


def _itemsize(value: Any) -> int:
  try:
    return np.dtype(value.dtype).itemsize
  except TypeError:  # An extended dtype: never stored as such.
    return 0


def _as_index(slices: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
  return tuple(
      (s.indices(n)[0], s.indices(n)[1]) for s, n in zip(slices, shape)
  )


@dataclasses.dataclass(frozen=True)
class _Slot:
  """One distinct stored slice of one array, and who hashes it."""

  key: str
  index: Index
  owner_process: int
  local_data: Any  # The slice's data if this process hashes it, else None.
  tile_rows: int | None = None  # Hashed in tiles of this many rows (`tile_rows`).


def _slots(key: str, value: Any) -> list[_Slot]:
  """The distinct slices of ``value``, in an order every process agrees on."""
  if not isinstance(value, jax.Array):  # NumPy: the primary process hashes it.
    index = full_index(np.shape(value))
    local = value if jax.process_index() == 0 else None
    return [_Slot(key, index, 0, local, tile_rows(np.shape(value), _itemsize(value)))]
  shape = value.shape
  devices = value.sharding.device_set
  if len(devices) == 1:  # The commonest case, without the general walk below.
    (device,) = devices
    holder: int = device.process_index  # type: ignore[attr-defined]  # jaxlib's Device: no stub.
    local_whole = value if holder == jax.process_index() else None
    rows = tile_rows(shape, _itemsize(value))
    return [_Slot(key, full_index(shape), holder, local_whole, rows)]
  owners = _owners(value)
  local = {
      shard.device: shard for shard in value.addressable_shards
  }
  slots = []
  for index in sorted(owners):
    owner = owners[index]
    shard = local.get(owner)
    data = shard.data if shard is not None else None
    rows = tile_rows(shape, _itemsize(value)) if index == full_index(shape) else None
    slots.append(_Slot(key, index, owner.process_index, data, rows))
  return slots


def _owners(value: jax.Array) -> dict[Index, jax.Device]:
  """Each distinct slice of a sharded array, and the device hashing it (the
  lowest id holding it)."""
  owners: dict[Index, jax.Device] = {}
  for device, slices in value.sharding.devices_indices_map(value.shape).items():
    index = _as_index(slices, value.shape)
    if index not in owners or device.id < owners[index].id:  # type: ignore[attr-defined]  # jaxlib's Device: no stub.
      owners[index] = device
  return owners


def indices(stored: Mapping[str, Any]) -> dict[str, tuple[Index, ...]]:
  """The slice of every checksum `HostCopies.digests` will record, by key,
  from the arrays' shapes, dtypes and shardings alone (nothing copied or
  read): a manifest's checksums but their digests, known before a save
  writes anything (`pz_persist.storage.writing.writer.check_publishable`)."""
  out = {}
  for key, value in stored.items():
    shape = tuple(np.shape(value))
    if isinstance(value, jax.Array) and len(value.sharding.device_set) > 1:
      cut = [(index, index == full_index(shape)) for index in sorted(_owners(value))]
    else:
      cut = [(full_index(shape), True)]
    rows = tile_rows(shape, _itemsize(value))
    out[key] = tuple(
        piece for index, whole in cut for piece in tile_indices(index, rows if whole else None)
    )
  return out


def compute(stored: Mapping[str, Any]) -> dict[str, tuple[ShardChecksum, ...]]:
  """Checksums of every distinct slice of every stored array, by key.

  Must be called by every process of a multi-process save, in the same order:
  each hashes the slices it owns and the digests are exchanged.
  """
  return host_copies(stored).digests()


@dataclasses.dataclass(frozen=True)
class HostCopies:
  """Host copies of the slices this process hashes, taken at one instant.

  Why two steps: an async save must return to the training loop as soon as
  the arrays are safe from later updates (a donated or deleted buffer), but
  hashing them need not hold the loop. `host_copies` is the part that must
  happen before the save returns; `digests` can run in the save's
  background work, as long as every process runs it, in the same order.
  """

  keys: tuple[str, ...]
  slots: tuple[_Slot, ...]

  def whole_arrays(self) -> dict[str, np.ndarray]:
    """``{key: host copy}`` when this process holds every array whole (one
    slice each): what a single-process direct write writes.

    Raises:
      ValueError: some array is sharded or held by another process.
    """
    # One distinct slice per array is the whole array.
    if len(self.slots) != len(self.keys) or any(
        slot.local_data is None for slot in self.slots
    ):
      raise ValueError("not every array is held whole by this process")
    return {slot.key: slot.local_data for slot in self.slots}

  def digests(
      self, exchange: str | None = None, stop: threading.Event | None = None
  ) -> dict[str, tuple[ShardChecksum, ...]]:
    """Hashes the copies and gathers every process's digests (collective).

    Args:
      exchange: A name every process gives this save alike (its directory),
        for saves whose digests are exchanged in background threads, where
        two items' exchanges may start in different orders in different
        processes. None: numbered in call order (one thread only).
      stop: Set when the save was abandoned (Ctrl-C): hashing stops before
        the next slice (hashing 1 GiB takes a second or more under load, all
        of it spent before the interrupted save could end).

    Raises:
      concurrent.futures.CancelledError: ``stop`` was set (single-process
        saves only: with several, every process must take part).
    """
    # Every process cuts every slot alike (from its shape and dtype alone).
    pieces = [(slot, index) for slot in self.slots
              for index in tile_indices(slot.index, slot.tile_rows)]
    digests = np.zeros((len(pieces), _DIGEST_BYTES), np.uint8)

    def hash_piece(i: int) -> None:
      slot, index = pieces[i]
      if stop is not None and stop.is_set():
        raise concurrent.futures.CancelledError("the save was abandoned")
      if slot.local_data is not None:
        data = slot.local_data
        if slot.tile_rows is not None:  # Rows of the whole array: a view.
          data = np.asarray(data)[index[0][0]:index[0][1]]
        digests[i] = np.frombuffer(bytes.fromhex(digest_of(data)), np.uint8)

    hashing_threads.map_in_threads(hash_piece, range(len(pieces)), name="save hashing")
    if jax.process_count() > 1 and pieces:
      gathered = _exchange(digests, exchange)
      owners = np.array([slot.owner_process for slot, _ in pieces])
      digests = gathered[owners, np.arange(len(pieces))]
    result: dict[str, list[ShardChecksum]] = {key: [] for key in self.keys}
    for (slot, index), raw in zip(pieces, digests):
      result[slot.key].append(ShardChecksum(index, bytes(raw).hex()))
    return {key: tuple(sums) for key, sums in result.items()}


def host_copies(stored: Mapping[str, Any]) -> HostCopies:
  """Copies to host memory the slices of ``stored`` this process hashes.

  All device-to-host transfers are started before the first is waited for,
  so they overlap. On the CPU backend a "copy" is a view of the array's own
  buffer (no bytes move), which JAX keeps alive and unchanged for the view
  even if the array is deleted or donated afterwards. On an accelerator with
  pinned host memory (GPUs) each slice is copied into pinned memory, which the
  DMA engine fills directly: measured on an H200, 576 MiB of fresh arrays took
  0.40-0.48 s through `copy_to_host_async` into pageable memory and 0.012 s
  into pinned memory (``benchmarks/async_save.py``), and this copy is the part
  of an async save that blocks the training loop. Orbax makes the same choice
  for its own saves on GPUs.
  """
  slots = [slot for key, value in stored.items() for slot in _slots(key, value)]
  transfers = [_start_transfer(slot.local_data) for slot in slots]
  return HostCopies(
      keys=tuple(stored),
      slots=tuple(
          slot if slot.local_data is None
          else dataclasses.replace(slot, local_data=np.asarray(transfer))
          for slot, transfer in zip(slots, transfers)
      ),
  )


def _start_transfer(data: Any) -> Any:
  """Starts copying ``data`` (a slice this process hashes) to host memory;
  returns what `np.asarray` then waits on (``data`` itself unless it moved)."""
  if not isinstance(data, jax.Array) or _on_cpu(data):
    return data
  pinned = _pinned_sharding(data)
  if pinned is not None:
    return jax.device_put(data, pinned)
  data.copy_to_host_async()
  return data


def _pinned_sharding(data: jax.Array) -> Any:
  """``data``'s sharding in pinned host memory, or None where its devices have none."""
  try:
    if not all(any(memory.kind == "pinned_host"
                   for memory in device.addressable_memories())  # type: ignore[attr-defined]
               for device in data.sharding.device_set):
      return None
    return data.sharding.with_memory_kind("pinned_host")
  except (AttributeError, NotImplementedError, ValueError):  # Shardings without memory kinds.
    return None


def _on_cpu(array: jax.Array) -> bool:
  """Whether ``array`` lives in host memory already (nothing to transfer)."""
  return all(
      device.platform == "cpu"  # type: ignore[attr-defined]  # jaxlib's Device: no stub.
      for device in array.sharding.device_set
  )


_exchanges = itertools.count()


def _exchange(digests: np.ndarray, name: str | None) -> np.ndarray:
  """Every process's ``digests``, stacked by process index.

  Why through the distributed runtime's key-value store, not a JAX
  collective: a save's background work runs in a thread of its own while
  the training loop goes on issuing its own collectives, and two threads
  issuing collectives can order them differently in different processes and
  deadlock. The key-value store needs no ordering with anything else. Keys
  are named after ``name`` (or numbered in call order); the last process to
  have read every digest deletes them, so nothing accumulates over a run.
  """
  client = ocp_multihost.get_jax_distributed_client()
  count, me = jax.process_count(), jax.process_index()
  if name is None:
    name = f"call_{next(_exchanges)}"
  prefix = f"pz_persist/checksums/{name}"
  client.key_value_set_bytes(f"{prefix}/{me}", digests.tobytes())
  timeout_ms = ocp_multihost.coordination_timeout() * 1000
  gathered = np.stack([
      np.frombuffer(
          client.blocking_key_value_get_bytes(f"{prefix}/{i}", timeout_ms), np.uint8
      ).reshape(digests.shape)
      for i in range(count)
  ])
  if client.key_value_increment(f"{prefix}/read", 1) == count:
    for key in [f"{prefix}/{i}" for i in range(count)] + [f"{prefix}/read"]:
      client.key_value_delete(key)
  return gathered


@dataclasses.dataclass(frozen=True)
class Check:
  """What checking one array against its checksums found.

  Attributes:
    checked: How many recorded slices were hashed and compared.
    mismatched: The recorded slices whose bytes hash differently.
    unreachable: Recorded slices not within the data read (shards of other
      processes, or slices crossing this process's shard boundaries).
  """

  checked: int
  mismatched: tuple[Index, ...]
  unreachable: int


def check(value: Any, checksums: Iterable[ShardChecksum]) -> Check:
  """Compares the stored bytes just read (``value``) with their checksums."""
  recorded = tuple(checksums)
  if (
      len(recorded) == 1
      and isinstance(value, np.ndarray)
      and value.flags.c_contiguous
      and recorded[0].index == full_index(value.shape)
  ):
    # The commonest case (a whole array read into host memory, one checksum
    # over all of it), without the general walk below: its bytes hashed
    # where they lie, the same bytes `digest_of` would hash.
    digest = xxhash.xxh3_128_hexdigest(value.reshape(-1).view(np.uint8).data)
    return Check(1, () if digest == recorded[0].digest else (recorded[0].index,), 0)
  pieces = _readable_pieces(value)
  checked, mismatched, unreachable = 0, [], 0
  for one in recorded:
    data = _extract(pieces, one.index)
    if data is None:
      unreachable += 1
      continue
    checked += 1
    if digest_of(data) != one.digest:
      mismatched.append(one.index)
  return Check(checked, tuple(mismatched), unreachable)


def _readable_pieces(value: Any) -> list[tuple[Index, Any]]:
  """The parts of ``value`` this process holds, as ``(index, data)``."""
  if not isinstance(value, jax.Array):
    return [(full_index(np.shape(value)), value)]
  seen, pieces = set(), []
  for shard in value.addressable_shards:
    index = _as_index(shard.index, value.shape)
    if index not in seen:
      seen.add(index)
      pieces.append((index, shard.data))
  return pieces


def _extract(pieces: list[tuple[Index, Any]], wanted: Index) -> Any:
  """The data of slice ``wanted`` if one held piece contains it, else None."""
  for index, data in pieces:
    if len(index) == len(wanted) and all(
        start <= w_start and w_stop <= stop
        for (start, stop), (w_start, w_stop) in zip(index, wanted)
    ):
      local = tuple(
          slice(w_start - start, w_stop - start)
          for (start, _), (w_start, w_stop) in zip(index, wanted)
      )
      return np.asarray(data)[local]
  return None
