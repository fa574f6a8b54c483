"""Gemma 4 checkpoints written by the ``gemma`` library (``gm.ckpts.save_params``:
an Orbax checkpoint of the Flax params, nested as ``model.init`` makes them)
into the Penzai model `load_hf` builds for Gemma 4 (``gemma4_text``).

The library's layout was read from its source (``gemma/gm/nn/gemma4/``:
``_modules.py``, ``_moe.py``, ``_layers.py``, ``_config.py``, ``_gemma4.py``);
the library itself cannot be installed here, so the tests write checkpoints
in that layout by hand. Per block ``layer_{i}``:

- ``attn/q_einsum`` ``[heads, embed, head_dim]``; ``attn/kv_einsum``
  ``[2, kv_heads, embed, head_dim]``, or ``attn/k_einsum`` ``[kv_heads,
  embed, head_dim]`` where keys are the values (31B's global layers);
  ``attn/attn_vec_einsum`` ``[heads, head_dim, embed]``; ``attn/query_norm``
  and ``attn/key_norm`` (the value norm has no scale). Layers reusing an
  earlier layer's keys and values still hold ``kv_einsum`` and ``key_norm``
  (the library computes and discards them): they are not read.
- norms hold the ``w`` used as ``x * w`` (not ``1 + w``), as Hugging Face's
  Gemma 4 does: copied as they are;
- ``mlp/gating_einsum`` ``[2, hidden, embed]`` and ``mlp/linear`` ``[hidden,
  embed]``; with experts (26B-A4B) the dense MLP is ``mlp2`` (between
  ``pre_ffw2_norm`` and ``post_ffw2_norm``) and ``mlp`` holds the experts:
  ``router_logits`` ``[embed, experts]``, ``router_scale`` ``[embed]``,
  ``per_expert_scale`` ``[experts]``, ``gating_einsum`` ``[experts, 2,
  hidden, embed]``, ``linear`` ``[experts, hidden, embed]`` (between
  ``pre_ffw_norm`` and ``post_ffw1_norm``);
- per-layer inputs (E2B/E4B): ``per_layer_input_gate`` ``[embed, width]``,
  ``per_layer_projection`` ``[width, embed]``, ``post_per_layer_input_norm``;
  the embedder's ``per_layer_embeddings`` ``[vocab, layers, width]``,
  ``per_layer_model_projection`` ``[embed, layers, width]`` and
  ``per_layer_projection_norm``;
- ``skip_scale`` ``[1]``, Hugging Face's ``layer_scalar``.

The arrays show the sizes, which layers are global (their key size), keys
as values, per-layer inputs, experts and the wider MLP of the layers reusing
keys and values. What they do not show (the sliding window, RoPE bases and
the global layers' rotated fraction, the final soft cap, how many layers
reuse keys and values, the experts chosen per token) comes from the
library's Gemma 4 configs, recognised by layer count and width, or
``preset={"like": ...}`` with overrides. Vision and audio arrays are not
used, and the load says so.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from pz_persist import sharding as sharding_lib
from pz_persist.pretrained import errors
from pz_persist.pretrained import gemma3_flax
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.families import gemma4

_log = logging.getLogger("pz_persist.pretrained.gemma")

_COMMON = {"local_base_frequency": 10_000.0, "global_base_frequency": 1_000_000.0,
           "global_rope_proportion": 0.25, "final_logit_softcap": 30.0, "top_k_experts": 8}
PRESETS: dict[str, dict[str, Any]] = {
    # The gemma library's Gemma 4 configs (gemma/gm/nn/gemma4/_gemma4.py).
    "gemma4_e2b": {"layers": 35, "embed_dim": 1536, "sliding_window_size": 512,
                   "global_every": 5, "kv_shared_layers": 20},
    "gemma4_e4b": {"layers": 42, "embed_dim": 2560, "sliding_window_size": 512,
                   "global_every": 6, "kv_shared_layers": 18},
    "gemma4_31b": {"layers": 60, "embed_dim": 5376, "sliding_window_size": 1024,
                   "global_every": 6, "kv_shared_layers": 0},
    "gemma4_26b_a4b": {"layers": 30, "embed_dim": 2816, "sliding_window_size": 1024,
                       "global_every": 6, "kv_shared_layers": 0},
}
"""Gemma 4's settings by the library's model name (all: RoPE bases 10 000
local and 1 000 000 global, a quarter of the global keys rotated, final soft
cap 30, 8 experts per token where there are experts)."""

_SETTINGS = ("sliding_window_size", "global_every", "kv_shared_layers",
             *sorted(_COMMON))
_BLOCK = re.compile(r"transformer/layer_(\d{1,6})/(.+)")
_NORM = "scale"
_ATTN = {"attn/q_einsum": "w", "attn/attn_vec_einsum": "w", "attn/query_norm": _NORM,
         "pre_attention_norm": _NORM, "post_attention_norm": _NORM, "skip_scale": "w",
         "pre_ffw_norm": _NORM, "post_ffw_norm": _NORM, "mlp/gating_einsum": "w",
         "mlp/linear": "w"}
_KEYS = {"attn/kv_einsum": "w", "attn/k_einsum": "w", "attn/key_norm": _NORM}
_DENSE_MOE = {"pre_ffw2_norm": _NORM, "post_ffw2_norm": _NORM, "post_ffw1_norm": _NORM,
              "mlp2/gating_einsum": "w", "mlp2/linear": "w", "mlp/router_logits": "w",
              "mlp/router_scale": "w", "mlp/per_expert_scale": "w"}
_PLE = {"per_layer_input_gate": "w", "per_layer_projection": "w",
        "post_per_layer_input_norm": _NORM}
_TOP = {"transformer/embedder": "input_embedding", "transformer/final_norm": _NORM,
        "transformer/embedder/per_layer_embeddings": "w",
        "transformer/embedder/per_layer_model_projection": "w",
        "transformer/embedder/per_layer_projection_norm": _NORM}
_MEDIA = ("transformer/vision_encoder", "transformer/audio_encoder", "transformer/embedder/mm_",
          "transformer/embedder/audio_")


def is_gemma4(stored: Mapping[str, Mapping[str, Any]]) -> bool:
  """Whether the flattened tree has Gemma 4's learned block output scale."""
  return "transformer/layer_0/skip_scale" in stored


