"""Save and restore speed and memory: pz_persist vs plain Orbax, safetensors, numpy.

Usage::

  python benchmarks/save_restore.py --size 1GiB [--repeats 5] [--dir /tmp/bench] [--cold]

The data is a transformer-shaped tree of ``NamedArray`` parameters (labels,
axis names and shapes as in a Penzai llamalike model) totalling ``--size``
bytes of float32. Each method saves and restores the same arrays:

* ``pz_persist``: `pzp.save` / `pzp.load` (no template).
* ``pz_persist_before``: the same checkpoint format written and read the way
  pz_persist did before its performance work, through its public Orbax
  handler: ``PenzaiCheckpointHandler(use_compression=True,
  direct_reads=False)`` (Orbax's zstd compression, Orbax's restore path in
  64 MiB batches). It shows the before/after in one run.
* ``pz_persist_tuned`` (not run by default; any pz_persist method takes the
  suffix): ``pz_persist`` in a process that called
  `pz_persist.tune_host_allocator` first (glibc's mmap and trim thresholds
  pinned), to measure what that opt-in buys.
* ``pz_persist_untrimmed``, ``pz_persist_before_untrimmed`` (not run by
  default): without the ``malloc_trim`` after each read
  (`pz_persist.storage.reading.host_memory.release_freed` made a no-op), to measure what it buys.
* ``orbax``: ``ocp.StandardCheckpointer`` save of the same frozen parameters,
  restore *with* a template (``jax.eval_shape``), the way Penzai's docs say.
* ``orbax_no_template`` (not run by default): the same save, restored
  without a template (bare arrays in nested dicts and lists).
* ``safetensors``: ``safetensors.numpy.save_file`` / ``load_file``.
* ``numpy``: ``np.savez`` / ``np.load`` of every array.

Every (method, operation) runs in its own process (see ``harness.py``); a
save is also timed until ``os.sync()`` returns (``save + sync``: Orbax and
pz_persist fsync their files, safetensors and numpy do not). The **warm
process** rows (skip with ``--skip warm``) run each method in one process
that saves (+ ``os.sync()``) and restores ``--warm-runs`` + 1 times, keeping
the second and later runs: the notebook case, where a model is reloaded in
the session that loaded it before. The summary states issue 19's targets
(save >= 1.5x plain Orbax and >= 1.0x safetensors, fresh and warm; restore
>= 1.0x safetensors warm and >= 1.2x fresh; restore peak RSS <= 1.2x the
data) with the measured ratios, met or not.
Restores read from a warm page cache (the files were just written); with
``--cold`` the page cache is also dropped before one extra restore each, when
the OS allows it. Printed: throughput, peak RSS above the process's baseline
(and as a ratio of the data's bytes), speed ratios of pz_persist against
every other method, save speed against the disk's measured write + fsync
bandwidth, the time of loading one label into a model
(``load_model(into=..., only=label)``) against a full restore, and the time
of `pzp.inspect`.
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

METHODS = ("pz_persist", "pz_persist_before", "orbax", "safetensors", "numpy")
VARIANTS = ("_tuned", "_untrimmed")
"""Suffixes running a pz_persist method under a process-wide setting (see the
module docstring), e.g. ``pz_persist_before_untrimmed``: fresh processes
only, since a setting made once cannot be undone to take turns with the
untouched method in one process."""


def _is_variant(method: str) -> bool:
  return method.endswith(VARIANTS)


def _apply_variant(method: str) -> str:
  """Makes ``method``'s process-wide setting; returns the method it runs."""
  if not _is_variant(method):
    return method
  from pz_persist.storage.reading import host_memory

  if method.endswith("_tuned"):
    host_memory.tune_host_allocator()
    return method.removesuffix("_tuned")
  host_memory.release_freed = lambda: None
  return method.removesuffix("_untrimmed")


