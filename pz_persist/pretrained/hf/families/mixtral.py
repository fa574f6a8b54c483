"""Mixtral checkpoints (``model_type`` ``mixtral``: Mixtral 8x7B, 8x22B).

Mistral's layout (`pz_persist.pretrained.hf.building.decoder`) with a mixture
of ``num_local_experts`` SwiGLU experts of ``intermediate_size`` in every
layer (``block_sparse_moe``: router ``gate``, experts' ``w1`` (gate), ``w3``
(up), ``w2`` (down)); the router is a softmax over the experts, the top
``num_experts_per_tok`` chosen and always renormalised over them
(`pz_persist.nn.mixture_of_experts`). Unlike Mistral's,
Mixtral's transformers config has no window by default (``sliding_window``
absent or null: global attention), ``rope_theta`` 1e6 and epsilon 1e-5.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained import errors
from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.defaults import NO_BIASES
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY_IGNORED
from pz_persist.pretrained.hf.building.moe import ExpertNames
from pz_persist.pretrained.hf.building.moe import Experts
from pz_persist.pretrained.hf.building.moe import check_experts
from pz_persist.pretrained.hf.building.moe import expert_fields
from pz_persist.pretrained.hf.building.moe import mixtures
from pz_persist.pretrained.hf.building.moe import read_experts
from pz_persist.pretrained.hf.building.moe import softmax_routed
from pz_persist.pretrained.hf.building.moe import softmax_router
from pz_persist.pretrained.hf.building.moe import with_experts
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

NAMES = ExpertNames(block="block_sparse_moe", router="gate", gate="w1", up="w3", down="w2")

FIELDS = {"num_local_experts": POSITIVE_INT, "num_experts_per_tok": POSITIVE_INT,
          **TRAINING_ONLY}


def mixtral_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Mixtral checkpoint (transformers' ``MixtralConfig`` defaults)."""
  experts_count, top_k, neurons = read_experts(cfg, "num_local_experts", "intermediate_size")
  window = cfg.nullable("sliding_window", None)
  kind = (llamalike_common.AttentionTypeGlobalCausal() if window is None
          else llamalike_common.AttentionTypeSlidingWindowCausal(window))
  plan = llama_plan(cfg, weights, attention=lambda count: kind, biases=Biases(),
                    max_positions_default=4096 * 32)
  layers = cfg.require("num_hidden_layers")  # Checked against the weights by llama_plan.
  experts = Experts(experts_count, top_k, neurons, True, tuple(range(layers)), NAMES)
  check_experts(cfg, weights, experts, "num_local_experts")
  return with_experts(plan, experts, cfg.require("hidden_size"), weights.names,
                      softmax_router(normalize_always=True))


def _detect(model: pz.nn.Layer) -> str | None:
  """Every block a softmax-routed mixture, renormalised, with no query norm."""
  found = mixtures(model)
  if (found and all(layer is not None and softmax_routed(layer) and layer.router.normalize
                    for layer in found)
      and not all_layers(attention(model).input_to_query, pz.nn.RMSLayerNorm)):
    return "mixtral"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only mixtral.
  fields = expert_fields(model, like)
  fields.pop("norm_topk_prob")  # Mixtral always renormalises (the plan checks it).
  experts, neurons = fields.pop("_experts"), fields.pop("_neurons")
  found_windows = set(windows(model))
  if len(found_windows) > 1:
    raise errors.ExportError(
        "the model's blocks attend through different windows; Mixtral has one window for"
        f" every layer or none (found {sorted(found_windows, key=str)}).")
  fields.update({"num_local_experts": experts, "intermediate_size": neurons,
                 "sliding_window": found_windows.pop()})
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {
        "defaults": {**LLAMA_LIKE, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
                     "intermediate_size": 14336,
                     "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "max_position_embeddings": 131_072},
        "defaults_why": {
            "attention_bias": NO_BIASES,
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Mixtral",
    model_types={"mixtral": ModelType(mixtral_plan, "MixtralForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["mixtral"],
                     ignored_fields=TRAINING_ONLY_IGNORED)},
    detect=_detect,
    write_config=_write_config,
    adds=("Mistral's layout with a mixture of experts in every layer (`MixtureOfExperts`:"
          " softmax router, top-k renormalised; experts on an `experts` axis, read from the"
          " Hub's per-expert `w1`/`w3`/`w2`); optional sliding window"),
    refuses="attention or MLP biases, other rope types, partial rotary",
    rank=850,
    fields=FIELDS,
)