def _error(path: Any, message: str) -> errors.GemmaCheckpointError:
  return errors.GemmaCheckpointError(f"{path}: {message}")


def _leaf(stored: Mapping[str, Mapping[str, Any]], key: str, path: Any) -> Any:
  """The one array (or its metadata) stored under ``key``."""
  leaves = stored.get(key)
  if not leaves or len(leaves) != 1:
    raise _error(path, f"{key!r} is missing (or holds {sorted(leaves or {})}): it is not a"
                 " complete Gemma 4 checkpoint of the gemma library.")
  return next(iter(leaves.values()))


def _shape(stored: Mapping[str, Mapping[str, Any]], key: str, path: Any,
           rank: int) -> tuple[int, ...]:
  shape = tuple(int(d) for d in _leaf(stored, key, path).shape)
  if len(shape) != rank:
    raise _error(path, f"{key!r} has shape {shape}; Gemma 4 stores it with {rank} dimensions.")
  return shape


def _expect(stored: Mapping[str, Any], key: str, shape: tuple[int, ...], path: Any) -> None:
  got = tuple(int(d) for d in _leaf(stored, key, path).shape)
  if got != shape:
    raise _error(path, f"{key!r} has shape {got}, not {shape} as the checkpoint's other arrays"
                 " imply: the tree is damaged or not a Gemma 4 checkpoint.")


def _check_names(stored: Mapping[str, Mapping[str, Any]], path: Any) -> int:
  """Refuses arrays Gemma 4 does not have; returns the number of vision and
  audio arrays (not read)."""
  media = 0
  known = {**_ATTN, **_KEYS, **_DENSE_MOE, **_PLE}
  for key, leaves in stored.items():
    if key.startswith(_MEDIA):
      media += len(leaves)
      continue
    block = _BLOCK.fullmatch(key)
    expected = known.get(block.group(2)) if block else _TOP.get(key)
    if expected is None or set(leaves) != {expected}:
      raise _error(path, f"{key!r} ({sorted(leaves)}) is not part of a Gemma 4 checkpoint of the"
                   " gemma library; pz_persist reads only the layout of gemma/gm/nn/gemma4.")
  return media


