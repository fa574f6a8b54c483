"""Restore onto an accelerator, and save from it: pz_persist vs plain Orbax and safetensors.

Usage::

  python benchmarks/accelerator.py --sizes 1GiB,4GiB [--repeats 3] [--warm-runs 3]
      [--save-size 512MiB] [--floors] [--before PATH]

On a machine with a GPU (or TPU), JAX's default device is the accelerator, and
a restore is only done when the arrays are in its memory. This benchmark
writes the transformer-shaped tree of `save_restore.py` once per format and
size, then restores it onto the default device with each method, each in a
fresh process (after a tiny warm-up, as in `save_restore.py`) and again
repeated in one warm process:

* ``pz_persist``: ``pzp.load(path)``; the arrays come back as ``jax.Array`` on
  the default device (checked), checksums verified.
* ``pz_persist_before``: the same, with the pz_persist package found under
  ``--before PATH`` (an older checkout, for a before/after in one run).
* ``pz_persist:wN``, ``pz_persist:bN``, ``pz_persist:rN``: ``pz_persist``
  with a streaming window of N MiB (`pz_persist.storage.reading.streaming.
  WINDOW_BYTES`), batches of N MiB (``streaming.BATCH_BYTES``), or N MiB of
  reads in flight (`pz_persist.storage.reading.direct_read.IN_FLIGHT_BYTES`),
  to choose them (``pz_persist:w128:r128`` sets two); ``pz_persist:sN``,
  ``pz_persist:lN``: staging slabs of N MiB (``staging.SLAB_BYTES``) within
  N MiB (``staging.LIMIT_BYTES``); ``pz_persist:unstaged``: a new host
  buffer per array, as before staging; ``pz_persist:unlocked``: staging
  slabs left pageable (no ``cuMemHostRegister``).
* ``orbax``: ``ocp.StandardCheckpointer().restore(path, template)`` with a
  template whose ``sharding`` is the default device, as Orbax's docs say.
* ``safetensors_jax``: ``safetensors.flax.load_file`` (memory-maps the file,
  ends in ``jax.Array`` on the default device).
* ``safetensors_numpy``: ``safetensors.numpy.load_file`` then one
  ``jax.device_put`` of the whole dict (ends in ``jax.Array`` on the device).
* ``safetensors_host``: ``safetensors.numpy.load_file`` alone (ends in NumPy
  arrays in host memory: the CPU reference of issue 39's fourth target).
* ``floor``: ``jax.device_put`` of the same arrays already in host memory: the
  host-to-device copy alone, with no file read (the floor a restore from the
  page cache cannot beat).

Printed per size: seconds (best and median), GB/s, the ratio of each method
to pz_persist, peak host RSS above the process's baseline (and as a fraction of
the data), and the device's peak bytes in use above what it held before
(``memory_stats()``, where the backend reports it).

``--save-size``: a save of that much, from arrays on the default device,
then ``os.sync()`` (``pzp.save`` vs ``StandardCheckpointer().save``, and
``pz_persist_before``), the first save of a fresh process and warm repeats
(new arrays each time: a ``jax.Array`` keeps the host copy a save took).

``--floors``: `floors.py`'s physical floors, measured in the same run.
``--cold``: restores with the page cache dropped (root only) after the
process's warm-up, just before the restore (so the libraries it imports are
not read cold too): one in a fresh process, and ``--warm-runs`` in a process
that restored once already (its memory warm, as a server loading a new
checkpoint), against the disk's floor for the same bytes: the checkpoint's
own files read cold into memory already provided (`cold_read_floor`), whole
and in the 4 MiB pieces TensorStore reads them in.

Then the targets of issue 39, met or not. The async save from device arrays
is `async_save.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402  pylint: disable=wrong-import-position
import save_restore  # noqa: E402  pylint: disable=wrong-import-position

METHODS = ("pz_persist", "orbax", "safetensors_jax", "safetensors_numpy", "floor")
SAVE_METHODS = ("pz_persist", "orbax")
_FORMAT = {"pz_persist": "pz_persist", "orbax": "orbax", "safetensors_jax": "safetensors",
           "safetensors_numpy": "safetensors", "safetensors_host": "safetensors",
           "floor": "safetensors"}
"""The file each method restores from (`save_restore.save_op`'s formats)."""


def _base(method: str) -> str:
  """``pz_persist`` for ``pz_persist_before`` and ``pz_persist:w32``."""
  return "pz_persist" if method.startswith("pz_persist") else method


def _prepare(method: str, before: str | None) -> None:
  """In a worker: imports pz_persist from ``before`` for ``pz_persist_before``,
  and sets the streaming window of ``pz_persist:wN``."""
  if method == "pz_persist_before":
    if not before:
      raise SystemExit("pz_persist_before needs --before PATH")
    sys.path.insert(0, before)
    for name in [n for n in sys.modules if n == "pz_persist" or n.startswith("pz_persist.")]:
      del sys.modules[name]
  for setting in method.split(":")[1:]:
    from pz_persist.storage.reading import direct_read
    from pz_persist.storage.reading import page_locking
    from pz_persist.storage.reading import staging
    from pz_persist.storage.reading import streaming
    if setting == "unstaged":
      streaming.copies_to_device = lambda target: False
      continue
    if setting == "unlocked":
      page_locking.locker_for = lambda device: None
      continue
    module = {"w": streaming, "b": streaming, "r": direct_read, "s": staging,
              "l": staging}[setting[0]]
    name = {"w": "WINDOW_BYTES", "b": "BATCH_BYTES", "r": "IN_FLIGHT_BYTES", "s": "SLAB_BYTES",
            "l": "LIMIT_BYTES"}[setting[0]]
    setattr(module, name, int(setting[1:]) * 2**20)


def _device_bytes() -> int | None:
  import jax

  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("bytes_in_use")


def _device_peak() -> int | None:
  import jax

  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def _on_default_device(tree) -> None:
  """Raises unless every array of ``tree`` is a `jax.Array` on the default device."""
  import jax

  device = jax.devices()[0]
  for leaf in jax.tree.leaves(tree):
    leaf = getattr(leaf, "data_array", leaf)
    if not isinstance(leaf, jax.Array) or leaf.devices() != {device}:
      raise AssertionError(f"restored {type(leaf).__name__} is not on {device}")


def restore_op(method: str, path: str, target_bytes: int):
  """A callable restoring ``path`` onto the default device, returning the tree."""
  import jax

  method = _base(method)
  if method == "pz_persist":
    import pz_persist as pzp
    return lambda: jax.block_until_ready(pzp.load(path))
  if method == "orbax":
    import orbax.checkpoint as ocp
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    template = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        jax.eval_shape(lambda: save_restore.build_params(target_bytes)))

    def op():
      with ocp.StandardCheckpointer() as checkpointer:
        return jax.block_until_ready(checkpointer.restore(path, template))
    return op
  if method == "safetensors_jax":
    from safetensors.flax import load_file
    return lambda: jax.block_until_ready(load_file(path))
  if method == "safetensors_numpy":
    from safetensors.numpy import load_file
    return lambda: jax.block_until_ready(jax.device_put(load_file(path)))
  if method == "safetensors_host":
    from safetensors.numpy import load_file
    return lambda: load_file(path)
  if method == "floor":
    from safetensors.numpy import load_file
    host = {k: np.ascontiguousarray(v) for k, v in load_file(path).items()}
    return lambda: jax.block_until_ready(jax.device_put(host, jax.devices()[0]))
  raise ValueError(method)


