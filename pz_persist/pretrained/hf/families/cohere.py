"""Cohere checkpoints: ``cohere2`` (Command R7B, Command A) and ``cohere``
(Command R / R+).

Llama's projections and SwiGLU MLP (`pz_persist.pretrained.hf.building.decoder`)
in Cohere's parallel block, ``x + attn(ln(x)) + mlp(ln(x))`` on one LayerNorm
without a bias (``input_layernorm``; no ``post_attention_layernorm``), and
the final LayerNorm alike. Sliding-window layers (``layer_types``; without
it, all but every ``sliding_window_pattern``-th) rotate adjacent pairs of
dimensions (`pz_persist.nn.llama4_attention.ApplyInterleavedRoPE`); the
global layers have no positions at all. The logits are multiplied by
``logit_scale`` (`pz_persist.nn.constant_scale.ConstantScale`, the
config's own number), and the head is tied to the embeddings by default.

Command R (``cohere``) has the same block with interleaved RoPE in every
layer and no windows, and optionally (``use_qk_norm``) a LayerNorm without
bias over each query and key head before the rotation, with a weight per
head and dimension.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.constant_scale import ConstantScale
from pz_persist.nn.llama4_attention import ApplyInterleavedRoPE
from pz_persist.nn.scaled_rope import ApplyScaledRoPE
from pz_persist.pretrained.errors import ExportError
from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import head_axes
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import activation_field
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import size_fields
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_LAYER_TYPES = ("full_attention", "sliding_attention")
_ROPE_LAYERS = (pz.nn.ApplyRoPE, ApplyScaledRoPE)


def cohere2_plan(cfg: Config, weights: Weights) -> Plan:
  """Llama's mapping edited into Cohere 2's blocks (the module docstring)."""
  if "rms_norm_eps" in cfg.raw:
    raise cfg.unsupported("rms_norm_eps", cfg.raw["rms_norm_eps"],
                          "Cohere 2's norms are LayerNorms of layer_norm_eps")
  layers = cfg.require("num_hidden_layers")
  kinds, sliding = _layer_kinds(cfg, layers)
  window = cfg.nullable("sliding_window", 4096)
  if window is None and sliding:
    raise cfg.unsupported("sliding_window", None,
                          "layers marked sliding_attention need a window; transformers gives"
                          " them neither a window nor positions then")
  eps = float(cfg.get("layer_norm_eps", 1e-5))
  scale = cfg.get("logit_scale", 0.0625)
  bias = cfg.get("attention_bias", False)

  def attention(count: int) -> tuple[llamalike_common.AttentionType, ...]:
    # Called once the layer count is checked against the weights.
    return tuple(
        llamalike_common.AttentionTypeSlidingWindowCausal(window) if kind == "sliding_attention"
        else llamalike_common.AttentionTypeGlobalCausal() for kind in kinds(count))

  plan = llama_plan(cfg, weights, attention=attention,
                    biases=Biases(query_key_value=bias, output=bias),
                    max_positions_default=8192)

  def build() -> model_parts.TransformerLM:
    rotary = [kind == "sliding_attention" for kind in kinds(layers)]
    return cohere_blocks(plan.build(), rotary, eps, scale)

  # One norm per block: Llama's second is not stored.
  specs = tuple(spec for spec in plan.tensors
                if not spec.source.endswith("post_attention_layernorm.weight"))
  return Plan(build, specs)


def cohere_plan(cfg: Config, weights: Weights) -> Plan:
  """Command R: Cohere 2's blocks with RoPE in every layer, no windows, and
  optional per-head query/key LayerNorms (``use_qk_norm``)."""
  if "rms_norm_eps" in cfg.raw:
    raise cfg.unsupported("rms_norm_eps", cfg.raw["rms_norm_eps"],
                          "Cohere's norms are LayerNorms of layer_norm_eps")
  eps = float(cfg.get("layer_norm_eps", 1e-5))
  scale = cfg.get("logit_scale", 0.0625)
  bias = cfg.get("attention_bias", False)
  qk_norm = cfg.get("use_qk_norm", False)

  def norm_specs(p: str, s: str,
                 config: llamalike_common.LlamalikeTransformerConfig) -> list[TensorSpec]:
    if not qk_norm:
      return []
    q_heads, kv_axes = head_axes(config)
    return [TensorSpec(p + f"attention/{which}_norm/scale.weights", s + f"self_attn.{name}.weight",
                       (*heads.values(), config.projection_dim), (*heads, "projection"),
                       stored=(math.prod(heads.values()) or 1, config.projection_dim))
            for which, name, heads in (("query", "q_norm", q_heads), ("key", "k_norm", kv_axes))]

  plan = llama_plan(cfg, weights, biases=Biases(query_key_value=bias, output=bias),
                    max_positions_default=8192, block_extras=norm_specs,
                    edit=lambda model, config: (with_head_norms(model, config, eps) if qk_norm
                                                else model))
  layers = cfg.require("num_hidden_layers")

  def build() -> model_parts.TransformerLM:
    return cohere_blocks(plan.build(), [True] * layers, eps, scale)

  return Plan(build, tuple(spec for spec in plan.tensors
                           if not spec.source.endswith("post_attention_layernorm.weight")))


def with_head_norms(model: model_parts.TransformerLM,
                    config: llamalike_common.LlamalikeTransformerConfig,
                    eps: float) -> model_parts.TransformerLM:
  """``model`` with a LayerNorm without bias over each query and key head
  (its weight per head and dimension) right before the rotation, named
  ``<projection>_norm`` (``attention/query_norm/scale.weights``)."""
  q_heads, kv_axes = head_axes(config)

  def add(part: pz.nn.Sequential, heads: dict[str, int]) -> pz.nn.Sequential:
    layers = list(part.sublayers)
    name = layers[0].weights.label.removesuffix(".weights") + "_norm"
    at = next(i for i, layer in enumerate(layers) if isinstance(layer, _ROPE_LAYERS))
    norm = pz.nn.LayerNorm(sublayers=[
        pz.nn.Standardize(across=("projection",), epsilon=eps),
        pz.nn.Linear.from_config(name=f"{name}/scale", init_base_rng=None, input_axes={},
                                 output_axes={},
                                 parallel_axes={**heads, "projection": config.projection_dim},
                                 dtype=config.parameter_dtype)])
    return pz.nn.Sequential([*layers[:at], norm, *layers[at:]])

  return (pz.select(model).at_instances_of(pz.nn.Attention)
          .apply(lambda attn: dataclasses.replace(
              attn, input_to_query=add(attn.input_to_query, q_heads),
              input_to_key=add(attn.input_to_key, kv_axes))))


def _layer_kinds(cfg: Config, layers: int) -> tuple[Callable[[int], list[str]], bool]:
  """Each layer's ``layer_types`` entry, as transformers' ``Cohere2Config``
  decides (every ``sliding_window_pattern``-th layer global without the
  list), given the checked layer count; and whether any layer slides. Read
  now, listed only once the weights confirm the count (a forged config may
  ask for 10**9 layers)."""
  types = cfg.get("layer_types")
  pattern = cfg.get("sliding_window_pattern", 4)
  if types is None:
    return (lambda count: ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(count)]), pattern != 1
  if len(types) != layers or not set(types) <= set(_LAYER_TYPES):
    raise cfg.unsupported("layer_types", types[:8],
                          f"expected {layers} entries (num_hidden_layers), each one of"
                          f" {list(_LAYER_TYPES)}")
  return (lambda count: list(types)), "sliding_attention" in types


def _layer_norm(norm: pz.nn.Layer, eps: float) -> pz.nn.LayerNorm:
  """Llama's RMS norm ``norm`` as a LayerNorm without a shift (its scale kept)."""
  scale = norm.sublayers[-1]
  return pz.nn.LayerNorm(sublayers=[pz.nn.Standardize(across=("embedding",), epsilon=eps),
                                    scale])


