"""Per-array costs: saving, loading and inspecting trees of many small arrays.

Usage::

  python benchmarks/many_arrays.py [--counts 1000,4000,16000] [--array-kib 16]
      [--repeats 3] [--warm-runs 2] [--methods pz_persist,orbax,...]
      [--skip warm,model] [--model-blocks 64] [--dir /tmp/bench]

Optimizer states, unstacked layers, LoRA adapters and mixtures of experts are
trees of many small arrays, where a checkpoint library's fixed cost per array
matters more than its bandwidth. The data is a tuple of ``pz.ParameterValue``
holding ``NamedArray`` values of ``--array-kib`` KiB of float32 each (distinct
labels), at each of ``--counts``. Each method saves and loads the same arrays:

* ``pz_persist``: `pzp.save` / `pzp.load`, and `pzp.inspect` (manifest only).
* ``orbax``: ``ocp.StandardCheckpointer`` save; restore with a template.
* ``orbax_no_template``: restore of ``orbax``'s checkpoint without one (its
  save is ``orbax``'s and is not measured twice).
* ``safetensors``: ``safetensors.numpy.save_file`` / ``load_file`` of the
  flattened ``{label: array}`` dict.

A save is timed until ``os.sync()`` returns, into a directory removed (and
synced) beforehand. Every (method, operation) runs in ``--repeats`` fresh
processes, each after a small warm-up on a tiny tree so that JAX's start-up is
not charged: the first measured run is the **fresh** figure; the process then
repeats the operation ``--warm-runs`` times, and those later runs are the
**warm** figure (the notebook case: a model reloaded in the same session).

The model section (skip with ``--skip model``) saves a Llama-like transformer
of ``--model-blocks`` unstacked blocks with tiny dimensions (`pzp.save_model`)
and, separately, its parameters alone (`pzp.save` of ``pz.unbind_params``),
then measures what rebuilding the model's structure adds: `pzp.load_model` of
the model's checkpoint against `pzp.load` of the parameters' checkpoint (the
same arrays and labels), beside `pzp.load` of the model's checkpoint,
``load_model(into=model)`` and `pzp.inspect`.

Printed per count: ms per array of each method and operation (fresh and warm,
best and median), pz_persist's speed relative to plain Orbax and safetensors,
how the per-array cost grows with the count, and issue 19's targets with
met / not met.
"""

from __future__ import annotations

import argparse
import collections
import json
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

METHODS = ("pz_persist", "orbax", "orbax_no_template", "safetensors")
OPERATIONS = {
    "pz_persist": ("save", "load", "inspect"),
    "orbax": ("save", "load"),
    "orbax_no_template": ("load",),
    "safetensors": ("save", "load"),
}
MODEL_OPERATIONS = ("load_model", "load_model_tree", "load_arrays", "load_model_into", "inspect")
"""What the model section measures, on the checkpoints `save_models` writes:
`pzp.load_model` of the model, `pzp.load` of the model's checkpoint (the
same rebuilt tree), `pzp.load` of the parameters alone (the arrays to
compare with), ``load_into(params, model)`` and `pzp.inspect` of the
model."""
WARM_UP_COUNT = 8
COLUMNS = 64  # Each array is [rows, 64] float32.