def _settings(preset: Any, layers: int, embed: int, path: Any
              ) -> tuple[str, dict[str, Any], set[str]]:
  if preset == "auto":
    named = [n for n, p in PRESETS.items() if (p["layers"], p["embed_dim"]) == (layers, embed)]
    if not named:
      raise _error(path, f"a Gemma 4 checkpoint of {layers} layers of width {embed} matches none"
                   f" of {sorted(PRESETS)}; pass preset={{'like': name, ...}} (settings:"
                   f" {list(_SETTINGS)}).")
    preset = {"like": named[0]}
  if not isinstance(preset, Mapping) or preset.get("like") not in PRESETS:
    raise _error(path, f"it is a Gemma 4 checkpoint: preset must be 'auto' or {{'like': one of"
                 f" {sorted(PRESETS)}, <setting>: value}} (settings: {list(_SETTINGS)}), not"
                 f" {preset!r:.120}.")
  unknown = sorted(set(preset) - {"like", *_SETTINGS})
  if unknown:
    raise _error(path, f"preset settings {unknown} are not Gemma 4's; known: {list(_SETTINGS)}.")
  chosen = {**_COMMON, **PRESETS[preset["like"]], **preset}
  from_like = sorted(k for k in _SETTINGS if k not in preset)
  _log.warning("%s: Gemma 4 settings from %s: %s", path, preset["like"],
               ", ".join(f"{k}={chosen[k]}" for k in from_like))
  return preset["like"], {k: chosen[k] for k in _SETTINGS}, set(preset) - {"like"}