def transformer_shapes(target_bytes: int) -> list[tuple[str, tuple[tuple[str, int], ...]]]:
  """Labels and named shapes of a llamalike model of at least ``target_bytes``."""

  def shapes(width: int, blocks: int):
    embedding, heads, kv_heads, projection = 128 * width, 8, 2, 16 * width
    neurons, vocab = 352 * width, 2000 * width
    out = [("transformer/embedder.embeddings", (("vocabulary", vocab), ("embedding", embedding)))]
    for i in range(blocks):
      prefix = f"transformer/block_{i}"
      out += [
          (f"{prefix}/pre_attention_norm/scale.weights", (("embedding", embedding),)),
          (f"{prefix}/attention/query.weights",
           (("embedding", embedding), ("heads", heads), ("projection", projection))),
          (f"{prefix}/attention/key.weights",
           (("embedding", embedding), ("heads", kv_heads), ("projection", projection))),
          (f"{prefix}/attention/value.weights",
           (("embedding", embedding), ("heads", kv_heads), ("projection", projection))),
          (f"{prefix}/attention/output.weights",
           (("heads", heads), ("projection", projection), ("embedding", embedding))),
          (f"{prefix}/pre_ffw_norm/scale.weights", (("embedding", embedding),)),
          (f"{prefix}/mlp/gating_linear.weights", (("embedding", embedding), ("neurons", neurons))),
          (f"{prefix}/mlp/value_linear.weights", (("embedding", embedding), ("neurons", neurons))),
          (f"{prefix}/mlp/out_linear.weights", (("neurons", neurons), ("embedding", embedding))),
      ]
    out += [
        ("transformer/final_norm/scale.weights", (("embedding", embedding),)),
        ("transformer/lm_head.weights", (("embedding", embedding), ("vocabulary", vocab))),
    ]
    return out

  def nbytes(spec):
    return sum(4 * int(np.prod([n for _, n in axes])) for _, axes in spec)

  # The widest model whose 4 blocks fit, then as many blocks as reach the size.
  width = 1
  while nbytes(shapes(width + 1, 4)) <= target_bytes:
    width += 1
  blocks = 1
  while nbytes(shapes(width, blocks)) < target_bytes:
    blocks += 1
  return shapes(width, blocks)


def build_params(target_bytes: int, seed: int = 0):
  """The benchmark tree: a tuple of ``pz.ParameterValue`` of NamedArrays."""
  import jax.numpy as jnp
  from penzai import pz

  rng = np.random.default_rng(seed)
  params = []
  for label, axes in transformer_shapes(target_bytes):
    shape = tuple(n for _, n in axes)
    data = rng.standard_normal(shape, dtype=np.float32)
    params.append(
        pz.ParameterValue(
            label=label,
            value=pz.nx.NamedArray(
                named_axes=collections.OrderedDict(axes), data_array=jnp.asarray(data)
            ),
        )
    )
  return tuple(params)


def _flat(params) -> dict[str, np.ndarray]:
  return {p.label: np.asarray(p.value.data_array) for p in params}


def _block(tree) -> None:
  """Waits for asynchronously produced jax.Arrays (every method returns
  fully read arrays: none of them maps files lazily)."""
  import jax

  jax.block_until_ready(tree)


def save_op(method: str, path: str, params):
  """A callable saving ``params`` to ``path`` with ``method``."""
  if method == "pz_persist":
    import pz_persist as pzp
    return lambda: pzp.save(path, params)
  if method == "pz_persist_before":
    import orbax.checkpoint as ocp

    import pz_persist as pzp

    def op():
      handler = pzp.PenzaiCheckpointHandler(use_compression=True, direct_reads=False)
      with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(path, args=pzp.PenzaiSave(params))
    return op
  if method in ("orbax", "orbax_no_template"):
    import orbax.checkpoint as ocp

    def op():
      with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, params)
    return op
  flat = _flat(params)
  if method == "safetensors":
    from safetensors.numpy import save_file
    return lambda: save_file(flat, path)
  return lambda: np.savez(path, **{k.replace("/", "|"): v for k, v in flat.items()})


def restore_op(method: str, path: str, target_bytes: int, template=None):
  """A callable restoring what `save_op` wrote.

  ``orbax`` gets ``template`` (default: the abstract `build_params` tree of
  ``target_bytes``); ``orbax_no_template`` restores without one.
  """
  if method == "pz_persist":
    import pz_persist as pzp
    return lambda: _block(pzp.load(path))
  if method == "pz_persist_before":
    import orbax.checkpoint as ocp

    import pz_persist as pzp

    def op():
      handler = pzp.PenzaiCheckpointHandler(use_compression=True, direct_reads=False)
      with ocp.Checkpointer(handler) as checkpointer:
        _block(checkpointer.restore(path, args=pzp.PenzaiRestore()))
    return op
  if method in ("orbax", "orbax_no_template"):
    import jax
    import orbax.checkpoint as ocp
    if method == "orbax" and template is None:
      template = jax.eval_shape(lambda: build_params(target_bytes))

    def op():
      with ocp.StandardCheckpointer() as checkpointer:
        _block(checkpointer.restore(path, template))
    return op
  if method == "safetensors":
    from safetensors.numpy import load_file
    return lambda: _block(load_file(path))

  def op():
    with np.load(path) as data:
      _block([data[k] for k in data.files])
  return op


