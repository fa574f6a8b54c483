"""Qwen3.5 / 3.6 mixture-of-experts text models (``model_type``
``qwen3_5_moe_text``: Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B's text model).

Qwen3.5's layers (`pz_persist.pretrained.hf.building.hybrid_decoder`: gated
DeltaNet beside gated attention) with a mixture of experts in place of every
MLP (`pz_persist.nn.mixture_of_experts.MixtureOfExperts`): a
softmax router over ``num_experts``, the top ``num_experts_per_tok`` always
renormalised over the chosen (transformers' ``Qwen3_5MoeTopKRouter``
divides by their sum whatever ``norm_topk_prob`` says, and the config has no
such field), SwiGLU experts of ``moe_intermediate_size``, plus a shared
SwiGLU expert of ``shared_expert_intermediate_size`` whose output is
multiplied by ``sigmoid(shared_expert_gate(x))`` (one logit per token).

The text model inside multimodal ``qwen3_5_moe`` folders (tensors under
``model.language_model.``) is read too, as `qwen3_5` reads ``qwen3_5``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.building import hybrid_decoder
from pz_persist.pretrained.hf.building.defaults import QWEN3_5_DEFAULTS
from pz_persist.pretrained.hf.building.defaults import QWEN3_5_DEFAULTS_WHY
from pz_persist.pretrained.hf.building.hybrid_moe import hybrid_moe_plan
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY_IGNORED
from pz_persist.pretrained.hf.building.moe import mixtures
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_DEFAULTS = {"hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2,
             "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
             "num_experts_per_tok": 8, "num_experts": 256}
"""transformers' ``Qwen3_5MoeTextConfig`` defaults where they differ from
the dense model's."""


_FIELDS = {**hybrid_decoder.FIELDS, **dict.fromkeys(
    ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
     "shared_expert_intermediate_size"), POSITIVE_INT), **TRAINING_ONLY}
"""Qwen3.5's fields, the experts' sizes and the router's training-only ones."""

def qwen3_5_moe_text_plan(cfg: Config, weights: Weights, root: str = "model.",
                          tied: bool | None = None) -> Plan:
  """Qwen3.5's plan with every MLP a mixture of experts and a gated shared
  expert (`pz_persist.pretrained.hf.building.hybrid_moe`), the text
  model's tensors under ``root``."""
  return hybrid_moe_plan(cfg, weights, root, tied, defaults=_DEFAULTS)


def qwen3_5_moe_plan(cfg: Config, weights: Weights) -> Plan:
  """The text model of a ``qwen3_5_moe`` (multimodal) folder: the config in
  ``text_config``, tensors under ``model.language_model.``; the vision tower
  and the multi-token-prediction head are not read, and reported."""
  return hybrid_decoder.multimodal_plan(cfg, weights, "qwen3_5_moe_text", qwen3_5_moe_text_plan,
                                        _FIELDS,
                                        RECORD.model_types["qwen3_5_moe_text"].ignored)


def _detect(model: pz.nn.Layer) -> str | None:
  """Qwen3.5's gated DeltaNet layers with mixtures of experts."""
  if hybrid_decoder.has_delta_net(model) and any(layer is not None for layer in mixtures(model)):
    return "qwen3_5_moe_text"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only qwen3_5_moe_text.
  fields = hybrid_decoder.hybrid_fields(model, like)
  fields.pop("intermediate_size", None)
  first = next(layer for layer in mixtures(model) if layer is not None)
  gate = named_shape(all_layers(first.experts, pz.nn.Linear)[0])
  shared = named_shape(all_layers(first.shared, pz.nn.Linear)[0])
  fields.update(num_experts=gate["experts"], moe_intermediate_size=gate["neurons"],
                num_experts_per_tok=first.router.top_k,
                shared_expert_intermediate_size=shared["neurons"])
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_5_moe_text": {
        "defaults": {**QWEN3_5_DEFAULTS, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                     "shared_expert_intermediate_size": 512},
        "defaults_why": dict(QWEN3_5_DEFAULTS_WHY),
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Qwen3.5 / Qwen3.6 MoE",
    model_types={
        "qwen3_5_moe_text": ModelType(qwen3_5_moe_text_plan, "Qwen3_5MoeForCausalLM",
            **_TRANSFORMERS_DEFAULTS["qwen3_5_moe_text"],
            ignored_fields={**hybrid_decoder.TEXT_IGNORED, **TRAINING_ONLY_IGNORED},
            foreign_fields=hybrid_decoder.TEXT_FOREIGN | {"router_jitter_noise"},
            left_out=(hybrid_decoder.MTP_HEAD,)),
        "qwen3_5_moe": ModelType(qwen3_5_moe_plan, "Qwen3_5MoeForConditionalGeneration",
                                 exported=False, written_as="qwen3_5_moe_text",
                                 ignored_fields=hybrid_decoder.MULTIMODAL_IGNORED),
    },
    detect=_detect,
    write_config=_write_config,
    adds=("Qwen3.5's layers with a `MixtureOfExperts` in every block: softmax router, top-k"
          " renormalised, experts on an `experts` axis, a shared SwiGLU expert gated by"
          " `sigmoid(shared_expert_gate)`; the text model of `qwen3_5_moe` folders"),
    refuses="what Qwen3.5 refuses",
    rank=310,
    fields=_FIELDS,
)