def _warm_up(method: str) -> None:
  """A tiny restore (and save): start-up costs not charged to the measure."""
  with tempfile.TemporaryDirectory() as directory:
    fmt = _FORMAT[_base(method)]
    tiny = 2**16
    tiny_path = save_restore._path(directory, fmt)
    save_restore.save_op(fmt, tiny_path, save_restore.build_params(tiny))()
    restored = restore_op(method, tiny_path, tiny)()
    if method != "safetensors_host":
      _on_default_device(restored)


def worker(method: str, operation: str, path: str, target_bytes: int) -> dict:
  """One measured restore (``fresh``), ``warm:N`` repeated restores, or the
  saves ``save:N`` (the first is the process's first save), in this process."""
  import jax

  _warm_up(method)
  if operation.startswith("save:"):
    return {"seconds_each": _saves(method, path, target_bytes, int(operation.split(":")[1]))}
  operation_fn = restore_op(method, path, target_bytes)
  before_device = _device_bytes()
  if operation in ("fresh", "cold"):
    check = (lambda tree: None) if method == "safetensors_host" else _on_default_device
    # Dropped here, after the warm-up: only the checkpoint's files are read
    # cold, not the libraries a new process imports on its way.
    if operation == "cold":
      harness.drop_page_cache_or_exit()
    result = harness.measure(lambda: check(operation_fn()))
  elif operation.startswith("cold_warm:"):
    operation_fn()  # The process's own memory warmed by one restore first.
    result = {"seconds_each": [_cold(operation_fn) for _ in range(int(operation.split(":")[1]))]}
  else:
    result = {"seconds_each": harness.timed_runs(operation_fn, int(operation.split(":")[1]) + 1)[1:]}
  peak = _device_peak()
  result["device"] = str(jax.devices()[0])
  result["device_extra"] = None if peak is None or before_device is None else peak - before_device
  return result