def _warm_up(method: str) -> None:
  """Saves and restores a tiny tree first, so one-time start-up costs (JAX
  backend, TensorStore contexts, thread pools) are not charged to the
  measured operation: it measures throughput, alike for every method."""
  with tempfile.TemporaryDirectory() as directory:
    path = _path(directory, method)
    tiny = 2**16
    save_op(method, path, build_params(tiny))()
    restore_op(method, path, tiny)()


def worker(method: str, operation: str, path: str, target_bytes: int) -> dict:
  """Runs one measured operation in this (fresh) process."""
  if operation == "own_work":
    return own_work(build_params(target_bytes))
  if operation == "paired":
    return paired(path, target_bytes, methods=method.split(","))
  method = _apply_variant(method)
  _warm_up(method)
  if operation.startswith("warm"):
    return warm_process(method, path, target_bytes, runs=int(operation.split(":")[1]))
  if operation == "save":
    params = build_params(target_bytes)
    _block(params)
    result = harness.measure(save_op(method, path, params))
    result["sync_seconds"] = harness.timed_runs(os.sync, 1)[0]
    return result
  if operation == "restore":
    return harness.measure(restore_op(method, path, target_bytes))
  if operation == "inspect":
    import pz_persist as pzp
    return harness.measure(lambda: pzp.inspect(path))
  if operation == "only":
    return load_one_label(path, target_bytes)
  raise ValueError(operation)


def warm_process(method: str, path: str, target_bytes: int, runs: int) -> dict:
  """Save (+ ``os.sync()``) and restore, each ``runs`` + 1 times in this process.

  The first of each is dropped: it is what a fresh process pays (measured
  apart); the later ones are what a notebook pays when it saves or reloads
  again, with the library's caches, thread pools and allocator arenas warm.
  """
  params = build_params(target_bytes)
  _block(params)

  def clear():
    _remove(path)
    os.sync()
  save = harness.timed_runs(harness.synced(save_op(method, path, params)), runs + 1, prepare=clear)
  restore = harness.timed_runs(restore_op(method, path, target_bytes), runs + 1)
  return {"save": save[1:], "restore": restore[1:]}


def load_one_label(path: str, target_bytes: int, repeats: int = 5) -> dict:
  """``load_into(path, model, only=label)`` for the smallest and the
  largest label, best of ``repeats``, beside a full restore in this process."""
  from penzai import pz

  import pz_persist as pzp

  model = tuple(p.unfreeze_as_copy() for p in build_params(target_bytes, seed=1))
  by_size = sorted(transformer_shapes(target_bytes),
                   key=lambda spec: int(np.prod([n for _, n in spec[1]])))
  labels = {"smallest": by_size[0][0], "largest": by_size[-1][0]}

  def best(fn):
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      _block(fn())
      times.append(time.perf_counter() - start)
    return min(times)

  result = {"full_seconds": best(lambda: pzp.load(path))}
  for name, label in labels.items():
    loaded = pzp.load_into(path, model, only=label)
    _, variables = pz.unbind_params(loaded)
    size = next(v.value.data_array.nbytes for v in variables if v.label == label)
    result[name] = {
        "label": label,
        "bytes": size,
        "seconds": best(lambda label=label: pzp.load_into(path, model, only=label)),
    }
  return result


def paired(directory: str, target_bytes: int, methods: list[str], rounds: int = 8) -> dict:
  """The methods in one process, taking turns, many rounds.

  Separate processes measure memory cleanly, but on a shared machine their
  times drift by tens of percent between runs. Taking turns in one warm
  process, in rotating order, compares the methods under the same
  conditions. Disk writeback stalls make times bimodal, so the best round is
  the steadier estimate; the median is shown too.
  """
  for method in methods:
    _warm_up(method)
  params = build_params(target_bytes)
  _block(params)
  times = {method: {"save": [], "restore": []} for method in methods}
  for index in range(rounds):
    order = methods[index % len(methods):] + methods[:index % len(methods)]
    for method in order:
      path = _path(directory, "paired_" + method)
      _remove(path)
      os.sync()
      start = time.perf_counter()
      save_op(method, path, params)()
      times[method]["save"].append(time.perf_counter() - start)
    for method in order:
      op = restore_op(method, _path(directory, "paired_" + method), target_bytes)
      start = time.perf_counter()
      op()
      times[method]["restore"].append(time.perf_counter() - start)
  for method in methods:
    _remove(_path(directory, "paired_" + method))
  return times


