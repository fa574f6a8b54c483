"""Placing arrays as they are read: checked on other threads, copied to their
device while the next ones are read, with a bounded number of bytes on the way.

The direct read (`pz_persist.storage.reading.direct_read`) hands each array to
`Placer.take` the moment TensorStore has filled its host buffer. The placer:

* gathers arrays going to one place into a batch until `BATCH_BYTES` are read
  (for all places together: then the largest batch goes; a larger array is a
  batch of its own), then
* starts the batch's checksum checks on a pool of threads
  (`pz_persist.storage.integrity.hashing_threads`: on an H200 host checks on
  the reading thread cost 0.18 s of a 0.37 s warm load of 1 GiB), and
* starts its copy to its device in one call (``jax.device_put`` returns
  before the copy is done);
* keeps at most `WINDOW_BYTES` of copies and checks unfinished: past that it
  waits for the oldest, whose host buffer is then free for the next read.

Why a window, measured on one NVIDIA H200 in a fresh process (1 GiB of
16 MiB arrays already in host memory, ``benchmarks/floors.py`` and the
accelerator benchmark's notes): one ``device_put`` of all of them took 0.50 s
(2.1 GB/s) and held 1.06 GiB more host memory, because JAX's GPU client
stages pageable memory through pinned buffers it allocates (and pins, which
is slow) for everything in flight; with at most 64 MiB in flight the same
copies took 0.09 s (12 GB/s) holding 132 MiB, since the same staging buffers
serve every copy. Warm, either way runs at about 28 GB/s. So a load no
longer holds the whole model in host memory before copying it: host memory
holds the reads in flight, the window, and the largest array.

On the CPU the copy is no copy at all (JAX adopts the 64-byte aligned host
buffer), and the window only bounds how far the checks may lag.

Arrays on their way to an accelerator are read into the placer's staging
buffers (`Placer.buffer_for`, `pz_persist.storage.reading.staging`): a few
slabs, page-locked for the load's duration where the device is a CUDA GPU,
reused as soon as the copies from them are done. So a load holds no new
host memory per array, and JAX copies from page-locked memory directly
instead of through staging buffers of its own.

Nothing is returned unchecked: `Placer.finish` waits for every check, and
the reader raises on any mismatch before the tree is built (arrays already
on a device are simply dropped).
"""

from __future__ import annotations

import collections
import concurrent.futures
import sys
import traceback
import types
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from pz_persist.format import array_specs as arrays_lib
from pz_persist.storage.integrity import hashing_threads
from pz_persist.storage.reading import page_locking
from pz_persist.storage.reading import staging

WINDOW_BYTES = 64 * 2**20
"""Bytes of device copies and checks left unfinished before the oldest is
waited for (see the module docstring for the measurements behind it)."""

BATCH_BYTES = 4 * 2**20
"""Arrays going to one place are gathered until this many bytes are read
(counting every place's batches together, the largest then going; a larger
array is a batch of its own), then checked in one task and
copied in one ``device_put``: a task costs about 10 us and a ``device_put``
about 40 us, more than hashing or copying a small array. Larger batches did
not help on an H200 (32 MiB: 1 GiB in 0.63 s fresh, 0.37 s warm, against
0.56 s and 0.41 s with 4 MiB), and they keep more bytes waiting."""

Check = Callable[[arrays_lib.ArraySpec, np.ndarray], None]
Put = Callable[[list[np.ndarray], jax.sharding.Sharding], list[jax.Array]]


def device_put(hosts: list[np.ndarray], target: jax.sharding.Sharding) -> list[jax.Array]:
  """Starts the copies of ``hosts`` to ``target`` (one ``jax.device_put``)."""
  return jax.device_put(hosts, target)


def copies_to_device(target: jax.sharding.Sharding | None) -> bool:
  """Whether placing an array on ``target`` copies its host buffer (to an
  accelerator's memory), so the buffer may serve again once the copy is
  done. On a CPU, JAX adopts the buffer itself; in a host memory kind, it
  may."""
  if target is None or target.memory_kind not in (None, "device"):
    return False
  devices: set[jax.Device] = target.device_set
  return all(device.platform != "cpu" for device in devices)


