"""The physical floors of a restore and a save on this machine.

Usage::

  python benchmarks/floors.py --size 1GiB [--threads 8] [--repeats 3]

What no checkpoint library can beat here, each measured alone, best of
``--repeats`` after one warm-up (figures in GB/s, 1 GB = 1e9 bytes):

* ``page cache -> pageable``: ``os.preadv`` of a file already in the page
  cache into ordinary (pageable) NumPy memory, with 1 thread and with
  ``--threads`` threads, each reading its own contiguous part;
* ``page cache -> pinned``: the same into page-locked host memory (CuPy's
  ``alloc_pinned_memory``; GPU only);
* ``disk -> pageable (cold)``: the same read after the page cache was dropped
  (root only: ``/proc/sys/vm/drop_caches``), the disk's read bandwidth;
* ``pageable -> device`` / ``pinned -> device``: ``jax.device_put`` of host
  arrays (16 MiB each) onto the default device; from pinned memory the source
  is a ``jax.Array`` in the device's ``pinned_host`` memory space. The first
  call of a process is printed apart (``first``): it pays one-time set-up;
* ``device -> pageable`` / ``device -> pinned``: ``np.asarray`` of device
  arrays (a fresh copy each time), and ``device_put`` into ``pinned_host``;
* ``disk write + fsync``: ``os.pwrite`` of the data into a new file, then
  ``os.fsync``;
* ``xxh3_128``: hashing the data (the checksum every load verifies), on 1
  thread and on ``--threads``.

The accelerator rows are skipped (``n/a``) where JAX has no accelerator or
CuPy is missing. `accelerator.py` prints these beside the restores it times,
from the same run (``--floors``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402  pylint: disable=wrong-import-position

PIECE = 16 * 2**20


def _best(operation, repeats: int) -> float:
  operation()
  return min(harness.timed_runs(operation, repeats))


def _read_into(fd: int, out: np.ndarray, threads: int) -> None:
  """Reads the file behind ``fd`` into ``out`` with ``threads`` threads."""
  view = memoryview(out.reshape(-1).view(np.uint8))
  size = len(view)
  step = -(-size // threads)

  def part(start: int) -> None:
    end = min(start + step, size)
    while start < end:
      done = os.preadv(fd, [view[start:min(end, start + PIECE)]], start)
      if done <= 0:
        raise OSError(f"short read at {start}")
      start += done

  if threads == 1:
    part(0)
    return
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    list(pool.map(part, range(0, size, step)))


def _hash(data: np.ndarray, threads: int) -> None:
  import xxhash

  flat = data.reshape(-1).view(np.uint8)
  pieces = [flat[i:i + PIECE] for i in range(0, flat.size, PIECE)]
  if threads == 1:
    for piece in pieces:
      xxhash.xxh3_128_digest(piece.data)
    return
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    list(pool.map(lambda p: xxhash.xxh3_128_digest(p.data), pieces))


def _pinned(nbytes: int) -> np.ndarray | None:
  try:
    import cupy
  except ImportError:
    return None
  memory = cupy.cuda.alloc_pinned_memory(nbytes)
  return np.frombuffer(memory, np.uint8, nbytes)


def measure(size: int, threads: int, repeats: int, directory: str) -> dict[str, float | None]:
  """The floors, in GB/s (None: not measurable here)."""
  import jax

  gb = size / 1e9
  out: dict[str, float | None] = {}
  path = os.path.join(directory, "floor.bin")
  data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)

  def write() -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
      view = memoryview(data)
      for start in range(0, size, PIECE):
        os.pwrite(fd, view[start:start + PIECE], start)
      os.fsync(fd)
    finally:
      os.close(fd)

  out["disk write + fsync"] = gb / _best(write, repeats)
  fd = os.open(path, os.O_RDONLY)
  try:
    pageable = np.empty(size, np.uint8)
    out["page cache -> pageable, 1 thread"] = gb / _best(lambda: _read_into(fd, pageable, 1), repeats)
    out[f"page cache -> pageable, {threads} threads"] = gb / _best(
        lambda: _read_into(fd, pageable, threads), repeats)
    pinned = _pinned(size)
    for n in (1, threads):
      key = f"page cache -> pinned, {n} thread{'s' if n > 1 else ''}"
      out[key] = None if pinned is None else gb / _best(lambda n=n: _read_into(fd, pinned, n), repeats)
    if harness.drop_page_cache():
      start = time.perf_counter()
      _read_into(fd, pageable, threads)
      out[f"disk -> pageable (cold), {threads} threads"] = gb / (time.perf_counter() - start)
    else:
      out[f"disk -> pageable (cold), {threads} threads"] = None
  finally:
    os.close(fd)
  out["xxh3_128, 1 thread"] = gb / _best(lambda: _hash(data, 1), repeats)
  out[f"xxh3_128, {threads} threads"] = gb / _best(lambda: _hash(data, threads), repeats)

  device = jax.devices()[0]
  if device.platform == "cpu":
    return out
  host = [np.ascontiguousarray(p).view(np.float32) for p in np.split(data, size // PIECE)]
  start = time.perf_counter()
  jax.block_until_ready(jax.device_put(host, device))
  out["pageable -> device (first call)"] = gb / (time.perf_counter() - start)
  out["pageable -> device"] = gb / _best(lambda: jax.block_until_ready(jax.device_put(host, device)), repeats)
  pinned_sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  start = time.perf_counter()
  in_pinned = jax.block_until_ready(jax.device_put(host, pinned_sharding))
  out["pageable -> pinned jax.Array (first call)"] = gb / (time.perf_counter() - start)
  out["pageable -> pinned jax.Array"] = gb / _best(
      lambda: jax.block_until_ready(jax.device_put(host, pinned_sharding)), repeats)
  device_sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
  out["pinned -> device"] = gb / _best(
      lambda: jax.block_until_ready(jax.device_put(in_pinned, device_sharding)), repeats)
  on_device = jax.block_until_ready(jax.device_put(host, device))

  def to_host() -> None:
    fresh = [x + 0 for x in on_device]  # New arrays: a jax.Array caches its host copy.
    jax.block_until_ready(fresh)
    start = time.perf_counter()
    [np.asarray(x) for x in fresh]
    return time.perf_counter() - start

  to_host()
  out["device -> pageable"] = gb / min(to_host() for _ in range(repeats))

  def to_pinned() -> float:
    fresh = jax.block_until_ready([x + 0 for x in on_device])
    start = time.perf_counter()
    jax.block_until_ready(jax.device_put(fresh, pinned_sharding))
    return time.perf_counter() - start

  to_pinned()
  out["device -> pinned jax.Array"] = gb / min(to_pinned() for _ in range(repeats))
  return out


def print_floors(floors: dict[str, float | None], size: int) -> str:
  rows = [[name, "n/a" if value is None else f"{value:.2f}",
           "n/a" if value is None else f"{size / value / 1e9:.3f} s"]
          for name, value in floors.items()]
  return harness.print_table(f"physical floors, {harness.format_size(size)}",
                             ["floor", "GB/s", "time for the data"], rows)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="1GiB")
  parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  size = harness.parse_size(args.size) // PIECE * PIECE
  print(harness.machine_description())
  with tempfile.TemporaryDirectory(prefix="pz_persist_floors_") as directory:
    floors = measure(size, args.threads, args.repeats, directory)
  print_floors(floors, size)
  return harness.finish({"size_bytes": size, "floors_gbps": floors}, json_path=args.json)


if __name__ == "__main__":
  main()