def own_work(params) -> dict:
  """Time pz_persist adds around Orbax's array I/O, measured without any I/O.

  Saving adds encoding the tree and serializing the manifest; loading adds
  parsing the manifest, checking what Orbax read and decoding the tree. The
  arrays themselves go through the same Orbax code as in plain Orbax.
  """
  from pz_persist.format import manifest as manifest_lib
  from pz_persist.storage.reading import placements
  from pz_persist.storage.reading import reader
  from pz_persist.storage.reading import restoring
  from pz_persist.storage.writing import writer

  def best(fn, repeats=5):
    return harness.best_of(fn, repeats)

  # Encoding, hashing (done in the save's background work since the hashing
  # moved off the critical path, still pz_persist's work) and serializing.
  manifest, stored = writer.encode_hashed(params)
  data = manifest.dumps()

  def decode():
    parsed = manifest_lib.Manifest.loads(data, where="bench")
    values = reader.values(parsed, stored, where="bench",
                           placed=placements.placements(parsed, None))
    return restoring.decode(parsed, values, where="bench")

  return {
      "save_seconds": best(lambda: writer.encode_hashed(params)[0].dumps()),
      "load_seconds": best(decode),
      "manifest_bytes": len(data),
  }


def _path(directory: str, method: str) -> str:
  suffix = {"safetensors": ".safetensors", "numpy": ".npz"}.get(method.split("_")[-1], "")
  return os.path.join(directory, method + suffix)


def _remove(path: str) -> None:
  if os.path.isdir(path):
    shutil.rmtree(path)
  elif os.path.exists(path):
    os.remove(path)


def _disk_bytes(path: str) -> int:
  if os.path.isfile(path):
    return os.path.getsize(path)
  return sum(
      os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
  )


def fsync_write_bandwidth(directory: str, nbytes: int) -> float:
  """Bytes/s of writing ``nbytes`` to a file and fsync'ing it (disk reference)."""
  path = os.path.join(directory, "fsync_probe.bin")
  block = np.random.default_rng(1).integers(0, 255, 64 * 2**20, dtype=np.uint8).tobytes()
  start = time.perf_counter()
  with open(path, "wb") as f:
    written = 0
    while written < nbytes:
      f.write(block)
      written += len(block)
    f.flush()
    os.fsync(f.fileno())
  seconds = time.perf_counter() - start
  os.remove(path)
  return written / seconds


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="1GiB")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
  parser.add_argument("--cold", action="store_true", help="also restore with a dropped page cache")
  parser.add_argument("--methods", default=",".join(METHODS))
  parser.add_argument("--json", default=None, help="write the results here too")
  parser.add_argument("--skip", default="", help="'only': skip inspect, own work and only=;"
                      " 'paired': skip the one-process rounds; 'warm': skip the warm-process rows")
  parser.add_argument("--warm-runs", type=int, default=3,
                      help="runs kept (after the first) of each warm-process save and restore")
  parser.add_argument("--worker", nargs=4, metavar=("METHOD", "OP", "PATH", "BYTES"), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)

  if args.worker:
    method, operation, path, nbytes = args.worker
    print(json.dumps(worker(method, operation, path, int(nbytes))))
    return {}

  target = harness.parse_size(args.size)
  methods = [m for m in args.methods.split(",") if m]
  directory = args.dir or tempfile.mkdtemp(prefix="pz_persist_bench_")
  os.makedirs(directory, exist_ok=True)
  data_bytes = sum(4 * int(np.prod([n for _, n in axes])) for _, axes in transformer_shapes(target))
  print(f"# save_restore benchmark, {time.strftime('%Y-%m-%d %H:%M')}")
  print(f"{harness.machine_description()}")
  print(f"data: {len(transformer_shapes(target))} NamedArray parameters,"
        f" {harness.format_size(data_bytes)} float32; {args.repeats} repeats (best shown)\n")

  def run(method, operation):
    return harness.run_worker(
        __file__, ["--worker", method, operation, _path(directory, method), str(target)]
    )

  # Methods take turns within each repeat, and dirty pages of the previous
  # write are flushed first, so no method pays for another's writeback and
  # slow phases of a shared machine hit every method alike.
  runs = {method: {"save": [], "restore": []} for method in methods}
  for _ in range(args.repeats):
    for method in methods:
      _remove(_path(directory, method))
      os.sync()
      runs[method]["save"].append(run(method, "save"))
  os.sync()
  for _ in range(args.repeats):
    for method in methods:
      runs[method]["restore"].append(run(method, "restore"))
  results = {"size_bytes": data_bytes, "methods": {}}
  for method in methods:
    entry = {
        op: min(runs[method][op], key=lambda r: r["seconds"]) for op in ("save", "restore")
    }
    entry["disk_bytes"] = _disk_bytes(_path(directory, method))
    if args.cold and harness.drop_page_cache():
      entry["restore_cold"] = run(method, "restore")
    if method == "pz_persist" and "only" not in args.skip:
      entry["inspect"] = min(
          (run(method, "inspect") for _ in range(args.repeats)), key=lambda r: r["seconds"]
      )
      entry["own_work"] = run(method, "own_work")
      entry["only"] = run(method, "only")
    for op in ("save", "restore"):
      entry[op]["median_seconds"] = float(np.median([r["seconds"] for r in runs[method][op]]))
    best, median = harness.best_and_median(
        [r["seconds"] + r["sync_seconds"] for r in runs[method]["save"]])
    entry["save_synced"] = {"seconds": best, "median_seconds": median}
    results["methods"][method] = entry

  if "warm" not in args.skip:
    results["warm"] = {
        method: harness.run_worker(__file__, [
            "--worker", method, f"warm:{args.warm_runs}", _path(directory, "warm_" + method),
            str(target)])
        for method in methods if method != "numpy" and not _is_variant(method)
    }
    for method in methods:
      _remove(_path(directory, "warm_" + method))

  if "pz_persist" in methods and len(methods) > 1 and "paired" not in args.skip:
    paired_methods = [m for m in methods  # numpy: far slower.
                      if m != "numpy" and not _is_variant(m)]
    results["paired"] = harness.run_worker(
        __file__, ["--worker", ",".join(paired_methods), "paired", directory, str(target)]
    )
  results["fsync_write_bytes_per_s"] = fsync_write_bandwidth(directory, min(data_bytes, 2**30))
  report(results)
  return harness.finish(results, json_path=args.json, directory=None if args.dir else directory)