def config_of(stored: Mapping[str, Mapping[str, Any]], preset: Any, path: Any
              ) -> tuple[dict[str, Any], int, str, dict[str, tuple[Any, str]]]:
  """The Hugging Face ``config.json`` (``gemma4_text``) of the checkpoint,
  from its arrays' shapes and the settings, every array's shape checked;
  its vision/audio array count; the preset followed; each setting with its
  source (for `GemmaReport`)."""
  media = _check_names(stored, path)
  layers = len({m.group(1) for key in stored if (m := _BLOCK.fullmatch(key))})
  if not all(f"transformer/layer_{i}/skip_scale" in stored for i in range(layers)):
    raise _error(path, f"the blocks are not layer_0...layer_{layers - 1}, each with its"
                 " 'skip_scale': it is not a complete Gemma 4 checkpoint.")
  vocab, embed = _shape(stored, "transformer/embedder", path, 2)
  name, settings, given = _settings(preset, layers, embed, path)
  every, shared = settings["global_every"], settings["kv_shared_layers"]
  for key in ("global_every", "kv_shared_layers", "sliding_window_size", "top_k_experts"):
    value = settings[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < (key != "kv_shared_layers"):
      raise _error(path, f"setting {key}={value!r} must be a positive integer.")
  for key in ("local_base_frequency", "global_base_frequency", "global_rope_proportion",
              "final_logit_softcap"):
    value = settings[key]
    if not ((value is None and key == "final_logit_softcap")
            or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0)):
      raise _error(path, f"setting {key}={value!r} must be a positive number"
                   + (" or None." if key == "final_logit_softcap" else "."))
  kinds = [gemma4.FULL if (i + 1) % every == 0 else gemma4.SLIDING for i in range(layers)]
  if kinds[-1] != gemma4.FULL:
    raise _error(path, f"with global_every={every}, the last of {layers} layers is not global,"
                 " as every Gemma 4 of the library has it (and transformers forces it).")
  first = layers - shared
  if shared and not (first >= 2 and kinds[first - 1] == gemma4.FULL
                     and kinds[first - 2] == gemma4.SLIDING):
    raise _error(path, f"with kv_shared_layers={shared}, the library's layers reusing keys and"
                 f" values read layers {first - 1} (global) and {first - 2} (sliding), which are"
                 " not of those kinds in this pattern.")
  p0 = "transformer/layer_0/"
  heads, _, head_dim = _shape(stored, p0 + "attn/q_einsum", path, 3)
  kv_heads = _shape(stored, p0 + "attn/kv_einsum", path, 4)[1]
  hidden = _shape(stored, p0 + ("mlp2" if p0 + "mlp2/linear" in stored else "mlp")
                  + "/linear", path, 2)[0]
  moe = p0 + "mlp/router_logits" in stored
  ple = "transformer/embedder/per_layer_embeddings" in stored
  ple_width = _shape(stored, "transformer/embedder/per_layer_embeddings", path, 3)[2] if ple else 0
  last = f"transformer/layer_{layers - 1}/"
  global_dim = _shape(stored, last + "attn/q_einsum", path, 3)[2]
  keys_are_values = last + "attn/k_einsum" in stored
  global_kv = _shape(stored, last + ("attn/k_einsum" if keys_are_values else "attn/kv_einsum"),
                     path, 3 if keys_are_values else 4)[-3]
  if not keys_are_values and global_kv != kv_heads:
    raise _error(path, f"{last}attn/kv_einsum has {global_kv} key heads, layer_0 {kv_heads}:"
                 " Hugging Face's Gemma 4 (whose model pz_persist builds) has its own global key"
                 " head count only where keys are the values (k_einsum).")
  experts = expert_dim = ple_vocab = 0
  if moe:
    experts = _shape(stored, p0 + "mlp/router_logits", path, 2)[1]
    expert_dim = _shape(stored, p0 + "mlp/linear", path, 3)[1]
  if ple:
    ple_vocab = _shape(stored, "transformer/embedder/per_layer_embeddings", path, 3)[0]
  widths = []
  for i, kind in enumerate(kinds):
    p = f"transformer/layer_{i}/"
    dim, kv = (head_dim, kv_heads) if kind == gemma4.SLIDING else (global_dim, global_kv)
    _expect(stored, p + "attn/q_einsum", (heads, embed, dim), path)
    _expect(stored, p + "attn/attn_vec_einsum", (heads, dim, embed), path)
    _expect(stored, p + "attn/query_norm", (dim,), path)
    if keys_are_values and kind == gemma4.FULL:
      _expect(stored, p + "attn/k_einsum", (kv, embed, dim), path)
    else:
      _expect(stored, p + "attn/kv_einsum", (2, kv, embed, dim), path)
    _expect(stored, p + "attn/key_norm", (dim,), path)
    for norm in ("pre_attention_norm", "post_attention_norm", "pre_ffw_norm", "post_ffw_norm"):
      _expect(stored, p + norm, (embed,), path)
    _expect(stored, p + "skip_scale", (1,), path)
    dense = p + ("mlp2" if moe else "mlp")
    width = _shape(stored, dense + "/linear", path, 2)[0]
    widths.append(width)
    _expect(stored, dense + "/linear", (width, embed), path)
    _expect(stored, dense + "/gating_einsum", (2, width, embed), path)
    if ple:
      _expect(stored, p + "per_layer_input_gate", (embed, ple_width), path)
      _expect(stored, p + "per_layer_projection", (ple_width, embed), path)
      _expect(stored, p + "post_per_layer_input_norm", (embed,), path)
    elif any(p + k in stored for k in _PLE):
      raise _error(path, f"{p} has per-layer input arrays but the embedder has no"
                   " 'per_layer_embeddings'.")
    if moe:
      for norm in ("pre_ffw2_norm", "post_ffw2_norm", "post_ffw1_norm"):
        _expect(stored, p + norm, (embed,), path)
      _expect(stored, p + "mlp/router_logits", (embed, experts), path)
      _expect(stored, p + "mlp/router_scale", (embed,), path)
      _expect(stored, p + "mlp/per_expert_scale", (experts,), path)
      _expect(stored, p + "mlp/gating_einsum", (experts, 2, expert_dim, embed), path)
      _expect(stored, p + "mlp/linear", (experts, expert_dim, embed), path)
    elif any(p + k in stored for k in _DENSE_MOE):
      raise _error(path, f"{p} has arrays of the experts' block but layer_0 has no"
                   " 'mlp/router_logits'.")
  double = shared > 0 and widths[-1] == 2 * hidden
  want = [hidden * (2 if double and i >= first else 1) for i in range(layers)]
  if widths != want:
    bad = next(i for i in range(layers) if widths[i] != want[i])
    raise _error(path, f"'transformer/layer_{bad}/mlp' is {widths[bad]} wide, not {want[bad]}:"
                 " Gemma 4's MLPs have one width (doubled only in the layers reusing keys and"
                 " values).")
  if ple:
    _expect(stored, "transformer/embedder/per_layer_model_projection",
            (embed, layers, ple_width), path)
    _expect(stored, "transformer/embedder/per_layer_projection_norm", (ple_width,), path)
    _expect(stored, "transformer/embedder/per_layer_embeddings", (ple_vocab, layers, ple_width),
            path)
  _expect(stored, "transformer/final_norm", (embed,), path)
  config: dict[str, Any] = {
      "model_type": "gemma4_text", "vocab_size": vocab, "hidden_size": embed,
      "intermediate_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
      "num_key_value_heads": kv_heads, "head_dim": head_dim, "global_head_dim": global_dim,
      "attention_k_eq_v": keys_are_values, "sliding_window": settings["sliding_window_size"],
      "layer_types": kinds, "final_logit_softcapping": (
          None if settings["final_logit_softcap"] is None
          else float(settings["final_logit_softcap"])),
      "rope_parameters": {
          gemma4.SLIDING: {"rope_type": "default",
                           "rope_theta": float(settings["local_base_frequency"])},
          gemma4.FULL: {"rope_type": "proportional",
                        "partial_rotary_factor": float(settings["global_rope_proportion"]),
                        "rope_theta": float(settings["global_base_frequency"])}},
      "num_kv_shared_layers": shared, "use_double_wide_mlp": double,
      "hidden_size_per_layer_input": ple_width, "hidden_activation": "gelu_pytorch_tanh",
      "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "enable_moe_block": moe,
  }
  if keys_are_values:
    config["num_global_key_value_heads"] = global_kv
  if ple:
    config["vocab_size_per_layer_input"] = ple_vocab
  if moe:
    config.update(num_experts=experts, moe_intermediate_size=expert_dim,
                  top_k_experts=settings["top_k_experts"])
  sources = {key: (config[key], "checkpoint") for key in (
      "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
      "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
      "attention_k_eq_v", "hidden_size_per_layer_input", "enable_moe_block",
      "use_double_wide_mlp")}
  sources.update({k: (v, "caller" if k in given else "preset") for k, v in settings.items()})
  return config, media, name, sources


