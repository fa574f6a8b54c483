"""LiquidAI LFM2 (``model_type`` ``lfm2``: LFM2-350M, 700M, 1.2B, 2.6B).

The layers (short double-gated convolutions among query/key-normed
attention layers) are `pz_persist.pretrained.hf.building.lfm2_layers`'s,
which LFM2-MoE shares; this record is the dense model's, whose MLP width
follows transformers' auto-adjust rules (``block_auto_adjust_ff_dim``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.nn.mixture_of_experts import MixtureOfExperts
from pz_persist.pretrained.hf.building.lfm2_layers import FIELDS
from pz_persist.pretrained.hf.building.lfm2_layers import FOREIGN
from pz_persist.pretrained.hf.building.lfm2_layers import IGNORED
from pz_persist.pretrained.hf.building.lfm2_layers import has_short_conv
from pz_persist.pretrained.hf.building.lfm2_layers import lfm2_fields
from pz_persist.pretrained.hf.building.lfm2_layers import lfm2_plan
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType


def _detect(model: pz.nn.Layer) -> str | None:
  """Short convolution layers without experts (LFM2-MoE's record, of lower
  rank, claims those with)."""
  return "lfm2" if has_short_conv(model) and not all_layers(model, MixtureOfExperts) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only lfm2.
  return lfm2_fields(model, like)


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "lfm2": {
        "defaults": {
            "vocab_size": 65536, "hidden_size": 2560, "intermediate_size": 12288,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "norm_eps": 1e-5, "tie_word_embeddings": True, "rope_theta": 1e6,
            "partial_rotary_factor": 1.0, "conv_bias": False, "conv_L_cache": 3,
            "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": True},
        "defaults_why": {},
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="LiquidAI LFM2",
    model_types={
        "lfm2": ModelType(lfm2_plan, "Lfm2ForCausalLM", **_TRANSFORMERS_DEFAULTS["lfm2"],
                          ignored_fields=IGNORED, foreign_fields=FOREIGN),
    },
    detect=_detect,
    write_config=_write_config,
    adds=("short double-gated causal convolutions (`ShortConv`: in_proj split into input gate,"
          " output gate and value, depthwise `conv_L_cache`-tap kernel; its state carried by"
          " `kv_caching_lm`) among grouped-query attention layers with per-head query/key RMS"
          " norms; `layer_types` or `full_attn_idxs`; the SwiGLU width's auto-adjust rules"
          " (`block_ff_dim`, `block_ffn_dim_multiplier`, `block_multiple_of`)"),
    refuses=("other rope types, partial rotary; the Hub's LiquidAI-only fields (`block_dim`,"
             " `conv_dim`, `num_heads`, `theta`, `use_pos_enc`...) when they disagree with the"
             " ones transformers reads"),
    rank=270,
    fields=FIELDS,
)
