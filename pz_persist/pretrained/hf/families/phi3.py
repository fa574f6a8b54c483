"""Phi-3, Phi-3.5, Phi-4 and Phi-4-mini checkpoints (``model_type`` ``phi3``).

Phi-3 is Llama's layout (`pz_persist.pretrained.hf.building.decoder`) stored
differently, plus its own RoPE:

- The query, key and value projections are one tensor (``qkv_proj``: the
  query rows, then the key rows, then the value rows), and the MLP's gate and
  up projections another (``gate_up_proj``: gate rows, then up rows). Each
  Penzai projection reads its range of rows (`TensorSpec.rows`), so the model
  is Penzai's own llama-like one, and export writes the fused tensors back
  bit for bit.
- ``rope_type`` ``longrope`` (long-context Phi-3 and Phi-4-mini; ``su`` and
  ``yarn`` are older names transformers maps to it) becomes
  `ApplyLongRoPE`; ``partial_rotary_factor`` (Phi-4-mini's 0.75) rotates
  only a prefix of each head (`ApplyLongRoPE.rotary_dim`, or Penzai's
  ``ApplyRoPEToSubset`` without longrope). The top-level
  ``original_max_position_embeddings`` wins over the one in the RoPE dict,
  as in transformers.
- ``sliding_window`` (Phi-3-mini-4k's 2047) applies to every layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.longrope import ApplyLongRoPE
from pz_persist.nn.mixture_of_experts import MixtureOfExperts
from pz_persist.nn.offset_scale import OffsetScale
from pz_persist.pretrained import errors
from pz_persist.pretrained.hf.building import longrope
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.defaults import NO_BIASES
from pz_persist.pretrained.hf.building.fused import fused_rows
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config_from_model import activation_field
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import rms_norm_fields
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import size_fields
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_DEFAULT_THETA = 10_000.0
_DEFAULT_POSITIONS = 4096  # Phi3Config's max_position_embeddings and original_...
_LONGROPE_NAMES = ("longrope", "su", "yarn")
_LONGROPE_KEYS = frozenset({"short_factor", "long_factor", "original_max_position_embeddings",
                            "factor", "attention_factor"})
_NEUTRAL = {"lm_head_bias": False, "interpolate_factor": 1, "full_attn_mod": 1}
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _dropout(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1


def phi3_plan(cfg: Config, weights: Weights) -> Plan:
  """Llama's mapping with Phi-3's fused tensors, RoPE and window."""
  # Phi-4-mini's fields of that remote code, which transformers' Phi3 does not
  # read: accepted at the values that change nothing.
  for field, neutral in _NEUTRAL.items():
    value = cfg.get(field, neutral)
    if value != neutral:
      raise cfg.unsupported(field, value, f"transformers' Phi-3 computes as if it were {neutral!r}")
  bool_field(cfg, "attention_bias", False, False, "Phi-3's projections have no biases")
  bool_field(cfg, "mlp_bias", False, False, "Phi-3's MLP has no biases")
  rotary = _read_rope(cfg)
  window = cfg.nullable("sliding_window", None)
  shared = (llamalike_common.AttentionTypeGlobalCausal() if window is None
            else llamalike_common.AttentionTypeSlidingWindowCausal(window))
  plan = llama_plan(cfg, weights, attention=lambda layers: shared)
  specs = fused_rows(plan.tensors, _FUSED)

  def build() -> model_parts.TransformerLM:
    return pz.select(plan.build()).at_instances_of(pz.nn.ApplyRoPE).apply(rotary)

  return Plan(build, specs)


def _read_rope(cfg: Config):
  """Phi-3's RoPE, read here in full (transformers' Phi-3 reads ``longrope``
  and a partial rotary fraction, which Llama's reader refuses); Llama's
  reader is then handed the unscaled base alone. Returns the function
  replacing each of Penzai's ``ApplyRoPE`` layers."""
  key, params, kind = longrope.rope_params(cfg, _LONGROPE_NAMES, _LONGROPE_KEYS, "Phi-3")
  theta = longrope.agreeing(cfg, key, params, "rope_theta", _DEFAULT_THETA)
  fraction = longrope.agreeing(cfg, key, params, "partial_rotary_factor", 1.0)
  # Phi3Config always has the top-level field (default 4096), which wins.
  original = longrope.original_context(
      cfg, key, params, cfg.get("original_max_position_embeddings", _DEFAULT_POSITIONS), "inner")
  hidden, heads = cfg.require("hidden_size"), cfg.require("num_attention_heads")
  head_dim = cfg.get("head_dim", hidden // heads)
  rotary_dim = int(head_dim * fraction)
  if rotary_dim < 2 or rotary_dim % 2:
    raise cfg.unsupported("partial_rotary_factor", fraction,
                          f"it rotates {rotary_dim} of {head_dim} entries; RoPE needs an even"
                          " number of at least 2")
  longrope.base_only(cfg, theta)
  subset = None if rotary_dim == head_dim else rotary_dim
  if kind == "default":
    if subset is None:
      return lambda layer: layer
    return lambda layer: pz.nn.ApplyRoPEToSubset(
        embedding_axis=layer.embedding_axis, max_wavelength=layer.max_wavelength,
        rope_subset_size=subset, positions_input_name=layer.positions_input_name)

  factors = longrope.factor_lists(cfg, key, params, rotary_dim // 2)
  factor = params.get("factor")
  factor = None if factor is None else cfg.checked(f"{key}.factor", factor)
  attention_factor = params.get("attention_factor")
  if attention_factor is not None:
    attention_factor = cfg.checked(f"{key}.attention_factor", attention_factor)
  max_positions = None
  if factor is None and attention_factor is None:
    max_positions = cfg.get("max_position_embeddings", _DEFAULT_POSITIONS)

  def longrope_layer(layer: pz.nn.ApplyRoPE) -> ApplyLongRoPE:
    return ApplyLongRoPE(
        embedding_axis=layer.embedding_axis, max_wavelength=layer.max_wavelength,
        positions_input_name=layer.positions_input_name,
        original_max_position_embeddings=original, factor=factor,
        attention_factor=attention_factor, max_position_embeddings=max_positions,
        rotary_dim=subset, **factors)

  return longrope_layer


def _detect(model: pz.nn.Layer) -> str | None:
  """LongRoPE, or a partial rotary embedding on RMS-normed blocks whose norms
  multiply by ``w`` (not by ``1 + w``, `OffsetScale`, as Gemma's do) and that
  hold no experts (GLM-4.5 has partial rotary and experts)."""
  if all_layers(model, OffsetScale):
    return None
  if all_layers(model, ApplyLongRoPE):
    return "phi3"
  if (all_layers(model, pz.nn.ApplyRoPEToSubset) and not all_layers(model, pz.nn.Standardize)
      and not all_layers(model, MixtureOfExperts)):
    return "phi3"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only phi3.
  fields = without_default_head_dim({
      **size_fields(model), **rms_norm_fields(model), **activation_field(model, like),
      **tied_field(model, like), "sliding_window": windows(model)[0]})
  fields.update(rope_fields(model))
  if "short_mscale" in fields["rope_parameters"]:
    raise errors.ExportError(
        "the model's ApplyLongRoPE keeps the short factors beyond the original context"
        " (ApplyPhimoeLongRoPE), as Phi-3.5-MoE's does, not Phi-3's; export it as phimoe.")
  if "partial_rotary_factor" in like:  # Written where like has it too (top level).
    fields["partial_rotary_factor"] = fields["rope_parameters"].get("partial_rotary_factor", 1.0)
  return fields


_PHI4_MINI_REMOTE_FIELD = (
    "a field of Microsoft's remote Phi-4-mini code, which transformers' Phi-3 does not read"
    " (it computes as with this value); pz_persist refuses any other")
"""Why the Phi-4-mini remote code's fields have defaults of their own."""


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "phi3": {
        "defaults": {**LLAMA_LIKE, "rms_norm_eps": 1e-5, "sliding_window": None, "mlp_bias": False,
                     "lm_head_bias": False, "interpolate_factor": 1, "full_attn_mod": 1,
                     "partial_rotary_factor": 1.0, "original_max_position_embeddings": 4096,
                     "max_position_embeddings": 4096},
        "defaults_why": {
            "attention_bias": NO_BIASES,
            "mlp_bias": NO_BIASES,
            "lm_head_bias": _PHI4_MINI_REMOTE_FIELD,
            "interpolate_factor": _PHI4_MINI_REMOTE_FIELD,
            "full_attn_mod": _PHI4_MINI_REMOTE_FIELD,
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Phi-3, Phi-3.5, Phi-4, Phi-4-mini",
    model_types={"phi3": ModelType(
        phi3_plan, "Phi3ForCausalLM", **_TRANSFORMERS_DEFAULTS["phi3"],
        ignored_fields={
            "dropout: inactive at inference": ("resid_pdrop",),
            "the Hub's folders name Microsoft's remote code, which transformers' own Phi3 class"
            " (the reference, and what export writes) replaces": ("auto_map",),
        }, foreign_fields=frozenset({"auto_map"}))},
    detect=_detect,
    write_config=_write_config,
    adds=("fused `qkv_proj` / `gate_up_proj` read as Penzai's separate projections (and written"
          " back fused), `longrope` (`ApplyLongRoPE`), partial rotary, a window on every layer"),
    refuses="rope types other than `default` / `longrope`, biases",
    rank=50,
    fields={"short_factor": (longrope.numbers, "a list of positive numbers"),
            "long_factor": (longrope.numbers, "a list of positive numbers"),
            "resid_pdrop": (_dropout, "a number in [0, 1]"),
            "auto_map": (lambda value: isinstance(value, dict), "a JSON object"),
            "lm_head_bias": (lambda value: isinstance(value, bool), "true or false"),
            "interpolate_factor": (_number, "a number"),
            "full_attn_mod": (_number, "a number")},
)
