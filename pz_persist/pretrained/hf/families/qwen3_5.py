"""Qwen3.5 / Qwen3.6 text models (``model_type`` ``qwen3_5_text``, and the
text model inside ``qwen3_5`` multimodal folders).

The layers (gated DeltaNet beside gated attention) are
`pz_persist.pretrained.hf.building.hybrid_decoder`'s, which Qwen3.5-MoE
shares; this record is the dense model's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.building.defaults import QWEN3_5_DEFAULTS
from pz_persist.pretrained.hf.building.defaults import QWEN3_5_DEFAULTS_WHY
from pz_persist.pretrained.hf.building.hybrid_decoder import FIELDS
from pz_persist.pretrained.hf.building.hybrid_decoder import MTP_HEAD
from pz_persist.pretrained.hf.building.hybrid_decoder import MULTIMODAL_IGNORED
from pz_persist.pretrained.hf.building.hybrid_decoder import MULTIMODAL_TEXT
from pz_persist.pretrained.hf.building.hybrid_decoder import TEXT
from pz_persist.pretrained.hf.building.hybrid_decoder import TEXT_FOREIGN
from pz_persist.pretrained.hf.building.hybrid_decoder import TEXT_IGNORED
from pz_persist.pretrained.hf.building.hybrid_decoder import has_delta_net
from pz_persist.pretrained.hf.building.hybrid_decoder import hybrid_fields
from pz_persist.pretrained.hf.building.hybrid_decoder import multimodal_plan
from pz_persist.pretrained.hf.building.hybrid_decoder import qwen3_5_text_plan
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights


def qwen3_5_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps the text model of a ``qwen3_5`` (multimodal) folder: the config in
  ``text_config``, the tensors under ``model.language_model.``, the head
  ``lm_head.weight``; the vision tower and the multi-token-prediction head
  are left unread, and reported."""
  return multimodal_plan(cfg, weights, "qwen3_5_text", qwen3_5_text_plan, FIELDS,
                         RECORD.model_types["qwen3_5_text"].ignored)



def _detect(model: pz.nn.Layer) -> str | None:
  """Gated DeltaNet layers (Qwen3.5-MoE's record, of lower rank, claims
  those with mixtures of experts)."""
  return "qwen3_5_text" if has_delta_net(model) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # qwen3_5 (multimodal) is read, never written.
  return hybrid_fields(model, like)


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_5_text": {
        "defaults": dict(QWEN3_5_DEFAULTS),
        "defaults_why": dict(QWEN3_5_DEFAULTS_WHY),
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Qwen3.5 / Qwen3.6",
    model_types={
        "qwen3_5_text": ModelType(qwen3_5_text_plan, "Qwen3_5ForCausalLM",
            **_TRANSFORMERS_DEFAULTS["qwen3_5_text"], ignored_fields=TEXT_IGNORED,
            foreign_fields=TEXT_FOREIGN, left_out=(MTP_HEAD,)),
        "qwen3_5": ModelType(qwen3_5_plan, "Qwen3_5ForConditionalGeneration", exported=False,
                             written_as="qwen3_5_text", ignored_fields=MULTIMODAL_IGNORED),
    },
    detect=_detect,
    write_config=_write_config,
    adds=("gated DeltaNet linear-attention layers (`GatedDeltaNet`: causal conv, delta-rule"
          " recurrence as a scan, gated RMS norm; its state carried by `kv_caching_lm`) beside"
          " query/key-normed attention with a sigmoid output gate, partial RoPE, `1 + w` norms; the text"
          " model of `qwen3_5` folders (vision tower and MTP head not read)"),
    refuses="other rope types, attention biases, activations other than SiLU",
    rank=320,
    fields=FIELDS,
    layer_prefixes=(TEXT + "layers.", MULTIMODAL_TEXT + "layers."),
)
