"""The bounded pools that hash (`pz_persist.storage.integrity.hashing_threads`):
results in order, errors re-raised, nothing left running, no thread kept."""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import pytest

import pz_persist as pzp
from pz_persist.storage.integrity import checksums
from pz_persist.storage.integrity import hashing_threads


def _pool_threads() -> list[str]:
  return [t.name for t in threading.enumerate() if t.name.startswith("pz_persist ")
          and "read buffers" not in t.name]


def test_results_come_in_order_whatever_order_the_calls_end(monkeypatch):
  monkeypatch.setattr(hashing_threads, "thread_count", lambda: 4)
  late = threading.Event()

  def square(i: int) -> int:
    if i == 0:
      late.wait()  # The first call ends last...
    elif i == 5:
      late.set()
    return i * i

  assert hashing_threads.map_in_threads(square, range(6), name="t") == [0, 1, 4, 9, 16, 25]
  assert _pool_threads() == []  # ...and no thread outlives the call.


def test_an_error_is_raised_once_and_the_rest_is_not_started(monkeypatch):
  """Calls after the first two wait until the pool has cancelled what is
  queued (not for a duration: on a loaded machine a free thread could
  otherwise run every call before the error reaches the caller)."""
  monkeypatch.setattr(hashing_threads, "thread_count", lambda: 2)
  started = []
  gate, cancelled = threading.Event(), threading.Event()
  make_pool = hashing_threads.pool

  class CancelsThenReleases(concurrent.futures.ThreadPoolExecutor):
    def shutdown(self, wait=True, *, cancel_futures=False):
      super().shutdown(wait=False, cancel_futures=cancel_futures)
      cancelled.set()  # Only now may the running calls end.
      super().shutdown(wait=wait)

  def pool(name, threads=None):
    made = make_pool(name, threads)
    made.__class__ = CancelsThenReleases
    return made

  monkeypatch.setattr(hashing_threads, "pool", pool)

  def call(i: int) -> int:
    started.append(i)
    if i == 0:
      gate.wait()
      raise ValueError("call 0 failed")
    if i == 1:
      gate.set()
    else:
      cancelled.wait()
    return i

  with pytest.raises(ValueError, match="call 0 failed"):
    hashing_threads.map_in_threads(call, range(200), name="t")
  assert len(started) <= 4  # 0 and 1, and at most one more on each thread.
  assert _pool_threads() == []


def test_one_core_hashes_on_the_calling_thread(monkeypatch):
  monkeypatch.setattr(hashing_threads, "thread_count", lambda: 1)
  names = hashing_threads.map_in_threads(
      lambda _: threading.current_thread().name, range(3), name="t")
  assert set(names) == {threading.current_thread().name}


def test_a_save_records_the_same_digests_on_any_number_of_threads(tmp_path, monkeypatch):
  rng = np.random.default_rng(0)
  tree = {f"a{i}": rng.standard_normal((300, 64)).astype(np.float32) for i in range(12)}
  digests = []
  for threads in (1, 3, 8):
    monkeypatch.setattr(hashing_threads, "thread_count", lambda threads=threads: threads)
    digests.append(checksums.compute(tree))
  assert digests[0] == digests[1] == digests[2]
  path = tmp_path / "ck"
  pzp.save(path, tree)
  assert pzp.verify(path).ok
