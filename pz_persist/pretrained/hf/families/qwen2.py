"""Qwen2 and Qwen2.5 checkpoints (``model_type`` ``qwen2``).

Qwen2 is Llama's layout (`pz_persist.pretrained.hf.building.decoder`) with a
bias on the query, key and value projections (none on the output projection
or in the MLP) and its own way of choosing which layers attend through a
sliding window.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.defaults import NO_BIASES
from pz_persist.pretrained.hf.building.defaults import QWEN_WINDOW
from pz_persist.pretrained.hf.building.defaults import QWEN_WINDOW_WHY
from pz_persist.pretrained.hf.building.qwen_windows import qwen2_attention
from pz_persist.pretrained.hf.building.qwen_windows import window_fields
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights


def qwen2_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Qwen2 / Qwen2.5 checkpoint to Penzai (Llama's mapping, with
  query/key/value biases and Qwen2's per-layer attention)."""
  bool_field(cfg, "use_mrope", False, False,
             "multimodal RoPE belongs to Qwen2-VL (model_type qwen2_vl), whose"
             " text model this loader does not build")
  return llama_plan(cfg, weights, attention=qwen2_attention(cfg),
                    biases=Biases(query_key_value=True))


def _detect(model: pz.nn.Layer) -> str | None:
  return "qwen2" if model_biases(model) == Biases(query_key_value=True) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only qwen2.
  return without_default_head_dim({**llamalike_fields(model, like), **window_fields(model, like)})


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": {
        "defaults": {**LLAMA_LIKE, **QWEN_WINDOW, "use_mrope": False,
                     "max_position_embeddings": 32768},
        "defaults_why": {
            **QWEN_WINDOW_WHY,
            "attention_bias": NO_BIASES,
            "use_mrope": (
                "Qwen2-VL's field, which transformers' Qwen2 does not have; pz_persist "
                'refuses true'),
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Qwen2, Qwen2.5",
    model_types={"qwen2": ModelType(qwen2_plan, "Qwen2ForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["qwen2"])},
    detect=_detect,
    write_config=_write_config,
    adds=("query/key/value biases; `use_sliding_window`, `sliding_window`, `max_window_layers`,"
          " `layer_types` per layer as transformers maps them; scaled RoPE"),
    refuses="`use_mrope` (Qwen2-VL)",
    rank=40,
)
