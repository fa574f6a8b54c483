"""Qwen3 checkpoints (``model_type`` ``qwen3``): dense, tied or untied.

Qwen3 is Llama's layout (`pz_persist.pretrained.hf.building.decoder`) with
Qwen2's choice of sliding-window layers, no query/key/value biases (its
``attention_bias`` biases all four projections, as Llama's), and an RMS norm
on the queries and the keys: after their projection, before RoPE, over each
head's ``projection`` axis (``self_attn.q_norm`` / ``k_norm``: one weight of
``head_dim`` shared by all heads, epsilon ``rms_norm_eps``). In Penzai that
norm is an ``RMSLayerNorm`` placed right after the projection's ``Linear``,
named after it: ``attention/query_norm/scale.weights``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.defaults import QWEN_WINDOW
from pz_persist.pretrained.hf.building.defaults import QWEN_WINDOW_WHY
from pz_persist.pretrained.hf.building.norms import query_key_norm_specs
from pz_persist.pretrained.hf.building.norms import with_query_key_norms
from pz_persist.pretrained.hf.building.qwen_windows import qwen2_attention
from pz_persist.pretrained.hf.building.qwen_windows import window_fields
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights


def qwen3_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Qwen3 checkpoint (transformers' ``Qwen3Config`` defaults:
  ``head_dim`` 128, 32768 positions)."""
  bias = cfg.get("attention_bias", False)
  return llama_plan(cfg, weights, attention=qwen2_attention(cfg),
                    biases=Biases(query_key_value=bias, output=bias),
                    head_dim_default=128, max_positions_default=32768,
                    block_extras=query_key_norm_specs, edit=with_query_key_norms)


def _detect(model: pz.nn.Layer) -> str | None:
  """Llama's layout with a norm among the query's layers."""
  return "qwen3" if all_layers(attention(model).input_to_query, pz.nn.RMSLayerNorm) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only qwen3.
  return {**llamalike_fields(model, like), **window_fields(model, like),
          "attention_bias": model_biases(model).output}


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {
        "defaults": {**LLAMA_LIKE, **QWEN_WINDOW, "head_dim": 128,
                     "max_position_embeddings": 32768},
        "defaults_why": {
            **QWEN_WINDOW_WHY,
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Qwen3",
    model_types={"qwen3": ModelType(qwen3_plan, "Qwen3ForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["qwen3"])},
    detect=_detect,
    write_config=_write_config,
    adds=("query/key RMS norms (`RMSLayerNorm` after each projection); Qwen2's sliding-window"
          " fields; tied or untied embeddings; scaled RoPE"),
    refuses="an MLP bias, other rope types (its mixture of experts is `qwen3_moe`)",
    rank=35,
)
