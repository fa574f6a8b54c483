"""Qwen1.5-MoE and Qwen2-MoE checkpoints (``model_type`` ``qwen2_moe``:
Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).

Qwen2's attention (query/key/value biases, switched by ``qkv_bias``) with,
in layer ``i`` when ``i`` is not in ``mlp_only_layers`` and ``(i + 1) %
decoder_sparse_step == 0``, a mixture of experts in place of the MLP
(`pz_persist.nn.mixture_of_experts.MixtureOfExperts`): a softmax router over
``num_experts``, the top ``num_experts_per_tok`` renormalised over them if
``norm_topk_prob``, SwiGLU experts of ``moe_intermediate_size``, plus a
shared SwiGLU expert of ``shared_expert_intermediate_size`` whose output is
multiplied by ``sigmoid(shared_expert_gate(x))`` (one logit per token). The
other layers keep a dense MLP of ``intermediate_size``.

The window: ``layer_types`` when present (transformers 5 writes it);
without it (the Hub's configs, written by transformers 4), transformers'
``Qwen2MoeConfig`` windows every other layer from the first below
``max_window_layers`` when ``use_sliding_window`` (not Qwen2's rule, which
windows the layers from ``max_window_layers`` on).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.building.defaults import QWEN_WINDOW
from pz_persist.pretrained.hf.building.defaults import QWEN_WINDOW_WHY
from pz_persist.pretrained.hf.building.moe import LAYER_LIST
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY_IGNORED
from pz_persist.pretrained.hf.building.moe import ExpertNames
from pz_persist.pretrained.hf.building.moe import Experts
from pz_persist.pretrained.hf.building.moe import check_experts
from pz_persist.pretrained.hf.building.moe import config_activation
from pz_persist.pretrained.hf.building.moe import expert_fields
from pz_persist.pretrained.hf.building.moe import mixtures
from pz_persist.pretrained.hf.building.moe import read_experts
from pz_persist.pretrained.hf.building.moe import routed_layers
from pz_persist.pretrained.hf.building.moe import softmax_routed
from pz_persist.pretrained.hf.building.moe import softmax_router
from pz_persist.pretrained.hf.building.moe import sparse_step_fields
from pz_persist.pretrained.hf.building.moe import with_experts
from pz_persist.pretrained.hf.building.moe import with_gated_shared_expert
from pz_persist.pretrained.hf.building.qwen_windows import qwen2_attention
from pz_persist.pretrained.hf.building.qwen_windows import qwen2_moe_sliding
from pz_persist.pretrained.hf.building.qwen_windows import window_fields
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

FIELDS = {
    "num_experts": POSITIVE_INT,
    "num_experts_per_tok": POSITIVE_INT,
    "moe_intermediate_size": POSITIVE_INT,
    "shared_expert_intermediate_size": POSITIVE_INT,
    "norm_topk_prob": BOOLEAN,
    "qkv_bias": BOOLEAN,
    "decoder_sparse_step": POSITIVE_INT,
    "mlp_only_layers": LAYER_LIST,
    **TRAINING_ONLY,
}


def qwen2_moe_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Qwen2-MoE checkpoint (transformers' ``Qwen2MoeConfig`` defaults)."""
  experts_count, top_k, neurons = read_experts(cfg, "num_experts", "moe_intermediate_size")
  shared = cfg.require("shared_expert_intermediate_size")
  normalize = cfg.get("norm_topk_prob", False)
  routed = routed_layers(cfg)
  attention = qwen2_attention(cfg, qwen2_moe_sliding, zero_is_no_window=True)
  plan = llama_plan(cfg, weights, attention=attention,
                    biases=Biases(query_key_value=cfg.get("qkv_bias", True)),
                    max_positions_default=32768)
  # llama_plan checked num_hidden_layers against the weights, and hidden_act.
  experts = Experts(experts_count, top_k, neurons, normalize,
                    routed(cfg.require("num_hidden_layers")), ExpertNames())
  check_experts(cfg, weights, experts, "num_experts")
  activation = config_activation(cfg)
  hidden = cfg.require("hidden_size")
  plan = with_experts(plan, experts, hidden, weights.names, softmax_router(), activation)
  return with_gated_shared_expert(plan, {i: f"model.layers.{i}.mlp." for i in experts.layers},
                                  shared, hidden, activation)


def _detect(model: pz.nn.Layer) -> str | None:
  """Softmax-routed mixtures with a gated shared expert, no query norms."""
  found = [layer for layer in mixtures(model) if layer is not None]
  if (found and all(softmax_routed(layer, gated_shared=True) for layer in found)
      and not all_layers(attention(model).input_to_query, pz.nn.RMSLayerNorm)):
    return "qwen2_moe"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only qwen2_moe.
  fields = expert_fields(model, like, gated_shared=True)
  experts, neurons = fields.pop("_experts"), fields.pop("_neurons")
  first = next(layer for layer in mixtures(model) if layer is not None)
  shared = named_shape(all_layers(first.shared, pz.nn.Linear)[0])["neurons"]
  fields.update({
      "num_experts": experts, "moe_intermediate_size": neurons,
      "shared_expert_intermediate_size": shared, **sparse_step_fields(model, like),
      "qkv_bias": model_biases(model).query_key_value,
      **window_fields(model, like, derive_first=False),
  })
  return without_default_head_dim(fields)


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_moe": {
        "defaults": {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10_000.0,
                     "partial_rotary_factor": 1.0, "rms_norm_eps": 1e-6, **QWEN_WINDOW,
                     "intermediate_size": 5632, "decoder_sparse_step": 1,
                     "norm_topk_prob": False, "num_experts_per_tok": 4, "num_experts": 60,
                     "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                     "qkv_bias": True, "mlp_only_layers": [],
                     "max_position_embeddings": 32768},
        "defaults_why": dict(QWEN_WINDOW_WHY),
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Qwen1.5-MoE, Qwen2-MoE",
    model_types={"qwen2_moe": ModelType(qwen2_moe_plan, "Qwen2MoeForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["qwen2_moe"],
                     ignored_fields=TRAINING_ONLY_IGNORED,
                     foreign_fields=frozenset({"router_jitter_noise"}))},
    detect=_detect,
    write_config=_write_config,
    adds=("Qwen2's attention (`qkv_bias`) with a mixture of experts (`MixtureOfExperts`:"
          " softmax router, top-k, `norm_topk_prob`) and a shared SwiGLU expert gated by"
          " `sigmoid(shared_expert_gate)`; `decoder_sparse_step`, `mlp_only_layers` dense"
          " layers; `layer_types` or Qwen2-MoE's own window rule"),
    refuses="an output-projection or MLP bias, other rope types, partial rotary",
    rank=340,
    fields=FIELDS,
)
