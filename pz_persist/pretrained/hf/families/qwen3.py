"""Qwen3 checkpoints (``model_type`` ``qwen3``): dense, tied or untied.

Qwen3 is Llama's layout (`pz_persist.pretrained.hf.building.decoder`) with
Qwen2's choice of sliding-window layers, no query/key/value biases (its
``attention_bias`` biases all four projections, as Llama's), and an RMS norm
on the queries and the keys: after their projection, before RoPE, over each
head's ``projection`` axis (``self_attn.q_norm`` / ``k_norm``: one weight of
``head_dim`` shared by all heads, epsilon ``rms_norm_eps``). In Penzai that
norm is an ``RMSLayerNorm`` placed right after the projection's ``Linear``,
named after it: ``attention/query_norm/scale.weights``.

A Qwen3-VL folder's (``qwen3_vl``) language model is that decoder without
the window fields (``Qwen3VLTextModel``: every layer global), with
interleaved multimodal RoPE, which at the positions of a text-only input is
ordinary RoPE (`pz_persist.pretrained.hf.building.vision_language`), and
DeepStack: visual features added to the first layers' outputs, at image and
video tokens only (none in a text-only input). Its config is
``text_config``; its tensors are under ``model.language_model.`` (or
``model.``), the head ``lm_head.weight``. The vision tower and its mergers
(``model.visual.*``) are not read, and the load says so (a warning on the
``pz_persist.pretrained.hf`` logger, naming how many); the model is exported
as ``qwen3``.
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
from pz_persist.pretrained.hf.building.ignored import OTHER_MODALITIES
from pz_persist.pretrained.hf.building.norms import query_key_norm_specs
from pz_persist.pretrained.hf.building.norms import with_query_key_norms
from pz_persist.pretrained.hf.building.qwen_windows import qwen2_attention
from pz_persist.pretrained.hf.building.qwen_windows import window_fields
from pz_persist.pretrained.hf.building.vision_language import QWEN_VL_FOLDER_FIELDS
from pz_persist.pretrained.hf.building.vision_language import QWEN_VL_LAYOUTS
from pz_persist.pretrained.hf.building.vision_language import VL_FIELDS
from pz_persist.pretrained.hf.building.vision_language import qwen3_vl_global_attention
from pz_persist.pretrained.hf.building.vision_language import qwen_vl_text_config
from pz_persist.pretrained.hf.building.vision_language import renamed_plan
from pz_persist.pretrained.hf.building.vision_language import text_positions_rope
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


def qwen3_vl_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps the language model of a ``qwen3_vl`` folder (module docstring); the
  vision tower is left unread, and reported."""
  text_cfg = qwen_vl_text_config(cfg, RECORD.fields)
  qwen3_vl_global_attention(text_cfg, "Qwen3-VL")
  # transformers' default sections, [24, 20, 20], when the file has none.
  text_positions_rope(text_cfg, interleaved=True, default_section=[24, 20, 20])
  return renamed_plan(cfg, weights, QWEN_VL_LAYOUTS, lambda seen: qwen3_plan(text_cfg, seen),
                      "Qwen3-VL's language model only")


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

_VL_DEFAULTS: dict[str, Any] = {
    "defaults": {**LLAMA_LIKE, **QWEN_WINDOW, "head_dim": 128, "rope_theta": 500_000.0,
                 "max_position_embeddings": 128_000},
    "defaults_why": {**QWEN_WINDOW_WHY, **dict.fromkeys(
        ("use_sliding_window", "max_window_layers"),
        "Qwen3's window field, which Qwen3VLTextConfig lacks: every layer is global, and"
        " pz_persist refuses a window")},
}
"""Qwen3-VL's text model (``Qwen3VLTextConfig``), whose defaults differ from
Qwen3's."""


RECORD = Family(
    title="Qwen3; Qwen3-VL's language model",
    model_types={
        "qwen3": ModelType(qwen3_plan, "Qwen3ForCausalLM", **_TRANSFORMERS_DEFAULTS["qwen3"]),
        "qwen3_vl": ModelType(qwen3_vl_plan, "Qwen3VLForConditionalGeneration", exported=False,
                              written_as="qwen3", ignored_fields={OTHER_MODALITIES: tuple(
                                  sorted(QWEN_VL_FOLDER_FIELDS))}, **_VL_DEFAULTS),
    },
    detect=_detect,
    write_config=_write_config,
    adds=("query/key RMS norms (`RMSLayerNorm` after each projection); Qwen2's sliding-window"
          " fields; tied or untied embeddings; scaled RoPE; the language model of `qwen3_vl`"
          " folders (interleaved multimodal RoPE at text positions; the vision tower and"
          " DeepStack mergers are not read, and the load says so)"),
    refuses="an MLP bias, other rope types (its mixture of experts is `qwen3_moe`)",
    rank=350,
    fields=VL_FIELDS,
)