def cohere_blocks(model: model_parts.TransformerLM, rotary: list[bool], eps: float,
                  scale: float) -> model_parts.TransformerLM:
  """Llama's skeleton ``model`` made Cohere's: parallel blocks on one
  LayerNorm, interleaved RoPE in the blocks ``rotary`` marks and none in the
  others, the logits times ``scale``."""
  body = []
  index = 0
  for layer in model.body.sublayers:
    if isinstance(layer, model_parts.TransformerBlock):
      (norm, attn), (_, mlp) = (residual.delta.sublayers for residual in layer.sublayers)
      if rotary[index]:
        attn = (pz.select(attn).at_instances_of(_ROPE_LAYERS)
                .apply(lambda rope: ApplyInterleavedRoPE(rope=rope)))
      else:
        attn = pz.select(attn).at_instances_of(_ROPE_LAYERS).remove_from_parent()
      layer = model_parts.TransformerBlock([pz.nn.Residual(pz.nn.Sequential([
          _layer_norm(norm, eps), pz.nn.BranchAndAddTogether([attn, mlp])]))])
      index += 1
    elif isinstance(layer, pz.nn.RMSLayerNorm):
      layer = _layer_norm(layer, eps)
    body.append(layer)
  body.append(ConstantScale(scale))
  return model_parts.TransformerLM(metadata=model.metadata, body=pz.nn.Sequential(body))


