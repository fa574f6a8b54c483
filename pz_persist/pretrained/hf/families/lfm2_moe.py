"""LiquidAI LFM2-MoE (``model_type`` ``lfm2_moe``: LFM2-8B-A1B).

LFM2's layers (`pz_persist.pretrained.hf.building.lfm2_layers`: short
double-gated convolutions among query/key-normed attention) whose first
``num_dense_layers`` keep a dense SwiGLU MLP of ``intermediate_size`` (no
auto-adjust, unlike LFM2) and whose others hold a mixture of experts
(`pz_persist.nn.mixture_of_experts.MixtureOfExperts`): each expert a SwiGLU
MLP of ``moe_intermediate_size``; the router's scores are ``sigmoid`` of its
logits; with ``use_expert_bias`` the ``num_experts_per_tok`` experts are
chosen by score plus ``expert_bias`` (a float32 vector, for choosing only),
weighted by the unbiased scores; with ``norm_topk_prob`` those are divided by
their sum (plus 1e-6); all are multiplied by ``routed_scaling_factor``, as
transformers' ``Lfm2MoeTopKRouter`` computes. The experts are read from the
Hub's per-expert tensors (``feed_forward.experts.{e}.w1`` / ``w3`` / ``w2``)
or transformers 5's fused ``gate_up_proj`` / ``down_proj``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.nn import mixture_of_experts as moe
from pz_persist.pretrained.hf.building.lfm2_layers import FIELDS
from pz_persist.pretrained.hf.building.lfm2_layers import FOREIGN
from pz_persist.pretrained.hf.building.lfm2_layers import IGNORED
from pz_persist.pretrained.hf.building.lfm2_layers import has_short_conv
from pz_persist.pretrained.hf.building.lfm2_layers import lfm2_fields
from pz_persist.pretrained.hf.building.lfm2_layers import lfm2_plan
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY_IGNORED
from pz_persist.pretrained.hf.building.moe import ExpertNames
from pz_persist.pretrained.hf.building.moe import Experts
from pz_persist.pretrained.hf.building.moe import check_experts
from pz_persist.pretrained.hf.building.moe import mixtures
from pz_persist.pretrained.hf.building.moe import read_experts
from pz_persist.pretrained.hf.building.moe import with_experts
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_NAMES = ExpertNames(block="feed_forward", router="gate", gate="w1", up="w3", down="w2")

_FIELDS = {**FIELDS, **dict.fromkeys(
    ("num_experts", "num_experts_per_tok", "moe_intermediate_size"), POSITIVE_INT),
    "num_dense_layers": NON_NEGATIVE_INT, "use_expert_bias": BOOLEAN,
    "routed_scaling_factor": POSITIVE_NUMBER, "norm_topk_prob": BOOLEAN, **TRAINING_ONLY}
"""LFM2's fields, the experts' and the router's training-only ones."""


def lfm2_moe_plan(cfg: Config, weights: Weights) -> Plan:
  """LFM2's plan (its dense width as given) with experts after the first
  ``num_dense_layers`` layers (module docstring)."""
  count, top_k, neurons = read_experts(cfg, "num_experts", "moe_intermediate_size")
  dense = cfg.get("num_dense_layers", 2)
  normalize = cfg.get("norm_topk_prob", True)
  biased = cfg.get("use_expert_bias", True)
  scale = float(cfg.get("routed_scaling_factor", 1.0))
  plan = lfm2_plan(cfg, weights, adjusted=False)  # Checks every field, then the layer count.
  layers = cfg.require("num_hidden_layers")
  experts = Experts(count, top_k, neurons, normalize, tuple(range(min(dense, layers), layers)),
                    _NAMES)
  check_experts(cfg, weights, experts, "num_experts")

  def router(name: str, experts: Experts, hidden: int) -> pz.nn.Layer:
    return moe.TopKRouter(
        logits=moe.router_linear(f"{name}/router", experts.num_experts, hidden),
        num_experts=experts.num_experts, top_k=experts.top_k, score="sigmoid",
        normalize=experts.normalize, normalize_epsilon=1e-6 if experts.normalize else 0.0,
        scale=scale, selection_bias=moe.expert_vector(f"{name}/router/selection_bias",
                                                      experts.num_experts) if biased else None)

  hidden = cfg.require("hidden_size")
  routed = with_experts(plan, experts, hidden, weights.names, router)
  if not biased:
    return routed
  specs = [TensorSpec(f"transformer/block_{i}/mlp/router/selection_bias",
                      f"model.layers.{i}.feed_forward.expert_bias", (count,), ("experts",))
           for i in experts.layers]
  return Plan(routed.build, (*routed.tensors, *specs), routed.views)


def _detect(model: pz.nn.Layer) -> str | None:
  """Short convolution layers with mixtures of experts."""
  if has_short_conv(model) and any(layer is not None for layer in mixtures(model)):
    return "lfm2_moe"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only lfm2_moe.
  fields = lfm2_fields(model, like, adjusted=False)
  found = mixtures(model)
  first = next(layer for layer in found if layer is not None)
  router = first.router
  assert isinstance(router, moe.TopKRouter), "LFM2-MoE's router is a TopKRouter"
  gate = named_shape(all_layers(first.experts, pz.nn.Linear)[0])
  dense = found.index(first)
  fields.update(num_experts=gate["experts"], moe_intermediate_size=gate["neurons"],
                num_experts_per_tok=router.top_k, norm_topk_prob=router.normalize,
                use_expert_bias=router.selection_bias is not None,
                routed_scaling_factor=router.scale, num_dense_layers=dense)
  # The dense layers' width (Penzai's metadata keeps it even with none).
  fields["intermediate_size"] = model.metadata.mlp_hidden_dim
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "lfm2_moe": {
        "defaults": {
            "vocab_size": 65536, "hidden_size": 2048, "intermediate_size": 7168,
            "moe_intermediate_size": 1792, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "norm_eps": 1e-5, "tie_word_embeddings": True,
            "rope_theta": 1e6, "partial_rotary_factor": 1.0, "conv_bias": False,
            "conv_L_cache": 3, "num_dense_layers": 2, "num_experts_per_tok": 4,
            "num_experts": 32, "use_expert_bias": True, "routed_scaling_factor": 1.0,
            "norm_topk_prob": True},
        "defaults_why": {},
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="LiquidAI LFM2-MoE",
    model_types={
        "lfm2_moe": ModelType(lfm2_moe_plan, "Lfm2MoeForCausalLM",
                              **_TRANSFORMERS_DEFAULTS["lfm2_moe"],
                              ignored_fields={**IGNORED, **TRAINING_ONLY_IGNORED},
                              foreign_fields=FOREIGN | {"router_aux_loss_coef", "router_jitter_noise"}),
    },
    detect=_detect,
    write_config=_write_config,
    adds=("LFM2's layers with a `MixtureOfExperts` after the first `num_dense_layers`: sigmoid"
          " router, top-k chosen with `expert_bias` (`use_expert_bias`), `norm_topk_prob`,"
          " `routed_scaling_factor`; SwiGLU experts on an `experts` axis (the Hub's per-expert"
          " tensors or transformers 5's fused ones)"),
    refuses="what LFM2 refuses; configs without `layer_types`",
    rank=260,
    fields=_FIELDS,
)
