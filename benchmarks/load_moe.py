"""Loading a mixture of experts: `load_hf` against reading its safetensors alone.

Usage::

  python benchmarks/load_moe.py [--experts 128] [--layers 48] [--hidden 64]
      [--neurons 32] [--shards 4] [--repeats 3] [--dir /tmp/bench] [--json out.json]

The benchmark writes its own Qwen3-MoE checkpoint with the ``safetensors``
library, laid out as the Hub's are: one tensor per expert and projection
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``), so 128 experts x 48
layers is 18,432 expert tensors at a tiny width, where the per-tensor work
of a loader, not the bytes, is what costs. Then, each in a fresh process
after a warm-up on a tiny checkpoint (``harness.py``), and ``--repeats``
times in that process (the first call is a fresh process's, the best of
the others a warm one's):

* ``safetensors_numpy``: ``safetensors.numpy.load_file`` of every file (every
  tensor as a NumPy array: what any loader must at least do);
* ``safe_open``: ``safetensors.safe_open(framework="numpy")`` and
  ``get_tensor`` of each tensor;
* ``load_hf``: `pz_persist.pretrained.load_hf`, which stacks each layer's
  experts into one parameter per projection (a ``weights.stacked`` view: one
  buffer, each expert read into its slice) and builds the Penzai model;
* the floors, parts of ``load_hf`` timed alone (each bounds it from below):
  ``headers`` (every header parsed and validated), ``skeleton`` (the Penzai
  model built from the plan, no reads), ``bind`` (the parameters bound into
  it).

Printed: time and peak RSS above the process's baseline for each (fresh and
warm), ``load_hf``'s ratio to each reader alone (the target is at most
1.5x ``safetensors.numpy.load_file``) and the sum of reading and the floors.
"""

from __future__ import annotations

import argparse
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

OPS = ("safetensors_numpy", "safe_open", "headers", "skeleton", "bind", "load_hf")
FLOORS = ("headers", "skeleton", "bind")
"""Parts of ``load_hf`` measured alone: each bounds it from below."""
TARGET = 1.5
"""``load_hf`` within this factor of ``safetensors.numpy.load_file`` (issue 28)."""


