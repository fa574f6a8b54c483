"""Page-locking host buffers for the CUDA driver, so copies to a GPU start at once.

A GPU copies host memory by DMA, which needs the memory page-locked. JAX's
GPU client copies ordinary (pageable) memory through staging buffers it
page-locks itself, the first time it needs them: measured on one NVIDIA H200
in a fresh process (``benchmarks/phases.py put``), four 64 MiB read buffers
took 0.156 s to place (1.7 GB/s) and added 351 MiB of host memory; the same
buffers page-locked first (0.015 s) took 0.0063 s (42.5 GB/s) and added
84 MiB. So the buffers a load reads into on their way to a GPU
(`pz_persist.storage.reading.staging.StagingBuffers`) are page-locked while
the load runs, and unlocked before it returns.

Why the driver API through ``ctypes``: ``libcuda.so.1`` is present wherever
a CUDA GPU is usable (JAX itself runs on it), needs no extra package, and
``cuMemHostRegister`` with ``CU_MEMHOSTREGISTER_PORTABLE`` locks the memory
for every context of the process, including the primary context XLA uses.

Nothing here is needed for correctness: where locking is unavailable (no
CUDA, another accelerator, a failed call), `locker_for` returns None or
`Locker.lock` returns False, and the buffers are used as they are. The same
holds where the user turns it off: ``PZ_PERSIST_PAGE_LOCKING=0`` in the
environment (read at each load), for a driver that misbehaves or a process
that must not lock memory (a container with a low ``RLIMIT_MEMLOCK``
ulimit fails the calls anyway, which costs nothing but the speed).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from typing import Any
from typing import Protocol

import jax
import numpy as np

from pz_persist import errors

_LOG = logging.getLogger(__name__)

_CU_MEMHOSTREGISTER_PORTABLE = 0x01

SWITCH = "PZ_PERSIST_PAGE_LOCKING"
"""The environment variable that turns page-locking off (``0``)."""

_OFF = ("0", "false", "off", "no")
_ON = ("", "1", "true", "on", "yes")


class Locker(Protocol):
  """Page-locks host buffers for one accelerator, and unlocks them."""

  def lock(self, buffer: np.ndarray) -> bool:
    """Locks ``buffer``'s memory; False (nothing locked) where that failed."""

  def unlock(self, buffer: np.ndarray) -> None:
    """Unlocks what `lock` locked; called before the memory is freed."""

  def close(self) -> None:
    """Lets go of what the locker holds (every buffer is unlocked by then)."""


class _CudaDriverLocker:
  """`Locker` through the CUDA driver's ``cuMemHostRegister``.

  The calls run with the device's primary context current (the one XLA
  uses), pushed and popped around each, so the caller's thread is left as
  it was found.
  """

  def __init__(self, driver: Any, ordinal: int):
    self._driver = driver
    self._device = ctypes.c_int()
    self._context = ctypes.c_void_p()
    self._lock = threading.Lock()
    _call(driver.cuDeviceGet, ctypes.byref(self._device), ordinal)
    _call(driver.cuDevicePrimaryCtxRetain, ctypes.byref(self._context), self._device)

  def lock(self, buffer: np.ndarray) -> bool:
    with self._current():
      result = self._driver.cuMemHostRegister_v2(
          ctypes.c_void_p(buffer.ctypes.data),
          ctypes.c_size_t(buffer.nbytes),
          ctypes.c_uint(_CU_MEMHOSTREGISTER_PORTABLE),
      )
    if result != 0:
      _LOG.debug("cuMemHostRegister of %d bytes failed with CUDA error %d", buffer.nbytes, result)
    return result == 0

  def unlock(self, buffer: np.ndarray) -> None:
    with self._current():
      result = self._driver.cuMemHostUnregister(ctypes.c_void_p(buffer.ctypes.data))
    if result != 0:
      _LOG.debug("cuMemHostUnregister failed with CUDA error %d", result)

  def close(self) -> None:
    result = self._driver.cuDevicePrimaryCtxRelease_v2(self._device)
    if result != 0:
      _LOG.debug("cuDevicePrimaryCtxRelease failed with CUDA error %d", result)

  def _current(self):
    return _PushedContext(self._driver, self._context, self._lock)


class _PushedContext:
  """Makes a context current on this thread for the duration of a block."""

  def __init__(self, driver: Any, context: ctypes.c_void_p, lock: threading.Lock):
    self._driver, self._context, self._lock = driver, context, lock

  def __enter__(self) -> None:
    self._lock.acquire()
    _call(self._driver.cuCtxPushCurrent_v2, self._context)

  def __exit__(self, *exc: Any) -> None:
    try:
      _call(self._driver.cuCtxPopCurrent_v2, ctypes.byref(ctypes.c_void_p()))
    finally:
      self._lock.release()


def _call(function: Any, *args: Any) -> None:
  result = function(*args)
  if result != 0:
    raise OSError(f"{function.__name__} failed with CUDA error {result}")


@functools.cache
def _cuda_driver() -> Any:
  """The CUDA driver library, initialized; None where it cannot be loaded."""
  try:
    driver = ctypes.CDLL("libcuda.so.1")
    _call(driver.cuInit, 0)
  except (OSError, AttributeError) as e:
    _LOG.debug("no CUDA driver to page-lock read buffers with: %s", e)
    return None
  return driver


def locker_for(device: jax.Device) -> Locker | None:
  """A `Locker` for copies to ``device``, or None where pz_persist cannot
  page-lock memory for it (not a CUDA GPU, the driver is unavailable, or
  ``PZ_PERSIST_PAGE_LOCKING=0``)."""
  if not switched_on():
    return None
  if device.platform != "gpu" or "rocm" in device.client.platform_version.lower():
    return None
  # PJRT's local_hardware_id is the CUDA ordinal, -1 where undefined: then no
  # guess (retaining another GPU's primary context would cost its memory).
  ordinal = getattr(device, "local_hardware_id", None)
  if not isinstance(ordinal, int) or ordinal < 0:
    return None
  driver = _cuda_driver()
  if driver is None:
    return None
  try:
    return _CudaDriverLocker(driver, ordinal)
  except (OSError, AttributeError) as e:
    _LOG.debug("cannot page-lock read buffers for %s: %s", device, e)
    return None


def switched_on() -> bool:
  """Whether the environment leaves page-locking on (`SWITCH`); a value
  that is neither on nor off is an error, not a guess."""
  value = os.environ.get(SWITCH, "").strip().lower()
  if value in _OFF:
    return False
  if value in _ON:
    return True
  raise errors.ArgumentError(
      f"environment variable {SWITCH}={os.environ[SWITCH]!r}: expected 0 (page-lock no read"
      f" buffers) or 1 (page-lock them on CUDA GPUs, the default). Set it to one of those, or"
      f" unset it."
  )
