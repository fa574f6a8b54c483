"""Qwen2 and Qwen2.5 checkpoints (``model_type`` ``qwen2``), and the language
model of Qwen2-VL and Qwen2.5-VL folders (``qwen2_vl``, ``qwen2_5_vl``).

Qwen2 is Llama's layout (`pz_persist.pretrained.hf.building.decoder`) with a
bias on the query, key and value projections (none on the output projection
or in the MLP) and its own way of choosing which layers attend through a
sliding window.

A Qwen2-VL / Qwen2.5-VL folder's language model is that very decoder
(``Qwen2_5_VLTextModel``), with multimodal RoPE: at the positions of a
text-only input it is ordinary RoPE
(`pz_persist.pretrained.hf.building.vision_language`). Its config is
``text_config`` or, in the Hub's older files, the folder's own fields; its
tensors are under ``model.language_model.`` or (older saves) ``model.``,
the head ``lm_head.weight``. The vision tower (``visual.*``) and its merger
are not read, and the load says so (a warning on the
``pz_persist.pretrained.hf`` logger, naming how many); the model is exported
as ``qwen2``.
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
from pz_persist.pretrained.hf.building.ignored import OTHER_MODALITIES
from pz_persist.pretrained.hf.building.qwen_windows import qwen2_attention
from pz_persist.pretrained.hf.building.qwen_windows import window_fields
from pz_persist.pretrained.hf.building.vision_language import QWEN_VL_FOLDER_FIELDS
from pz_persist.pretrained.hf.building.vision_language import QWEN_VL_LAYOUTS
from pz_persist.pretrained.hf.building.vision_language import VL_FIELDS
from pz_persist.pretrained.hf.building.vision_language import qwen_vl_text_config
from pz_persist.pretrained.hf.building.vision_language import renamed_plan
from pz_persist.pretrained.hf.building.vision_language import text_positions_rope
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


def qwen2_vl_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps the language model of a ``qwen2_vl`` / ``qwen2_5_vl`` folder (module
  docstring); the vision tower is left unread, and reported."""
  text_cfg = qwen_vl_text_config(cfg, RECORD.fields, _VL_FOLDER_FIELDS)
  # transformers' default sections, [16, 24, 24], when the file has none.
  text_positions_rope(text_cfg, interleaved=False, default_section=[16, 24, 24])
  return renamed_plan(cfg, weights, QWEN_VL_LAYOUTS, lambda seen: qwen2_plan(text_cfg, seen),
                      "Qwen2-VL's language model only")


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

_VL_FOLDER_FIELDS = QWEN_VL_FOLDER_FIELDS | {"vision_token_id"}
"""The Hub's Qwen2-VL / Qwen2.5-VL files also hold ``vision_token_id``."""

_VL_DEFAULTS: dict[str, Any] = {
    "defaults": {**LLAMA_LIKE, **QWEN_WINDOW, "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0,
                 "max_window_layers": 80, "max_position_embeddings": 32768},
    "defaults_why": {**QWEN_WINDOW_WHY, "attention_bias": NO_BIASES},
}
"""Qwen2-VL's and Qwen2.5-VL's text model (``Qwen2VLTextConfig``,
``Qwen2_5_VLTextConfig``: the same defaults), which differ from Qwen2's."""


RECORD = Family(
    title="Qwen2, Qwen2.5; Qwen2-VL and Qwen2.5-VL's language model",
    model_types={
        "qwen2": ModelType(qwen2_plan, "Qwen2ForCausalLM", **_TRANSFORMERS_DEFAULTS["qwen2"]),
        **{folder: ModelType(qwen2_vl_plan, architecture, exported=False, written_as="qwen2",
                             ignored_fields={OTHER_MODALITIES: tuple(sorted(
                                 _VL_FOLDER_FIELDS))},
                             foreign_fields=frozenset({"vision_token_id"}), **_VL_DEFAULTS)
           for folder, architecture in (("qwen2_vl", "Qwen2VLForConditionalGeneration"),
                                        ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"))},
    },
    detect=_detect,
    write_config=_write_config,
    adds=("query/key/value biases; `use_sliding_window`, `sliding_window`, `max_window_layers`,"
          " `layer_types` per layer as transformers maps them; scaled RoPE; the language model"
          " of `qwen2_vl` / `qwen2_5_vl` folders (multimodal RoPE at text positions; the vision"
          " tower is not read, and the load says so)"),
    refuses="`use_mrope` (Qwen2-VL's field) in a `qwen2` folder; multimodal RoPE sections"
            " that do not cover half a head",
    rank=400,
    fields=VL_FIELDS,
)
