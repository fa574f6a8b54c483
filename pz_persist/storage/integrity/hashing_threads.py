"""The threads that hash: one bounded pool per save, load or check.

xxHash releases the GIL, so hashing on several threads scales with the cores:
measured on an H200 host (16 cores, ``benchmarks/floors.py``), one thread
hashed 5.8 GB/s and eight 47 GB/s. A save hashed every array, then every
file, on one thread, and a load checked every array on the thread that
reads, so on such a machine hashing alone was 0.18 s of each GiB loaded or
saved, beside the 0.04 s the page cache needs to read it.

Each operation makes its own pool and stops it when it ends: no thread
outlives the call that started it, and nothing is shared process-wide.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import TypeVar

MAX_THREADS = 8
"""Threads one operation hashes on: past eight, the page cache, not the
hashing, bounds a load on the machines measured."""

T = TypeVar("T")
R = TypeVar("R")


def thread_count() -> int:
  """The threads to hash on here: the cores, at most `MAX_THREADS`."""
  return max(1, min(MAX_THREADS, os.cpu_count() or 1))


def pool(name: str, threads: int | None = None) -> concurrent.futures.ThreadPoolExecutor:
  """A new pool of ``threads`` threads (default `thread_count`) named after
  ``name`` (the caller shuts it down, usually as a context manager)."""
  return concurrent.futures.ThreadPoolExecutor(
      max_workers=threads or thread_count(), thread_name_prefix=f"pz_persist {name}"
  )


@contextlib.contextmanager
def ordered_results(
    function: Callable[[T], R], items: Iterable[T], *, name: str, threads: int | None = None
) -> Iterator[Iterator[R]]:
  """The results of ``function(item)`` for each of ``items``, in order, as
  the calls run on a pool of ``threads`` threads (default `thread_count`).

  Leaving the block, also on an error or Ctrl-C in it, cancels the calls not
  yet started and waits for those running: a verify of a large checkpoint
  stops when asked, not once every queued file is hashed.
  """
  with pool(name, threads) as threads_pool:
    futures = [threads_pool.submit(function, item) for item in items]
    try:
      yield (future.result() for future in futures)
    finally:
      threads_pool.shutdown(wait=True, cancel_futures=True)


def map_in_threads(function: Callable[[T], R], items: Iterable[T], *, name: str) -> list[R]:
  """``[function(item) for item in items]``, run on a pool of threads, in order.

  The first exception raised is re-raised here once the calls already
  running end; calls not yet started are cancelled.
  """
  items = list(items)
  if len(items) < 2 or thread_count() == 1:
    return [function(item) for item in items]
  with ordered_results(function, items, name=name) as results:
    return list(results)