def report(results: dict) -> None:
  size = results["size_bytes"]
  methods = results["methods"]
  rows = []
  for name, entry in methods.items():
    row = [name]
    synced = entry["save_synced"]
    row.append(f"{synced['seconds']:.2f} s ({size / synced['seconds'] / 2**20:.0f} MiB/s),"
               f" median {synced['median_seconds']:.2f} s")
    for op in ("save", "restore", "restore_cold"):
      if op not in entry:
        row += ["-", "-"]
        continue
      seconds = entry[op]["seconds"]
      median = entry[op].get("median_seconds")
      row.append(
          f"{seconds:.2f} s ({size / seconds / 2**20:.0f} MiB/s)"
          + (f", median {median:.2f} s" if median else "")
      )
      extra = entry[op]["extra_rss"]
      row.append(f"{harness.format_size(extra)} ({extra / size:.2f}x)")
    row.append(harness.format_size(entry["disk_bytes"]))
    rows.append(row)
  harness.print_table(
      "Throughput and peak memory (RSS above the process baseline; x: of the data's bytes)",
      ["method", "save + sync", "save", "save peak RSS", "restore (warm cache)", "restore peak RSS",
       "restore (cold)", "cold peak RSS", "on disk"],
      rows,
  )
  ours = methods.get("pz_persist")
  if ours:
    ratio_rows = []
    for name, entry in methods.items():
      if name == "pz_persist":
        continue
      ratio_rows.append([
          name,
          *(
              f"{entry[op][key] / ours[op][key]:.2f}x"
              for op in ("save", "restore")
              for key in ("seconds", "median_seconds")
          ),
      ])
    harness.print_table(
        "pz_persist's speed relative to each method, fresh processes (above 1: pz_persist is faster)",
        ["method", "save (best)", "save (median)", "restore (best)", "restore (median)"],
        ratio_rows,
    )
  if "paired" in results:
    times = results["paired"]
    rows = []
    for name in times:
      if name == "pz_persist":
        continue
      row = [name]
      for op in ("save", "restore"):
        for stat in (min, np.median):
          theirs, mine = float(stat(times[name][op])), float(stat(times["pz_persist"][op]))
          row.append(f"{theirs / mine:.2f}x ({mine:.2f} s vs {theirs:.2f} s)")
      rows.append(row + [len(times[name]["save"])])
    harness.print_table(
        "pz_persist's speed relative to each method, taking turns in one process",
        ["method", "save (best)", "save (median)", "restore (best)", "restore (median)",
         "rounds"],
        rows,
    )
  if "warm" in results:
    report_warm(results)
  if ours:
    report_targets(results)
  fsync = results["fsync_write_bytes_per_s"]
  print(f"Disk reference: write + fsync {fsync / 2**20:.0f} MiB/s", end="")
  if ours:
    speed = size / ours["save"]["seconds"]
    print(f"; pz_persist's best save {speed / 2**20:.0f} MiB/s = {speed / fsync:.2f}x of it")
  else:
    print()
  if ours and "inspect" in ours:
    print(f"pz_persist.inspect: {ours['inspect']['seconds'] * 1000:.1f} ms"
          " (reads the manifest only)")
  if ours and "only" in ours:
    only = ours["only"]
    for name in ("smallest", "largest"):
      one = only[name]
      print(
          f"load_model(into=model, only={one['label']!r}) ({name} label,"
          f" {harness.format_size(one['bytes'])}): {one['seconds'] * 1000:.1f} ms ="
          f" {one['seconds'] / only['full_seconds']:.2%} of a full pzp.load"
          f" ({only['full_seconds']:.2f} s, same process)"
      )
  if ours and "own_work" in ours:
    work = ours["own_work"]
    print(
        f"pz_persist's own work around the array I/O (no I/O): save {work['save_seconds'] * 1000:.1f} ms"
        f" ({work['save_seconds'] / ours['save']['seconds']:.2%} of its best save),"
        f" load {work['load_seconds'] * 1000:.1f} ms"
        f" ({work['load_seconds'] / ours['restore']['seconds']:.2%} of its best restore);"
        f" manifest {harness.format_size(work['manifest_bytes'])}"
    )


