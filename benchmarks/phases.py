"""Where a load or a save spends its time, phase by phase, in one process.

Usage::

  python benchmarks/phases.py load --size 1GiB [--runs 4] [--cold]
  python benchmarks/phases.py save --size 512MiB [--runs 3]
  python benchmarks/phases.py put --size 256MiB --page-locked   # GPU only

A profile, not a comparison: it wraps pz_persist's internal steps with timers
(the first run of the process is the fresh one) and prints the seconds spent
in each, so a change can be aimed at the phase that costs. ``load``: the
direct read (`direct_read.read`), its waits on TensorStore, the streaming
placer's ``take`` and its waits for copies and checks (``--cold``: each run
with the page cache dropped first; root). ``save`` (from arrays
on the default device): the host copies, the writes started and finished,
hashing the arrays, Orbax's finalize, the file digests; then ``os.sync()``.
``put``: one fresh ``device_put`` of four of pz_persist's read buffers,
as they are or page-locked first (``cuMemHostRegister``, through
`pz_persist.storage.reading.page_locking`): whether JAX's client then skips
its pinned staging copy.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402  pylint: disable=wrong-import-position
import save_restore  # noqa: E402  pylint: disable=wrong-import-position

_times: dict[str, float] = collections.defaultdict(float)


def _wrap(owner, name: str, label: str) -> None:
  function = getattr(owner, name)

  def timed(*args, **kwargs):
    start = time.perf_counter()
    try:
      return function(*args, **kwargs)
    finally:
      _times[label] += time.perf_counter() - start

  setattr(owner, name, timed)


def _report(what: str, seconds: float) -> None:
  phases = ", ".join(f"{k} {v:.3f}" for k, v in _times.items())
  print(f"{what}: {seconds:.3f} s ({phases})", flush=True)
  _times.clear()


def profile_load(size: int, runs: int, directory: str, cold: bool = False) -> None:
  import jax

  import pz_persist as pzp
  from pz_persist.storage.reading import direct_read
  from pz_persist.storage.reading import streaming

  path = os.path.join(directory, "ck")
  pzp.save(path, save_restore.build_params(size))
  pzp.save(os.path.join(directory, "tiny"), save_restore.build_params(2**16))
  jax.block_until_ready(pzp.load(os.path.join(directory, "tiny")))
  _wrap(direct_read, "read", "direct read")
  _wrap(direct_read, "_result", "TensorStore waits")
  _wrap(streaming.Placer, "take", "placer take")
  _wrap(streaming.Placer, "_settle_oldest", "copy/check waits")
  for i in range(runs):
    if cold:
      harness.drop_page_cache_or_exit()
    with harness.PeakRss() as rss:
      start = time.perf_counter()
      tree = jax.block_until_ready(pzp.load(path))
      seconds = time.perf_counter() - start
    del tree
    _report(f"load {i} (peak RSS +{harness.format_size(rss.extra)})", seconds)


def profile_save(size: int, runs: int, directory: str) -> None:
  import jax
  import orbax.checkpoint as ocp

  import pz_persist as pzp
  from pz_persist.storage.integrity import checksums
  from pz_persist.storage.integrity import file_digests
  from pz_persist.storage.writing import direct_write

  pzp.save(os.path.join(directory, "tiny"), save_restore.build_params(2**16))
  _wrap(checksums, "host_copies", "host copies")
  _wrap(direct_write, "start", "writes started")
  _wrap(checksums.HostCopies, "digests", "hash arrays")
  _wrap(direct_write.Started, "finish", "writes finish")
  _wrap(ocp.PyTreeCheckpointHandler, "finalize", "Orbax finalize")
  _wrap(file_digests, "write", "file digests")
  for i in range(runs):
    params = jax.block_until_ready(save_restore.build_params(size, seed=i))
    path = os.path.join(directory, f"s{i}")
    start = time.perf_counter()
    pzp.save(path, params)
    os.sync()
    _report(f"save + sync {i}", time.perf_counter() - start)
    shutil.rmtree(path)


def profile_put(size: int, page_locked: bool) -> None:
  import jax
  import psutil

  from pz_persist.storage.reading import host_memory

  device = jax.devices()[0]
  jax.block_until_ready(jax.device_put(np.ones(16, np.float32), device))
  buffers = [host_memory.aligned_empty((size // 16,), np.float32) for _ in range(4)]
  for i, buffer in enumerate(buffers):
    buffer[:] = i
  process = psutil.Process()
  before = process.memory_info().rss
  register = 0.0
  if page_locked:
    from pz_persist.storage.reading import page_locking

    locker = page_locking.locker_for(device)
    if locker is None:
      raise SystemExit(f"cannot page-lock memory for {device}")
    start = time.perf_counter()
    locked = [locker.lock(buffer) for buffer in buffers]
    if not all(locked):
      raise SystemExit("cuMemHostRegister failed")
    register = time.perf_counter() - start
  for i in range(3):
    start = time.perf_counter()
    arrays = jax.block_until_ready(jax.device_put(buffers, device))
    seconds = time.perf_counter() - start
    correct = all(float(array[0]) == j for j, array in enumerate(arrays))
    print(f"{'page-locked' if page_locked else 'as they are'}: register {register:.3f} s,"
          f" put {i} {seconds:.4f} s ({size / seconds / 1e9:.1f} GB/s),"
          f" RSS +{harness.format_size(process.memory_info().rss - before)}, values correct"
          f" {correct}", flush=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("what", choices=("load", "save", "put"))
  parser.add_argument("--size", default="1GiB")
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--page-locked", action="store_true")
  parser.add_argument("--cold", action="store_true", help="load: drop the page cache before each run")
  args = parser.parse_args(argv)
  size = harness.parse_size(args.size)
  if args.what == "put":
    profile_put(size, args.page_locked)
    return
  with tempfile.TemporaryDirectory(prefix="pz_persist_phases_") as directory:
    if args.what == "load":
      profile_load(size, args.runs, directory, args.cold)
    else:
      profile_save(size, args.runs, directory)


if __name__ == "__main__":
  main()