class Placer:
  """Takes arrays as they are read and places them (see the module docstring).

  Use as a context manager: leaving it (also on an error) waits for the
  checks already started and stops their threads.

  Args:
    targets: Where each stored array goes, by storage key: a sharding of
      this process's devices, or None to keep the NumPy array.
    check: Checks one array's bytes; called on a pool thread, so it must be
      safe to call from several threads at once. None: nothing is checked.
    on_placed: Called on the reading thread with each spec once it is taken
      (for progress).
    staged: Whether arrays for a target are read into the staging buffers
      (default `copies_to_device`; tests stage CPU copies with a copying
      ``put``).
    put: Starts the copies of a batch to its target (``jax.device_put``).
  """

  def __init__(
      self,
      targets: Mapping[str, jax.sharding.Sharding | None],
      check: Check | None,
      *,
      on_placed: Callable[[arrays_lib.ArraySpec], None] | None = None,
      staged: Callable[[jax.sharding.Sharding | None], bool] | None = None,
      put: Put | None = None,
  ):
    self._targets = targets
    self._check = check
    self._on_placed = on_placed
    self._staged = copies_to_device if staged is None else staged
    self._put: Put = device_put if put is None else put
    self._staging: staging.StagingBuffers | None = None
    self._slabs: dict[str, staging.Slab] = {}
    self._threads = hashing_threads.pool("checks")
    self._placed: dict[str, Any] = {}
    self._batches: dict[jax.sharding.Sharding | None, _Batch] = {}
    self._pending: collections.deque[_Pending] = collections.deque()
    self._pending_bytes = 0
    self._batched_bytes = 0
    self._outer: BaseException | None = None

  def __enter__(self) -> Placer:
    self._outer = sys.exception()
    return self

  def __exit__(
      self,
      kind: type[BaseException] | None,
      error: BaseException | None,
      trace: types.TracebackType | None,
  ) -> None:
    interrupted: BaseException | None = None
    try:
      self._threads.shutdown(wait=True, cancel_futures=True)
    finally:
      if self._staging is not None:
        # No copy may still read a staging buffer once it is unlocked.
        for pending in self._pending:
          interrupted = _wait_quietly(pending.arrays) or interrupted
          pending.arrays, pending.slabs = (), ()  # A traceback may hold this frame.
        self._staging.close()
      if kind is not None:
        # The error's traceback holds this placer: what it placed (on an
        # accelerator, device memory) must not live as long as the error does.
        self._placed.clear()
        self._batches.clear()
        self._pending.clear()
        self._slabs.clear()
        traceback.clear_frames(trace)  # Also where ``error``'s own was replaced since.
        _forget_locals(error, self._outer)
    if interrupted is not None and kind is None:
      raise interrupted

  def buffer_for(self, spec: arrays_lib.ArraySpec) -> np.ndarray | None:
    """The host buffer to read ``spec``'s stored array into, then hand to
    `take`: from the staging buffers where its placement copies it; None
    where the reader's own new buffer is to become the array."""
    target = self._targets[spec.key]
    if not self._staged(target):
      return None
    if self._staging is None:
      assert target is not None
      devices: set[jax.Device] = target.device_set
      device = min(devices, key=lambda device: device.id)
      self._staging = staging.StagingBuffers(page_locking.locker_for(device), self._make_room)
    buffer, self._slabs[spec.key] = self._staging.take(spec.shape, spec.storage_dtype)
    return buffer

  def take(self, spec: arrays_lib.ArraySpec, host: np.ndarray) -> None:
    """Checks and places one array just read into ``host`` (which the
    placer now owns: nothing else may write to it)."""
    target = self._targets[spec.key]
    self._batches.setdefault(target, _Batch()).add(spec, host)
    self._batched_bytes += host.nbytes
    # Batched for every target together, not for each: a tree placed in
    # many ways would otherwise hold that much per placement, outside the
    # window, unchecked.
    while self._batched_bytes >= BATCH_BYTES:
      self._send(max(self._batches, key=lambda place: self._batches[place].nbytes))
    if self._on_placed is not None:
      self._on_placed(spec)

  def finish(self) -> dict[str, Any]:
    """Sends what is batched, waits for every copy and check; returns the
    placed arrays by storage key (``jax.Array``, or NumPy where the target
    was None). Re-raises an exception a check raised."""
    for target in list(self._batches):
      self._send(target)
    while self._pending:
      self._settle_oldest()
    return self._placed

  def _send(self, target: jax.sharding.Sharding | None) -> None:
    """Starts the batch's checks (one task for all of it: a task costs
    about 10 us, more than hashing a small array) and its copy."""
    batch = self._batches.pop(target)
    self._batched_bytes -= batch.nbytes
    checks = () if self._check is None else (self._threads.submit(self._check_all, batch.items),)
    hosts = [host for _, host in batch.items]
    keys = [spec.key for spec, _ in batch.items]
    copies: list[jax.Array] = [] if target is None else self._put(hosts, target)
    self._placed.update(zip(keys, copies or hosts))
    slabs = tuple(self._slabs.pop(key) for key in keys if key in self._slabs)
    self._pending.append(_Pending(tuple(copies), checks, batch.nbytes, slabs))
    self._pending_bytes += batch.nbytes
    while self._pending and self._pending_bytes > WINDOW_BYTES:
      self._settle_oldest()

  def _check_all(self, items: list[tuple[arrays_lib.ArraySpec, np.ndarray]]) -> None:
    assert self._check is not None
    for spec, host in items:
      self._check(spec, host)

  def _settle_oldest(self) -> None:
    oldest = self._pending.popleft()
    self._pending_bytes -= oldest.nbytes
    try:
      for array in oldest.arrays:
        array.block_until_ready()
      for checking in oldest.checks:
        checking.result()
    finally:
      interrupted = None
      if self._staging is not None:
        interrupted = _wait_quietly(oldest.arrays)  # Released only once no copy reads them.
        for slab in oldest.slabs:
          self._staging.release(slab)
      oldest.arrays, oldest.slabs = (), ()  # The error's traceback holds ``oldest``.
    if interrupted is not None:
      raise interrupted

  def _make_room(self) -> bool:
    """For the staging buffers: waits for the oldest copies (sending what is
    batched, if nothing else is on its way); False where nothing was."""
    if not self._pending and self._batches:
      self._send(max(self._batches, key=lambda place: self._batches[place].nbytes))
    if not self._pending:
      return False
    self._settle_oldest()
    return True


