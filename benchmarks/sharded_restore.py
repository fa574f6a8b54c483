"""Per-process memory of a sharded restore across several processes.

Usage::

  python benchmarks/sharded_restore.py [--sizes 256MiB,512MiB] [--processes 4]

A transformer-shaped checkpoint of NamedArray parameters (saved unsharded) is
restored by N processes joined with ``jax.distributed`` on localhost (8 CPU
devices in all, mesh ``(data=2, model=4)``), each reading only its own shards
through `pz_persist.AxisRules`. For contrast, the same processes restore their
shards with plain Orbax and a hand-written template, and load the checkpoint
whole (no sharding). Each method runs in fresh processes. Printed per process:
the bytes its devices hold, the baseline RSS, and the peak RSS above baseline
of each method; then, over the sizes run, the fit of the sharded restore's peak
to ``slope x shard bytes + fixed baseline``. Target: slope under 1.5.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402  pylint: disable=wrong-import-position

RULES = {"embedding": "data", "neurons": "model", "vocabulary": "model", "projection": "model"}


def write_checkpoint(path: str, target_bytes: int) -> int:
  """Saves the benchmark parameters (unsharded) and returns their bytes."""
  import save_restore  # pylint: disable=import-outside-toplevel

  import pz_persist as pzp

  params = save_restore.build_params(target_bytes)
  pzp.save(path, params, overwrite=True)
  pzp.save(os.path.join(os.path.dirname(path), "tiny"), save_restore.build_params(2**20), overwrite=True)
  return sum(p.value.data_array.nbytes for p in params)


METHODS = ("pz_persist_sharded", "orbax_sharded_with_template", "pz_persist_whole")


def worker(method: str, process_id: int, processes: int, port: str, path: str) -> dict:
  """Measures one method in one process of a fresh distributed run."""
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // processes}"
  import jax

  jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{port}", num_processes=processes,
      process_id=process_id, initialization_timeout=120,
  )
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.experimental import multihost_utils

  import pz_persist as pzp

  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  rules = pzp.AxisRules(mesh, RULES)
  manifest = pzp.checkpoint.read_manifest(path)
  item = pzp.checkpoint.find_item(path)

  def plain_orbax():
    placements = pzp.storage.reading.placements.placements(manifest, rules)
    restore_args = {
        spec.key: ocp.ArrayRestoreArgs(sharding=sharding, global_shape=spec.shape, dtype=spec.np_dtype)
        for spec, sharding in zip(manifest.arrays, placements)
    }
    with ocp.PyTreeCheckpointer() as checkpointer:
      return checkpointer.restore(item, args=ocp.args.PyTreeRestore(restore_args=restore_args))

  operation = {
      "pz_persist_sharded": lambda: pzp.load(path, sharding=rules),
      "orbax_sharded_with_template": plain_orbax,
      "pz_persist_whole": lambda: pzp.load(path),
  }[method]
  # The first restore of a process sets up thread pools and caches once:
  # do that on a tiny checkpoint, so the measured restore is the big one's.
  jax.block_until_ready(pzp.load(os.path.join(os.path.dirname(path), "tiny"), sharding=rules))
  multihost_utils.sync_global_devices("start")
  with harness.PeakRss() as rss:
    start = time.perf_counter()
    jax.block_until_ready(operation())
    seconds = time.perf_counter() - start
  multihost_utils.sync_global_devices("end")
  jax.distributed.shutdown()
  return {
      "process": process_id,
      "shard_bytes": pzp.storage.reading.placements.shard_bytes(manifest, rules),
      "extra_rss": rss.extra, "baseline": rss.baseline, "seconds": seconds,
  }


def run_distributed(method: str, processes: int, path: str) -> list[dict]:
  port = str(_free_port())
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  workers = [
      subprocess.Popen(
          [sys.executable, __file__, "--worker", method, str(i), str(processes), port, path],
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
      )
      for i in range(processes)
  ]
  results = []
  try:
    for process in workers:
      out, err = process.communicate(timeout=1800)
      if process.returncode:
        raise RuntimeError(f"worker failed:\n{err[-3000:]}")
      results.append(json.loads(out.strip().splitlines()[-1]))
  finally:
    for process in workers:
      if process.poll() is None:
        process.kill()
  return results


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="256MiB,512MiB",
                      help="checkpoint sizes to measure (two or more give the fit)")
  parser.add_argument("--processes", type=int, default=4, choices=[1, 2, 4, 8])
  parser.add_argument("--dir", default=None)
  parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    method, process_id, processes, port, path = args.worker
    print(json.dumps(worker(method, int(process_id), int(processes), port, path)))
    return {}

  directory = args.dir or tempfile.mkdtemp(prefix="pz_persist_sharded_")
  print(f"# sharded_restore benchmark, {time.strftime('%Y-%m-%d %H:%M')}")
  print(harness.machine_description())
  print(f"{args.processes} processes, mesh (data=2, model=4), rules {RULES}\n")
  runs = []
  for size in args.sizes.split(","):
    path = os.path.join(directory, size, "ckpt")
    nbytes = write_checkpoint(path, harness.parse_size(size))
    by_method = {method: run_distributed(method, args.processes, path) for method in METHODS}
    rows = []
    for i in range(args.processes):
      shard = by_method[METHODS[0]][i]["shard_bytes"]
      row = [i, harness.format_size(shard),
             harness.format_size(by_method[METHODS[0]][i]["baseline"])]
      for method in METHODS:
        result = by_method[method][i]
        row.append(f"{harness.format_size(result['extra_rss'])}"
                   f" ({result['extra_rss'] / shard:.2f}x shard), {result['seconds']:.2f} s")
      rows.append(row)
    harness.print_table(
        f"Checkpoint of {harness.format_size(nbytes)}: peak RSS above baseline per process",
        ["process", "shard bytes", "baseline RSS", "pz_persist, axis rules",
         "plain Orbax, template shardings", "pz_persist, whole (no sharding)"],
        rows,
    )
    runs.append({"size": nbytes, **by_method})

  # Peak = slope x shard bytes + fixed baseline, fitted over the sizes run.
  points = [(r["shard_bytes"], r["extra_rss"]) for run in runs for r in run[METHODS[0]]]
  fit = {}
  if len({x for x, _ in points}) > 1:
    slope, intercept = np.polyfit([x for x, _ in points], [y for _, y in points], 1)
    fit = {"slope": float(slope), "fixed_bytes": float(intercept)}
    print(f"pz_persist sharded restore, per process: peak above baseline ="
          f" {slope:.2f} x shard bytes + {harness.format_size(intercept)}"
          " (target: under 1.5 x shard bytes plus a fixed baseline)")
  if not args.dir:
    shutil.rmtree(directory, ignore_errors=True)
  return {"runs": runs, "fit": fit}


if __name__ == "__main__":
  main()
