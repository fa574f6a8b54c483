"""GLM-4-0414 checkpoints (``model_type`` ``glm4``: GLM-4-9B-0414,
GLM-4-32B-0414, GLM-Z1).

GLM-4-0414 is Llama's layout (`pz_persist.pretrained.hf.building.decoder`)
with:

- **Sandwich norms**: besides the norms before the attention and the MLP
  (``input_layernorm``, ``post_attention_layernorm``, as Llama), one after
  each (``post_self_attn_layernorm``, ``post_mlp_layernorm``) on the branch
  before it joins the residual (Penzai's Gemma 2 names ``post_attention_norm``
  and ``post_ffw_norm``).
- **A fused** ``gate_up_proj`` (gate rows, then up rows), read as Penzai's
  two projections (`pz_persist.pretrained.hf.building.fused`).
- **Partial rotary on interleaved pairs**: RoPE turns the first
  ``partial_rotary_factor`` of each head (default one half, read as GLM-4.5
  reads it: `pz_persist.pretrained.hf.building.partial_rotary`), as neighbouring
  pairs ``(0, 1), (2, 3)...``; the rest passes through. The rotated part is
  reordered (`pz_persist.nn.latent_attention.Deinterleave`: even positions,
  then odd ones) before Penzai's ``ApplyRoPE``, which turns halves: queries
  and keys are reordered alike, so their dot products, hence the logits, are
  transformers' own.
- **Biases** on the query, key and value projections (``attention_bias``,
  default true), never on the output one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn import latent_attention as mla
from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.fused import fused_rows
from pz_persist.pretrained.hf.building.partial_rotary import partial_rotary
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_FUSED = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}

_POST_NORMS = {"post_attention_norm": "post_self_attn_layernorm",
               "post_ffw_norm": "post_mlp_layernorm"}
"""Penzai's name of each norm after a branch -> GLM-4's module."""


def _refuse_scaled_rope(cfg: Config) -> None:
  """GLM-4-0414's interleaved partial rotary is read unscaled only."""
  for key in ("rope_parameters", "rope_scaling"):
    params = cfg.raw.get(key)
    if isinstance(params, dict):
      kind = params.get("rope_type", params.get("type", "default"))
      if kind != "default":
        raise cfg.unsupported(f"{key}.rope_type", kind, "GLM-4-0414's interleaved partial"
                              " rotary is read with unscaled ('default') RoPE only")


