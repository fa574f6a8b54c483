"""Norms families add to Llama's layout: RMS norms of the query and key of
each head before RoPE (``q_norm`` / ``k_norm``, as Qwen3-MoE, Qwen3.5,
Gemma 3 and 4 and GLM-4.5 have them) and Gemma's ``1 + w`` scale
(`OffsetScale`, which Qwen3.5 shares)."""

from __future__ import annotations

import dataclasses

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.offset_scale import OffsetScale
from pz_persist.pretrained.hf.plan import TensorSpec

_NORMED = {"query": "q_norm", "key": "k_norm"}  # Penzai projection -> Hugging Face norm.


def query_key_norm_specs(p: str, s: str,
                         config: llamalike_common.LlamalikeTransformerConfig) -> list[TensorSpec]:
  """The query and key norms' weights of block ``p`` (layer ``s``)."""
  return [TensorSpec(f"{p}attention/{name}_norm/scale.weights", f"{s}self_attn.{hf}.weight",
                     (config.projection_dim,), ("projection",)) for name, hf in _NORMED.items()]


def with_query_key_norms(model: model_parts.TransformerLM,
                         config: llamalike_common.LlamalikeTransformerConfig
                         ) -> model_parts.TransformerLM:
  """``model`` with an RMS norm over ``projection`` after the query and key
  projections (and their biases), before RoPE."""

  def normed(part: pz.nn.Sequential) -> pz.nn.Sequential:
    layers = list(part.sublayers)
    at = next(i for i, layer in enumerate(layers)
              if not isinstance(layer, (pz.nn.Linear, pz.nn.AddBias)))
    name = layers[0].weights.label.removesuffix(".weights") + "_norm"
    norm = pz.nn.RMSLayerNorm.from_config(
        name=name, init_base_rng=None, across_axes={"projection": config.projection_dim},
        epsilon=config.rms_norm_eps, dtype=config.parameter_dtype)
    return dataclasses.replace(part, sublayers=[*layers[:at], norm, *layers[at:]])

  def add(attn: pz.nn.Attention) -> pz.nn.Attention:
    return dataclasses.replace(attn, input_to_query=normed(attn.input_to_query),
                               input_to_key=normed(attn.input_to_key))

  return pz.select(model).at_instances_of(pz.nn.Attention).apply(add)


def with_offset_norms(model: model_parts.TransformerLM) -> model_parts.TransformerLM:
  """``model`` with the scale ``Linear`` of each ``RMSLayerNorm`` replaced by
  an `OffsetScale` holding the same parameter (same label)."""

  def replace(norm: pz.nn.RMSLayerNorm) -> pz.nn.RMSLayerNorm:
    standardize, scale = norm.sublayers
    assert isinstance(standardize, pz.nn.RMSStandardize) and isinstance(scale, pz.nn.Linear), (
        "Penzai's RMSLayerNorm is RMSStandardize then a scale Linear")
    return dataclasses.replace(norm, sublayers=[standardize, OffsetScale(weights=scale.weights)])

  return pz.select(model).at_instances_of(pz.nn.RMSLayerNorm).apply(replace)