def build_tree(count: int, array_kib: float, *, abstract: bool = False, seed: int = 0):
  """``count`` ``pz.ParameterValue`` of float32 NamedArrays, distinct labels.

  With ``abstract``, the values are ``jax.ShapeDtypeStruct`` (Orbax's template).
  """
  import jax
  import jax.numpy as jnp
  from penzai import pz

  rows = max(1, int(array_kib * 1024) // 4 // COLUMNS)
  rng = np.random.default_rng(seed)
  tree = []
  for index in range(count):
    if abstract:
      data = jax.ShapeDtypeStruct((rows, COLUMNS), jnp.float32)
    else:
      data = jnp.asarray(rng.standard_normal((rows, COLUMNS), dtype=np.float32))
    tree.append(pz.ParameterValue(
        label=f"experts/group_{index // 64}/expert_{index % 64}.weights",
        value=pz.nx.NamedArray(
            named_axes=collections.OrderedDict((("embedding", rows), ("neurons", COLUMNS))),
            data_array=data,
        ),
    ))
  return tuple(tree)


def array_bytes(count: int, array_kib: float) -> int:
  return count * max(1, int(array_kib * 1024) // 4 // COLUMNS) * COLUMNS * 4


def checkpoint_path(directory: str, method: str) -> str:
  """Where ``method``'s checkpoint is: ``orbax_no_template`` reads ``orbax``'s."""
  return save_restore._path(directory, "orbax" if method == "orbax_no_template" else method)  # pylint: disable=protected-access


def array_operation(method: str, operation: str, path: str, count: int, array_kib: float):
  """(the callable to time, the untimed preparation before each call)."""
  import pz_persist as pzp

  if operation == "save":
    tree = build_tree(count, array_kib)
    save_restore._block(tree)  # pylint: disable=protected-access

    def clear():
      save_restore._remove(path)  # pylint: disable=protected-access
      os.sync()
    return harness.synced(save_restore.save_op(method, path, tree)), clear
  if operation == "inspect":
    return (lambda: pzp.inspect(path)), None
  template = build_tree(count, array_kib, abstract=True) if method == "orbax" else None
  return save_restore.restore_op(method, path, 0, template=template), None


def save_models(directory: str, blocks: int) -> dict:
  """Writes the model section's checkpoints (and tiny ones for warm-ups)."""
  from penzai import pz

  import pz_persist as pzp

  out = {}
  for name, size in (("model", blocks), ("tiny", 1)):
    model = build_model(size)
    _, params = pz.unbind_params(model, freeze=True)
    for kind, value, save in (("model", model, pzp.save_model), ("params", params, pzp.save)):
      path = os.path.join(directory, f"{name}_{kind}")
      save_restore._remove(path)  # pylint: disable=protected-access
      save(path, value)
    out[name] = len(params)
  return out


def build_model(blocks: int):
  """A Llama-like transformer with ``blocks`` unstacked blocks, tiny dims."""
  import jax
  from penzai.models.transformer.variants import llamalike_common as llamalike

  config = llamalike.LlamalikeTransformerConfig(
      num_kv_heads=2, query_head_multiplier=2, embedding_dim=32, projection_dim=8,
      mlp_hidden_dim=64, num_decoder_blocks=blocks, vocab_size=64, mlp_variant="swiglu",
      tie_embedder_and_logits=False, use_layer_stack=False,
  )
  return llamalike.build_llamalike_transformer(
      config, init_base_rng=jax.random.key(0), name="transformer"
  )


def model_operation(operation: str, directory: str, name: str):
  """The callable timing ``operation`` on the ``name`` (model / tiny) checkpoints."""
  import pz_persist as pzp

  model_path = os.path.join(directory, f"{name}_model")
  params_path = os.path.join(directory, f"{name}_params")
  block = save_restore._block  # pylint: disable=protected-access
  if operation == "load_model":
    return lambda: block(pzp.load_model(model_path))
  if operation == "load_model_tree":
    return lambda: block(pzp.load(model_path))
  if operation == "load_arrays":
    return lambda: block(pzp.load(params_path))
  if operation == "load_model_into":
    into = pzp.load_model(model_path)
    return lambda: block(pzp.load_into(params_path, into))
  if operation == "inspect":
    return lambda: pzp.inspect(model_path)
  raise ValueError(operation)


def model_rounds(directory: str, rounds: int) -> dict:
  """The model operations taking turns in one warm process, ``rounds`` times.

  Fresh processes drift by hundreds of milliseconds on a shared machine, more
  than the 50 ms measured; in one process, each round runs every operation
  back to back (in rotating order), so a round's difference between
  ``load_model`` and ``load_arrays`` compares them under the same conditions.
  """
  ops = {name: model_operation(name, directory, "model") for name in MODEL_OPERATIONS}
  for name in MODEL_OPERATIONS:
    harness.timed_runs(model_operation(name, directory, "tiny"), 1)
    harness.timed_runs(ops[name], 1)
  names = list(MODEL_OPERATIONS)
  times: dict[str, list[float]] = {name: [] for name in names}
  for index in range(rounds):
    for name in names[index % len(names):] + names[:index % len(names)]:
      times[name] += harness.timed_runs(ops[name], 1)
  return times


def worker(method: str, operation: str, path: str, count: int, array_kib: float,
           warm_runs: int) -> dict:
  """One (method, operation) in this process: a warm-up on a tiny tree, the
  fresh run (timed, with its peak memory), then ``warm_runs`` repeats."""
  if method == "model":
    harness.timed_runs(model_operation(operation, path, "tiny"), 1)
    op, prepare = model_operation(operation, path, "model"), None
  else:
    with tempfile.TemporaryDirectory() as scratch:
      tiny = checkpoint_path(scratch, method)
      for step in OPERATIONS[method if method != "orbax_no_template" else "orbax"]:
        warm_up_method = "orbax" if method == "orbax_no_template" and step == "save" else method
        run, before = array_operation(warm_up_method, step, tiny, WARM_UP_COUNT, array_kib)
        harness.timed_runs(run, 1, prepare=before)
    op, prepare = array_operation(method, operation, path, count, array_kib)
  if prepare is not None:
    prepare()
  fresh = harness.measure(op)
  return {"fresh": fresh, "warm": harness.timed_runs(op, warm_runs, prepare=prepare)}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--counts", default="1000,4000,16000", help="array counts, comma-separated")
  parser.add_argument("--array-kib", type=float, default=16, help="KiB of float32 per array")
  parser.add_argument("--repeats", type=int, default=3, help="fresh processes per operation")
  parser.add_argument("--warm-runs", type=int, default=2,
                      help="runs after the first in each process (the warm figures)")
  parser.add_argument("--methods", default=",".join(METHODS))
  parser.add_argument("--skip", default="", help="comma-separated: 'floors' (no issue 31"
                      " floors), 'warm' (no repeats in a"
                      " process), 'model' (no model section), 'inspect'")
  parser.add_argument("--model-blocks", type=int, default=64)
  parser.add_argument("--model-rounds", type=int, default=8,
                      help="rounds of the model operations taking turns in one process")
  parser.add_argument("--in-process", action="store_true",
                      help="run every operation in this process (quick checks: no fresh figures)")
  parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
  parser.add_argument("--json", default=None, help="write the results here too")
  parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    method, operation, path, count, kib, warm_runs = args.worker
    if method == "save_models":  # The model section's checkpoints, in a process of their own.
      print(json.dumps(save_models(path, int(count))))
    elif method == "model_rounds":
      print(json.dumps(model_rounds(path, int(count))))
    elif method == "floors":
      print(json.dumps(manifest_floors(path)))
    else:
      print(json.dumps(worker(method, operation, path, int(count), float(kib), int(warm_runs))))
    return {}

  counts = [int(c) for c in args.counts.split(",") if c]
  methods = [m for m in args.methods.split(",") if m]
  unknown = set(methods) - set(METHODS)
  if unknown:
    parser.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
  if "orbax_no_template" in methods and "orbax" not in methods:
    parser.error("orbax_no_template restores orbax's checkpoint: add orbax to --methods")
  skip = set(args.skip.split(","))
  warm_runs = 0 if "warm" in skip else args.warm_runs
  directory = args.dir or tempfile.mkdtemp(prefix="pz_persist_many_")
  os.makedirs(directory, exist_ok=True)
  print(f"# many_arrays benchmark, {time.strftime('%Y-%m-%d %H:%M')} (load average"
        f" {', '.join(f'{x:.2f}' for x in os.getloadavg())})")
  print(harness.machine_description())
  print(f"arrays of {harness.format_size(array_bytes(1, args.array_kib))} float32; counts {counts};"
        f" {args.repeats} {'runs in this process' if args.in_process else 'fresh processes'}"
        f" per operation, each then repeating it {warm_runs} times (warm)\n")

  def run(method, operation, path, count):
    worker_args = [method, operation, path, str(count), str(args.array_kib), str(warm_runs)]
    if args.in_process:
      return worker(method, operation, path, count, args.array_kib, warm_runs)
    return harness.run_worker(__file__, ["--worker", *worker_args])

  results = {"array_bytes": array_bytes(1, args.array_kib), "counts": {}, "skip": sorted(skip)}
  for count in counts:
    count_dir = os.path.join(directory, f"count_{count}")
    os.makedirs(count_dir, exist_ok=True)
    runs = {m: {op: [] for op in OPERATIONS[m] if not (op == "inspect" and "inspect" in skip)}
            for m in methods}
    # Methods take turns within each repeat; saves first, then what reads them.
    for operation in ("save", "load", "inspect"):
      for _ in range(args.repeats):
        for method in methods:
          if operation in runs[method]:
            path = checkpoint_path(count_dir, method)
            runs[method][operation].append(run(method, operation, path, count))
    results["counts"][count] = summarize(runs)
    report_count(count, args.array_kib, results["counts"][count])
    if "pz_persist" in methods and "floors" not in skip:
      results.setdefault("floors", {})[count] = floors_of(
          checkpoint_path(count_dir, "pz_persist"), in_process=args.in_process)
      report_floors(f"{count} arrays", results["floors"][count])
    shutil.rmtree(count_dir, ignore_errors=True)
  if len(counts) > 1:
    report_growth(results["counts"])
  if "model" not in skip:
    model_dir = os.path.join(directory, "model")
    os.makedirs(model_dir, exist_ok=True)
    if args.in_process:
      sizes = save_models(model_dir, args.model_blocks)
    else:
      sizes = harness.run_worker(__file__, ["--worker", "save_models", "-", model_dir,
                                            str(args.model_blocks), "0", "0"])
    runs = {"model": {op: [] for op in MODEL_OPERATIONS}}
    for _ in range(args.repeats):
      for operation in MODEL_OPERATIONS:
        runs["model"][operation].append(run("model", operation, model_dir, 0))
    results["model"] = {"blocks": args.model_blocks, "arrays": sizes["model"],
                        **summarize(runs)["model"]}
    if args.model_rounds:
      if args.in_process:
        results["model"]["rounds"] = model_rounds(model_dir, args.model_rounds)
      else:
        results["model"]["rounds"] = harness.run_worker(__file__, [
            "--worker", "model_rounds", "-", model_dir, str(args.model_rounds), "0", "0"])
    report_model(results["model"])
    if "floors" not in skip:
      results["model"]["floors"] = floors_of(
          os.path.join(model_dir, "model_model"), in_process=args.in_process)
      report_floors(f"the {args.model_blocks}-block model", results["model"]["floors"])
    shutil.rmtree(model_dir, ignore_errors=True)
  report_targets(results)
  report_issue_31(results)
  return harness.finish(results, json_path=args.json, directory=None if args.dir else directory)


def floors_of(path: str, *, in_process: bool) -> dict:
  """`manifest_floors` of ``path``, in a fresh process unless ``in_process``."""
  if in_process:
    return manifest_floors(path)
  return harness.run_worker(__file__, ["--worker", "floors", "-", path, "0", "0", "0"])


def manifest_floors(path: str) -> dict:
  """What the manifest of the checkpoint at ``path`` costs, part by part, in
  one warm process (best of 7, milliseconds): issue 31's floors.

  * ``json_loads``: Python's C JSON parser on the manifest's bytes, no checks
    (the floor of any JSON manifest of this size and layout);
  * ``manifest``: the manifest read and validated whole (`Manifest.loads`);
  * ``decode``: the abstract tree decoded from the parsed manifest;
  * ``inspect``: `pzp.inspect` whole (opening, lock, manifest, decode);
  * ``inspect_gc_off``: the same with Python's cyclic garbage collector
    paused (the benchmark's own process only): how much of ``inspect`` is
    the collector walking the process's objects while the tree is built;
  * ``constructors``: the abstract values alone, built through Penzai's
    public constructors (``pz.ParameterValue``, ``NamedArray``) from the
    parsed manifest: what building the tree costs with no checks at all;
  * ``collect``: one full pass of the cyclic garbage collector over this
    process (``gc.collect()``, best of 3; ``objects``: how many it tracks),
    and ``full_passes``: how many full passes Python's own thresholds ran
    during the 7 timed ``inspect`` calls. Each call leaves tens of thousands
    of containers (the parsed JSON, the specs, the tree) promoted to the
    oldest generation, which sets off a full pass about every other call in a
    warm process: that pass, not the manifest, is then most of the call.
  """
  import gc

  import jax
  from penzai import pz

  import pz_persist as pzp
  from pz_persist.format import manifest as manifest_lib
  from pz_persist.storage.reading import restoring

  item = os.path.join(path, "penzai")
  with open(os.path.join(item, manifest_lib.MANIFEST_FILENAME), "rb") as f:
    data = f.read()
  manifest = manifest_lib.Manifest.loads(data, where=item)

  def best(fn, n=7):
    times = []
    for _ in range(n):
      start = time.perf_counter()
      fn()
      times.append(time.perf_counter() - start)
    return min(times) * 1000

  def constructors():
    out = []
    for spec in manifest.arrays:
      axes = {f"a{i}": n for i, n in enumerate(spec.shape)}
      out.append(pz.ParameterValue(
          value=pz.nx.NamedArray(named_axes=axes, data_array=jax.ShapeDtypeStruct(
              spec.shape, spec.np_dtype)),
          label=spec.label, metadata={}))
    return out

  out = {
      "bytes": len(data), "arrays": len(manifest.arrays),
      "format_version": manifest.format_version,
      "json_loads": best(lambda: json.loads(data)),
      "manifest": best(lambda: manifest_lib.Manifest.loads(data, where=item)),
      "decode": best(lambda: restoring.abstract_tree(manifest, where=item)),
  }
  passes = gc.get_stats()[2]["collections"]
  out["inspect"] = best(lambda: pzp.inspect(path))
  out["full_passes"] = gc.get_stats()[2]["collections"] - passes
  out["constructors"] = best(constructors)
  out["collect"] = best(gc.collect, 3)
  out["objects"] = len(gc.get_objects())
  gc.disable()
  try:
    out["inspect_gc_off"] = best(lambda: pzp.inspect(path))
  finally:
    gc.enable()
  return out


def report_floors(what: str, floors: dict) -> None:
  harness.print_table(
      f"Issue 31: the manifest of {what}, part by part (one warm process, best of 7)",
      ["manifest format", "bytes", "bytes per array", "json.loads", "manifest read and checked",
       "decode (abstract tree)", "inspect", "inspect, collector paused",
       "Penzai constructors alone", "one full collector pass (objects)",
       "full passes in the 7 inspects"],
      [(floors["format_version"], floors["bytes"],
        f"{floors['bytes'] / max(1, floors['arrays']):.0f}",
        *(f"{floors[k]:.1f} ms" for k in ("json_loads", "manifest", "decode", "inspect",
                                           "inspect_gc_off", "constructors")),
        f"{floors['collect']:.1f} ms ({floors['objects']})", floors["full_passes"])],
  )


def report_issue_31(results: dict) -> None:
  """Issue 31's targets for the manifest: inspect and load_model's overhead."""
  rows = []
  for count, summary in results["counts"].items():
    inspect = summary.get("pz_persist", {}).get("inspect", {})
    for phase in ("fresh", "warm"):
      if phase in inspect:
        rows.append((f"{count}: inspect, {phase}, best", inspect[phase][0] * 1000, 50, False,
                     "ms"))
  if "model" in results:
    model = results["model"]
    for phase in ("fresh", "warm"):
      if phase in model["load_model"]:
        added = model["load_model"][phase][0] - model["load_arrays"][phase][0]
        rows.append((f"load_model over load of the arrays ({model['blocks']} blocks), {phase},"
                     " best minus best", added * 1000, 50, False, "ms"))
    if "rounds" in model:
      rows.append(("the same, taking turns in one process, median of rounds",
                   model_overhead(model["rounds"]) * 1000, 50, False, "ms"))
    floors = model.get("floors")
    if floors and "fresh" in model["load_model"]:
      # The model's checkpoint holds arrays the parameters' does not (layers'
      # scalars: epsilons, scales, masked values): reading them is per-array
      # load cost, not structure; counted at load_arrays' own per-array cost.
      extra = floors["arrays"] - model["arrays"]
      per_array = model["load_arrays"]["fresh"][0] / max(1, model["arrays"])
      added = model["load_model"]["fresh"][0] - model["load_arrays"]["fresh"][0]
      print(f"The model's checkpoint holds {extra} arrays beyond the parameters'"
            f" ({floors['arrays']} against {model['arrays']}): reading them at load_arrays'"
            f" per-array cost is ~{extra * per_array * 1000:.0f} ms of load_model's fresh"
            f" {added * 1000:.0f} ms; the structure's share is the rest,"
            f" ~{(added - extra * per_array) * 1000:.0f} ms (its manifest checked in"
            f" {floors['manifest']:.0f} ms and decoded, abstract, in {floors['decode']:.0f} ms"
            " above).\n")
  for count, floors in results.get("floors", {}).items():
    if "collect" in floors:
      print(f"{count} arrays: inspect {floors['inspect']:.0f} ms (best of 7, warm process),"
            f" {floors['inspect_gc_off']:.0f} ms with the collector paused; a full pass of the"
            f" collector over this process's {floors['objects']} objects costs"
            f" {floors['collect']:.0f} ms and Python's thresholds ran {floors['full_passes']}"
            " during the 7 calls: such a call takes the pass's time on top, whatever the"
            " manifest (the floor of a warm process's inspect).\n")
  if rows:
    harness.print_targets("Issue 31's targets (pz_persist, best runs)", rows)


def summarize(runs: dict) -> dict:
  """Best and median seconds, fresh and warm, of each (method, operation)."""
  out = {}
  for method, operations in runs.items():
    out[method] = {}
    for operation, results in operations.items():
      fresh = [r["fresh"]["seconds"] for r in results]
      warm = [s for r in results for s in r["warm"]]
      entry = {"fresh": harness.best_and_median(fresh),
               "fresh_extra_rss": min(r["fresh"]["extra_rss"] for r in results)}
      if warm:
        entry["warm"] = harness.best_and_median(warm)
      out[method][operation] = entry
  return out


def _ms_per_array(entry: dict, phase: str, count: int) -> str:
  if phase not in entry:
    return "-"
  best, median = entry[phase]
  return f"{best / count * 1000:.3f} ({median / count * 1000:.3f})"


def report_count(count: int, array_kib: float, summary: dict) -> None:
  nbytes = array_bytes(count, array_kib)
  rows = []
  for method, operations in summary.items():
    for operation, entry in operations.items():
      best = entry["fresh"][0]
      rows.append([method, operation, _ms_per_array(entry, "fresh", count),
                   _ms_per_array(entry, "warm", count), f"{best:.3f} s",
                   harness.format_size(entry["fresh_extra_rss"])])
  harness.print_table(
      f"{count} arrays ({harness.format_size(nbytes)}): ms per array, best (median)",
      ["method", "operation", "fresh process", "warm process", "fresh, total (best)",
       "fresh peak RSS above baseline"],
      rows,
  )
  ours = summary.get("pz_persist")
  if not ours:
    return
  rows = []
  for method, operations in summary.items():
    if method == "pz_persist":
      continue
    for operation, entry in operations.items():
      if operation not in ours:
        continue
      row = [method, operation]
      for phase in ("fresh", "warm"):
        if phase in entry and phase in ours[operation]:
          row += [f"{entry[phase][i] / ours[operation][phase][i]:.2f}x" for i in (0, 1)]
        else:
          row += ["-", "-"]
      rows.append(row)
  harness.print_table(
      f"{count} arrays: pz_persist's speed relative to each method (above 1: pz_persist is faster)",
      ["method", "operation", "fresh, best", "fresh, median", "warm, best", "warm, median"],
      rows,
  )


def report_growth(by_count: dict) -> None:
  """Per-array cost at each count, and its growth from the smallest to the largest."""
  counts = sorted(by_count)
  rows = []
  for method, operations in by_count[counts[0]].items():
    for operation in operations:
      for phase in ("fresh", "warm"):
        if phase not in operations[operation]:
          continue
        per_array = [by_count[c][method][operation][phase][0] / c * 1000 for c in counts]
        rows.append([method, operation, phase, *(f"{ms:.3f}" for ms in per_array),
                     f"{per_array[-1] / per_array[0]:.2f}x"])
  harness.print_table(
      "How the cost per array grows with the count: ms per array (best)",
      ["method", "operation", "process", *(f"{c} arrays" for c in counts),
       f"{counts[-1]} / {counts[0]}"],
      rows,
  )


def report_model(model: dict) -> None:
  rows = []
  arrays = model["load_arrays"]
  for operation in MODEL_OPERATIONS:
    entry = model[operation]
    row = [operation]
    for phase in ("fresh", "warm"):
      if phase not in entry:
        row += ["-", "-"]
        continue
      best, median = entry[phase]
      extra = (f", {1000 * (best - arrays[phase][0]):+.1f} ms"
               if operation not in ("load_arrays", "inspect") else "")
      row += [f"{best * 1000:.1f} ms{extra}", f"{median * 1000:.1f} ms"]
    rows.append(row)
  harness.print_table(
      f"A {model['blocks']}-block unstacked transformer ({model['arrays']} arrays): best"
      " (difference to load_arrays) and median",
      ["operation", "fresh, best", "fresh, median", "warm, best", "warm, median"],
      rows,
  )
  print("load_model: pzp.load_model(model checkpoint); load_model_tree: pzp.load of it;"
        " load_arrays: pzp.load of the parameters alone (same arrays and labels);"
        " load_model_into: load_into(parameters, model); inspect: of the model\n")
  if "rounds" in model:
    rounds = model["rounds"]
    rows = []
    for operation in MODEL_OPERATIONS:
      best, median = harness.best_and_median(rounds[operation])
      row = [operation, f"{best * 1000:.1f} ms", f"{median * 1000:.1f} ms"]
      if operation in ("load_arrays", "inspect"):
        row.append("-")
      else:
        row.append(f"{model_overhead(rounds, operation) * 1000:+.1f} ms")
      rows.append(row)
    harness.print_table(
        f"The same, taking turns in one warm process ({len(rounds['load_arrays'])} rounds)",
        ["operation", "best", "median", "median of each round's difference to load_arrays"],
        rows,
    )


def model_overhead(rounds: dict, operation: str = "load_model") -> float:
  """Median over rounds of ``operation``'s time minus ``load_arrays``' time."""
  import statistics

  return statistics.median(
      mine - arrays for mine, arrays in zip(rounds[operation], rounds["load_arrays"]))


def report_targets(results: dict) -> None:
  """Issue 19's per-array targets (defined at 4000 x 16 KiB), for each count."""
  rows = []
  for count, summary in results["counts"].items():
    ours, orbax = summary.get("pz_persist", {}), summary.get("orbax", {})
    for phase in ("fresh", "warm"):
      for operation, bound in (("save", 0.25), ("load", 0.1)):
        if phase in ours.get(operation, {}):
          best = ours[operation][phase][0]
          rows.append((f"{count}: {operation} ms/array, {phase}", best / count * 1000, bound,
                       False, "ms"))
          if phase in orbax.get(operation, {}):
            rows.append((f"{count}: {operation} vs plain Orbax, {phase}",
                         orbax[operation][phase][0] / best, 5.0, True, "x"))
    if "inspect" in ours:
      rows.append((f"{count}: inspect", ours["inspect"]["fresh"][0] * 1000, 50, False, "ms"))
  if "model" in results:
    model = results["model"]
    for phase in ("fresh", "warm"):
      if phase in model["load_model"]:
        added = model["load_model"][phase][0] - model["load_arrays"][phase][0]
        rows.append((f"load_model adds over loading the arrays ({model['blocks']} blocks),"
                     f" {phase}, best minus best", added * 1000, 50, False, "ms"))
    if "rounds" in model:
      rows.append((f"the same, taking turns in one process, median of"
                   f" {len(model['rounds']['load_arrays'])} rounds",
                   model_overhead(model["rounds"]) * 1000, 50, False, "ms"))
  if rows:
    harness.print_targets("Issue 19's targets (pz_persist, best runs)", rows)


if __name__ == "__main__":
  main()