def rotary_size(cfg: Config, fraction: float) -> int:
  """How many entries of each head RoPE turns (an even number, at least 2)."""
  hidden, heads = cfg.require("hidden_size"), cfg.require("num_attention_heads")
  head_dim = cfg.get("head_dim", hidden // heads)
  size = int(head_dim * fraction)
  if not 2 <= size <= head_dim or size % 2:
    raise cfg.unsupported("partial_rotary_factor", fraction,
                          f"it rotates {size} of {head_dim} entries of each head; RoPE needs an"
                          " even number of at least 2, at most the head")
  return size


def interleaved_rope(rope: pz.nn.ApplyRoPE, rotated: int, head_dim: int) -> mla.ApplyToParts:
  """Penzai's ``ApplyRoPE`` turning the neighbouring pairs of the first
  ``rotated`` entries of ``projection`` (GLM's layout), the rest unchanged."""
  turn = pz.nn.Sequential([
      mla.Deinterleave("rotary"),
      pz.nn.ApplyRoPE(embedding_axis="rotary", max_wavelength=rope.max_wavelength,
                      positions_input_name=rope.positions_input_name)])
  if rotated == head_dim:
    return mla.ApplyToParts(parts=[turn], names=("rotary",), sizes=(rotated,),
                            axis=rope.embedding_axis)
  return mla.ApplyToParts(parts=[turn, pz.nn.Sequential([])], names=("rotary", "unrotated"),
                          sizes=(rotated, head_dim - rotated), axis=rope.embedding_axis)


def with_post_norms(model: model_parts.TransformerLM,
                    config: llamalike_common.LlamalikeTransformerConfig
                    ) -> model_parts.TransformerLM:
  """Each block's branches ending with an RMS norm (``post_attention_norm``
  after the attention, ``post_ffw_norm`` after the MLP), their pre-norms kept."""

  def add(block: model_parts.TransformerBlock) -> model_parts.TransformerBlock:
    residuals = []
    for residual, post in zip(block.sublayers, _POST_NORMS):
      first = residual.delta.sublayers[0]
      prefix = first.sublayers[1].weights.label.rsplit("/", 2)[0]
      norm = pz.nn.RMSLayerNorm.from_config(
          name=f"{prefix}/{post}", init_base_rng=None,
          across_axes={"embedding": config.embedding_dim}, epsilon=config.rms_norm_eps,
          dtype=config.parameter_dtype)
      residuals.append(dataclasses.replace(
          residual, delta=pz.nn.Sequential([*residual.delta.sublayers, norm])))
    return dataclasses.replace(block, sublayers=residuals)

  return pz.select(model).at_instances_of(model_parts.TransformerBlock).apply(add)


def _post_norm_specs(p: str, s: str,
                     config: llamalike_common.LlamalikeTransformerConfig) -> list[TensorSpec]:
  return [TensorSpec(f"{p}{name}/scale.weights", f"{s}{hf}.weight", (config.embedding_dim,),
                     ("embedding",)) for name, hf in _POST_NORMS.items()]


def glm4_plan(cfg: Config, weights: Weights) -> Plan:
  """Llama's plan with GLM-4-0414's norms, fused MLP and rotary (module
  docstring)."""
  _refuse_scaled_rope(cfg)
  fraction = partial_rotary(cfg)
  rotated = rotary_size(cfg, fraction)
  bias = cfg.get("attention_bias", FROM_TABLE)

  def edit(model: model_parts.TransformerLM,
           config: llamalike_common.LlamalikeTransformerConfig) -> model_parts.TransformerLM:
    model = pz.select(model).at_instances_of(pz.nn.ApplyRoPE).apply(
        lambda rope: interleaved_rope(rope, rotated, config.projection_dim))
    return with_post_norms(model, config)

  plan = llama_plan(cfg, weights, biases=Biases(query_key_value=bias),
                    block_extras=_post_norm_specs, edit=edit)
  return Plan(plan.build, fused_rows(plan.tensors, _FUSED), plan.views)


def _detect(model: pz.nn.Layer) -> str | None:
  """RoPE on interleaved pairs (`Deinterleave`) outside latent attention
  (DeepSeek-V3's), with dense MLPs."""
  from pz_persist.nn import mixture_of_experts as moe  # pylint: disable=import-outside-toplevel
  if (all_layers(model, mla.Deinterleave) and not all_layers(model, mla.LatentAttentionLogits)
      and not all_layers(model, moe.MixtureOfExperts)):
    return "glm4"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only glm4.
  fields = llamalike_fields(model, like)
  parts = first_layer(model, mla.ApplyToParts, "GLM's rotary")
  fields["rope_parameters"]["partial_rotary_factor"] = parts.sizes[0] / sum(parts.sizes)
  fields["attention_bias"] = model_biases(model).query_key_value
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm4": {
        "defaults": {**LLAMA_LIKE, "rms_norm_eps": 1.5625e-07, "partial_rotary_factor": 0.5,
                     "attention_bias": True, "head_dim": 128, "num_key_value_heads": 2,
                     "max_position_embeddings": 131072},
    },
}
"""What each absent field means (``Glm4Config``'s value;
`pz_persist.pretrained.hf.record.ModelType.defaults`)."""


RECORD = Family(
    title="GLM-4-0414",
    model_types={"glm4": ModelType(glm4_plan, "Glm4ForCausalLM",
                                   **_TRANSFORMERS_DEFAULTS["glm4"])},
    detect=_detect,
    write_config=_write_config,
    adds=("norms after the attention and the MLP beside those before, a fused `gate_up_proj`,"
          " RoPE on interleaved pairs of the first `partial_rotary_factor` of each head,"
          " query/key/value biases"),
    refuses="scaled RoPE, an odd rotated width",
    rank=34,
)
