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

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.building import hybrid_decoder
from pz_persist.pretrained.hf.building.defaults import QWEN3_5_DEFAULTS
from pz_persist.pretrained.hf.building.defaults import QWEN3_5_DEFAULTS_WHY
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY_IGNORED
from pz_persist.pretrained.hf.building.moe import ExpertNames
from pz_persist.pretrained.hf.building.moe import Experts
from pz_persist.pretrained.hf.building.moe import check_experts
from pz_persist.pretrained.hf.building.moe import mixtures
from pz_persist.pretrained.hf.building.moe import read_experts
from pz_persist.pretrained.hf.building.moe import softmax_router
from pz_persist.pretrained.hf.building.moe import with_experts
from pz_persist.pretrained.hf.building.moe import with_gated_shared_expert
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Stacked
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
  expert, the text model's tensors under ``root``."""
  for key, default in _DEFAULTS.items():
    if cfg.raw.get(key) is None:
      cfg.raw[key] = default
  count, top_k, neurons = read_experts(cfg, "num_experts", "moe_intermediate_size")
  shared = cfg.require("shared_expert_intermediate_size")
  # No dense MLP: the dense plan's placeholder size is the experts' (its
  # MLPs are all replaced before anything is allocated).
  if cfg.raw.get("intermediate_size") is None:
    cfg.raw["intermediate_size"] = neurons
  plan = hybrid_decoder.qwen3_5_text_plan(cfg, weights, root=root, tied=tied)
  layers = cfg.require("num_hidden_layers")
  hidden = cfg.require("hidden_size")
  experts = Experts(count, top_k, neurons, True, tuple(range(layers)), ExpertNames())
  # The experts' shared loader names layers ``model.layers.{i}.``: it is
  # given the names as if under that root, and its specs are moved back.
  names = {_LAYERS + n[len(root) + len("layers."):] if n.startswith(root + "layers.") else n
           for n in weights.names}
  check_experts(cfg, types.SimpleNamespace(names=names,
                                           stand_in=getattr(weights, "stand_in", False)),
                experts, "num_experts")
  routed = with_experts(plan, experts, hidden, names, softmax_router(normalize_always=True))
  plan = Plan(routed.build, tuple(_moved(spec, root) if spec.label.split("/")[2:3] == ["mlp"]
                                  else spec for spec in routed.tensors),
              tuple(Stacked(_rooted(v.name, root), tuple(_rooted(p, root) for p in v.parts))
                    if isinstance(v, Stacked) else v for v in routed.views))
  return with_gated_shared_expert(plan, {i: f"{root}layers.{i}.mlp." for i in range(layers)},
                                  shared, hidden)


_LAYERS = "model.layers."


def _rooted(name: str, root: str) -> str:
  return root + "layers." + name[len(_LAYERS):] if name.startswith(_LAYERS) else name


def _moved(spec: TensorSpec, root: str) -> TensorSpec:
  return dataclasses.replace(spec, source=_rooted(spec.source, root))


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
            foreign_fields=hybrid_decoder.TEXT_FOREIGN | {"router_jitter_noise"}),
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
    rank=31,
    fields=_FIELDS,
)