def _cold(operation) -> float:
  """Seconds of ``operation`` with the page cache dropped just before."""
  harness.drop_page_cache_or_exit()
  start = time.perf_counter()
  operation()
  return time.perf_counter() - start


def cold_read_floor(path: str, threads: int, repeats: int = 2, *, pieces: bool = False) -> float:
  """Seconds to read every file under ``path`` (a checkpoint) with the page
  cache dropped, into one buffer already in memory: the disk's read time for
  exactly the bytes a restore reads, in this checkpoint's files, with no new
  memory to provide.

  ``pieces=False``: each file read start to end by one of ``threads``
  threads, in 4 MiB ``preadv`` calls (the disk's bandwidth). ``pieces=True``:
  each 4 MiB piece of each file read by whichever thread is free, through a
  descriptor of its own, as TensorStore reads stored chunks (of up to
  ``DEFAULT_CHUNK_BYTES``, 4 MiB); what that pattern costs the disk, with
  nothing else done.
  """
  import concurrent.futures

  files = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
  sizes = [os.path.getsize(name) for name in files]
  buffer = np.ones(sum(sizes), np.uint8)
  starts = np.cumsum([0] + sizes[:-1])
  piece = 4 * 2**20

  def read(i: int, first: int, end: int) -> None:
    fd = os.open(files[i], os.O_RDONLY)
    try:
      view, done = memoryview(buffer)[starts[i]:starts[i] + sizes[i]], first
      while done < end:
        read_now = os.preadv(fd, [view[done:min(done + piece, end)]], done)
        if not read_now:
          raise OSError(f"{files[i]} shrank while the floor read it")
        done += read_now
    finally:
      os.close(fd)

  jobs = ([(i, first, min(first + piece, sizes[i]))
           for i in range(len(files)) for first in range(0, sizes[i], piece)]
          if pieces else [(i, 0, sizes[i]) for i in range(len(files))])

  def read_all() -> None:
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      list(pool.map(lambda job: read(*job), jobs))
  return min(_cold(read_all) for _ in range(repeats))


def _saves(method: str, directory: str, target_bytes: int, count: int) -> list[float]:
  """Seconds of ``count`` saves (then ``os.sync()``) of new device arrays each."""
  import shutil

  import jax

  seconds = []
  fmt = _FORMAT[_base(method)]
  for i in range(count):
    params = jax.block_until_ready(save_restore.build_params(target_bytes, seed=i))
    path = save_restore._path(directory, fmt) + f"_{i}"
    operation = harness.synced(save_restore.save_op(fmt, path, params))
    start = time.perf_counter()
    operation()
    seconds.append(time.perf_counter() - start)
    shutil.rmtree(path, ignore_errors=True)
  return seconds


