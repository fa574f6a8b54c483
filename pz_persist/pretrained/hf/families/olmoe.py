"""OLMoE checkpoints (``model_type`` ``olmoe``: OLMoE-1B-7B).

Llama's pre-norm layout (`pz_persist.pretrained.hf.building.decoder`) with:

- query and key RMS norms over the whole projection, every head at once
  (``q_norm`` over ``hidden_size``, ``k_norm`` over the key/value heads'
  dimensions), as OLMo 2's (`pz_persist.pretrained.hf.building.post_norms`),
  but with the norms before attention and MLP;
- ``clip_qkv``: the query, key and value clamped to ``[-clip_qkv,
  clip_qkv]`` after the norms, before RoPE
  (`pz_persist.pretrained.hf.building.clip_qkv`);
- ``attention_bias`` on all four projections;
- a mixture of ``num_experts`` SwiGLU experts of ``intermediate_size`` in
  every layer (`pz_persist.nn.mixture_of_experts.MixtureOfExperts`): a
  softmax router, the top ``num_experts_per_tok`` kept *without*
  renormalisation unless ``norm_topk_prob`` (false by default, as
  OLMoE-1B-7B has it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.building.clip_qkv import POSITIVE_NUMBER
from pz_persist.pretrained.hf.building.clip_qkv import clip_qkv_field
from pz_persist.pretrained.hf.building.clip_qkv import read_clip_qkv
from pz_persist.pretrained.hf.building.clip_qkv import with_clipped_qkv
from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY_IGNORED
from pz_persist.pretrained.hf.building.moe import ExpertNames
from pz_persist.pretrained.hf.building.moe import Experts
from pz_persist.pretrained.hf.building.moe import check_experts
from pz_persist.pretrained.hf.building.moe import config_activation
from pz_persist.pretrained.hf.building.moe import expert_fields
from pz_persist.pretrained.hf.building.moe import mixtures
from pz_persist.pretrained.hf.building.moe import read_experts
from pz_persist.pretrained.hf.building.moe import softmax_routed
from pz_persist.pretrained.hf.building.moe import softmax_router
from pz_persist.pretrained.hf.building.moe import with_experts
from pz_persist.pretrained.hf.building.post_norms import olmo_blocks
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import FROM_TABLE
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
    "num_local_experts": POSITIVE_INT,
    "num_experts_per_tok": POSITIVE_INT,
    "norm_topk_prob": BOOLEAN,
    "clip_qkv": POSITIVE_NUMBER,
    **TRAINING_ONLY,
}


def olmoe_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps an OLMoE checkpoint (transformers' ``OlmoeConfig`` defaults)."""
  experts_count, top_k, neurons = read_experts(cfg, "num_experts", "intermediate_size",
                                               aliases=("num_local_experts",))
  normalize = cfg.get("norm_topk_prob", FROM_TABLE)
  limit = read_clip_qkv(cfg)
  bias = cfg.get("attention_bias", FROM_TABLE)
  hidden, heads = cfg.require("hidden_size"), cfg.require("num_attention_heads")
  head_dim = cfg.raw.get("head_dim")
  if head_dim is not None and head_dim * heads != hidden:
    raise cfg.unsupported("head_dim", head_dim,
                          f"OLMoE's query norm spans hidden_size={hidden}, so the heads must too"
                          f" (head_dim {hidden // heads}); transformers fails on this config")
  plan = llama_plan(cfg, weights, biases=Biases(query_key_value=bias, output=bias),
                    max_positions_default=4096)
  # llama_plan checked num_hidden_layers against the weights, and hidden_act.
  plan = olmo_blocks(plan, float(cfg.get("rms_norm_eps", FROM_TABLE)), post_norms=False)
  experts = Experts(experts_count, top_k, neurons, normalize,
                    tuple(range(cfg.require("num_hidden_layers"))), ExpertNames())
  check_experts(cfg, weights, experts, "num_experts")
  activation = config_activation(cfg)
  plan = with_experts(plan, experts, hidden, weights.names, softmax_router(), activation)
  routed_build = plan.build
  return Plan(lambda: with_clipped_qkv(routed_build(), limit), plan.tensors, plan.views)


def _query_norm_axes(model: pz.nn.Layer) -> set[str]:
  norms = all_layers(attention(model).input_to_query, pz.nn.RMSLayerNorm)
  return set(named_shape(norms[0].sublayers[1])) if norms else set()


def _detect(model: pz.nn.Layer) -> str | None:
  """Softmax-routed mixtures in every block, query norms over every head."""
  found = mixtures(model)
  if (found and all(layer is not None and softmax_routed(layer) for layer in found)
      and len(_query_norm_axes(model)) > 1):
    return "olmoe"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only olmoe.
  fields = expert_fields(model, like)
  experts, neurons = fields.pop("_experts"), fields.pop("_neurons")
  count_key = "num_local_experts" if "num_local_experts" in like else "num_experts"
  fields.update({count_key: experts, "intermediate_size": neurons,
                 "attention_bias": model_biases(model).output, **clip_qkv_field(model)})
  return without_default_head_dim(fields)


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "olmoe": {
        "defaults": {**LLAMA_LIKE, "rms_norm_eps": 1e-5, "intermediate_size": 2048,
                     "max_position_embeddings": 4096, "clip_qkv": None,
                     "num_experts_per_tok": 8, "num_experts": 64, "norm_topk_prob": False},
        "defaults_why": {},
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="OLMoE",
    model_types={"olmoe": ModelType(olmoe_plan, "OlmoeForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["olmoe"],
                     ignored_fields=TRAINING_ONLY_IGNORED,
                     foreign_fields=frozenset({"router_jitter_noise"}))},
    detect=_detect,
    write_config=_write_config,
    adds=("query/key RMS norms over the whole projection (every head at once), `clip_qkv`"
          " (`ClipValues`), `attention_bias`, a mixture of experts in every layer"
          " (`MixtureOfExperts`: softmax router, top-k, renormalised only with"
          " `norm_topk_prob`)"),
    refuses="an MLP bias, a window, `head_dim` other than `hidden_size / heads`, other rope types",
    rank=280,
    fields=FIELDS,
)
