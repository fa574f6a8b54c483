"""Gemma 3 checkpoints written by the ``gemma`` library (``gm.ckpts.save_params``:
an Orbax checkpoint of the Flax params, nested as ``model.init`` makes them)
into the Penzai model `load_hf` builds for Gemma 3.

Penzai has no Gemma 3, so `pz_persist.pretrained.load_gemma` hands such a
checkpoint here: each array is laid out as Hugging Face stores it (the
library's einsum weights ``q_einsum`` ``[heads, embed, head_dim]``,
``kv_einsum`` ``[2, kv_heads, embed, head_dim]`` or ``qkv_einsum``
``[3, heads, embed, head_dim]``, ``attn_vec_einsum`` ``[heads, head_dim,
embed]``, ``gating_einsum`` ``[2, hidden, embed]``, ``linear`` ``[hidden,
embed]``; norms hold the same ``w`` used as ``1 + w``), and the Gemma 3
plan of `pz_persist.pretrained.hf.families.gemma3` builds and fills the
model, so both loaders give the same structure and `export_hf` writes either.

The arrays show the sizes; what they do not show (window, RoPE bases, the
global layers' scaling, query scaling) comes from the library's Gemma 3
configs, recognised by layer count and width, or ``preset={"like": ...}``
with overrides. The vision encoder's arrays are not used, and the load says
so.
"""

from __future__ import annotations

import logging
import re
import typing
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from penzai import pz

from pz_persist import sharding as sharding_lib
from pz_persist.pretrained import errors
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.families import gemma3
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import penzai_layout
from pz_persist.pretrained.hf.weights import Weights

_log = logging.getLogger("pz_persist.pretrained.gemma")

PRESETS: dict[str, dict[str, Any]] = {
    # The gemma library's Gemma 3 configs: (layers, width) identify them.
    "gemma3_270m": {"layers": 18, "embed_dim": 640, "sliding_window_size": 512,
                    "global_scale_factor": 1.0},
    "gemma3_1b": {"layers": 26, "embed_dim": 1152, "sliding_window_size": 512,
                  "global_scale_factor": 1.0},
    "gemma3_4b": {"layers": 34, "embed_dim": 2560, "sliding_window_size": 1024,
                  "global_scale_factor": 8.0},
    "gemma3_12b": {"layers": 48, "embed_dim": 3840, "sliding_window_size": 1024,
                   "global_scale_factor": 8.0},
    # Queries scaled by (embed_dim / heads) ** -0.5 = 168 ** -0.5, not head_dim's.
    "gemma3_27b": {"layers": 62, "embed_dim": 5376, "sliding_window_size": 1024,
                   "global_scale_factor": 8.0, "query_pre_attn_scalar": 168},
}
"""Gemma 3's settings by the library's model name (all: RoPE bases 10 000
local and 1 000 000 global, five local layers then one global)."""

_SETTINGS = ("sliding_window_size", "global_scale_factor", "query_pre_attn_scalar",
             "local_base_frequency", "global_base_frequency")
_BLOCK = re.compile(r"transformer/layer_(\d{1,6})/(.+)")
_BLOCK_KEYS = {  # The library's names in a Gemma 3 block -> their leaf.
    "pre_attention_norm": "scale", "post_attention_norm": "scale", "pre_ffw_norm": "scale",
    "post_ffw_norm": "scale", "attn/_query_norm": "scale", "attn/_key_norm": "scale",
    "attn/attn_vec_einsum": "w", "mlp/gating_einsum": "w", "mlp/linear": "w",
}
_VISION = ("transformer/vision_encoder", "transformer/embedder/mm_")


def is_gemma3(stored: Mapping[str, Mapping[str, Any]]) -> bool:
  """Whether the flattened tree has Gemma 3's query norms (a later Gemma's
  own arrays are refused by `load`)."""
  return "transformer/layer_0/attn/_query_norm" in stored


def _refuse_others(stored: Mapping[str, Mapping[str, Any]], path: Any) -> int:
  """Refuses arrays Gemma 3 does not have (a later Gemma, or a damaged
  tree); returns the number of vision arrays (not read into the model)."""
  vision = 0
  for key, leaves in stored.items():
    if key.startswith(_VISION):
      vision += len(leaves)
      continue
    block = _BLOCK.fullmatch(key)
    expected = (_BLOCK_KEYS.get(block.group(2)) if block else
                {"transformer/embedder": "input_embedding",
                 "transformer/final_norm": "scale"}.get(key))
    if block and block.group(2) in ("attn/q_einsum", "attn/kv_einsum", "attn/qkv_einsum"):
      expected = "w"
    if expected is None or set(leaves) != {expected}:
      raise errors.GemmaCheckpointError(
          f"{path}: {key!r} ({sorted(leaves)}) is not part of a Gemma 3 checkpoint; this"
          " looks like a later Gemma (3n, 4...), whose architecture pz_persist does not build.")
  layers = {m.group(1) for key in stored if (m := _BLOCK.fullmatch(key))}
  for i in range(len(layers)):
    p = f"transformer/layer_{i}/"
    needed = [p + name for name in _BLOCK_KEYS] + ["transformer/embedder", "transformer/final_norm"]
    needed += [p + "attn/qkv_einsum"] if p + "attn/qkv_einsum" in stored else [
        p + "attn/q_einsum", p + "attn/kv_einsum"]
    missing = [key for key in needed if key not in stored]
    if missing:
      raise errors.GemmaCheckpointError(
          f"{path} has Gemma 3's query norms but not {missing[0]!r} (layers"
          f" {sorted(layers, key=int)[:8]}...): it is not a complete Gemma 3 checkpoint.")
  return vision