def _restores(methods, path_of, target: int, args) -> dict:
  """Fresh and warm restores of one size, methods taking turns."""
  fresh: dict[str, list[dict]] = {m: [] for m in methods}
  for _ in range(args.repeats):  # Methods take turns, so a slow phase hits all alike.
    for method in methods:
      fresh[method].append(_run(method, "fresh", path_of(method), target, args))
  warm = {m: _run(m, f"warm:{args.warm_runs}", path_of(m), target, args)["seconds_each"]
          for m in methods}
  cold: dict[str, dict] = {}
  if args.cold:  # Root was checked at the start (`main`).
    # Fresh processes take turns like the warm-cache ones above: one cold
    # run swings as much as 1.5x on a shared disk, so --repeats of them.
    cold_fresh: dict[str, list[float]] = {m: [] for m in methods if m != "floor"}
    for _ in range(args.repeats):
      for method in cold_fresh:
        cold_fresh[method].append(_run(method, "cold", path_of(method), target, args)["seconds"])
    for method, seconds in cold_fresh.items():
      cold[method] = {
          "fresh": min(seconds), "fresh_runs": seconds,
          "warm": min(_run(method, f"cold_warm:{args.warm_runs}", path_of(method), target,
                           args)["seconds_each"]),
      }
    threads = min(8, os.cpu_count() or 1)
    read = "pz_persist" if "pz_persist" in cold else next(iter(cold))
    repeats = max(2, args.repeats)
    cold["floor"] = {"files": cold_read_floor(path_of(read), threads, repeats),
                     "pieces": cold_read_floor(path_of(read), threads, repeats, pieces=True),
                     "threads": threads, "format": _FORMAT[_base(read)]}
  return {"fresh": fresh, "warm": warm, "cold": cold}


def _run(method: str, operation: str, path: str, target: int, args) -> dict:
  extra = ["--before", args.before] if args.before else []
  return harness.run_worker(__file__, ["--worker", method, operation, path, str(target), *extra])


def _restore_table(methods, runs: dict, data_bytes: int) -> dict:
  fresh, warm = runs["fresh"], runs["warm"]
  results = {"size_bytes": data_bytes, "device": fresh[methods[0]][0]["device"], "methods": {}}
  rows = []
  base = "pz_persist" if "pz_persist" in methods else methods[0]
  base_fresh = min(r["seconds"] for r in fresh[base])
  base_warm = min(warm[base])
  for method in methods:
    seconds = [r["seconds"] for r in fresh[method]]
    best, median = harness.best_and_median(seconds)
    warm_best, warm_median = harness.best_and_median(warm[method])
    extra = min(r["extra_rss"] for r in fresh[method])
    device_extra = [r["device_extra"] for r in fresh[method] if r["device_extra"] is not None]
    results["methods"][method] = {"fresh": seconds, "warm": warm[method], "extra_rss": extra,
                                  "device_extra": min(device_extra) if device_extra else None}
    rows.append([
        method, f"{best:.3f} s ({median:.3f})", f"{data_bytes / best / 1e9:.2f}",
        f"{best / base_fresh:.2f}x", f"{warm_best:.3f} s ({warm_median:.3f})",
        f"{data_bytes / warm_best / 1e9:.2f}", f"{warm_best / base_warm:.2f}x",
        f"{harness.format_size(extra)} ({extra / data_bytes:.2f}x)",
        harness.format_size(min(device_extra)) if device_extra else "n/a"])
  if runs["cold"]:
    results["cold"] = cold = runs["cold"]
    floor = cold["floor"]
    harness.print_table(
        f"restore after the page cache was dropped, {harness.format_size(data_bytes)}"
        " (dropped after each process's warm-up; warm process: best of --warm-runs, after one"
        " restore)",
        ["method", "fresh process: best (median)", "GB/s", "warm process: best", "GB/s"],
        [[m, f"{t['fresh']:.3f} s ({float(np.median(t['fresh_runs'])):.3f})",
          f"{data_bytes / t['fresh'] / 1e9:.2f}", f"{t['warm']:.3f} s",
          f"{data_bytes / t['warm'] / 1e9:.2f}"] for m, t in cold.items() if m != "floor"]
        + [[f"floor: the {floor['format']} checkpoint's files read cold, {floor['threads']} threads",
            f"{floor['files']:.3f} s", f"{data_bytes / floor['files'] / 1e9:.2f}", "", ""],
           [f"the same in 4 MiB pieces, a descriptor each (TensorStore's pattern), "
            f"{floor['threads']} threads", f"{floor['pieces']:.3f} s",
            f"{data_bytes / floor['pieces'] / 1e9:.2f}", "", ""]])
  harness.print_table(
      f"restore onto {results['device']}, {harness.format_size(data_bytes)}",
      ["method", "fresh: best (median)", "GB/s", f"time / {base}'s", "warm: best (median)",
       "GB/s", f"time / {base}'s", "peak host RSS extra (x data)", "peak device bytes extra"],
      rows)
  return results


