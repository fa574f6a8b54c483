"""Hunyuan dense checkpoints (``model_type`` ``hunyuan_v1_dense``).

Llama's layout with Hunyuan's attention, as transformers'
``HunYuanDenseV1ForCausalLM`` computes it
(`pz_persist.pretrained.hf.building.hunyuan`): query/key RMS norms after
RoPE, and RoPE of type ``dynamic`` with an ``alpha`` read as the fixed base
transformers computes from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.hunyuan import ADDS
from pz_persist.pretrained.hf.building.hunyuan import FIELDS
from pz_persist.pretrained.hf.building.hunyuan import REFUSES
from pz_persist.pretrained.hf.building.hunyuan import hunyuan_plan
from pz_persist.pretrained.hf.building.hunyuan import norms_after_rope
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType


def _detect(model: pz.nn.Layer) -> str | None:
  """Query/key norms after RoPE (Hunyuan MoE, whose experts set it apart,
  is asked first)."""
  return "hunyuan_v1_dense" if norms_after_rope(model) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only hunyuan_v1_dense.
  return {**llamalike_fields(model, like), "attention_bias": model_biases(model).output}


RECORD = Family(
    title="Hunyuan (dense)",
    model_types={"hunyuan_v1_dense": ModelType(
        hunyuan_plan, "HunYuanDenseV1ForCausalLM",
        defaults={**LLAMA_LIKE, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048},
        ignored_fields={"the end-of-document token id, read by no layer": ("eod_token_id",)})},
    detect=_detect,
    write_config=_write_config,
    adds=ADDS,
    refuses=REFUSES,
    rank=344,
    fields=FIELDS,
)
