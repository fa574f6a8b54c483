"""OLMo 2 checkpoints (``model_type`` ``olmo2``), and the pieces OLMo 3
shares (`with_post_norms`, `with_query_key_norms`).

OLMo 2 is Llama's layout (`pz_persist.pretrained.hf.families.llama`) with
two changes to each block:

- Post-norms: each residual branch normalizes its *output* (``attention ->
  post_attention_norm``, ``mlp -> post_ffw_norm``, Penzai's Gemma 2 names),
  and nothing normalizes its input; the Hugging Face tensors are
  ``post_attention_layernorm`` and ``post_feedforward_layernorm``.
- Query/key norms over the whole projection: an RMS norm of the query
  projection's output across all its heads at once (``q_norm``, one scale of
  ``heads * head_dim`` entries), and likewise for the keys, before RoPE. In
  Penzai, an ``RMSLayerNorm`` across the projection's head axes and
  ``projection`` (``attention/query_norm``, ``attention/key_norm``), its
  scale laid out as the projection's output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.families.family_defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.families.family_defaults import NO_BIASES
from pz_persist.pretrained.hf.families.llama import llama_plan
from pz_persist.pretrained.hf.families.llama import model_biases
from pz_persist.pretrained.hf.families.qwen2 import without_default_head_dim
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_PRE_NORMS = {"pre_attention_norm": "post_attention_norm", "pre_ffw_norm": "post_ffw_norm"}
_POST_NORM_SOURCES = {"post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
_QK = {"query": "q_norm", "key": "k_norm"}


def olmo2_plan(cfg: Config, weights: Weights) -> Plan:
  """Llama's mapping (with ``attention_bias``) turned into OLMo 2's blocks."""
  bool_field(cfg, "mlp_bias", False, False, "OLMo's MLP has no biases")
  return olmo_blocks(llama_plan(cfg, weights), float(cfg.get("rms_norm_eps", FROM_TABLE)))


def olmo_blocks(plan: Plan, epsilon: float) -> Plan:
  """``plan`` (Llama's) with OLMo's post-norms and whole-projection
  query/key norms: the tensors and the skeleton."""
  specs = []
  norms: dict[str, dict[str, int]] = {}
  for spec in plan.tensors:
    block, _, name = spec.label.rpartition("/")
    prefix, _, norm = block.rpartition("/")
    if norm in _PRE_NORMS:
      post = _PRE_NORMS[norm]
      source = spec.source.rsplit(".", 2)[0] + f".{_POST_NORM_SOURCES[post]}.weight"
      specs.append(dataclasses.replace(spec, label=f"{prefix}/{post}/{name}", source=source))
      continue
    specs.append(spec)
    kind = name.removesuffix(".weights")
    if block.endswith("/attention") and kind in _QK:
      # Query/key matrix (heads..., projection, embedding): its norm spans all but embedding.
      axes = dict(zip(spec.axes[:-1], spec.shape[:-1]))
      norms[f"{block}/{kind}_norm"] = axes
      source = spec.source.replace(f"{kind[0]}_proj", _QK[kind])
      specs.append(TensorSpec(f"{block}/{kind}_norm/scale.weights", source, tuple(axes.values()),
                              tuple(axes), stored=(spec.stored or spec.shape)[:1]))

  hidden = next(spec.shape[0] for spec in specs if spec.label.endswith("final_norm/scale.weights"))

  def build() -> model_parts.TransformerLM:
    return with_query_key_norms(with_post_norms(plan.build(), epsilon, hidden), norms, epsilon)

  return Plan(build, tuple(specs))


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


def with_query_key_norms(
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


def is_post_norm(model: Any) -> bool:
  """Whether the first block's attention branch ends with its norm."""
  block = blocks(model)[0]
  delta = all_layers(block, pz.nn.Residual)[0].delta
  return isinstance(delta.sublayers[0], pz.nn.Attention) and isinstance(
      delta.sublayers[-1], pz.nn.RMSLayerNorm)


def _detect(model: Any) -> str | None:
  """Post-norms and no window (OLMo 3's record, of lower rank, claims those with one)."""
  return "olmo2" if is_post_norm(model) else None


def olmo_fields(model: Any, like: Mapping[str, Any]) -> dict[str, Any]:
  """The fields OLMo 2 and 3 write alike."""
  biases = model_biases(model)
  return without_default_head_dim(
      {**llamalike_fields(model, like), "attention_bias": biases.query_key_value})


def _write_config(model: Any, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only olmo2.
  return olmo_fields(model, like)


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "olmo2": {
        "defaults": {**LLAMA_LIKE, "rms_norm_eps": 1e-5, "mlp_bias": False,
                     "max_position_embeddings": 2048},
        "defaults_why": {
            "mlp_bias": NO_BIASES,
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="OLMo 2",
    model_types={"olmo2": ModelType(olmo2_plan, "Olmo2ForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["olmo2"])},
    detect=_detect,
    write_config=_write_config,
    adds=("post-norms (`post_attention_norm`, `post_ffw_norm`), query/key RMS norms over the"
          " whole projection (`query_norm`, `key_norm`), `attention_bias`, scaled RoPE"),
    refuses="what Llama refuses",
    rank=30,
)