def _save_table(methods, directory: str, target: int, args) -> dict:
  runs = {m: [] for m in methods}
  for _ in range(args.repeats):  # Fresh processes, taking turns.
    for method in methods:
      runs[method].append(_run(method, f"save:{args.save_runs}", directory, target, args)["seconds_each"])
  data_bytes = sum(int(p.size) * 4 for p in _shapes(target))
  rows, results = [], {}
  for method in methods:
    first = [r[0] for r in runs[method]]
    later = [s for r in runs[method] for s in r[1:]] or first
    results[method] = {"first": first, "later": later}
    first_best, first_median = harness.best_and_median(first)
    later_best, later_median = harness.best_and_median(later)
    rows.append([method, f"{first_best:.3f} s ({first_median:.3f})",
                 f"{later_best:.3f} s ({later_median:.3f})",
                 f"{data_bytes / min(later) / 1e9:.2f}"])
  harness.print_table(
      f"save from {args.device} + os.sync(), {harness.format_size(data_bytes)}",
      ["method", "first save of a process: best (median)", "later saves: best (median)",
       "GB/s (later, best)"], rows)
  return results


def _shapes(target: int):
  import types

  return [types.SimpleNamespace(size=int(np.prod([n for _, n in axes])))
          for _, axes in save_restore.transformer_shapes(target)]