def moe_config(experts: int, layers: int, hidden: int, neurons: int) -> dict:
  """A Qwen3-MoE config (every layer routed, top 8 of ``experts``)."""
  return {
      "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
      "hidden_size": hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
      "head_dim": hidden // 4, "num_hidden_layers": layers, "vocab_size": 256,
      "intermediate_size": 4 * hidden, "moe_intermediate_size": neurons,
      "num_experts": experts, "num_experts_per_tok": min(8, experts), "norm_topk_prob": True,
      "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
      "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
      "use_sliding_window": False, "torch_dtype": "bfloat16",
  }


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
  h, n, v = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["vocab_size"]
  d = cfg["head_dim"]
  q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
  shapes = [("model.embed_tokens.weight", (v, h))]
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    shapes += [
        (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
        (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
        (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
        (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
        (p + "mlp.gate.weight", (cfg["num_experts"], h)),
    ]
    for e in range(cfg["num_experts"]):
      shapes += [(f"{p}mlp.experts.{e}.gate_proj.weight", (n, h)),
                 (f"{p}mlp.experts.{e}.up_proj.weight", (n, h)),
                 (f"{p}mlp.experts.{e}.down_proj.weight", (h, n))]
  return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def write_moe(path: str, *, experts: int, layers: int, hidden: int, neurons: int,
              shards: int = 4, seed: int = 0) -> tuple[int, int]:
  """Writes the checkpoint folder (bfloat16); returns (tensor bytes, tensor count)."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  cfg = moe_config(experts, layers, hidden, neurons)
  shapes = tensor_shapes(cfg)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f, indent=1)
  rng = np.random.default_rng(seed)
  per_shard = -(-len(shapes) // shards)
  weight_map, total = {}, 0
  for index in range(shards):
    group = shapes[index * per_shard:(index + 1) * per_shard]
    file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
    tensors = {}
    for name, shape in group:
      scale = 1.0 if "norm" in name else 0.02
      tensors[name] = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(
          ml_dtypes.bfloat16)
      total += tensors[name].nbytes
      weight_map[name] = file
    save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
  return total, len(shapes)


def _files(src: str) -> list[str]:
  return [os.path.join(src, f) for f in sorted(os.listdir(src)) if f.endswith(".safetensors")]


def operation(op: str, src: str):
  """The measured operation, as a function of no arguments."""
  if op == "safetensors_numpy":
    import safetensors.numpy  # pylint: disable=import-outside-toplevel
    return lambda: [safetensors.numpy.load_file(f) for f in _files(src)]
  if op == "safe_open":
    from safetensors import safe_open  # pylint: disable=import-outside-toplevel

    def run():
      out = {}
      for file in _files(src):
        with safe_open(file, framework="numpy") as f:
          for name in f.keys():  # noqa: SIM118  (safe_open is no mapping)
            out[name] = f.get_tensor(name)
      return out
    return run
  if op in FLOORS:
    return _floor(op, src)
  if op == "load_hf":
    import jax  # pylint: disable=import-outside-toplevel
    from penzai import pz  # pylint: disable=import-outside-toplevel

    from pz_persist.pretrained import hf  # pylint: disable=import-outside-toplevel

    def run():
      model = hf.load_hf(src, progress=False)
      jax.block_until_ready([p.value for p in pz.unbind_params(model)[1]])
    return run
  raise ValueError(op)


def _floor(op: str, src: str):
  """One part of ``load_hf`` alone, with what it needs prepared untimed:

  * ``headers``: every safetensors file opened, its header parsed and
    validated (what ``load_hf`` does before any read), and closed;
  * ``skeleton``: the Penzai model built from the plan, with no reads
    (config and headers already checked);
  * ``bind``: the loaded parameters bound into that skeleton.
  """
  # pylint: disable=import-outside-toplevel
  from pz_persist.pretrained import safetensors_io
  from pz_persist.pretrained.hf import families
  from pz_persist.pretrained.hf import load as hf_load
  from pz_persist.pretrained.hf.config import Config
  from pz_persist.pretrained.hf.weights import Weights

  if op == "headers":
    def run():
      for file in _files(src):
        safetensors_io.SafetensorsFile(file).close()
    return run
  with open(os.path.join(src, "config.json")) as f:
    raw = json.load(f)
  where = os.path.join(src, "config.json")
  with Weights(src, None, []) as weights:
    cfg = Config(raw, where, families.FAMILY_OF[raw["model_type"]].fields)
    plan = families.MODEL_TYPES[raw["model_type"]].plan(cfg, weights)
    weights.add_views(plan.views)
  if op == "skeleton":
    return plan.build
  from penzai import pz
  skeleton = plan.build()
  params = pz.unbind_params(hf_load.load_hf(src, progress=False))[1]
  bind = getattr(hf_load, "_bind", None)
  if bind is None:  # Before load_hf bound in one pass (to measure older versions).
    def bind(skeleton, params):
      pz.nn.assert_no_parameter_slots(model := pz.bind_variables(skeleton, params))
      return model
  return lambda: bind(skeleton, params)


def worker(op: str, src: str, repeats: int) -> dict:
  """Runs one operation in this (fresh) process: a warm-up on a tiny
  checkpoint, then ``repeats`` timed calls (the first with its peak RSS)."""
  with tempfile.TemporaryDirectory() as directory:
    tiny = os.path.join(directory, "tiny")
    write_moe(tiny, experts=4, layers=2, hidden=16, neurons=8, shards=1)
    operation(op, tiny)()
  run = operation(op, src)
  first = harness.measure(run)
  warm = harness.timed_runs(run, max(0, repeats - 1))
  return {**first, "fresh": first["seconds"], "warm": min(warm) if warm else first["seconds"]}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--experts", type=int, default=128)
  parser.add_argument("--layers", type=int, default=48)
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--neurons", type=int, default=32)
  parser.add_argument("--shards", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=3,
                      help="calls per fresh process: the first is fresh, the best other warm")
  parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
  parser.add_argument("--json", default=None, help="write the results here too")
  parser.add_argument("--worker", nargs=3, metavar=("OP", "SRC", "REPEATS"),
                      help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    op, src, repeats = args.worker
    print(json.dumps(worker(op, src, int(repeats))))
    return {}

  directory = args.dir or tempfile.mkdtemp(prefix="pz_persist_bench_moe_")
  src = os.path.join(directory, "hf_moe")
  shutil.rmtree(src, ignore_errors=True)
  model_bytes, count = write_moe(src, experts=args.experts, layers=args.layers,
                                 hidden=args.hidden, neurons=args.neurons, shards=args.shards)
  print(f"# MoE load benchmark, {time.strftime('%Y-%m-%d %H:%M')}")
  print(harness.machine_description())
  print(f"checkpoint: Qwen3-MoE, {args.layers} layers x {args.experts} experts, hidden"
        f" {args.hidden}, expert width {args.neurons}: {count} tensors,"
        f" {harness.format_size(model_bytes)} bfloat16 in {args.shards} safetensors files\n")
  results: dict = {"model_bytes": model_bytes, "tensors": count, "ops": {}}
  for op in OPS:
    os.sync()
    results["ops"][op] = harness.run_worker(__file__, ["--worker", op, src, str(args.repeats)])
  report(results)
  return harness.finish(results, json_path=args.json, directory=None if args.dir else directory)


NAMES = {
    "safetensors_numpy": "`safetensors.numpy.load_file` (arrays only)",
    "safe_open": "`safetensors.safe_open` + `get_tensor` each (arrays only)",
    "load_hf": "`pzp.pretrained.load_hf` (the Penzai model, experts stacked)",
    "headers": "floor: headers parsed and validated alone (no reads)",
    "skeleton": "floor: the Penzai skeleton built alone (no reads)",
    "bind": "floor: the parameters bound into the skeleton alone",
}


def report(results: dict) -> None:
  ops = results["ops"]
  harness.print_table(
      f"Loading {results['tensors']} tensors ({harness.format_size(results['model_bytes'])})"
      " of a mixture of experts (fresh: first call in a new process, after a warm-up;"
      " warm: best later call)",
      ["operation", "fresh", "warm", "peak RSS above baseline"],
      [[NAMES[op], f"{e['fresh']:.3f} s", f"{e['warm']:.3f} s",
        harness.format_size(e["extra_rss"])] for op, e in ops.items()])
  load = ops["load_hf"]
  rows = []
  for reader in ("safetensors_numpy", "safe_open"):
    for kind in ("fresh", "warm"):
      ratio = load[kind] / ops[reader][kind]
      results[f"ratio_{reader}_{kind}"] = ratio
      rows.append((f"load_hf / {reader} ({kind})", ratio, TARGET, False, "x"))
  harness.print_targets("load_hf against reading the safetensors alone", rows)
  for kind in ("fresh", "warm"):
    floor = ops["safetensors_numpy"][kind] + sum(ops[op][kind] for op in FLOORS)
    results[f"floor_{kind}"] = floor
    print(f"sum of the floors ({kind}): reading + headers + skeleton + bind = {floor:.3f} s,"
          f" {floor / ops['safetensors_numpy'][kind]:.2f}x reading alone; load_hf is"
          f" {load[kind] / floor:.2f}x that sum")


if __name__ == "__main__":
  main()
