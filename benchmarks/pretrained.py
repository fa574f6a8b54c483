"""Pretrained weights: converting a Hugging Face checkpoint vs reloading it natively.

Usage::

  python benchmarks/pretrained.py --size 1GiB [--dtype float32] [--shards 4] [--dir /tmp/bench]
      [--rope-scaling llama3] [--ops fresh_memory,load_hf]

The benchmark writes its own Llama-shaped Hugging Face checkpoint with the
``safetensors`` library (``config.json`` with ``model_type: llama``, tensors
named ``model.layers.{i}.self_attn.q_proj.weight`` etc., random weights
totalling ``--size`` bytes, split into ``--shards`` files plus
``model.safetensors.index.json``; with ``--rope-scaling llama3``, Llama 3.x's
RoPE: ``rope_theta`` 500000 and Llama 3.2's ``rope_scaling``, which `load_hf`
builds with `pz_persist.nn.scaled_rope.ApplyScaledRoPE`), then measures, each in a fresh process
(see ``harness.py``):

* ``load_hf``: `pz_persist.pretrained.load_hf` (safetensors only, no torch);
* ``convert``: ``pz-persist convert hf SRC DST`` (``load_hf`` + ``save_model``);
* ``reload``: `pz_persist.load_model` of the converted checkpoint;
* ``torch``: Penzai's own path, ``llama_from_huggingface_model(
  LlamaForCausalLM.from_pretrained(SRC))``, when torch and transformers are
  importable (not with ``--rope-scaling``: Penzai's converter has no scaled RoPE);
* ``fresh_memory``: only the allocation of new, populated memory for every
  tensor (no reading): the least any loader that copies into new memory
  pays, and on virtual machines most of what a warm load costs;
* for a float32 checkpoint, the commonest reason to convert once: loading in
  bfloat16. ``load_hf_bf16`` is ``load_hf(SRC, dtype=bfloat16)``,
  ``convert_bf16`` is ``convert --dtype bfloat16`` and ``reload_bf16`` reloads
  that.

Printed: time and peak RSS above the process's baseline for each, the native
reload's speedup over ``load_hf`` (same dtype, and bfloat16), what the
``fresh_memory`` floor leaves possible, and each path's peak RSS / model bytes.
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

OPS = ("fresh_memory", "load_hf", "convert", "reload", "load_hf_bf16", "convert_bf16",
       "reload_bf16", "torch")
_BF16_OPS = ("load_hf_bf16", "convert_bf16", "reload_bf16")

ROPE_SCALINGS = {
    "llama3": {
        "rope_theta": 500_000.0, "max_position_embeddings": 131_072,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
}
"""``--rope-scaling`` choices: the config fields they set (Llama 3.2's)."""


def llama_config(target_bytes: int, itemsize: int) -> dict:
  """A Llama config (GQA, untied head) whose weights total about ``target_bytes``.

  Widths scale with the size, so tiny smoke runs stay tiny and 1 GiB has
  realistic proportions (hidden 2048, 4 query heads per KV head).
  """
  hidden = 2048 if target_bytes >= 2**28 else 64
  heads, kv_heads = (16, 4) if hidden >= 2048 else (4, 2)
  head_dim = hidden // heads
  intermediate = int(hidden * 8 / 3) // 64 * 64 or 64
  vocab = 32_000 if hidden >= 2048 else 256
  per_layer = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate + 2 * hidden
  fixed = 2 * vocab * hidden + hidden
  layers = max(1, -(-(target_bytes // itemsize - fixed) // per_layer))
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "hidden_size": hidden, "intermediate_size": intermediate,
      "num_attention_heads": heads, "num_key_value_heads": kv_heads,
      "num_hidden_layers": int(layers), "vocab_size": vocab, "hidden_act": "silu",
      "rms_norm_eps": 1e-5, "rope_theta": 10_000.0, "max_position_embeddings": 2048,
      "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
      "bos_token_id": 1, "eos_token_id": 2,
  }


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
  """Hugging Face names and (out, in) shapes of a Llama checkpoint."""
  h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
  kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
  shapes = [("model.embed_tokens.weight", (v, h))]
  for n in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{n}"
    shapes += [
        (f"{p}.input_layernorm.weight", (h,)),
        (f"{p}.self_attn.q_proj.weight", (h, h)),
        (f"{p}.self_attn.k_proj.weight", (kv, h)),
        (f"{p}.self_attn.v_proj.weight", (kv, h)),
        (f"{p}.self_attn.o_proj.weight", (h, h)),
        (f"{p}.post_attention_layernorm.weight", (h,)),
        (f"{p}.mlp.gate_proj.weight", (i, h)),
        (f"{p}.mlp.up_proj.weight", (i, h)),
        (f"{p}.mlp.down_proj.weight", (h, i)),
    ]
  return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def write_llama(path: str, target_bytes: int, *, dtype: str = "float32", shards: int = 4,
                seed: int = 0, rope_scaling: str | None = None) -> int:
  """Writes a Llama-shaped safetensors checkpoint folder; returns its tensor bytes.

  One shard is built at a time, so writing needs about one shard of memory.
  """
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  np_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
  cfg = dict(llama_config(target_bytes, np_dtype.itemsize), torch_dtype=dtype,
             **ROPE_SCALINGS.get(rope_scaling or "", {}))
  shapes = tensor_shapes(cfg)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f, indent=1)
  total = sum(int(np.prod(s)) for _, s in shapes) * np_dtype.itemsize
  per_shard = -(-total // shards)
  rng = np.random.default_rng(seed)
  groups, current, size = [], [], 0
  for name, shape in shapes:
    current.append((name, shape))
    size += int(np.prod(shape)) * np_dtype.itemsize
    if size >= per_shard:
      groups.append(current)
      current, size = [], 0
  if current:
    groups.append(current)
  weight_map = {}
  for index, group in enumerate(groups):
    file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
    tensors = {}
    for name, shape in group:
      scale = 1.0 if name.endswith("layernorm.weight") or name == "model.norm.weight" else 0.02
      tensors[name] = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np_dtype)
      weight_map[name] = file
    save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
    del tensors
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
  return total


def _block(model) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  from penzai import pz  # pylint: disable=import-outside-toplevel

  jax.block_until_ready([p.value for p in pz.unbind_params(model)[1]])


def _rope_scaling_of(src: str) -> str | None:
  with open(os.path.join(src, "config.json")) as f:
    return (json.load(f).get("rope_scaling") or {}).get("rope_type")


def _warm_up(op: str, rope_scaling: str | None = None) -> None:
  """Loads a tiny checkpoint (of the same RoPE) first, so one-time start-up
  (JAX backend, imports, TensorStore) is not charged to the measured operation."""
  with tempfile.TemporaryDirectory() as directory:
    src = os.path.join(directory, "hf")
    write_llama(src, 2**16, shards=1, rope_scaling=rope_scaling)
    operation(op, src, os.path.join(directory, "native"), warm_up=True)()


def operation(op: str, src: str, dst: str, warm_up: bool = False):
  """The measured operation, as a function of no arguments."""
  if op == "fresh_memory":
    from pz_persist.pretrained import safetensors_io  # pylint: disable=import-outside-toplevel
    from pz_persist.storage.reading import host_memory

    files = [os.path.join(src, f) for f in sorted(os.listdir(src)) if f.endswith(".safetensors")]
    tensors = [entry for f in files for entry in safetensors_io.SafetensorsFile(f).entries.values()]
    return lambda: [host_memory.aligned_empty(shape, dtype) for dtype, shape, _, _ in tensors]
  cast = ["--dtype", "bfloat16"] if op in _BF16_OPS else []
  if cast:
    op, dst = op.removesuffix("_bf16"), dst + "_bf16"
  if op == "load_hf":
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    from pz_persist.pretrained import hf  # pylint: disable=import-outside-toplevel
    dtype = jnp.bfloat16 if cast else None
    return lambda: _block(hf.load_hf(src, dtype=dtype))
  if op == "convert":
    from pz_persist.tools import cli

    def run():
      if cli.main(["convert", "hf", src, dst, "--overwrite", "--quiet", *cast]) != 0:
        raise RuntimeError("pz-persist convert failed")
    return run
  if op == "reload":
    import pz_persist as pzp  # pylint: disable=import-outside-toplevel
    if warm_up:
      operation("convert_bf16" if cast else "convert", src, dst.removesuffix("_bf16"))()
    return lambda: _block(pzp.load_model(dst))
  if op == "torch":
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    from penzai.models.transformer.variants import llama  # pylint: disable=import-outside-toplevel

    def run():
      hf_model = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
      # Penzai 0.2.5 refuses config attributes newer transformers record on
      # load (dtype, _name_or_path) though they change no math, and reads
      # rope_theta, which transformers 5 moved into rope_parameters.
      reference = transformers.LlamaConfig().to_dict()
      for key in ("dtype", "torch_dtype", "_name_or_path"):
        if key in reference:
          setattr(hf_model.config, key, reference[key])
      if not hasattr(hf_model.config, "rope_theta"):  # transformers >= 5.
        hf_model.config.rope_theta = hf_model.config.rope_parameters["rope_theta"]
      _block(llama.llama_from_huggingface_model(hf_model))
    return run
  raise ValueError(op)


def worker(op: str, src: str, dst: str) -> dict:
  """Runs one measured operation in this (fresh) process."""
  _warm_up(op, _rope_scaling_of(src))
  return harness.measure(operation(op, src, dst))


def torch_available() -> bool:
  import importlib.util  # pylint: disable=import-outside-toplevel
  return all(importlib.util.find_spec(m) for m in ("torch", "transformers"))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="1GiB")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--shards", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=1, help="best of N per operation")
  parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
  parser.add_argument("--ops", default=",".join(OPS),
                      help=f"comma-separated, among {','.join(OPS)} (default: all)")
  parser.add_argument("--rope-scaling", default=None, choices=sorted(ROPE_SCALINGS),
                      help="write a Llama 3.x checkpoint: rope_theta 500000 and this rope_scaling")
  parser.add_argument("--json", default=None, help="write the results here too")
  parser.add_argument("--worker", nargs=3, metavar=("OP", "SRC", "DST"), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)

  if args.worker:
    print(json.dumps(worker(*args.worker)))
    return {}

  target = harness.parse_size(args.size)
  ops = [
      op for op in args.ops.split(",")
      if op and (op != "torch" or (torch_available() and not args.rope_scaling))
      and (op not in _BF16_OPS or args.dtype == "float32")
  ]
  directory = args.dir or tempfile.mkdtemp(prefix="pz_persist_bench_")
  src, dst = os.path.join(directory, "hf_llama"), os.path.join(directory, "native")
  shutil.rmtree(src, ignore_errors=True)
  model_bytes = write_llama(src, target, dtype=args.dtype, shards=args.shards,
                            rope_scaling=args.rope_scaling)
  with open(os.path.join(src, "config.json")) as f:
    cfg = json.load(f)
  print(f"# pretrained benchmark, {time.strftime('%Y-%m-%d %H:%M')}")
  print(harness.machine_description())
  rope = f", {args.rope_scaling} rope_scaling" if args.rope_scaling else ""
  print(f"checkpoint: Llama-shaped{rope}, {cfg['num_hidden_layers']} layers, hidden"
        f" {cfg['hidden_size']}, {harness.format_size(model_bytes)} {args.dtype} in"
        f" {len(os.listdir(src)) - 2} safetensors files; best of {args.repeats}\n")

  results = {"model_bytes": model_bytes, "rope_scaling": args.rope_scaling, "ops": {}}
  order = [op for op in OPS if op in ops]
  for reload, convert in (("reload", "convert"), ("reload_bf16", "convert_bf16")):
    if reload in order and convert not in order:
      order.insert(order.index(reload), convert)
  for op in order:
    runs = []
    for _ in range(args.repeats):
      os.sync()
      runs.append(harness.run_worker(__file__, ["--worker", op, src, dst]))
    results["ops"][op] = min(runs, key=lambda r: r["seconds"])
  report(results)
  return harness.finish(results, json_path=args.json, directory=None if args.dir else directory)


NAMES = {
    "load_hf": "`pzp.pretrained.load_hf` (safetensors)",
    "convert": "`pz-persist convert hf` (load_hf + save_model)",
    "reload": "`pzp.load_model` of the converted checkpoint",
    "torch": "Penzai's converter on `LlamaForCausalLM.from_pretrained`",
    "fresh_memory": "new populated memory for every tensor, no reading (floor)",
    "load_hf_bf16": "`load_hf(dtype=bfloat16)`",
    "convert_bf16": "`pz-persist convert hf --dtype bfloat16`",
    "reload_bf16": "`pzp.load_model` of the bfloat16 conversion",
}


def report(results: dict) -> None:
  model_bytes, ops = results["model_bytes"], results["ops"]

  def loaded_bytes(op: str) -> int:
    """The bytes of the model ``op`` builds (half for a bfloat16 load of float32)."""
    return model_bytes // 2 if op in _BF16_OPS else model_bytes

  rows = []
  for op, entry in ops.items():
    rows.append([NAMES[op], f"{entry['seconds']:.2f} s",
                 f"{model_bytes / entry['seconds'] / 2**20:.0f} MiB/s",
                 harness.format_size(entry["extra_rss"]),
                 f"{entry['extra_rss'] / loaded_bytes(op):.2f}x"])
  harness.print_table(
      f"Loading {harness.format_size(model_bytes)} of pretrained weights"
      " (throughput: checkpoint bytes per second; RSS: against the model built)",
      ["operation", "time", "throughput", "peak RSS above baseline", "peak RSS / model bytes"],
      rows,
  )
  if "load_hf" in ops and "reload" in ops:
    speedup = ops["load_hf"]["seconds"] / ops["reload"]["seconds"]
    results["reload_speedup"] = speedup
    print(f"native reload speedup over load_hf: {speedup:.2f}x (target >= 3x)")
  if "load_hf" in ops and "fresh_memory" in ops:
    needed = ops["load_hf"]["seconds"] / 3
    floor = ops["fresh_memory"]["seconds"]
    results["floor_over_3x_target"] = floor / needed
    print(f"a 3x reload would take {needed:.2f} s; only allocating fresh memory for the"
          f" model takes {floor:.2f} s ({floor / needed:.2f}x that), and load_hf is"
          f" {ops['load_hf']['seconds'] / floor:.2f}x this floor")
  if "load_hf_bf16" in ops and "reload_bf16" in ops:
    speedup = ops["load_hf_bf16"]["seconds"] / ops["reload_bf16"]["seconds"]
    results["reload_bf16_speedup"] = speedup
    print(f"converted once to bfloat16, reload speedup over load_hf(dtype=bfloat16): {speedup:.2f}x")
  for op in ("load_hf", "reload", "load_hf_bf16", "reload_bf16"):
    if op in ops:
      ratio = ops[op]["extra_rss"] / loaded_bytes(op)
      results[f"{op}_rss_ratio"] = ratio
      print(f"{op}: peak RSS / model bytes {ratio:.2f}x (target <= 1.3x)")
  if "torch" in ops and "load_hf" in ops:
    print(f"load_hf speedup over the torch path: {ops['torch']['seconds'] / ops['load_hf']['seconds']:.2f}x")


if __name__ == "__main__":
  main()
