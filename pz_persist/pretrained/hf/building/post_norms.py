"""OLMo's layout (OLMo 2 and 3): Llama's blocks with their norms after the
attention and the MLP instead of before (``post_attention_layernorm``,
``post_feedforward_layernorm``), and query/key norms over the whole
projection (every head at once), not per head."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec

_PRE_NORMS = {"pre_attention_norm": "post_attention_norm", "pre_ffw_norm": "post_ffw_norm"}


_POST_NORM_SOURCES = {"post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}


_QK = {"query": "q_norm", "key": "k_norm"}


def olmo_blocks(plan: Plan, epsilon: float, post_norms: bool = True) -> Plan:
  """``plan`` (Llama's) with OLMo's post-norms (unless not ``post_norms``:
  OLMoE keeps Llama's pre-norms) and whole-projection query/key norms: the
  tensors and the skeleton."""
  plan = whole_query_key_norms(plan, epsilon)
  return post_norm_plan(plan, epsilon) if post_norms else plan


def post_norm_plan(plan: Plan, epsilon: float) -> Plan:
  """``plan`` (Llama's) with its norms after the attention and the MLP
  (``post_attention_layernorm``, ``post_feedforward_layernorm``) instead of
  before: the tensors and the skeleton (OLMo 2 and 3, EXAONE 4)."""
  specs = []
  for spec in plan.tensors:
    block, _, name = spec.label.rpartition("/")
    prefix, _, norm = block.rpartition("/")
    if norm in _PRE_NORMS:
      post = _PRE_NORMS[norm]
      source = spec.source.rsplit(".", 2)[0] + f".{_POST_NORM_SOURCES[post]}.weight"
      spec = dataclasses.replace(spec, label=f"{prefix}/{post}/{name}", source=source)
    specs.append(spec)

  hidden = next(spec.shape[0] for spec in specs if spec.label.endswith("final_norm/scale.weights"))

  def build() -> model_parts.TransformerLM:
    return with_post_norms(plan.build(), epsilon, hidden)

  return Plan(build, tuple(specs), plan.views)


def whole_query_key_norms(plan: Plan, epsilon: float) -> Plan:
  """``plan`` with an RMS norm over the whole query and the whole key
  projection (every head at once: ``q_norm`` / ``k_norm`` of
  ``num_heads * head_dim`` weights, as OLMo 2 and MiniMax-M2 have them)
  right after each projection, before RoPE."""
  specs = []
  norms: dict[str, dict[str, int]] = {}
  for spec in plan.tensors:
    specs.append(spec)
    block, _, name = spec.label.rpartition("/")
    kind = name.removesuffix(".weights")
    if block.endswith("/attention") and kind in _QK:
      # Query/key matrix (heads..., projection, embedding): its norm spans all but embedding.
      axes = dict(zip(spec.axes[:-1], spec.shape[:-1]))
      norms[f"{block}/{kind}_norm"] = axes
      source = spec.source.replace(f"{kind[0]}_proj", _QK[kind])
      specs.append(TensorSpec(f"{block}/{kind}_norm/scale.weights", source, tuple(axes.values()),
                              tuple(axes), stored=(spec.stored or spec.shape)[:1]))

  def build() -> model_parts.TransformerLM:
    return _with_query_key_norms(plan.build(), norms, epsilon)

  return Plan(build, tuple(specs), plan.views)


def with_post_norms(model: model_parts.TransformerLM, epsilon: float,
                    hidden: int) -> model_parts.TransformerLM:
  """Each block's pre-norms moved to the end of their residual branch and
  renamed (``pre_attention_norm`` -> ``post_attention_norm``)."""

  def move(residual: pz.nn.Residual) -> pz.nn.Residual:
    norm, *rest = residual.delta.sublayers
    prefix, name, _ = norm.sublayers[1].weights.label.rsplit("/", 2)
    post = pz.nn.RMSLayerNorm.from_config(name=f"{prefix}/{_PRE_NORMS[name]}", init_base_rng=None,
                                          across_axes={"embedding": hidden}, epsilon=epsilon)
    return dataclasses.replace(residual, delta=pz.nn.Sequential([*rest, post]))

  return (pz.select(model).at_instances_of(model_parts.TransformerBlock)
          .at_instances_of(pz.nn.Residual).apply(move))


def _with_query_key_norms(
    model: model_parts.TransformerLM, norms: Mapping[str, Mapping[str, int]], epsilon: float
) -> model_parts.TransformerLM:
  """An ``RMSLayerNorm`` named by ``norms`` (``.../attention/query_norm``:
  its axes) right after the projection (and its bias) it normalizes."""

  def insert(sequence: pz.nn.Sequential) -> pz.nn.Sequential:
    layers = list(sequence.sublayers)
    for i, layer in enumerate(layers):
      if isinstance(layer, pz.nn.Linear):
        name = layer.weights.label.removesuffix(".weights") + "_norm"
        if name in norms:
          at = i + 2 if i + 1 < len(layers) and isinstance(layers[i + 1], pz.nn.AddBias) else i + 1
          norm = pz.nn.RMSLayerNorm.from_config(name=name, init_base_rng=None,
                                                across_axes=dict(norms[name]), epsilon=epsilon)
          return dataclasses.replace(sequence, sublayers=[*layers[:at], norm, *layers[at:]])
    return sequence

  return pz.select(model).at_instances_of(pz.nn.Attention).apply(
      lambda a: dataclasses.replace(a, input_to_query=insert(a.input_to_query),
                                    input_to_key=insert(a.input_to_key)))


def is_post_norm(model: pz.nn.Layer) -> bool:
  """Whether the first block's attention branch ends with its norm."""
  block = blocks(model)[0]
  delta = all_layers(block, pz.nn.Residual)[0].delta
  return isinstance(delta.sublayers[0], pz.nn.Attention) and isinstance(
      delta.sublayers[-1], pz.nn.RMSLayerNorm)


def olmo_fields(model: pz.nn.Layer, like: Mapping[str, Any]) -> dict[str, Any]:
  """The fields OLMo 2 and 3 write alike."""
  biases = model_biases(model)
  return without_default_head_dim(
      {**llamalike_fields(model, like), "attention_bias": biases.query_key_value})
