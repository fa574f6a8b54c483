"""MiniMax-M2 checkpoints (``model_type`` ``minimax_m2``: MiniMax-M2, M2.1).

MiniMax-M2 is Llama's layout (`pz_persist.pretrained.hf.building.decoder`,
grouped-query attention without biases) with:

- **Query/key RMS norms over all heads** (``q_norm`` / ``k_norm`` of
  ``num_heads * head_dim`` weights, before RoPE), as OLMo 2 has them
  (`pz_persist.pretrained.hf.building.post_norms.whole_query_key_norms`).
- **Partial rotary**: RoPE on the first ``rotary_dim`` entries of each head
  (the Hub's field; transformers reads it as ``partial_rotary_factor =
  rotary_dim / head_dim``, which wins when both are given), in halves
  (`pz_persist.pretrained.hf.building.partial_rotary`).
- **A mixture of experts in every layer** (``block_sparse_moe``: router
  ``gate``, experts' ``w1`` (gate), ``w3`` (up), ``w2`` (down), as Mixtral
  stores them): sigmoid scores, ``e_score_correction_bias`` added to choose
  the top ``num_experts_per_tok`` only, their unbiased scores renormalised to
  sum to one (`pz_persist.nn.mixture_of_experts.TopKRouter`); no shared
  expert.

The Hub's config carries fields of MiniMax's own code that transformers'
class does not read; each is accepted only at the value transformers
computes as (``use_qk_norm`` true, ``qk_norm_type`` ``per_layer``,
``use_routing_bias`` true, ``scoring_func`` ``sigmoid``,
``shared_intermediate_size`` 0, ``attn_type_list`` all 1), and its
multi-token prediction modules (``use_mtp``...) are left unread, as
transformers leaves them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn import mixture_of_experts as moe
from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import attention_size_fields
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.defaults import NO_BIASES
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY_IGNORED
from pz_persist.pretrained.hf.building.moe import ExpertNames
from pz_persist.pretrained.hf.building.moe import Experts
from pz_persist.pretrained.hf.building.moe import check_experts
from pz_persist.pretrained.hf.building.moe import read_experts
from pz_persist.pretrained.hf.building.moe import with_experts
from pz_persist.pretrained.hf.building.partial_rotary import given
from pz_persist.pretrained.hf.building.partial_rotary import partial_rotary
from pz_persist.pretrained.hf.building.partial_rotary import with_rope_on_subset
from pz_persist.pretrained.hf.building.post_norms import whole_query_key_norms
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import STRING
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config_from_model import activation_field
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.config_from_model import rms_norm_fields
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import left_out_matching
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

NAMES = ExpertNames(block="block_sparse_moe", router="gate", gate="w1", up="w3", down="w2")

_NEUTRAL = {"use_qk_norm": True, "qk_norm_type": "per_layer", "use_routing_bias": True,
            "scoring_func": "sigmoid", "shared_intermediate_size": 0}
"""The Hub's fields of MiniMax's code, at the values transformers computes as."""


def _ones(value: Any) -> bool:
  return isinstance(value, list) and all(v == 1 and not isinstance(v, bool) for v in value)


def _rotary_fraction(cfg: Config, head_dim: int) -> float:
  """``partial_rotary_factor`` if given, else ``rotary_dim / head_dim`` (the
  Hub's field), else the table's (all rotated)."""
  rotary_dim = cfg.get("rotary_dim")
  stated = given(cfg)
  fraction = partial_rotary(cfg)
  if rotary_dim is not None and not stated:
    fraction = rotary_dim / head_dim
  elif rotary_dim is not None and int(head_dim * fraction) != rotary_dim:
    raise cfg.unsupported("rotary_dim", rotary_dim, f"partial_rotary_factor={fraction} rotates"
                          f" {int(head_dim * fraction)} entries of each head; give one of them")
  subset = int(head_dim * fraction)
  if not 2 <= subset <= head_dim or subset % 2:
    raise cfg.unsupported("rotary_dim" if rotary_dim is not None and not stated
                          else "partial_rotary_factor", rotary_dim if not stated else fraction,
                          f"it rotates {subset} of {head_dim} entries of each head; RoPE needs"
                          " an even number of at least 2, at most the head")
  return fraction


def _sigmoid_router(name: str, experts: Experts, hidden: int) -> pz.nn.Layer:
  """MiniMax-M2's router: sigmoid scores, the correction bias added for the
  choice only, the chosen unbiased scores divided by their sum."""
  return moe.TopKRouter(
      logits=moe.router_linear(f"{name}/router", experts.num_experts, hidden),
      num_experts=experts.num_experts, top_k=experts.top_k, score="sigmoid", normalize=True,
      normalize_epsilon=0.0,
      selection_bias=moe.expert_vector(f"{name}/router/selection_bias", experts.num_experts))


def minimax_m2_plan(cfg: Config, weights: Weights) -> Plan:
  """Llama's plan with MiniMax-M2's norms, rotary and experts (module
  docstring)."""
  for field, neutral in _NEUTRAL.items():
    value = cfg.get(field)
    if value is not None and value != neutral:
      raise cfg.unsupported(field, value, f"transformers' MiniMax-M2 computes as if it were"
                            f" {neutral!r}")
  cfg.get("attn_type_list")  # Read: its schema allows only 1s (full attention everywhere).
  bool_field(cfg, "attention_bias", False, False, "MiniMax-M2's projections have no biases")
  hidden, heads = cfg.require("hidden_size"), cfg.require("num_attention_heads")
  head_dim = cfg.get("head_dim", hidden // heads)
  fraction = _rotary_fraction(cfg, head_dim)
  count, top_k, neurons = read_experts(cfg, "num_local_experts", "intermediate_size")
  eps = float(cfg.get("rms_norm_eps", 1e-6))

  def edit(model: model_parts.TransformerLM,
           config: llamalike_common.LlamalikeTransformerConfig) -> model_parts.TransformerLM:
    return with_rope_on_subset(model, int(config.projection_dim * fraction),
                               config.projection_dim)

  plan = llama_plan(cfg, weights, biases=Biases(), max_positions_default=196608, edit=edit)
  layers = cfg.require("num_hidden_layers")  # Checked against the weights by llama_plan.
  experts = Experts(count, top_k, neurons, True, tuple(range(layers)), NAMES)
  check_experts(cfg, weights, experts, "num_local_experts")
  plan = with_experts(whole_query_key_norms(plan, eps), experts, hidden, weights.names,
                      _sigmoid_router)
  biases = tuple(
      TensorSpec(f"transformer/block_{i}/mlp/router/selection_bias",
                 f"model.layers.{i}.{NAMES.block}.e_score_correction_bias", (count,),
                 ("experts",)) for i in range(layers))
  return Plan(plan.build, plan.tensors + biases, plan.views)


def _is_minimax_router(layer: moe.MixtureOfExperts) -> bool:
  router = layer.router
  return (isinstance(router, moe.TopKRouter) and router.score == "sigmoid"
          and router.selection_bias is not None and layer.shared is None and router.groups == 1)


def _detect(model: pz.nn.Layer) -> str | None:
  """Every block a sigmoid-routed mixture with a correction bias and no
  shared expert, the query normed over all heads at once."""
  found = [all_layers(ffw, moe.MixtureOfExperts)
           for ffw in all_layers(model, model_parts.TransformerFeedForward)]
  if not found or not all(layers and _is_minimax_router(layers[0]) for layers in found):
    return None
  norms = all_layers(attention(model).input_to_query, pz.nn.RMSLayerNorm)
  scale = norms[0].sublayers[1] if norms else None
  spans_heads = isinstance(scale, pz.nn.Linear) and len(named_shape(scale)) > 1
  return "minimax_m2" if spans_heads else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only minimax_m2.
  first = all_layers(model, moe.MixtureOfExperts)[0]
  gate = named_shape(all_layers(first.experts, pz.nn.Linear)[0])
  fields = {**attention_size_fields(model), **rms_norm_fields(model), **rope_fields(model),
            **activation_field(model, like), **tied_field(model, like),
            "num_local_experts": gate["experts"], "intermediate_size": gate["neurons"],
            "num_experts_per_tok": first.router.top_k}
  fraction = fields["rope_parameters"].get("partial_rotary_factor", 1.0)
  if "rotary_dim" in like:  # The Hub's spelling, kept.
    fields["rotary_dim"] = int(fraction * fields["head_dim"])
  # The Hub's fields at their neutral values, where like has them.
  fields.update({k: like[k] for k in (*_NEUTRAL, "attn_type_list") if k in like})
  return fields


_MINIMAX_FIELD = ("a field of MiniMax's own code, which transformers' MiniMax-M2 does not read"
                  " (it computes as with this value); pz_persist refuses any other")

_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "minimax_m2": {
        "defaults": {**LLAMA_LIKE, "rope_theta": 5_000_000.0, "head_dim": 128,
                     "num_key_value_heads": 8, "intermediate_size": 1536,
                     "num_local_experts": 256, "num_experts_per_tok": 8,
                     "max_position_embeddings": 196608, **_NEUTRAL},
        "defaults_why": {"attention_bias": NO_BIASES,
                         **dict.fromkeys(_NEUTRAL, _MINIMAX_FIELD)},
    },
}
"""What each absent field means (``MiniMaxM2Config``'s value;
`pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="MiniMax-M2",
    model_types={"minimax_m2": ModelType(
        minimax_m2_plan, "MiniMaxM2ForCausalLM", **_TRANSFORMERS_DEFAULTS["minimax_m2"],
        # MiniMax's own code's multi-token prediction modules (``use_mtp``), which
        # transformers' class does not build: tensors of theirs are not read.
        left_out=(left_out_matching(
            (r"(^|\.)mtp",), "the multi-token-prediction modules (use_mtp)",
            "transformers' MiniMaxM2ForCausalLM does not build them", reported=True),),
        ignored_fields={
            **TRAINING_ONLY_IGNORED,
            "the multi-token prediction modules, which the causal LM does not run": (
                "use_mtp", "num_mtp_modules", "mtp_transformer_layers"),
            "the Hub's folders name MiniMax's remote code, which transformers' own class"
            " replaces": ("auto_map",),
        },
        foreign_fields=frozenset({"use_mtp", "num_mtp_modules", "mtp_transformer_layers",
                                  "auto_map"}))},
    detect=_detect,
    write_config=_write_config,
    adds=("query/key RMS norms over all heads, RoPE on the first `rotary_dim` of each head"
          " (`ApplyRoPEToSubset`), a mixture of experts in every layer with sigmoid routing and a"
          " correction bias (`e_score_correction_bias`), renormalised top-k"),
    refuses="biases, scaled RoPE with partial rotary, MiniMax's own fields at other values",
    rank=112,
    fields={"num_local_experts": POSITIVE_INT, "num_experts_per_tok": POSITIVE_INT,
            "rotary_dim": POSITIVE_INT, **TRAINING_ONLY,
            "use_qk_norm": BOOLEAN, "qk_norm_type": STRING, "use_routing_bias": BOOLEAN,
            "scoring_func": STRING, "shared_intermediate_size": NON_NEGATIVE_INT,
            "attn_type_list": (_ones, "a list of 1s (full attention on every layer)"),
            "use_mtp": BOOLEAN, "num_mtp_modules": NON_NEGATIVE_INT,
            "mtp_transformer_layers": NON_NEGATIVE_INT},
)
