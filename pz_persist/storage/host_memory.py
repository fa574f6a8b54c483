"""Host memory for reads: aligned buffers, and freed memory handed back.

Arrays read from disk land in buffers from `aligned_empty`, which JAX's CPU
backend adopts as device arrays without a copy.

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

import ctypes
import functools
import math
import mmap

import numpy as np


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


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """A new array for a read to fill, its pages already mapped, 64-byte aligned.

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
  0.85-0.96 s). The mapping is released when the array (or the ``jax.Array``
  that adopted it) is freed. Elsewhere, an over-allocated NumPy array is used.
  """
  nbytes = math.prod(shape) * np.dtype(dtype).itemsize
  if _CAN_POPULATE and nbytes:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    mapping = mmap.mmap(-1, nbytes, flags=flags)
    return np.frombuffer(mapping, np.uint8).view(dtype).reshape(shape)
  raw = np.empty(nbytes + ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % ALIGNMENT
  return raw[start : start + nbytes].view(dtype).reshape(shape)