def report_warm(results: dict) -> None:
  """The warm-process rows: each method's later saves and restores in one process."""
  size, warm = results["size_bytes"], results["warm"]
  rows = []
  for name, times in warm.items():
    row = [name]
    for op in ("save", "restore"):
      best, median = harness.best_and_median(times[op])
      row.append(f"{best:.2f} s ({size / best / 2**20:.0f} MiB/s), median {median:.2f} s")
      if "pz_persist" in warm and name != "pz_persist":
        ours = harness.best_and_median(warm["pz_persist"][op])
        row.append(f"{best / ours[0]:.2f}x / {median / ours[1]:.2f}x")
      else:
        row.append("-")
    rows.append(row + [len(times["save"])])
  harness.print_table(
      "Warm process: save + sync and restore repeated in one process (2nd and later runs),"
      " best and median; x: pz_persist's speed relative to the method, best / median",
      ["method", "save + sync", "x", "restore", "x", "runs"],
      rows,
  )


def report_targets(results: dict) -> None:
  """Issue 19's save and restore targets: ratios measured in this run, met or not."""
  methods, warm = results["methods"], results.get("warm", {})
  ours = methods["pz_persist"]
  rows = []

  def ratio(name, theirs, mine, bound):
    for stat, index in (("best", 0), ("median", 1)):
      rows.append((f"{name} ({stat})", theirs[index] / mine[index], bound, True, "x"))

  def fresh(method, op):
    entry = methods[method][op]
    return entry["seconds"], entry["median_seconds"]

  for other, bound in (("orbax", 1.5), ("safetensors", 1.0)):
    if other in methods:
      ratio(f"save + sync vs {other}, fresh", fresh(other, "save_synced"),
            fresh("pz_persist", "save_synced"), bound)
    if other in warm and "pz_persist" in warm:
      ratio(f"save + sync vs {other}, warm", harness.best_and_median(warm[other]["save"]),
            harness.best_and_median(warm["pz_persist"]["save"]), bound)
  if "safetensors" in methods:
    ratio("restore vs safetensors, fresh", fresh("safetensors", "restore"),
          fresh("pz_persist", "restore"), 1.2)
  if "safetensors" in warm and "pz_persist" in warm:
    ratio("restore vs safetensors, warm", harness.best_and_median(warm["safetensors"]["restore"]),
          harness.best_and_median(warm["pz_persist"]["restore"]), 1.0)
  rows.append(("restore peak RSS / data bytes (best run)",
               ours["restore"]["extra_rss"] / results["size_bytes"], 1.2, False, "x"))
  harness.print_targets("Issue 19's targets: pz_persist's speed relative to each method", rows)


if __name__ == "__main__":
  main()
