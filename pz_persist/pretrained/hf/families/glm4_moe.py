"""GLM-4.5 / GLM-4.6 checkpoints (``model_type`` ``glm4_moe``).

GLM-4.5 is Llama's attention (`pz_persist.pretrained.hf.building.decoder`:
grouped-query, ``attention_bias`` on the query, key and value projections
only) with optional per-head query/key RMS norms (``use_qk_norm``), RoPE on the
first ``partial_rotary_factor`` of each head (default one half: Penzai's
``ApplyRoPEToSubset``), and DeepSeek-V3's mixture of experts
(`pz_persist.pretrained.hf.building.deepseek_moe`: group-limited sigmoid
routing with a correction bias, shared experts) in the layers from
``first_k_dense_replace`` on. Its multi-token prediction layers
(``num_nextn_predict_layers``) are left unread, as in DeepSeek-V3.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.deepseek_moe import MOE_FIELDS
from pz_persist.pretrained.hf.building.deepseek_moe import MOE_FOREIGN
from pz_persist.pretrained.hf.building.deepseek_moe import MOE_IGNORED
from pz_persist.pretrained.hf.building.deepseek_moe import ROUTER_DEFAULTS_WHY
from pz_persist.pretrained.hf.building.deepseek_moe import check_expert_count
from pz_persist.pretrained.hf.building.deepseek_moe import main_layers
from pz_persist.pretrained.hf.building.deepseek_moe import mtp_layers
from pz_persist.pretrained.hf.building.deepseek_moe import read_routing
from pz_persist.pretrained.hf.building.deepseek_moe import routing_fields
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.norms import query_key_norm_specs
from pz_persist.pretrained.hf.building.norms import with_query_key_norms
from pz_persist.pretrained.hf.building.partial_rotary import partial_rotary
from pz_persist.pretrained.hf.building.partial_rotary import with_rope_on_subset
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import View
from pz_persist.pretrained.hf.weights import Weights
from pz_persist.pretrained.hf.weights import stacked

_DEFAULTS = {"n_routed_experts": 128, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
             "moe_intermediate_size": 1408, "n_shared_experts": 1, "routed_scaling_factor": 1.0}
"""``Glm4MoeConfig``'s defaults for an absent field."""

FIELDS = {**MOE_FIELDS, "use_qk_norm": BOOLEAN}


@dataclasses.dataclass
class _MainLayers:
  """``weights`` without the multi-token prediction layers' tensors (which
  `llama_plan` would count as layers)."""

  weights: Weights
  names: set[str]

  def __getattr__(self, name: str) -> Any:
    return getattr(self.weights, name)


def glm4_moe_plan(cfg: Config, weights: Weights) -> Plan:
  """Llama's plan with GLM-4.5's attention and DeepSeek's experts."""
  hidden = cfg.require("hidden_size")
  routing = read_routing(cfg, hidden, _DEFAULTS)
  fraction = partial_rotary(cfg)
  norms = cfg.get("use_qk_norm", False)
  layers = cfg.require("num_hidden_layers")
  dense = min(cfg.get("first_k_dense_replace", 1), layers)
  mtp = cfg.get("num_nextn_predict_layers", 1)
  bias = cfg.get("attention_bias", False)

  def edit(model: model_parts.TransformerLM,
           config: llamalike_common.LlamalikeTransformerConfig) -> model_parts.TransformerLM:
    if norms:
      model = with_query_key_norms(model, config)
    model = with_rope_on_subset(model, int(config.projection_dim * fraction),
                                config.projection_dim)
    for i in range(dense, config.num_decoder_blocks):
      block = pz.select(model).at_instances_of(model_parts.TransformerBlock).pick_nth_selected(i)
      model = block.at_instances_of(model_parts.TransformerFeedForward).apply(
          lambda _, i=i: routing.layer(f"transformer/block_{i}/mlp", config.parameter_dtype))
    return model

  names = main_layers(weights.names, layers, mtp)
  plan = llama_plan(cfg, _MainLayers(weights, names),  # type: ignore[arg-type]
                    biases=Biases(query_key_value=bias), head_dim_default=None,
                    max_positions_default=131072,
                    block_extras=query_key_norm_specs if norms else None, edit=edit)
  views: list[View] = []

  def src(name: str, shape: tuple[int, int], parts: list[str] | None = None) -> str:
    if parts is None:
      return name
    views.append(stacked(name, parts))
    return name

  # Once llama_plan has checked the layers against the weights; export's
  # stand-in (the model being written) has no files to count experts in.
  if dense < layers and isinstance(weights, Weights):
    check_expert_count(cfg, weights.names, dense, routing.experts)
  moe_blocks = tuple(f"transformer/block_{i}/mlp/" for i in range(dense, layers))
  specs = [spec for spec in plan.tensors if not spec.label.startswith(moe_blocks)]
  for i in range(dense, layers):
    specs += routing.specs(f"transformer/block_{i}/", f"model.layers.{i}.", src)
  return Plan(plan.build, tuple(specs), tuple(views), (mtp_layers(layers, mtp),))


def _detect(model: pz.nn.Layer) -> str | None:
  """DeepSeek's experts (a router with a correction bias, shared experts)
  beside Llama's attention (latent attention, rank 6, is DeepSeek-V3)."""
  from pz_persist.nn import mixture_of_experts as moe  # pylint: disable=import-outside-toplevel
  layers = all_layers(model, moe.MixtureOfExperts)
  return ("glm4_moe" if layers and all(
      getattr(layer.router, "selection_bias", None) is not None and layer.shared is not None
      for layer in layers) else None)


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only glm4_moe.
  fields = llamalike_fields(model, like)
  params = fields["rope_parameters"]
  params.setdefault("partial_rotary_factor", 1.0)
  fields["use_qk_norm"] = bool(all_layers(attention(model).input_to_query, pz.nn.RMSLayerNorm))
  fields["attention_bias"] = model_biases(model).query_key_value
  dense = sum(1 for block in blocks(model)
              if all_layers(block, model_parts.TransformerFeedForward))
  fields["num_nextn_predict_layers"] = like.get("num_nextn_predict_layers", 0)
  fields.update(routing_fields(model, like, dense))
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm4_moe": {
        "defaults": {**LLAMA_LIKE, "rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5,
                     "use_qk_norm": False, "first_k_dense_replace": 1,
                     "num_nextn_predict_layers": 1,
                     "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1,
                     "topk_group": 1, "n_shared_experts": 1, "n_routed_experts": 128,
                     "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
                     "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1},
        "defaults_why": dict(ROUTER_DEFAULTS_WHY),
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="GLM-4.5, GLM-4.6",
    model_types={"glm4_moe": ModelType(glm4_moe_plan, "Glm4MoeForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["glm4_moe"],
                     ignored_fields=MOE_IGNORED, foreign_fields=MOE_FOREIGN)},
    detect=_detect,
    write_config=_write_config,
    adds=("Llama's attention with query/key/value biases, optional query/key norms"
          " (`use_qk_norm`) and partial rotary (`ApplyRoPEToSubset`); DeepSeek-V3's experts"
          " (group-limited sigmoid routing, correction bias, shared experts) after"
          " `first_k_dense_replace` dense layers"),
    refuses="scaled RoPE with partial rotary, an output-projection bias, FP8 folders",
    rank=70,
    fields=FIELDS,
)