def _settings(preset: Any, layers: int, embed: int, head_dim: int, heads: int,
              path: Any) -> tuple[str, dict[str, Any], set[str]]:
  """The settings the arrays do not show: the library's config of that size,
  or ``preset={"like": name, <setting>: value...}``; with the name followed
  and the settings the caller gave."""
  if preset == "auto":
    named = [n for n, p in PRESETS.items() if (p["layers"], p["embed_dim"]) == (layers, embed)]
    if not named:
      raise errors.GemmaCheckpointError(
          f"{path}: a Gemma 3 checkpoint of {layers} layers of width {embed} matches none of"
          f" {sorted(PRESETS)}; pass preset={{'like': name, ...}} (settings: {_SETTINGS}).")
    preset = {"like": named[0]}
  if not isinstance(preset, Mapping) or preset.get("like") not in PRESETS:
    raise errors.GemmaCheckpointError(
        f"{path} is a Gemma 3 checkpoint: preset must be 'auto' or {{'like': one of"
        f" {sorted(PRESETS)}, <setting>: value}} (settings: {_SETTINGS}), not {preset!r:.120}.")
  unknown = sorted(set(preset) - {"like", *_SETTINGS})
  if unknown:
    raise errors.GemmaCheckpointError(
        f"{path}: preset settings {unknown} are not Gemma 3's; known: {list(_SETTINGS)}.")
  like = PRESETS[preset["like"]]
  chosen = {"local_base_frequency": 10_000.0, "global_base_frequency": 1_000_000.0,
            "query_pre_attn_scalar": head_dim, **like, **preset}
  if preset["like"] == "gemma3_27b" and "query_pre_attn_scalar" not in preset:
    chosen["query_pre_attn_scalar"] = embed // heads
  from_like = sorted(k for k in _SETTINGS if k not in preset)
  _log.warning("%s: Gemma 3 settings from %s: %s", path, preset["like"],
               ", ".join(f"{k}={chosen[k]}" for k in from_like))
  return preset["like"], {k: chosen[k] for k in _SETTINGS}, set(preset) - {"like"}


def _hf_arrays(params: Mapping[str, Mapping[str, np.ndarray]], layers: int
               ) -> dict[str, np.ndarray]:
  """The arrays under Hugging Face's names and layouts."""
  out = {"model.embed_tokens.weight": params["transformer/embedder"]["input_embedding"],
         "model.norm.weight": params["transformer/final_norm"]["scale"]}
  for i in range(layers):
    p, s = f"transformer/layer_{i}/", f"model.layers.{i}."

    def flat(rows: np.ndarray) -> np.ndarray:  # [heads, embed, head_dim] -> [heads*head_dim, embed]
      return rows.transpose(0, 2, 1).reshape(-1, rows.shape[1])

    if p + "attn/qkv_einsum" in params:
      q, k, v = params[p + "attn/qkv_einsum"]["w"]
    else:
      q = params[p + "attn/q_einsum"]["w"]
      k, v = params[p + "attn/kv_einsum"]["w"]
    out_proj = params[p + "attn/attn_vec_einsum"]["w"]  # [heads, head_dim, embed]
    gate, up = params[p + "mlp/gating_einsum"]["w"]  # [2, hidden, embed]
    out.update({
        s + "self_attn.q_proj.weight": flat(q),
        s + "self_attn.k_proj.weight": flat(k),
        s + "self_attn.v_proj.weight": flat(v),
        s + "self_attn.o_proj.weight": out_proj.reshape(-1, out_proj.shape[-1]).T,
        s + "self_attn.q_norm.weight": params[p + "attn/_query_norm"]["scale"],
        s + "self_attn.k_norm.weight": params[p + "attn/_key_norm"]["scale"],
        s + "mlp.gate_proj.weight": gate,
        s + "mlp.up_proj.weight": up,
        s + "mlp.down_proj.weight": params[p + "mlp/linear"]["w"].T,
        s + "input_layernorm.weight": params[p + "pre_attention_norm"]["scale"],
        s + "post_attention_layernorm.weight": params[p + "post_attention_norm"]["scale"],
        s + "pre_feedforward_layernorm.weight": params[p + "pre_ffw_norm"]["scale"],
        s + "post_feedforward_layernorm.weight": params[p + "post_ffw_norm"]["scale"],
    })
  return out


