"""What integrity checking costs: checksums on save, verification on load.

Usage::

  python benchmarks/integrity.py --size 1GiB [--rounds 6] [--dir /tmp/bench]

On the same transformer-shaped tree as ``save_restore.py``, saved once with
pz_persist, plain Orbax and safetensors, one warm process alternates (in both
orders, ``--rounds`` times):

* ``pzp.load(verify=False)`` and ``pzp.load(verify=True)``, the default:
  the difference is what checking every array's checksum costs;
* plain Orbax restore with a template and safetensors ``load_file``, as
  references measured in the same run on the same data.

It also times the two things a save adds (hashing every array; hashing every
written file), and `pzp.verify` of the whole checkpoint in a fresh process,
with its peak memory (it reads a bounded batch of arrays at a time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402  pylint: disable=wrong-import-position
import save_restore  # noqa: E402  pylint: disable=wrong-import-position

LOADS = ("pz_persist_unverified", "pz_persist_verified", "orbax", "safetensors")


def _paths(directory: str) -> dict[str, str]:
  return {
      "pz_persist": os.path.join(directory, "pz_persist"),
      "orbax": os.path.join(directory, "orbax"),
      "safetensors": os.path.join(directory, "model.safetensors"),
  }


def _load_op(name: str, paths: dict[str, str], target_bytes: int):
  import pz_persist as pzp

  if name.startswith("pz_persist"):
    verify = name == "pz_persist_verified"
    return lambda: save_restore._block(pzp.load(paths["pz_persist"], verify=verify))  # pylint: disable=protected-access
  return save_restore.restore_op(name, paths[name], target_bytes)


def paired_loads(directory: str, target_bytes: int, rounds: int) -> dict:
  """Every load method in one warm process, alternating order each round."""
  paths = _paths(directory)
  for method in ("pz_persist", "orbax", "safetensors"):
    save_restore._warm_up(method)  # pylint: disable=protected-access
  ops = {name: _load_op(name, paths, target_bytes) for name in LOADS}
  times: dict[str, list[float]] = {name: [] for name in LOADS}
  for index in range(rounds):
    order = LOADS if index % 2 == 0 else tuple(reversed(LOADS))
    for name in order:
      start = time.perf_counter()
      ops[name]()
      times[name].append(time.perf_counter() - start)
  return times


def save_costs(directory: str, target_bytes: int) -> dict:
  """A pz_persist save, and the two integrity steps inside it, timed alone."""
  import pz_persist as pzp
  from pz_persist.storage.integrity import checksums
  from pz_persist.storage.integrity import file_digests

  save_restore._warm_up("pz_persist")  # pylint: disable=protected-access
  params = save_restore.build_params(target_bytes)
  save_restore._block(params)  # pylint: disable=protected-access
  path = os.path.join(directory, "pz_persist_save")
  save_restore._remove(path)  # pylint: disable=protected-access
  start = time.perf_counter()
  pzp.save(path, params)
  save_seconds = time.perf_counter() - start
  stored = pzp.PenzaiSave(params).stored_arrays
  start = time.perf_counter()
  checksums.compute(stored)
  hash_arrays = time.perf_counter() - start
  start = time.perf_counter()
  file_digests.write(pzp.checkpoint.find_item(path))
  hash_files = time.perf_counter() - start
  save_restore._remove(path)  # pylint: disable=protected-access
  return {"save": save_seconds, "hash_arrays": hash_arrays, "hash_files": hash_files}


def worker(operation: str, directory: str, target_bytes: int, rounds: int) -> dict:
  if operation == "paired":
    return paired_loads(directory, target_bytes, rounds)
  if operation == "save_costs":
    return save_costs(directory, target_bytes)
  if operation == "verify":
    import pz_persist as pzp

    path = _paths(directory)["pz_persist"]
    pzp.verify(path)  # Warm: same page-cache state as the loads.
    result = {}
    report = None

    def op():
      nonlocal report
      report = pzp.verify(path)
    result = harness.measure(op)
    assert report is not None and report.ok, str(report)
    return result
  raise ValueError(operation)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", default="1GiB")
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--dir", default=None)
  parser.add_argument("--worker", nargs=2, metavar=("OPERATION", "DIR"), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  target_bytes = harness.parse_size(args.size)
  if args.worker:
    import json

    print(json.dumps(worker(args.worker[0], args.worker[1], target_bytes, args.rounds)))
    return {}

  with tempfile.TemporaryDirectory(dir=args.dir) as directory:
    params = save_restore.build_params(target_bytes)
    paths = _paths(directory)
    for method, path in paths.items():
      save_restore.save_op(method, path, params)()
    nbytes = sum(p.value.data_array.nbytes for p in params)
    del params
    print(f"# integrity benchmark, {time.strftime('%Y-%m-%d %H:%M')}")
    print(harness.machine_description())
    print(f"data: {harness.format_size(nbytes)} float32; {args.rounds} rounds\n")

    def run(operation):
      return harness.run_worker(
          __file__, ["--worker", operation, directory, "--size", args.size,
                     "--rounds", str(args.rounds)],
      )
    loads = run("paired")
    saves = run("save_costs")
    verify = run("verify")

  median = {name: statistics.median(times) for name, times in loads.items()}
  best = {name: min(times) for name, times in loads.items()}
  unverified = median["pz_persist_unverified"]
  rows = [
      [name, f"{median[name]:.3f}", f"{best[name]:.3f}",
       f"{nbytes / 2**20 / median[name]:.0f}", f"{median[name] / unverified:.3f}"]
      for name in LOADS
  ]
  harness.print_table(
      "Load (warm page cache): seconds, MiB/s, ratio to pz_persist without verification",
      ["method", "median s", "best s", "MiB/s", "/ unverified"], rows,
  )
  overhead = median["pz_persist_verified"] / unverified - 1
  direct = saves["hash_arrays"] / best["pz_persist_unverified"]
  print(
      f"verification on load costs {100 * overhead:+.1f}% of the load (median of"
      f" paired runs; noise on a shared machine can exceed it). Hashing every"
      f" array, timed alone, takes {saves['hash_arrays']:.3f} s ="
      f" {100 * direct:.1f}% of the best unverified load.\n"
  )
  harness.print_table(
      "Save: what checksums add",
      ["step", "seconds", "fraction of save"],
      [["pzp.save (total)", f"{saves['save']:.3f}", "1.000"],
       ["hash every array", f"{saves['hash_arrays']:.3f}",
        f"{saves['hash_arrays'] / saves['save']:.3f}"],
       ["hash every file", f"{saves['hash_files']:.3f}",
        f"{saves['hash_files'] / saves['save']:.3f}"]],
  )
  harness.print_table(
      "pzp.verify (whole checkpoint, fresh process)",
      ["seconds", "MiB/s", "peak RSS above baseline", "/ checkpoint bytes"],
      [[f"{verify['seconds']:.3f}", f"{nbytes / 2**20 / verify['seconds']:.0f}",
        harness.format_size(verify["extra_rss"]), f"{verify['extra_rss'] / nbytes:.2f}"]],
  )
  return {"loads": loads, "saves": saves, "verify": verify, "overhead": overhead,
          "direct_overhead": direct,
          "nbytes": nbytes}


if __name__ == "__main__":
  main()