def _targets(restores: dict, saves: dict | None) -> None:
  rows = []
  for result in restores.values():
    methods = result["methods"]
    if "pz_persist" not in methods or "orbax" not in methods:
      continue
    if result["device"].startswith("cpu"):
      # Targets 1-2 are a restore into an accelerator's memory; onto the CPU
      # the arrays are host memory, so "peak host memory 0.25x" cannot hold.
      print(f"(targets 1-2 left out for {harness.format_size(result['size_bytes'])}: this run"
            " restored onto the CPU; target 4 below is the CPU's)\n")
      continue
    ours, orbax = methods["pz_persist"], methods["orbax"]
    label = harness.format_size(result["size_bytes"])
    rows.append((f"restore {label} fresh, vs Orbax (best)",
                 min(orbax["fresh"]) / min(ours["fresh"]), 3.0, True, "x"))
    rows.append((f"restore {label} warm, vs Orbax (best)",
                 min(orbax["warm"]) / min(ours["warm"]), 3.0, True, "x"))
    rows.append((f"restore {label} warm, GB/s",
                 result["size_bytes"] / min(ours["warm"]) / 1e9, 5.0, True, "GB/s"))
    rows.append((f"restore {label} peak host RSS / data",
                 ours["extra_rss"] / result["size_bytes"], 0.25, False, "x"))
  for result in restores.values():
    methods = result["methods"]
    if "pz_persist" in methods and "safetensors_host" in methods:
      label = harness.format_size(result["size_bytes"])
      for kind in ("fresh", "warm"):
        rows.append((f"restore {label} {kind}, vs safetensors numpy load_file (best)",
                     min(methods["safetensors_host"][kind]) / min(methods["pz_persist"][kind]),
                     1.0, True, "x"))
    cold = result.get("cold", {})
    if "pz_persist" in cold:
      for kind in ("fresh", "warm"):
        rows.append((f"restore {harness.format_size(result['size_bytes'])} cold, {kind} process,"
                     " vs its files read cold", cold["pz_persist"][kind] / cold["floor"]["files"],
                     1.2, False, "x"))
  if saves and "pz_persist" in saves and "orbax" in saves:
    rows.append(("save + sync, first of a process, vs Orbax (best)",
                 min(saves["orbax"]["first"]) / min(saves["pz_persist"]["first"]), 1.5, True, "x"))
    rows.append(("save + sync, later saves, vs Orbax (best)",
                 min(saves["orbax"]["later"]) / min(saves["pz_persist"]["later"]), 1.5, True, "x"))
  if rows:
    harness.print_targets("Issue 39's targets (same run)", rows)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", "--size", default="2GiB", help="comma-separated sizes")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--warm-runs", type=int, default=3)
  parser.add_argument("--methods", default=",".join(METHODS))
  parser.add_argument("--big-methods", default=None,
                      help="methods for sizes after the first (default: --methods)")
  parser.add_argument("--save-size", default=None, help="also time saves of this size")
  parser.add_argument("--save-runs", type=int, default=3, help="saves per fresh process")
  parser.add_argument("--save-methods", default=",".join(SAVE_METHODS))
  parser.add_argument("--floors", action="store_true", help="measure floors.py's floors too")
  parser.add_argument("--cold", action="store_true",
                      help="also restores with the page cache dropped (root), in a fresh"
                      " process and in a warm one, against the files read cold")
  parser.add_argument("--before", default=None, help="a checkout for pz_persist_before")
  parser.add_argument("--dir", default=None)
  parser.add_argument("--json", default=None)
  parser.add_argument("--worker", nargs=4, metavar=("METHOD", "OP", "PATH", "BYTES"),
                      help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    method, operation, path, nbytes = args.worker
    _prepare(method, args.before)
    print(json.dumps(worker(method, operation, path, int(nbytes))))
    return {}

  if args.cold:  # Said at once, not after the warm restores have run.
    harness.drop_page_cache_or_exit()
  import jax

  args.device = f"{jax.devices()[0]} ({jax.devices()[0].device_kind})"
  directory = args.dir or tempfile.mkdtemp(prefix="pz_persist_accel_")
  print(f"# accelerator benchmark, {time.strftime('%Y-%m-%d %H:%M')}")
  print(harness.machine_description())
  print(f"default device: {args.device}\n", flush=True)
  results: dict = {"restores": {}, "saves": None, "floors": None}
  if args.floors:
    import floors
    size = harness.parse_size("1GiB")
    results["floors"] = floors.measure(size, min(8, os.cpu_count() or 1), 3, directory)
    floors.print_floors(results["floors"], size)
  for n, size_text in enumerate(s for s in args.sizes.split(",") if s):
    target = harness.parse_size(size_text)
    chosen = args.methods if n == 0 or not args.big_methods else args.big_methods
    methods = [m for m in chosen.split(",") if m]
    params = save_restore.build_params(target)
    data_bytes = sum(int(p.value.data_array.nbytes) for p in params)
    formats = sorted({_FORMAT[_base(m)] for m in methods})
    paths = {fmt: save_restore._path(directory, fmt) + f"_{size_text}" for fmt in formats}
    for fmt in formats:
      save_restore.save_op(fmt, paths[fmt], params)()
    del params
    os.sync()
    runs = _restores(methods, lambda m, paths=paths: paths[_FORMAT[_base(m)]], target, args)
    results["restores"][size_text] = _restore_table(methods, runs, data_bytes)
  if args.save_size:
    methods = [m for m in args.save_methods.split(",") if m]
    results["saves"] = _save_table(methods, directory, harness.parse_size(args.save_size), args)
  _targets(results["restores"], results["saves"])
  first = next(iter(results["restores"].values()), {})
  results["methods"] = first.get("methods", {})  # The first size's, as before.
  return harness.finish(results, json_path=args.json, directory=None if args.dir else directory)


if __name__ == "__main__":
  main()
