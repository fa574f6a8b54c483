"""Hunyuan's attention (shared code, no record): what transformers'
``HunYuanDenseV1ForCausalLM`` and ``HunYuanMoEV1ForCausalLM`` compute alike
on Llama's layout (`pz_persist.pretrained.hf.building.decoder`):

- an RMS norm on each head's query and key *after* RoPE
  (``self_attn.query_layernorm`` / ``key_layernorm``; before the
  ``1/sqrt(head_dim)`` scaling, which transformers applies inside attention);
- RoPE of type ``dynamic`` with an ``alpha`` (the Hub's Hunyuan folders) is
  not dynamic at all: transformers reads it as a fixed base of
  ``rope_theta * alpha ** (head_dim / (head_dim - 2))`` (its other keys
  unread), which is what is built (a plain ``ApplyRoPE`` of that base).

The dense family is `hunyuan_plan` itself; the mixture of experts builds its
experts on it (`pz_persist.pretrained.hf.families.hunyuan_v1_moe`).
"""

from __future__ import annotations

import dataclasses

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.weights import Weights

_NORMS = {"query": "query_layernorm", "key": "key_layernorm"}
_ROTARY = (pz.nn.ApplyRoPE,)

FIELDS = {"alpha": POSITIVE_NUMBER}
"""The field Hunyuan's RoPE reads beyond the shared ones (inside
``rope_parameters`` / ``rope_scaling``)."""

ADDS = ("query/key RMS norms after RoPE (`RMSLayerNorm` after each `ApplyRoPE`); `dynamic`"
        " RoPE with `alpha` as the fixed base it gives; `attention_bias`")
REFUSES = "scaled RoPE other than Llama's types; `alpha` with a rope type other than dynamic"
"""What both Hunyuan families' rows of the guide's table say of the attention."""


def _alpha_rope(cfg: Config) -> None:
  """A ``dynamic`` RoPE with ``alpha`` rewritten as the fixed base
  transformers computes from it (module docstring)."""
  key = "rope_parameters" if cfg.raw.get("rope_parameters") is not None else "rope_scaling"
  params = cfg.get(key)
  if not params or params.get("alpha") is None:
    return
  kind = params.get("rope_type", params.get("type"))
  alpha = cfg.checked(f"{key}.alpha", params["alpha"])
  if kind != "dynamic":
    raise cfg.unsupported(f"{key}.rope_type", kind, "alpha is read with rope type 'dynamic' only")
  theta = params.get("rope_theta", cfg.get("rope_theta", 10_000.0))
  cfg.checked("rope_theta", theta)
  heads = cfg.require("num_attention_heads")
  dim = cfg.get("head_dim", cfg.require("hidden_size") // heads)
  if dim <= 2:
    raise cfg.unsupported("head_dim", dim, "alpha RoPE divides by head_dim - 2")
  for name in ("rope_scaling", "rope_theta"):
    cfg.raw.pop(name, None)
  cfg.raw["rope_parameters"] = {"rope_type": "default",
                                "rope_theta": float(theta * alpha ** (dim / (dim - 2)))}


def _norm_specs(p: str, s: str, config: llamalike_common.LlamalikeTransformerConfig
                ) -> list[TensorSpec]:
  return [TensorSpec(f"{p}attention/{name}_norm/scale.weights", f"{s}self_attn.{hf}.weight",
                     (config.projection_dim,), ("projection",)) for name, hf in _NORMS.items()]


def _with_norms_after_rope(model: model_parts.TransformerLM,
                           config: llamalike_common.LlamalikeTransformerConfig
                           ) -> model_parts.TransformerLM:
  """An RMS norm over ``projection`` right after the query's and the key's
  RoPE (before the query's scaling)."""

  def normed(part: pz.nn.Sequential) -> pz.nn.Sequential:
    layers = list(part.sublayers)
    at = next(i for i, layer in enumerate(layers) if isinstance(layer, _ROTARY)) + 1
    name = layers[0].weights.label.removesuffix(".weights") + "_norm"
    norm = pz.nn.RMSLayerNorm.from_config(
        name=name, init_base_rng=None, across_axes={"projection": config.projection_dim},
        epsilon=config.rms_norm_eps, dtype=config.parameter_dtype)
    return dataclasses.replace(part, sublayers=[*layers[:at], norm, *layers[at:]])

  return pz.select(model).at_instances_of(pz.nn.Attention).apply(
      lambda a: dataclasses.replace(a, input_to_query=normed(a.input_to_query),
                                    input_to_key=normed(a.input_to_key)))


def hunyuan_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Hunyuan checkpoint's attention and dense layout (module
  docstring); the MoE family swaps its MLPs for experts afterwards."""
  _alpha_rope(cfg)
  bias = cfg.get("attention_bias", False)
  return llama_plan(cfg, weights, biases=Biases(query_key_value=bias, output=bias),
                    block_extras=_norm_specs, edit=_with_norms_after_rope)


def norms_after_rope(model: pz.nn.Layer) -> bool:
  """Whether a norm comes among the query's layers after its RoPE (the
  per-head norms of other families come before)."""
  layers = list(attention(model).input_to_query.sublayers)
  rope = [i for i, layer in enumerate(layers) if isinstance(layer, _ROTARY)]
  norms = [i for i, layer in enumerate(layers) if isinstance(layer, pz.nn.RMSLayerNorm)]
  return bool(rope and norms and norms[0] > rope[0])
