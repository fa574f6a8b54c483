"""The host buffers a load reads into on the way to an accelerator: few, reused,
page-locked.

Reading each array into new host memory costs twice on an accelerator: the
kernel zeroes every new page (a GiB of them is a good part of a warm load),
and JAX must copy pageable memory through staging buffers of its own, which
it page-locks on first use (slow in a fresh process, and more host memory;
`pz_persist.storage.reading.page_locking`). A load that copies everything
to a device keeps no host array, so it needs host memory only for the
arrays on their way: `StagingBuffers` hands out parts of a few *slabs*,
page-locked once per load and reused as soon as the arrays in them are on
their device.

* An array of at most `SLAB_BYTES` is carved from the current slab (64-byte
  aligned), arrays packed one after the other; a larger one gets a slab of
  its own size.
* A slab is free again once every array carved from it is released (its
  copy and checks waited for, by `pz_persist.storage.reading.streaming.Placer`).
* Slabs stay within `LIMIT_BYTES` together: before making a new one past
  that, ``make_room`` is called (the placer waits for its oldest copies),
  free slabs too small for the array are dropped, and only where nothing is
  left to wait for is the limit passed (an array larger than it, or reads
  in flight holding every slab). A slab made for an array larger than the
  limit is dropped once free rather than serving smaller arrays, and an
  idle slab being filled counts as free: so the limit is passed only while
  such an array is on its way.

`close` unlocks every slab; the caller must have waited for every copy from
them first (DMA from memory being unlocked is undefined).

Only for arrays whose placement copies them (an accelerator's memory): on a
CPU, JAX adopts the host buffer as the array, which must then never be
reused (`pz_persist.storage.reading.host_memory.aligned_empty`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from pz_persist.storage.reading import host_memory
from pz_persist.storage.reading import page_locking

SLAB_BYTES = 16 * 2**20
"""The size of a slab that small arrays are packed into."""

LIMIT_BYTES = 128 * 2**20
"""The slabs' bytes together, past which a new slab waits for copies to end
(the placer's window of copies plus the reads in flight:
``streaming.WINDOW_BYTES`` + ``direct_read.IN_FLIGHT_BYTES``)."""

_PAGE = 4096

_LOG = logging.getLogger(__name__)


class Slab:
  """One page-locked buffer and the arrays carved from it."""

  __slots__ = ("buffer", "used", "live", "locked")

  def __init__(self, capacity: int, locker: page_locking.Locker | None):
    self.buffer = host_memory.aligned_empty((capacity,), np.dtype(np.uint8))
    self.used = 0
    self.live = 0
    self.locked = locker is not None and _lock(locker, self.buffer)

  @property
  def capacity(self) -> int:
    return self.buffer.nbytes

  def fits(self, nbytes: int) -> bool:
    return self.used + nbytes <= self.capacity

  def carve(self, nbytes: int) -> np.ndarray:
    view = self.buffer[self.used : self.used + nbytes]
    self.used += -(-nbytes // host_memory.ALIGNMENT) * host_memory.ALIGNMENT
    self.live += 1
    return view


class StagingBuffers:
  """Hands out host buffers from reused, page-locked slabs (see the module
  docstring).

  Args:
    locker: Page-locks each new slab; None leaves them pageable.
    make_room: Waits for the oldest copies still running and releases their
      arrays; returns False where there were none to wait for.
  """

  def __init__(self, locker: page_locking.Locker | None, make_room: Callable[[], bool]):
    self._locker = locker
    self._make_room = make_room
    self._open: Slab | None = None
    self._free: list[Slab] = []
    self._slabs: list[Slab] = []

  @property
  def nbytes(self) -> int:
    """The bytes of every slab this holds."""
    return sum(slab.capacity for slab in self._slabs)

  @property
  def locked_bytes(self) -> int:
    """The bytes of the slabs that are page-locked."""
    return sum(slab.capacity for slab in self._slabs if slab.locked)

  def take(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, Slab]:
    """A buffer for an array of ``shape`` and ``dtype``, and the slab to
    `release` once the array's copy and checks are done."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes > SLAB_BYTES:
      slab = self._free_slab(nbytes)
    else:
      if self._open is None or not self._open.fits(nbytes):
        self._close_open()
        self._open = self._free_slab(SLAB_BYTES)
      slab = self._open
    return slab.carve(nbytes).view(dtype).reshape(shape), slab

  def release(self, slab: Slab) -> None:
    """One array carved from ``slab`` is no longer needed."""
    slab.live -= 1
    if slab.live == 0:
      slab.used = 0
      if slab is not self._open:
        self._free.append(slab)

  def close(self) -> None:
    """Unlocks every slab and lets go of them (every copy from them must be
    done)."""
    slabs, self._slabs, self._free, self._open = self._slabs, [], [], None
    locker, self._locker = self._locker, None
    if locker is None:
      return
    for slab in slabs:
      _unlock(locker, slab)
    try:
      locker.close()
    except Exception as e:  # pylint: disable=broad-exception-caught  # Locking is optional.
      _LOG.debug("closing the page locker failed: %s", e)

  def _close_open(self) -> None:
    slab, self._open = self._open, None
    if slab is not None and slab.live == 0:
      self._free.append(slab)

  def _free_slab(self, nbytes: int) -> Slab:
    capacity = max(SLAB_BYTES, -(-nbytes // _PAGE) * _PAGE)
    while True:
      if self._open is not None and self._open.live == 0:
        self._close_open()  # Idle: free to serve, or to drop, like any other.
      # Past the limit (a slab made for an array larger than it), only a
      # slab of the size asked serves again; a larger one is dropped below.
      within = self.nbytes <= LIMIT_BYTES
      fitting = [
          slab
          for slab in self._free
          if slab.capacity == capacity or (within and slab.capacity > capacity)
      ]
      if fitting:
        slab = min(fitting, key=lambda slab: slab.capacity)
        self._free.remove(slab)
        return slab
      if self.nbytes + capacity <= LIMIT_BYTES or not self._make_room():
        break
    while self._free and self.nbytes + capacity > LIMIT_BYTES:
      self._drop(max(self._free, key=lambda slab: slab.capacity))
    slab = Slab(capacity, self._locker)
    self._slabs.append(slab)
    return slab

  def _drop(self, slab: Slab) -> None:
    self._free.remove(slab)
    self._slabs.remove(slab)
    if self._locker is not None:
      _unlock(self._locker, slab)


# Every lock and unlock goes through these two: page-locking only speeds
# copies up, so a locker that raises (a CUDA driver call failing, say) must
# neither fail the load nor keep the other slabs locked.


def _lock(locker: page_locking.Locker, buffer: np.ndarray) -> bool:
  try:
    return locker.lock(buffer)
  except Exception as e:  # pylint: disable=broad-exception-caught  # Locking is optional.
    _LOG.debug("page-locking %d bytes failed: %s", buffer.nbytes, e)
    return False


def _unlock(locker: page_locking.Locker, slab: Slab) -> None:
  if not slab.locked:
    return
  slab.locked = False
  try:
    locker.unlock(slab.buffer)
  except Exception as e:  # pylint: disable=broad-exception-caught  # Locking is optional.
    _LOG.debug("unlocking %d bytes failed: %s", slab.capacity, e)
