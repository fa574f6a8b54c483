"""Cohere 2 checkpoints (``model_type`` ``cohere2``: Command R7B, Command A).

Llama's projections and SwiGLU MLP (`pz_persist.pretrained.hf.building.decoder`)
in Cohere's parallel block, ``x + attn(ln(x)) + mlp(ln(x))`` on one LayerNorm
without a bias (``input_layernorm``; no ``post_attention_layernorm``), and
the final LayerNorm alike. Sliding-window layers (``layer_types``; without
it, all but every ``sliding_window_pattern``-th) rotate adjacent pairs of
dimensions (`pz_persist.nn.llama4_attention.ApplyInterleavedRoPE`); the
global layers have no positions at all. The logits are multiplied by
``logit_scale`` (`pz_persist.nn.constant_scale.ConstantScale`, the
config's own number), and the head is tied to the embeddings by default.
"""

from __future__ import annotations

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
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import activation_field
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import size_fields
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import Plan
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
    return cohere_blocks(plan.build(), kinds(layers), eps, scale)

  # One norm per block: Llama's second is not stored.
  specs = tuple(spec for spec in plan.tensors
                if not spec.source.endswith("post_attention_layernorm.weight"))
  return Plan(build, specs)


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


def cohere_blocks(model: model_parts.TransformerLM, kinds: list[str], eps: float,
                  scale: float) -> model_parts.TransformerLM:
  """Llama's skeleton ``model`` made Cohere 2's: parallel blocks on one
  LayerNorm, interleaved RoPE on sliding layers and none on global ones,
  the logits times ``scale``."""
  body = []
  index = 0
  for layer in model.body.sublayers:
    if isinstance(layer, model_parts.TransformerBlock):
      (norm, attn), (_, mlp) = (residual.delta.sublayers for residual in layer.sublayers)
      if kinds[index] == "sliding_attention":
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
  """Cohere 2: interleaved RoPE (Llama 4's pairing) in LayerNorm blocks."""
  if all_layers(model, ApplyInterleavedRoPE) and all_layers(model, pz.nn.LayerNorm):
    return "cohere2"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only cohere2.
  found = windows(model)
  sliding = [bool(all_layers(block, ApplyInterleavedRoPE)) for block in blocks(model)]
  if [w is not None for w in found] != sliding:
    raise ExportError("Cohere 2 rotates exactly its sliding-window layers; the model's rotary"
                      f" layers {sliding} and windows {found} differ.")
  scales = all_layers(model, ConstantScale)
  if len(scales) != 1 or scales[0].divide:
    raise ExportError("Cohere 2 multiplies its logits by one logit_scale; the model has"
                      f" {len(scales)} constant scales.")
  window = next((w for w in found if w is not None), like.get("sliding_window", 4096))
  biases = model_biases(model)
  # Without a sliding layer the model has no rotary layer: like's RoPE (or
  # the default) says what transformers would rotate with, which no layer reads.
  rope = (rope_fields(model) if any(sliding) else
          {"rope_parameters": like.get("rope_parameters")
           or {"rope_theta": 10_000.0, "rope_type": "default"}})
  return without_default_head_dim({
      **size_fields(model), **rope, **activation_field(model, like), **tied_field(model, like),
      "layer_norm_eps": number(first_layer(model, pz.nn.Standardize, "layer norm").epsilon),
      "logit_scale": scales[0].by,
      "sliding_window": window,
      "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
      "attention_bias": biases.query_key_value,
  })


RECORD = Family(
    title="Command R7B / A (Cohere 2)",
    model_types={"cohere2": ModelType(
        cohere2_plan, "Cohere2ForCausalLM",
        defaults={"vocab_size": 256000, "hidden_size": 8192, "intermediate_size": 22528,
                  "num_hidden_layers": 40, "num_attention_heads": 64, "logit_scale": 0.0625,
                  "hidden_act": "silu", "layer_norm_eps": 1e-5, "tie_word_embeddings": True,
                  "attention_bias": False, "sliding_window": 4096, "rope_theta": 10_000.0,
                  "partial_rotary_factor": 1.0, "max_position_embeddings": 8192,
                  "sliding_window_pattern": 4, "rms_norm_eps": 1e-5},
        defaults_why={
            "rms_norm_eps": (
                "not a field of Cohere2Config: Llama's mapping reads it for norms that become"
                " LayerNorms of layer_norm_eps, and a config.json giving it is refused"),
            "sliding_window_pattern": (
                "transformers 5 takes it only as an argument (default 4) that builds"
                " layer_types"),
        })},
    detect=_detect,
    write_config=_write_config,
    adds=("parallel attention and SwiGLU on one LayerNorm without bias, sliding-window layers"
          " with interleaved RoPE (`ApplyInterleavedRoPE`) and global layers without positions"
          " (`layer_types`), `logit_scale` (`ConstantScale`), `attention_bias`, tied head"),
    refuses="what Llama refuses; a layer marked sliding without a window",
    rank=2,
    fields={"logit_scale": POSITIVE_NUMBER, "sliding_window_pattern": POSITIVE_INT},
)
