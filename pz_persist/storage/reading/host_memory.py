"""Host memory for reads: aligned buffers, and freed memory handed back.

Arrays read from disk land in buffers from `aligned_empty`, which JAX's CPU
backend adopts as device arrays without a copy. When such an array dies, its
memory serves the next buffer of its size for a while (`_Pool`): a process
loading a model again gets the previous model's memory back instead of
memory the kernel must zero.

Reading a batch of arrays allocates read buffers that are freed once the
arrays are built. glibc's allocator keeps freed memory in per-thread arenas,
still resident, and TensorStore reads on many threads: across batches the
process's resident memory keeps growing although nothing uses it. Trimming
the arenas after each batch (`release_freed`) keeps a restore's peak close
to the bytes it returns: on Orbax's batched path, a 531 MiB restore peaked
at 1.44x the data's bytes trimmed and 1.62x untrimmed (``benchmarks/
save_restore.py``, ``pz_persist_before`` vs ``pz_persist_before_untrimmed``;
see ``benchmarks/sharded_restore.py`` for sharded loads). A trim is a
one-shot release of memory nobody uses, not a setting: it changes nothing
for later allocations of the process, so pz_persist keeps doing it.

What pz_persist does not do by itself is change the allocator's settings,
which would apply to the user's whole process: `tune_host_allocator` is the
opt-in for that.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import math
import mmap
import os
import threading
import time
import weakref

import numpy as np

from pz_persist import errors


@functools.cache
def _glibc(name: str):
  """The C library's function ``name``, or None (glibc only; elsewhere the
  calls below are no-ops)."""
  try:
    return getattr(ctypes.CDLL(None), name)
  except (AttributeError, OSError):
    return None


_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h).
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 * 2**20
_TRIM_THRESHOLD = 2 * _MMAP_THRESHOLD


def tune_host_allocator() -> None:
  """Lets glibc reuse freed blocks of up to 32 MiB instead of unmapping them.

  Opt-in, for the whole process: it pins two of glibc's ``mallopt`` settings
  (``M_MMAP_THRESHOLD`` 32 MiB, ``M_TRIM_THRESHOLD`` 64 MiB), which apply to
  every allocation of every library in the process from then on and cannot
  be undone (glibc's own adaptive threshold stays off once set). pz_persist
  never calls it by itself; call it once at start-up if the figures below
  matter to you. Idempotent; a no-op without glibc.

  Why it can help: TensorStore reads and encodes every chunk in a new buffer
  and frees it once copied. glibc starts out returning blocks of 128 KiB or
  more straight to the OS, and raises that threshold only as it sees such
  blocks freed, up to 32 MiB, while trimming its heaps whenever their free
  top exceeds twice the threshold. Until then each chunk maps fresh pages,
  which the kernel must zero, and on virtual machines whose memory the host
  backs lazily that costs far more than the copy. Pinning both thresholds at
  the values glibc's own heuristic ends at lets chunk buffers be reused from
  the first chunk on. Measured with ``benchmarks/save_restore.py``
  (``--methods pz_persist,pz_persist_tuned``): see the benchmarks README.
  """
  _pin_thresholds()


@functools.cache
def _pin_thresholds() -> None:
  mallopt = _glibc("mallopt")
  if mallopt is None:
    return
  mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
  mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


def release_freed() -> None:
  """Returns freed heap memory to the OS, where the C library allows it."""
  trim = _glibc("malloc_trim")
  if trim is not None:
    trim(0)


ALIGNMENT = 64
"""JAX's CPU backend adopts host buffers aligned to this many bytes."""

_CAN_POPULATE = hasattr(mmap, "MAP_POPULATE")  # Linux.

POOL_SECONDS = 60.0
"""How long the memory of dead read buffers is kept for the next load (see
`aligned_empty`): a notebook re-running a load cell within this time gets it
back instead of new memory."""

_MADV_FREE = getattr(mmap, "MADV_FREE", None)  # Linux 4.5 and later.


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """A new array for a read to fill, its pages already mapped, 64-byte aligned.

  Its contents are undefined (memory of a dead array may be reused): the
  caller writes every byte before anything reads it.

  Why aligned: JAX's CPU backend adopts such a buffer as a device array
  without copying it (NumPy's own allocations, and TensorStore's, are only
  16-byte aligned, and get copied), so an array read into it reaches the
  model without a second copy: half the memory traffic and no doubled peak.

  Why mapped up front (Linux): the buffer is a private anonymous mapping
  made with ``MAP_POPULATE``, so the kernel provides all its pages in one
  call instead of one page fault at a time while TensorStore's threads copy
  into it, and with ordinary 4 KiB pages. NumPy asks for transparent huge
  pages for large arrays, which are fast once a machine has them at hand but
  cost seconds per GiB on a virtual machine whose memory the host has not
  backed yet (measured on this project's machine: a first load in a fresh
  process 3.4-3.9 s with huge pages, 0.84-0.97 s like this, and safetensors
  0.85-0.96 s).

  Why reused: providing new memory is most of a load's time even in a warm
  process (the kernel zeroes every page, then unmaps the old ones; measured
  with ``perf``, 40-45% of a warm 512 MiB load), so the mapping of a
  buffer whose array died is kept for the next buffer of the same size
  (`_Pool`): a notebook reloading a model gets the previous model's memory
  back with nothing to zero. See `_Pool` for what that costs and its bounds.
  Elsewhere than Linux, an over-allocated NumPy array is used.
  """
  if min(shape, default=0) < 0:  # mmap would say only "Invalid argument".
    raise errors.ArgumentError(f"shape {shape!r}: an array's dimensions are at least 0.")
  nbytes = math.prod(shape) * np.dtype(dtype).itemsize
  if _CAN_POPULATE and nbytes:
    return _POOL.take(nbytes).view(dtype).reshape(shape)
  return aligned_heap(nbytes).view(dtype).reshape(shape)


def aligned_heap(nbytes: int) -> np.ndarray:
  """``nbytes`` (uint8) of 64-byte aligned memory of its own, from the C
  heap (NumPy's allocator): freed when the array dies, whatever else lives.

  For small arrays (`pz_persist.storage.reading.raw_chunks`): a mapping of their own
  would cost more than reading them (about 7 us), and a mapping shared by
  many would be held whole by any one of them a user keeps (keeping one
  16 KiB array from each of 40 loads held 640 MiB of 16 MiB mappings). Heap
  memory costs a pointer bump and is held per array.
  """
  raw = np.empty(nbytes + ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % ALIGNMENT
  return raw[start : start + nbytes]


def release_buffers() -> None:
  """Unmaps the memory kept from dead read buffers now (see `_Pool`),
  instead of up to `POOL_SECONDS` after their arrays died.

  For a process about to need that memory for something else at once (the
  kernel takes it back by itself under memory pressure anyway).

  Example::

    del model                    # The arrays pz_persist loaded die...
    pzp.release_read_buffers()   # ...and their memory is unmapped now.
  """
  _POOL.expire(older_than=0.0)


class _Pool:
  """Mappings of dead read buffers, kept for the next buffers of their size.

  A buffer handed out is a NumPy array (the *owner*) over a mapping; every
  array built on it keeps the owner alive: NumPy views, the ``jax.Array``
  that adopted it, TensorStore while it writes into it. Only when the owner
  dies does a ``weakref.finalize`` give the mapping back: memory is never
  handed out while anything still refers to it.

  Bounds, the cost of the reuse:

  * Time: a mapping not reused within `POOL_SECONDS` of its array's death is
    unmapped, by a daemon thread that sleeps in between (one per process,
    started by the first buffer handed out).
  * Bytes: what is kept never exceeds the bytes handed out in the last
    `POOL_SECONDS`, about one load's worth: a process that drops models it
    loaded long ago gets their memory back at once, as before.
  * Memory pressure: a kept mapping is marked ``MADV_FREE``: its pages stay
    counted in the process's resident memory, but the kernel may take them
    whenever it needs memory, without swapping (a later reuse then faults in
    zeroed pages, which costs what new memory costs).

  So after a load, the previous model's memory (when it died) stays mapped
  for up to a minute, and the next load of the same shapes in that minute
  maps nothing new. A fresh process, or a load of other shapes, works as
  before: the pool is only ever consulted by size.

  The finalizers run wherever an owner dies (any thread, inside garbage
  collection): they append to a queue and take the lock only if it is free
  (never waiting, never starting a thread); whoever holds the lock empties
  the queue before and after letting go.
  """

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._returned: collections.deque[mmap.mmap] = collections.deque()
    self._free: dict[int, list[tuple[float, mmap.mmap]]] = {}
    self._free_bytes = 0
    self._recent: collections.deque[tuple[float, int]] = collections.deque()
    self._recent_bytes = 0
    self._expiring: threading.Thread | None = None
    self._wake = threading.Event()

  def take(self, nbytes: int) -> np.ndarray:
    """A buffer of ``nbytes`` (uint8), reused or newly mapped and populated."""
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    with self._locked():
      now = time.monotonic()
      self._recent.append((now, size))
      self._recent_bytes += size
      kept = self._free.get(size)
      mapping = kept.pop()[1] if kept else None
      if mapping is not None:
        self._free_bytes -= size
      if self._expiring is None:
        self._expiring = threading.Thread(
            target=self._expire_forever, name="pz_persist read buffers", daemon=True
        )
        self._expiring.start()
    if mapping is None:
      mapping = _new_mapping(size)
    owner = np.frombuffer(mapping, np.uint8, count=nbytes)
    weakref.finalize(owner, self._give_back, mapping).atexit = False
    return owner

  def expire(self, older_than: float | None = None) -> None:
    """Unmaps kept mappings returned more than ``older_than`` seconds ago
    (default: `POOL_SECONDS`)."""
    with self._locked():
      since = time.monotonic() - (POOL_SECONDS if older_than is None else older_than)
      dropped = self._keep_only(since)
    del dropped  # Unmapped here, out of the lock.

  def _give_back(self, mapping: mmap.mmap) -> None:
    """An owner died (its finalizer): its mapping may serve again."""
    self._returned.append(mapping)
    self._settle()

  @contextlib.contextmanager
  def _locked(self):
    with self._lock:
      self._drain()
      yield
      self._drain()
    self._settle()

  def _settle(self) -> None:
    """Empties what finalizers queued while the lock was taken."""
    while self._returned and self._lock.acquire(blocking=False):
      try:
        self._drain()
      finally:
        self._lock.release()

  def _drain(self) -> None:
    """Keeps or drops every returned mapping (the lock is held)."""
    now = time.monotonic()
    while self._recent and self._recent[0][0] < now - POOL_SECONDS:
      self._recent_bytes -= self._recent.popleft()[1]
    while self._returned:
      mapping = self._returned.popleft()
      size = len(mapping)
      if self._free_bytes + size > self._recent_bytes:
        continue  # Dropped: unmapped once its last view is gone.
      _let_kernel_take(mapping)
      self._free.setdefault(size, []).append((now, mapping))
      self._free_bytes += size

  def _keep_only(self, since: float) -> list[mmap.mmap]:
    """Stops keeping mappings returned at or before ``since`` (the lock is
    held); returns them, to be unmapped once the caller lets them go."""
    dropped = []
    for size, kept in list(self._free.items()):
      young = [entry for entry in kept if entry[0] > since]
      dropped += [mapping for returned, mapping in kept if returned <= since]
      self._free_bytes -= size * (len(kept) - len(young))
      if young:
        self._free[size] = young
      else:
        del self._free[size]
    return dropped

  def _expire_forever(self) -> None:
    """The expiring thread: sleeps until the oldest kept mapping is due (or
    `POOL_SECONDS` when nothing is kept), then unmaps what is due."""
    while True:
      self._wake.wait(self._seconds_to_next_expiry())
      self._wake.clear()
      self.expire()

  def _seconds_to_next_expiry(self) -> float:
    with self._locked():
      returned = [entry[0] for kept in self._free.values() for entry in kept]
      if not returned:
        return POOL_SECONDS
      return max(min(returned) + POOL_SECONDS - time.monotonic(), 0.0) + 0.01

  def _after_fork(self) -> None:
    """In a forked child: the parent's expiring thread does not exist here."""
    self._lock = threading.Lock()
    self._wake = threading.Event()
    self._expiring = None
    self._free.clear()
    self._free_bytes = 0


def _new_mapping(size: int) -> mmap.mmap:
  """``size`` bytes of new memory, every page provided up front."""
  flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
  return mmap.mmap(-1, size, flags=flags)


def _let_kernel_take(mapping: mmap.mmap) -> None:
  """Marks a kept mapping's pages as reclaimable (``MADV_FREE``), where the
  kernel has it."""
  if _MADV_FREE is None:
    return
  try:
    mapping.madvise(_MADV_FREE)
  except OSError:  # Not supported by this kernel: the pages just stay.
    pass


_POOL = _Pool()
if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_POOL._after_fork)  # pylint: disable=protected-access