def _wait_quietly(arrays: tuple[jax.Array, ...]) -> BaseException | None:
  """Waits for copies to end, whatever their outcome (the error, if any, is
  raised where the copy is used), Ctrl-C included: an interrupted wait is
  waited for once more, since the copy may go on reading its staging buffer
  (only once: a wait that is always interrupted must not hang the load).
  Returns the first interruption, for the caller to raise once its buffers
  are safe."""
  interrupted: BaseException | None = None
  for array in arrays:
    for _ in range(2):
      try:
        array.block_until_ready()
      except Exception:  # pylint: disable=broad-exception-caught
        pass
      except BaseException as e:  # pylint: disable=broad-exception-caught  # Ctrl-C: wait again.
        interrupted = interrupted or e
        continue
      break
  return interrupted


def _forget_locals(error: BaseException | None, outer: BaseException | None) -> None:
  """Clears the local variables of the finished frames in the tracebacks of
  ``error`` and of the errors it chains to (its causes and contexts) down to
  ``outer``, the one being handled when the load began (the caller's, left
  as it is). Those frames are the load's own calls, and they hold host
  buffers (staging slabs, arrays read, batches) that must not live as long
  as the error does. Frames still running are left alone."""
  stack, seen = [error], {id(outer)}
  while stack:
    linked = stack.pop()
    if linked is None or id(linked) in seen:
      continue
    seen.add(id(linked))
    traceback.clear_frames(linked.__traceback__)
    stack += [linked.__cause__, linked.__context__]


class _Batch:
  """Arrays read for one target and not sent yet."""

  def __init__(self) -> None:
    self.items: list[tuple[arrays_lib.ArraySpec, np.ndarray]] = []
    self.nbytes = 0

  def add(self, spec: arrays_lib.ArraySpec, host: np.ndarray) -> None:
    self.items.append((spec, host))
    self.nbytes += host.nbytes


class _Pending:
  """Copies sent (``arrays``) and checks started, not yet waited for."""

  __slots__ = ("arrays", "checks", "nbytes", "slabs")

  def __init__(
      self,
      arrays: tuple[jax.Array, ...],
      checks: tuple[concurrent.futures.Future[None], ...],
      nbytes: int,
      slabs: tuple[staging.Slab, ...],
  ):
    self.arrays = arrays
    self.checks = checks
    self.nbytes = nbytes
    self.slabs = slabs