def _detect(model: pz.nn.Layer) -> str | None:
  """Cohere: interleaved RoPE (Llama 4's pairing) in LayerNorm blocks;
  Cohere 2 when some layers have windows."""
  if not (all_layers(model, ApplyInterleavedRoPE) and all_layers(model, pz.nn.LayerNorm)):
    return None
  return "cohere2" if any(w is not None for w in windows(model)) else "cohere"


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  found = windows(model)
  rotary = [bool(all_layers(block, ApplyInterleavedRoPE)) for block in blocks(model)]
  scales = all_layers(model, ConstantScale)
  if len(scales) != 1 or scales[0].divide:
    raise ExportError("Cohere multiplies its logits by one logit_scale; the model has"
                      f" {len(scales)} constant scales.")
  # Without a rotary layer (Cohere 2, every layer global) like's RoPE (or the
  # default) says what transformers would rotate with; no layer reads it.
  rope = (rope_fields(model) if any(rotary) else
          {"rope_parameters": like.get("rope_parameters")
           or {"rope_theta": 10_000.0, "rope_type": "default"}})
  fields = {
      **size_fields(model), **rope, **activation_field(model, like), **tied_field(model, like),
      "layer_norm_eps": number(first_layer(model, pz.nn.Standardize, "layer norm").epsilon),
      "logit_scale": scales[0].by,
      "attention_bias": model_biases(model).query_key_value,
  }
  if model_type == "cohere":
    if any(w is not None for w in found) or not all(rotary):
      raise ExportError("Command R (cohere) rotates every layer and has no windows; the"
                        f" model's rotary layers are {rotary} and windows {found}.")
    head_norms = [norm for norm in all_layers(attention(model), pz.nn.Standardize)
                  if tuple(norm.across) == ("projection",)]
    return without_default_head_dim({**fields, "use_qk_norm": bool(head_norms)})
  if [w is not None for w in found] != rotary:
    raise ExportError("Cohere 2 rotates exactly its sliding-window layers; the model's rotary"
                      f" layers {rotary} and windows {found} differ.")
  return without_default_head_dim({
      **fields,
      "sliding_window": next((w for w in found if w is not None),
                             like.get("sliding_window", 4096)),
      "layer_types": ["sliding_attention" if r else "full_attention" for r in rotary],
  })


_RMS_WHY = ("not a field of the config class: Llama's mapping reads it for norms that become"
            " LayerNorms of layer_norm_eps, and a config.json giving it is refused")
_COMMON_DEFAULTS = {
    "vocab_size": 256000, "hidden_size": 8192, "intermediate_size": 22528,
    "num_hidden_layers": 40, "num_attention_heads": 64, "logit_scale": 0.0625,
    "hidden_act": "silu", "layer_norm_eps": 1e-5, "tie_word_embeddings": True,
    "attention_bias": False, "partial_rotary_factor": 1.0, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5}
"""What Cohere's and Cohere 2's config classes share."""


RECORD = Family(
    title="Command R / R+, R7B, A (Cohere, Cohere 2)",
    model_types={
        "cohere": ModelType(
            cohere_plan, "CohereForCausalLM",
            defaults={**_COMMON_DEFAULTS, "rope_theta": 500_000.0, "use_qk_norm": False},
            defaults_why={"rms_norm_eps": _RMS_WHY}),
        "cohere2": ModelType(
            cohere2_plan, "Cohere2ForCausalLM",
            defaults={**_COMMON_DEFAULTS, "rope_theta": 10_000.0, "sliding_window": 4096,
                      "sliding_window_pattern": 4},
            defaults_why={
                "rms_norm_eps": _RMS_WHY,
                "sliding_window_pattern": (
                    "transformers 5 takes it only as an argument (default 4) that builds"
                    " layer_types"),
            }),
    },
    detect=_detect,
    write_config=_write_config,
    adds=("parallel attention and SwiGLU on one LayerNorm without bias, interleaved RoPE"
          " (`ApplyInterleavedRoPE`), `logit_scale` (`ConstantScale`), `attention_bias`, tied"
          " head; Command R's per-head query/key LayerNorms (`use_qk_norm`); Command R7B / A's"
          " sliding-window layers with RoPE and global layers without positions (`layer_types`)"),
    refuses="what Llama refuses; `rms_norm_eps`; a layer marked sliding without a window",
    rank=6,
    fields={"logit_scale": POSITIVE_NUMBER, "sliding_window_pattern": POSITIVE_INT,
            "use_qk_norm": BOOLEAN},
)