def hf_arrays(params: Mapping[str, Mapping[str, np.ndarray]], config: Mapping[str, Any]
              ) -> tuple[dict[str, np.ndarray], int]:
  """The arrays under Hugging Face's names and layouts; and how many stored
  arrays are not read (keys and values of the layers reusing others')."""

  def get(key: str) -> np.ndarray:
    return next(iter(params[key].values()))

  def heads_rows(w: np.ndarray) -> np.ndarray:  # [n, embed, dim] -> [n*dim, embed]
    return w.transpose(0, 2, 1).reshape(-1, w.shape[1])

  layers = config["num_hidden_layers"]
  first = layers - config["num_kv_shared_layers"]
  moe = config["enable_moe_block"]
  out = {"model.embed_tokens.weight": get("transformer/embedder"),
         "model.norm.weight": get("transformer/final_norm")}
  unread = 0
  if config["hidden_size_per_layer_input"]:
    table = get("transformer/embedder/per_layer_embeddings")
    projection = get("transformer/embedder/per_layer_model_projection")
    out.update({
        "model.embed_tokens_per_layer.weight": table.reshape(table.shape[0], -1),
        "model.per_layer_model_projection.weight": projection.reshape(
            projection.shape[0], -1).T,
        "model.per_layer_projection_norm.weight": get(
            "transformer/embedder/per_layer_projection_norm"),
    })
  for i in range(layers):
    p, s = f"transformer/layer_{i}/", f"model.layers.{i}."
    out_proj = get(p + "attn/attn_vec_einsum")
    out.update({
        s + "layer_scalar": get(p + "skip_scale"),
        s + "self_attn.q_proj.weight": heads_rows(get(p + "attn/q_einsum")),
        s + "self_attn.q_norm.weight": get(p + "attn/query_norm"),
        s + "self_attn.o_proj.weight": out_proj.reshape(-1, out_proj.shape[-1]).T,
        s + "input_layernorm.weight": get(p + "pre_attention_norm"),
        s + "post_attention_layernorm.weight": get(p + "post_attention_norm"),
        s + "post_feedforward_layernorm.weight": get(p + "post_ffw_norm"),
    })
    if i >= first:  # Reuses an earlier layer's keys and values.
      unread += 2
    elif p + "attn/k_einsum" in params:
      out[s + "self_attn.k_proj.weight"] = heads_rows(get(p + "attn/k_einsum"))
    else:
      keys, values = get(p + "attn/kv_einsum")
      out[s + "self_attn.k_proj.weight"] = heads_rows(keys)
      out[s + "self_attn.v_proj.weight"] = heads_rows(values)
    if i < first:
      out[s + "self_attn.k_norm.weight"] = get(p + "attn/key_norm")
    dense = p + ("mlp2" if moe else "mlp")
    gate, up = get(dense + "/gating_einsum")
    out.update({s + "mlp.gate_proj.weight": gate, s + "mlp.up_proj.weight": up,
                s + "mlp.down_proj.weight": get(dense + "/linear").T})
    if moe:
      fused = get(p + "mlp/gating_einsum")  # [experts, 2, width, embed]
      out.update({
          s + "pre_feedforward_layernorm.weight": get(p + "pre_ffw2_norm"),
          s + "post_feedforward_layernorm_1.weight": get(p + "post_ffw2_norm"),
          s + "pre_feedforward_layernorm_2.weight": get(p + "pre_ffw_norm"),
          s + "post_feedforward_layernorm_2.weight": get(p + "post_ffw1_norm"),
          s + "router.proj.weight": get(p + "mlp/router_logits").T,
          s + "router.scale": get(p + "mlp/router_scale"),
          s + "router.per_expert_scale": get(p + "mlp/per_expert_scale"),
          s + "experts.gate_up_proj": fused.reshape(fused.shape[0], -1, fused.shape[-1]),
          s + "experts.down_proj": get(p + "mlp/linear").transpose(0, 2, 1),
      })
    else:
      out[s + "pre_feedforward_layernorm.weight"] = get(p + "pre_ffw_norm")
    if config["hidden_size_per_layer_input"]:
      out.update({
          s + "per_layer_input_gate.weight": get(p + "per_layer_input_gate").T,
          s + "per_layer_projection.weight": get(p + "per_layer_projection").T,
          s + "post_per_layer_input_norm.weight": get(p + "post_per_layer_input_norm"),
      })
  return out, unread


def load(path: Any, params: Mapping[str, Mapping[str, np.ndarray]], config: dict[str, Any],
         media: int, sharding: sharding_lib.Target, tracker: Any) -> Any:
  """The model, from the arrays `load_gemma` read (``params``) and
  `config_of`'s config; ``tracker`` advances by the bytes placed."""
  if media:
    _log.warning("%s: %d arrays of the vision and audio encoders are not used: the model is"
                 " Gemma 4's text model.", path, media)
  arrays, unread = hf_arrays(params, config)
  if unread:
    _log.info("%s: the keys and values the library stores (and discards) in the %d layers"
              " reusing an earlier layer's are not read.", path, config["num_kv_shared_layers"])
  return gemma3_flax.bind_plan(
      path, arrays,
      lambda standin: gemma4.gemma4_text_plan(
          Config(dict(config), f"{path} (Gemma 4 settings)", gemma4.RECORD.fields,
                 gemma4.RECORD.model_types["gemma4_text"].defaults), standin),
      sharding, tracker)
