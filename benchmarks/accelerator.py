"""Restore onto an accelerator: pz_persist vs plain Orbax and safetensors.

Usage::

  python benchmarks/accelerator.py --size 2GiB [--repeats 3] [--warm-runs 3]

On a machine with a GPU (or TPU), JAX's default device is the accelerator, and
a restore is only done when the arrays are in its memory. This benchmark
writes the transformer-shaped tree of `save_restore.py` once per format, then
restores it onto the default device with each method, each in a fresh
process (after a tiny warm-up, as in `save_restore.py`) and again repeated in
one warm process:

* ``pz_persist``: ``pzp.load(path)``; the arrays come back as ``jax.Array`` on
  the default device (checked).
* ``orbax``: ``ocp.StandardCheckpointer().restore(path, template)`` with a
  template whose ``sharding`` is the default device, as Orbax's docs say.
* ``safetensors_jax``: ``safetensors.flax.load_file`` (memory-maps the file,
  ends in ``jax.Array`` on the default device).
* ``safetensors_numpy``: ``safetensors.numpy.load_file`` then one
  ``jax.device_put`` of the whole dict (ends in ``jax.Array`` on the device).
* ``floor``: ``jax.device_put`` of the same arrays already in host memory: the
  host-to-device copy alone, with no file read (the floor a restore from the
  page cache cannot beat).

Printed: seconds (best and median), GB/s, the ratio of each method to
pz_persist, peak host RSS above the process's baseline, and the device's peak
bytes in use above what it held before (``memory_stats()``, where the backend
reports it). The async save from accelerator arrays is `async_save.py`, which
runs unchanged on an accelerator (its training state lives on the default
device).
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
_FORMAT = {"pz_persist": "pz_persist", "orbax": "orbax", "safetensors_jax": "safetensors",
           "safetensors_numpy": "safetensors", "floor": "safetensors"}
"""The file each method restores from (`save_restore.save_op`'s formats)."""


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
  if method == "floor":
    from safetensors.numpy import load_file
    host = {k: np.ascontiguousarray(v) for k, v in load_file(path).items()}
    return lambda: jax.block_until_ready(jax.device_put(host))
  raise ValueError(method)


def worker(method: str, operation: str, path: str, target_bytes: int) -> dict:
  """One measured restore (``fresh``), or ``warm:N`` repeated restores, in this process."""
  import jax

  with tempfile.TemporaryDirectory() as directory:  # Warm-up: start-up costs not charged.
    tiny = 2**16
    tiny_path = save_restore._path(directory, _FORMAT[method])
    save_restore.save_op(_FORMAT[method], tiny_path, save_restore.build_params(tiny))()
    _on_default_device(restore_op(method, tiny_path, tiny)())
  operation_fn = restore_op(method, path, target_bytes)
  before_device = _device_bytes()
  if operation == "fresh":
    result = harness.measure(lambda: _on_default_device(operation_fn()))
  else:
    result = {"seconds_each": harness.timed_runs(operation_fn, int(operation.split(":")[1]) + 1)[1:]}
  peak = _device_peak()
  result["device"] = str(jax.devices()[0])
  result["device_extra"] = None if peak is None or before_device is None else peak - before_device
  return result


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="2GiB")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--warm-runs", type=int, default=3)
  parser.add_argument("--methods", default=",".join(METHODS))
  parser.add_argument("--dir", default=None)
  parser.add_argument("--json", default=None)
  parser.add_argument("--worker", nargs=4, metavar=("METHOD", "OP", "PATH", "BYTES"),
                      help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    method, operation, path, nbytes = args.worker
    print(json.dumps(worker(method, operation, path, int(nbytes))))
    return {}

  import jax

  target = harness.parse_size(args.size)
  methods = [m for m in args.methods.split(",") if m]
  directory = args.dir or tempfile.mkdtemp(prefix="pz_persist_accel_")
  params = save_restore.build_params(target)
  data_bytes = sum(int(p.value.data_array.nbytes) for p in params)
  print(f"# accelerator restore benchmark, {time.strftime('%Y-%m-%d %H:%M')}")
  print(harness.machine_description())
  print(f"default device: {jax.devices()[0]} ({jax.devices()[0].device_kind});"
        f" data: {len(params)} float32 NamedArray parameters, {harness.format_size(data_bytes)}\n")
  for fmt in sorted({_FORMAT[m] for m in methods}):
    save_restore.save_op(fmt, save_restore._path(directory, fmt), params)()
  del params
  os.sync()

  def run(method: str, operation: str) -> dict:
    path = save_restore._path(directory, _FORMAT[method])
    return harness.run_worker(__file__, ["--worker", method, operation, path, str(target)])

  fresh: dict[str, list[dict]] = {m: [] for m in methods}
  for _ in range(args.repeats):  # Methods take turns, so a slow phase hits all alike.
    for method in methods:
      fresh[method].append(run(method, "fresh"))
  warm = {m: run(m, f"warm:{args.warm_runs}")["seconds_each"] for m in methods}

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
        f"{warm_best / base_warm:.2f}x", harness.format_size(extra),
        harness.format_size(min(device_extra)) if device_extra else "n/a"])
  harness.print_table(
      f"restore onto {results['device']}, {harness.format_size(data_bytes)}",
      ["method", "fresh: best (median)", "GB/s", f"time / {base}'s", "warm: best (median)",
       f"time / {base}'s", "peak host RSS extra", "peak device bytes extra"], rows)
  return harness.finish(results, json_path=args.json, directory=None if args.dir else directory)


if __name__ == "__main__":
  main()
