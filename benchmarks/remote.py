"""Requests and time of a remote save and load: pz_persist vs plain Orbax.

Usage::

  python benchmarks/remote.py [--size 200MiB] [--arrays 100] [--stores gs,s3] [--repeats 3]

Starts the object-store emulators of the remote tests (fake-gcs-server for
``gs://``, moto's server for ``s3://``; see tests/remote/emulators.py), each
behind a counting reverse proxy (``request_counter.py``) that every client is
pointed at, and measures on the same tree of ``--arrays`` float32 NamedArray
parameters totalling ``--size``:

* ``orbax save`` / ``orbax restore``: ``ocp.StandardCheckpointer`` save of
  the frozen parameters, restore with a template (``jax.eval_shape``);
* ``orbax save force``: the same save over an existing checkpoint
  (``force=True``), the baseline of an overwrite;
* ``pz_persist save`` / ``pz_persist load``: `pzp.save` / `pzp.load`;
* ``pz_persist save overwrite``: `pzp.save(..., overwrite=True)` over an
  existing checkpoint.

Every measurement runs in a fresh process (``harness.run_worker``) after a
tiny warm-up save and restore on another path; the counters are reset just
before the measured operation and read just after it, so the requests are
the operation's own. Printed: best and median time, requests (total and by
kind), bytes up and down, peak RSS above the baseline, and pz_persist's
ratios to plain Orbax (target: a save at most 1.2x Orbax's requests and
time). A row whose operation fails on this checkout (s3:// before pz_persist
registers Orbax's S3 kvstore, for example) prints its error instead.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import sys
import time
import uuid

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402  pylint: disable=wrong-import-position
import request_counter  # noqa: E402  pylint: disable=wrong-import-position

EMULATORS = os.path.join(os.path.dirname(HERE), "tests", "remote", "emulators.py")
ROWS = ("orbax save", "pz_persist save", "orbax save force", "pz_persist save overwrite",
        "orbax restore", "pz_persist load")
"""Measured operations, in the order they run within a repeat (a forced or
overwriting save goes over the checkpoint its plain save just wrote; the
loads read them)."""
PAIRS = (("pz_persist save", "orbax save"), ("pz_persist save overwrite", "orbax save force"),
         ("pz_persist load", "orbax restore"))


def _emulators():
  """tests/remote/emulators.py, imported by path (benchmarks are not a package)."""
  spec = importlib.util.spec_from_file_location("pz_remote_emulators", EMULATORS)
  module = importlib.util.module_from_spec(spec)
  assert spec.loader is not None
  sys.modules[spec.name] = module  # dataclasses look their module up there.
  spec.loader.exec_module(module)
  return module


def proxied_env(scheme: str, env: dict[str, str], proxy_url: str) -> dict[str, str]:
  """The emulator's client environment with every endpoint at the proxy."""
  endpoints = {"gs": ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"),
               "s3": ("AWS_ENDPOINT_URL",)}[scheme]
  return {**env, **dict.fromkeys(endpoints, proxy_url)}


