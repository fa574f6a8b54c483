"""Handing freed memory back to the operating system between read batches.

Reading a batch of arrays allocates read buffers that are freed once the
arrays are built. glibc's allocator keeps freed memory in per-thread arenas,
still resident, and TensorStore reads on many threads: across batches the
process's resident memory keeps growing although nothing uses it. Trimming
the arenas after each batch keeps a restore's peak close to the bytes it
returns (measured in ``benchmarks/sharded_restore.py``).
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
  try:
    return ctypes.CDLL(None).malloc_trim  # glibc only; elsewhere a no-op.
  except (AttributeError, OSError):
    return None


def release_freed() -> None:
  """Returns freed heap memory to the OS, where the C library allows it."""
  trim = _malloc_trim()
  if trim is not None:
    trim(0)
