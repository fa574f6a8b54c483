"""`pz_persist.open` on a multi-GiB checkpoint: opening, rendering, and reading
one layer or one slice, against what those bytes cost and the alternatives.

Usage::

  python benchmarks/lazy_open.py --size 2GiB [--layers 32] [--warm-runs 4] [--cold]

The data: a transformer-like tree of ``--layers`` blocks of NamedArray
parameters (``layer_NN/attn.{q,k,v,o}``: d x d; ``layer_NN/mlp.{up,down}``:
d x 4d and 4d x d) and an embedding table (``embed``: 32000 x d), float32,
``d`` chosen so that the whole is about ``--size``. It is saved once with
`pzp.save`, and the same arrays (named by label) once with
``safetensors.numpy.save_file``. Each (side, operation) runs in a fresh
process (``harness.run_worker``); the process repeats the operation
``--warm-runs`` more times (the warm rows: a notebook asking again). What
each side does:

* ``pz_persist``: ``pzp.open(path)`` (the manifest only); ``render``: that
  and ``treescope.render_to_html(ckpt)``; ``layer``: ``ckpt.load(only=
  "layer_07")`` (the tree with that layer's six arrays read and verified,
  every other array left abstract); ``slice``: ``ckpt.read("embed",
  {"vocabulary": slice(1000, 1100)})`` verified, which reads and hashes the
  16 MiB checksum tile holding those rows; ``slice_unverified``: the same
  with ``verify=False`` (only the rows' chunks).
* ``floor``: TensorStore alone reading the same arrays (``layer``) or rows
  (``slice``) from the same files, through Orbax's read spec, into NumPy; no
  manifest, no checksum, no tree: what those bytes cost.
* ``safetensors``: ``safe_open(file, framework="numpy")`` then
  ``get_tensor`` of the layer's six tensors, or ``get_slice("embed")
  [1000:1100]``: its own lazy reads (memory-mapped, ends in NumPy; no
  checksums).
* ``orbax``: plain Orbax's partial restore of the same checkpoint's files:
  ``ocp.PyTreeCheckpointer().restore(item, args=ocp.args.PyTreeRestore(
  item={key: ...}, restore_args={key: RestoreArgs(restore_type=np.ndarray)},
  partial_restore=True))`` with the storage keys of the layer's arrays, which
  reads only those arrays (bare NumPy arrays, no names, no checksums). Orbax
  has no slice read: its ``slice`` row restores the whole embedding array.
* ``inspect``, ``render_inspect``: ``pzp.inspect(path)`` and its treescope
  HTML, what ``open`` and ``render`` are measured against.
* ``load_all``: ``pzp.load(path)`` of everything, for scale (fresh only).

Files are read from a warm page cache (just written) unless ``--cold``
drops it before each fresh process (root on Linux). Printed: seconds
(fresh, and the median of the warm runs), peak RSS above the process's
baseline, and ratios of pz_persist to each alternative.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402  # pylint: disable=wrong-import-position

VOCAB = 32000
LAYER = 7  # The layer read (the last one of smaller trees).
SLICE = (1000, 1100)
NAMES = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.up", "mlp.down")


def _width(size: int, layers: int) -> int:
  """d such that layers * 12 d^2 + VOCAB d float32 is about ``size`` bytes."""
  a, b, c = 48 * layers, 4 * VOCAB, -size
  d = int((-b + (b * b - 4 * a * c) ** 0.5) / (2 * a))
  return max(64, d - d % 64)


def _shapes(d: int) -> dict[str, tuple[tuple[int, int], tuple[str, str]]]:
  return {
      "attn.q": ((d, d), ("embedding", "projection")),
      "attn.k": ((d, d), ("embedding", "projection")),
      "attn.v": ((d, d), ("embedding", "projection")),
      "attn.o": ((d, d), ("projection", "embedding")),
      "mlp.up": ((d, 4 * d), ("embedding", "neurons")),
      "mlp.down": ((4 * d, d), ("neurons", "embedding")),
  }


def _layer(directory: str) -> int:
  with open(os.path.join(directory, "layer.txt")) as f:
    return int(f.read())


def _layer_labels(directory: str) -> list[str]:
  return [f"layer_{_layer(directory):02d}/{name}" for name in NAMES]


# ---- Workers (each in a fresh process). ---------------------------------------


def _build(directory: str, size: int, layers: int) -> dict:
  import numpy as np
  import safetensors.numpy
  from penzai import pz

  import pz_persist as pzp

  d = _width(size, layers)
  rng = np.random.default_rng(0)
  flat: dict[str, np.ndarray] = {}

  def param(label, shape, axes):
    data = rng.standard_normal(shape, dtype=np.float32)
    flat[label] = data
    return pz.ParameterValue(value=pz.nx.wrap(data, *axes), label=label)

  tree = {
      "embed": param("embed", (VOCAB, d), ("vocabulary", "embedding")),
      "layers": [
          {name: param(f"layer_{i:02d}/{name}", shape, axes)
           for name, (shape, axes) in _shapes(d).items()}
          for i in range(layers)
      ],
  }
  with open(os.path.join(directory, "layer.txt"), "w") as f:
    f.write(str(min(LAYER, layers - 1)))
  start = time.perf_counter()
  pzp.save(os.path.join(directory, "pz"), tree)
  saved = time.perf_counter() - start
  safetensors.numpy.save_file(flat, os.path.join(directory, "model.safetensors"))
  os.sync()
  total = sum(a.nbytes for a in flat.values())
  layer = sum(flat[label].nbytes for label in _layer_labels(directory))
  return {"d": d, "bytes": total, "layer_bytes": layer, "arrays": len(flat),
          "slice_bytes": (SLICE[1] - SLICE[0]) * d * 4, "save_seconds": saved}


def _operation(side: str, op: str, directory: str):
  """``(prepare, operation)`` for one side and operation: ``prepare`` runs
  once, untimed (imports); ``operation`` is timed."""
  import numpy as np

  import pz_persist as pzp

  path = os.path.join(directory, "pz")
  item = os.path.join(path, "penzai")
  labels = _layer_labels(directory)
  prefix = labels[0].split("/")[0]
  if side == "pz_persist":
    if op == "open":
      return lambda: pzp.open(path)
    if op == "render":
      import treescope
      return lambda: treescope.render_to_html(pzp.open(path))
    if op == "load_all":
      return lambda: pzp.load(path)
    if op == "inspect":
      return lambda: pzp.inspect(path)
    if op == "render_inspect":
      import treescope
      return lambda: treescope.render_to_html(pzp.inspect(path))
    ckpt = pzp.open(path)  # Opened once, untimed: the notebook reads from it.
    if op == "layer":
      return lambda: ckpt.load(only=prefix)
    if op == "layer_each":
      return lambda: [ckpt[label] for label in labels]
    if op == "slice":
      return lambda: ckpt.read("embed", {"vocabulary": slice(*SLICE)})
    if op == "slice_unverified":
      return lambda: ckpt.read("embed", {"vocabulary": slice(*SLICE)}, verify=False)
  from etils import epath

  from pz_persist.format import manifest as manifest_lib
  manifest = manifest_lib.read(item)
  keys = {spec.label: spec.key for spec in manifest.arrays}
  if side == "floor":
    from pz_persist.storage.reading import direct_read

    def floor_layer():  # Every read issued at once, then waited for.
      stores = [direct_read.open_array(epath.Path(item), keys[label]) for label in labels]
      reads = [store.read() for store in stores]
      return [np.asarray(read.result()) for read in reads]

    def floor_slice():
      store = direct_read.open_array(epath.Path(item), keys["embed"])
      return np.asarray(store[SLICE[0]:SLICE[1]].read().result())

    return floor_layer if op == "layer" else floor_slice
  if side == "safetensors":
    from safetensors import safe_open
    file = os.path.join(directory, "model.safetensors")

    def st_layer():
      with safe_open(file, framework="numpy") as f:
        return [f.get_tensor(label) for label in labels]

    def st_slice():
      with safe_open(file, framework="numpy") as f:
        return f.get_slice("embed")[SLICE[0]:SLICE[1]]

    return st_layer if op == "layer" else st_slice
  if side == "orbax":
    import orbax.checkpoint as ocp
    wanted = [keys[label] for label in labels] if op == "layer" else [keys["embed"]]

    def orbax_partial():
      with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(item, args=ocp.args.PyTreeRestore(
            item=dict.fromkeys(wanted, np.ndarray),
            restore_args={key: ocp.RestoreArgs(restore_type=np.ndarray) for key in wanted},
            partial_restore=True,
        ))

    return orbax_partial
  raise ValueError(f"unknown side/operation {side}/{op}")


def _worker(side: str, op: str, directory: str, warm_runs: int) -> dict:
  operation = _operation(side, op, directory)
  fresh = harness.measure(operation)
  warm = [harness.measure(operation) for _ in range(warm_runs)]
  return {
      "fresh": fresh["seconds"], "fresh_rss": fresh["extra_rss"],
      "warm": statistics.median(w["seconds"] for w in warm) if warm else None,
      "warm_rss": max(w["extra_rss"] for w in warm) if warm else None,
  }


# ---- The run. ------------------------------------------------------------------

RUNS = [
    ("pz_persist", "open"), ("pz_persist", "inspect"), ("pz_persist", "render"),
    ("pz_persist", "render_inspect"),
    ("pz_persist", "layer"), ("pz_persist", "layer_each"), ("floor", "layer"), ("safetensors", "layer"), ("orbax", "layer"),
    ("pz_persist", "slice"), ("pz_persist", "slice_unverified"), ("floor", "slice"),
    ("safetensors", "slice"), ("orbax", "slice"),
    ("pz_persist", "load_all"),
]


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size", default="2GiB")
  parser.add_argument("--layers", type=int, default=32)
  parser.add_argument("--warm-runs", type=int, default=4)
  parser.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
  parser.add_argument("--cold", action="store_true", help="drop the page cache before each run")
  parser.add_argument("--json", default=None)
  parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    side, op, directory, warm_runs = args.worker
    if side == "build":
      result = _build(directory, harness.parse_size(op), int(warm_runs))
    else:
      result = _worker(side, op, directory, int(warm_runs))
    print(json.dumps(result))
    return result
  directory = tempfile.mkdtemp(prefix="lazy_open_", dir=args.dir)
  results: dict = {"machine": harness.machine_description()}
  try:
    built = harness.run_worker(__file__, ["--worker", "build", args.size, directory,
                                          str(args.layers)])
    results["data"] = built
    print(f"{harness.machine_description()}\n{built['arrays']} arrays, d={built['d']},"
          f" {harness.format_size(built['bytes'])} (one layer:"
          f" {harness.format_size(built['layer_bytes'])}, slice:"
          f" {harness.format_size(built['slice_bytes'])}); pzp.save took"
          f" {built['save_seconds']:.2f} s\n", flush=True)
    measured = {}
    for side, op in RUNS:
      if args.cold:
        harness.drop_page_cache()
      warm = 0 if op == "load_all" else args.warm_runs
      measured[(side, op)] = harness.run_worker(
          __file__, ["--worker", side, op, directory, str(warm)])
    results["runs"] = {f"{side}/{op}": value for (side, op), value in measured.items()}
    _report(measured, built)
  finally:
    harness.finish(results, json_path=args.json, directory=directory)
  return results


def _report(measured: dict, built: dict) -> None:
  def ms(value):
    return "-" if value is None else f"{value * 1000:.1f}"

  def mib(value):
    return "-" if value is None else f"{value / 2**20:.1f}"

  rows = [[f"{side}", op, ms(v["fresh"]), ms(v["warm"]), mib(v["fresh_rss"]), mib(v["warm_rss"])]
          for (side, op), v in measured.items()]
  harness.print_table("lazy_open.py: seconds and peak RSS above baseline",
                      ["side", "operation", "fresh ms", "warm ms (median)",
                       "fresh peak MiB", "warm peak MiB"], rows)
  ratios = []
  for op, mine in (("layer", "layer"), ("slice", "slice"), ("slice", "slice_unverified")):
    for other in ("floor", "safetensors", "orbax"):
      a, b = measured[("pz_persist", mine)], measured[(other, op)]
      ratios.append([f"pz_persist {mine} / {other} {op}",
                     f"{a['fresh'] / b['fresh']:.2f}x",
                     f"{a['warm'] / b['warm']:.2f}x" if a["warm"] and b["warm"] else "-"])
  for mine, other in (("open", "inspect"), ("render", "render_inspect")):
    a, b = measured[("pz_persist", mine)], measured[("pz_persist", other)]
    ratios.append([f"pz_persist {mine} / {other}", f"{a['fresh'] / b['fresh']:.2f}x",
                   f"{a['warm'] / b['warm']:.2f}x"])
  full = measured[("pz_persist", "load_all")]["fresh"]
  layer = measured[("pz_persist", "layer")]["fresh"]
  ratios.append(["pz_persist layer / load_all (fresh)", f"{layer / full:.3f}x",
                 f"bytes: {built['layer_bytes'] / built['bytes']:.3f}x"])
  harness.print_table("lazy_open.py: ratios (time of pz_persist / time of the other; < 1 is faster)",
                      ["ratio", "fresh", "warm"], ratios)


if __name__ == "__main__":
  main()