def build_params(target_bytes: int, arrays: int, seed: int = 0):
  """``arrays`` float32 ``pz.ParameterValue`` NamedArrays of ``target_bytes`` in all."""
  import jax.numpy as jnp
  from penzai import pz

  rng = np.random.default_rng(seed)
  width = 256
  rows = max(1, target_bytes // (4 * width * arrays))
  params = []
  for i in range(arrays):
    data = rng.standard_normal((rows, width), dtype=np.float32)
    params.append(pz.ParameterValue(
        label=f"block_{i // 4}/weights_{i % 4}",
        value=pz.nx.NamedArray(named_axes=collections.OrderedDict(rows=rows, embedding=width),
                               data_array=jnp.asarray(data))))
  return tuple(params)


def _op(row: str, path: str, params, template):
  import jax
  import orbax.checkpoint as ocp

  import pz_persist as pzp

  def orbax_save(force: bool):
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(path, params, force=force)

  def orbax_restore():
    with ocp.StandardCheckpointer() as checkpointer:
      jax.block_until_ready(checkpointer.restore(path, template))

  return {
      "orbax save": lambda: orbax_save(False),
      "orbax save force": lambda: orbax_save(True),
      "orbax restore": orbax_restore,
      "pz_persist save": lambda: pzp.save(path, params),
      "pz_persist save overwrite": lambda: pzp.save(path, params, overwrite=True),
      "pz_persist load": lambda: jax.block_until_ready(pzp.load(path)),
  }[row]


def enable_orbax_s3(path: str) -> str | None:
  """Teaches plain Orbax ``s3://`` with pz_persist's kvstore registration
  (`pz_persist.storage.stores.s3_kvstore`); the reason it cannot, if it cannot.

  Why: Orbax 0.12.8 alone takes ``s3://b/ck`` for the relative local path
  ``s3:/b/ck`` and would write there, on the local disk.
  """
  if not path.startswith("s3://"):
    return None
  try:
    from pz_persist.storage.stores import s3_kvstore  # pylint: disable=import-outside-toplevel
  except ImportError:
    return ("plain Orbax 0.12.8 cannot write s3:// (this checkout has no"
            " pz_persist.storage.stores.s3_kvstore to register its S3 kvstore spec)")
  s3_kvstore.enable_orbax_s3()
  return None


def worker(row: str, path: str, target_bytes: int, arrays: int, proxy_url: str) -> dict:
  """One measured operation in this (fresh) process: time, memory, requests."""
  import jax

  refused = enable_orbax_s3(path)
  if refused:
    return {"error": refused}

  tiny, tiny_path = build_params(2**14, 2), f"{path}-warmup-{uuid.uuid4().hex[:8]}"
  for warm_up in ("orbax save", "orbax restore") if row.startswith("orbax") else (
      "pz_persist save", "pz_persist load"):
    _op(warm_up, tiny_path, tiny, jax.eval_shape(lambda: tiny))()
  params = build_params(target_bytes, arrays)
  jax.block_until_ready(params)
  template = jax.eval_shape(lambda: params)
  operation = _op(row, path, params, template)
  request_counter.reset(proxy_url)
  try:
    result = harness.measure(operation)
  except Exception as e:  # pylint: disable=broad-exception-caught
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
  result["requests"] = request_counter.counts(proxy_url)
  return result


def measure_store(scheme: str, args, emulators) -> dict:
  """Every row of ``ROWS`` on one emulator, ``args.repeats`` times."""
  emulator = emulators.STARTERS[scheme]()
  proxy_url, _, stop_proxy = request_counter.start(emulator.url)
  env = proxied_env(scheme, emulator.env, proxy_url)
  runs: dict[str, list[dict]] = {row: [] for row in args.rows.split(",")}
  try:
    for _ in range(args.repeats):
      base = f"{emulator.root()}/{uuid.uuid4().hex[:12]}"
      for row in args.rows.split(","):
        method = row.split()[0]
        path = f"{base}/{method}"
        if runs[row] and "error" in runs[row][-1]:
          continue  # It failed once; the error is reported.
        runs[row].append(harness.run_worker(
            __file__, ["--worker", row, path, str(args.target), str(args.arrays), proxy_url],
            env=env))
  finally:
    stop_proxy()
    emulator.stop()
  return runs


def summarize(runs: list[dict]) -> dict:
  """Best and median seconds, and the requests of the best run."""
  failed = [run for run in runs if "error" in run]
  if failed:
    return {"error": failed[0]["error"]}
  best = min(runs, key=lambda run: run["seconds"])
  return {"seconds": best["seconds"],
          "median_seconds": float(np.median([run["seconds"] for run in runs])),
          "extra_rss": best["extra_rss"], "requests": best["requests"],
          "request_totals": [run["requests"]["total"] for run in runs]}


def report(results: dict, names: bool = False) -> None:
  """Prints the tables; requests by object name for pz_persist's saves (for
  every row with ``names``)."""
  size = results["size_bytes"]
  for scheme, rows in results["stores"].items():
    table = []
    for row, entry in rows.items():
      if "error" in entry:
        table.append([row, "fails: " + entry["error"], "-", "-", "-", "-"])
        continue
      requests = entry["requests"]
      kinds = ", ".join(f"{k} {n}" for k, n in sorted(requests["by_kind"].items(),
                                                        key=lambda item: -item[1]))
      table.append([
          row, f"{entry['seconds']:.2f} s (median {entry['median_seconds']:.2f} s)",
          f"{requests['total']}" + (f" (runs: {entry['request_totals']})"
                                    if len(set(entry["request_totals"])) > 1 else ""),
          kinds,
          f"{harness.format_size(requests['bytes_up'])} up,"
          f" {harness.format_size(requests['bytes_down'])} down",
          harness.format_size(entry["extra_rss"]),
      ])
    harness.print_table(
        f"{scheme}:// ({harness.format_size(size)} in {results['arrays']} arrays,"
        f" best of {results['repeats']})",
        ["operation", "time", "requests", "by kind", "bytes", "peak RSS"], table)
    ratios = []
    for ours, theirs in PAIRS:
      a, b = rows.get(ours, {}), rows.get(theirs, {})
      if "error" in a or "error" in b or not a or not b:
        continue
      ratios.append([
          f"{ours} / {theirs}",
          f"{a['requests']['total'] / b['requests']['total']:.2f}x"
          f" ({a['requests']['total']} vs {b['requests']['total']})",
          f"{a['seconds'] / b['seconds']:.2f}x ({a['seconds']:.2f} s vs {b['seconds']:.2f} s)",
          f"{a['median_seconds'] / b['median_seconds']:.2f}x",
      ])
    if ratios:
      harness.print_table(f"{scheme}:// pz_persist / plain Orbax (target for saves: <= 1.2x)",
                          ["operations", "requests", "time (best)", "time (median)"], ratios)
    for row, entry in rows.items():
      if "error" in entry or not (names or row.startswith("pz_persist save")):
        continue
      print(f"{scheme}:// {row}, requests by name:")
      for name, count in sorted(entry["requests"]["by_name"].items(), key=lambda i: -i[1]):
        print(f"  {count:5d}  {name}")
      print()


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="200MiB")
  parser.add_argument("--arrays", type=int, default=100)
  parser.add_argument("--stores", default="gs,s3")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--rows", default=",".join(ROWS),
                      help="which operations to measure (comma-separated, of: %(default)s)")
  parser.add_argument("--json", default=None, help="write the results here too")
  parser.add_argument("--names", action="store_true",
                      help="print every row's requests by object name")
  parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    row, path, nbytes, arrays, proxy_url = args.worker
    print(json.dumps(worker(row, path, int(nbytes), int(arrays), proxy_url)))
    return {}
  args.target = harness.parse_size(args.size)
  emulators = _emulators()
  print(f"# remote benchmark, {time.strftime('%Y-%m-%d %H:%M')}")
  print(harness.machine_description())
  results = {"size_bytes": args.target, "arrays": args.arrays, "repeats": args.repeats,
             "stores": {}}
  for scheme in [s for s in args.stores.split(",") if s]:
    try:
      runs = measure_store(scheme, args, emulators)
    except Exception as e:  # pylint: disable=broad-exception-caught
      print(f"{scheme}:// not measured: the emulator did not start ({type(e).__name__}: {e})")
      continue
    results["stores"][scheme] = {row: summarize(runs[row]) for row in ROWS if runs.get(row)}
  report(results, args.names)
  return harness.finish(results, json_path=args.json)


if __name__ == "__main__":
  main()