class _Arrays:
  """Stands in for `pz_persist.pretrained.hf.weights.Weights` (names, dtype)."""

  def __init__(self, path: Any, arrays: Mapping[str, np.ndarray], dtype: np.dtype):
    self.path, self.names, self.dtype = str(path), set(arrays), dtype


def config_of(stored: Mapping[str, Mapping[str, Any]], preset: Any, path: Any
              ) -> tuple[dict[str, Any], int, str, dict[str, tuple[Any, str]]]:
  """The Hugging Face ``config.json`` of the checkpoint (``gemma3_text``)
  from its arrays' shapes and the settings; its vision array count; the
  preset followed; each setting with its source (for `GemmaReport`)."""
  vision = _refuse_others(stored, path)
  layers = len({m.group(1) for key in stored if (m := _BLOCK.fullmatch(key))})
  vocab, embed = stored["transformer/embedder"]["input_embedding"].shape
  first = "transformer/layer_0/attn/"
  if first + "qkv_einsum" in stored:
    _, heads, _, head_dim = stored[first + "qkv_einsum"]["w"].shape
    kv_heads = heads
  else:
    heads, _, head_dim = stored[first + "q_einsum"]["w"].shape
    kv_heads = stored[first + "kv_einsum"]["w"].shape[1]
  hidden = stored["transformer/layer_0/mlp/linear"]["w"].shape[0]
  name, settings, given = _settings(preset, layers, embed, head_dim, heads, path)
  scale = float(settings["global_scale_factor"])
  full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(settings["global_base_frequency"])}
  if scale != 1.0:
    full.update(rope_type="linear", factor=scale)
  config = {
      "model_type": "gemma3_text", "vocab_size": int(vocab), "hidden_size": int(embed),
      "intermediate_size": int(hidden), "num_hidden_layers": layers,
      "num_attention_heads": int(heads), "num_key_value_heads": int(kv_heads),
      "head_dim": int(head_dim), "query_pre_attn_scalar": settings["query_pre_attn_scalar"],
      "sliding_window": int(settings["sliding_window_size"]),
      "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                      for i in range(layers)],
      "rope_parameters": {"sliding_attention": {
          "rope_type": "default", "rope_theta": float(settings["local_base_frequency"])},
          "full_attention": full},
      "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
      "tie_word_embeddings": True,
  }
  sources = {key: (config[key], "checkpoint") for key in (
      "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
      "num_attention_heads", "num_key_value_heads", "head_dim")}
  sources.update({k: (v, "caller" if k in given else "preset") for k, v in settings.items()})
  return config, vision, name, sources


def load(path: Any, params: Mapping[str, Mapping[str, np.ndarray]], config: dict[str, Any],
         vision: int, sharding: sharding_lib.Target, tracker: Any) -> Any:
  """The model, from the arrays `load_gemma` read (``params``) and
  `config_of`'s config; ``tracker`` advances by the bytes placed."""
  if vision:
    _log.warning("%s: %d arrays of the vision encoder are not used: the model is Gemma 3's"
                 " text model.", path, vision)
  arrays = _hf_arrays(params, config["num_hidden_layers"])
  return bind_plan(path, arrays, lambda standin: gemma3.gemma3_text_plan(
      Config(config, f"{path} (Gemma 3 settings)", gemma3.RECORD.fields,
             gemma3.RECORD.model_types["gemma3_text"].defaults), standin),
      sharding, tracker)


def bind_plan(path: Any, arrays: Mapping[str, np.ndarray],
              plan_of: Callable[[Weights], Plan], sharding: sharding_lib.Target,
              tracker: Any) -> Any:
  """The model of the plan ``plan_of`` makes for ``arrays`` (Hugging Face's
  names and layouts), each parameter placed as ``sharding`` says; shared by
  the gemma library's Gemma 3 and Gemma 4 loaders."""
  dtype = np.dtype(arrays["model.embed_tokens.weight"].dtype)
  standin = typing.cast(Weights, _Arrays(path, arrays, dtype))  # Names and dtype: all it reads.
  plan = plan_of(standin)
  place = (sharding.sharding if isinstance(sharding, sharding_lib.AxisRules) else None)
  values = []
  for spec in plan.tensors:
    stored_shape = spec.file_shape
    host = np.ascontiguousarray(arrays[spec.source]).reshape(stored_shape)
    host = penzai_layout(spec, host).astype(dtype, copy=False)
    target = (place(tuple(spec.axes), host.shape, what=spec.label) if place
              else sharding or sharding_lib.default_sharding())
    data = jax.device_put(host, target)
    values.append(pz.Parameter(value=pz.nx.NamedArray.wrap(data).tag(*spec.axes),
                               label=spec.label))
    tracker.advance(host.nbytes)
  model = pz.bind_variables(plan.build(), values)
  pz.nn.assert_no_parameter_slots(model)
  return model
