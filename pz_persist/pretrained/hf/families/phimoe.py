"""Phi-3.5-MoE checkpoints (``model_type`` ``phimoe``: Phi-3.5-MoE-instruct).

Mixtral's layout (`pz_persist.pretrained.hf.building.decoder`, experts
under ``block_sparse_moe``: router ``gate``, experts' ``w1`` / ``w3`` /
``w2``) with:

- LayerNorms with a bias (``nn.LayerNorm``, epsilon ``rms_norm_eps``) in
  place of the RMS norms, the final one too: Penzai's ``pz.nn.LayerNorm``
  (``scale.weights``, ``shift.bias``);
- ``attention_bias`` on all four projections and ``lm_head_bias``;
- sparsemixer routing at inference (`pz_persist.nn.mixture_of_experts.SparseMixerRouter`
  ``score="sparsemixer"``): the best expert, then the best of the others,
  each weighted by its softmax over the logits within a relative gap of
  ``2 * router_jitter_noise`` of it (so ``router_jitter_noise``, training
  noise elsewhere, changes inference here); always two experts, as
  transformers' ``sparsemixer`` chooses two whatever ``num_experts_per_tok``
  says (a config saying otherwise is refused);
- a window on every layer if ``sliding_window`` is set;
- Phi-3.5-MoE's ``longrope`` (`pz_persist.nn.longrope.ApplyPhimoeLongRoPE`), as
  transformers computes it, which is not Phi-3's: ``PhimoeRotaryEmbedding``
  recomputes its frequencies without the sequence length, so
  ``short_factor`` divides them at every position (``long_factor`` is read,
  checked and kept for export, never applied),
  and multiplies cos and sin by ``short_mscale`` while the input's largest
  position is within ``original_max_position_embeddings`` and by
  ``long_mscale`` beyond (``attention_factor`` / ``long_attention_factor``).
  transformers' ``generate`` drops its cache on crossing the original
  context, as for Phi-3, and so does the sampler
  (`pz_persist.nn.longrope.LongRopeKVCachingLM`). The original context is
  the RoPE dict's (else ``max_position_embeddings``, as PhimoeConfig
  fills it in); a top-level one saying otherwise is refused, as are
  ``factor`` / ``attention_factor`` (which Phi-3.5-MoE never reads: the
  mscales replace them) and a ``partial_rotary_factor`` other than 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn import mixture_of_experts as moe
from pz_persist.nn.longrope import ApplyPhimoeLongRoPE
from pz_persist.pretrained import errors
from pz_persist.pretrained.hf.building import longrope
from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.moe import NUMBER
from pz_persist.pretrained.hf.building.moe import ExpertNames
from pz_persist.pretrained.hf.building.moe import Experts
from pz_persist.pretrained.hf.building.moe import check_experts
from pz_persist.pretrained.hf.building.moe import config_activation
from pz_persist.pretrained.hf.building.moe import expert_fields
from pz_persist.pretrained.hf.building.moe import mixtures
from pz_persist.pretrained.hf.building.moe import read_experts
from pz_persist.pretrained.hf.building.moe import with_experts
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import OBJECT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

NAMES = ExpertNames(block="block_sparse_moe", router="gate", gate="w1", up="w3", down="w2")

_NON_NEGATIVE = (lambda v: NUMBER[0](v) and v >= 0, "a non-negative number")

FIELDS = {"num_local_experts": POSITIVE_INT, "num_experts_per_tok": POSITIVE_INT,
          "router_jitter_noise": _NON_NEGATIVE, "input_jitter_noise": _NON_NEGATIVE,
          "output_router_logits": BOOLEAN, "router_aux_loss_coef": NUMBER,
          "lm_head_bias": BOOLEAN, "short_mscale": POSITIVE_NUMBER,
          "long_mscale": POSITIVE_NUMBER, "auto_map": OBJECT}

_LONGROPE_KEYS = frozenset({"short_factor", "long_factor", "original_max_position_embeddings",
                            "short_mscale", "long_mscale"})

_HEAD = "transformer/lm_head"


def phimoe_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Phi-3.5-MoE checkpoint (transformers' ``PhimoeConfig`` defaults)."""
  experts_count, top_k, neurons = read_experts(cfg, "num_local_experts", "intermediate_size")
  if top_k != 2:
    raise cfg.unsupported("num_experts_per_tok", top_k,
                          "transformers' Phi-3.5-MoE (sparsemixer) always routes to 2 experts")
  rotary = _read_rope(cfg)
  jitter = float(cfg.get("router_jitter_noise", FROM_TABLE))
  head_bias = cfg.get("lm_head_bias", FROM_TABLE)
  bias = cfg.get("attention_bias", FROM_TABLE)
  epsilon = float(cfg.get("rms_norm_eps", FROM_TABLE))
  window = cfg.nullable("sliding_window", FROM_TABLE)
  kind = (llamalike_common.AttentionTypeGlobalCausal() if window is None
          else llamalike_common.AttentionTypeSlidingWindowCausal(window))
  plan = llama_plan(cfg, weights, attention=lambda count: kind,
                    biases=Biases(query_key_value=bias, output=bias),
                    max_positions_default=131_072)
  layers = cfg.require("num_hidden_layers")  # Checked against the weights by llama_plan.
  hidden, vocab = cfg.require("hidden_size"), cfg.require("vocab_size")
  experts = Experts(experts_count, top_k, neurons, False, tuple(range(layers)), NAMES)
  check_experts(cfg, weights, experts, "num_local_experts")

  def router(name: str, experts: Experts, hidden: int) -> pz.nn.Layer:
    return moe.SparseMixerRouter(
        logits=moe.router_linear(f"{name}/router", experts.num_experts, hidden),
        num_experts=experts.num_experts, top_k=2, score="sparsemixer", jitter_eps=jitter)

  activation = config_activation(cfg)
  plan = with_experts(plan, experts, hidden, weights.names, router, activation)
  specs = list(plan.tensors)
  for spec in plan.tensors:
    if spec.label.endswith("norm/scale.weights"):
      specs.append(dataclasses.replace(
          spec, label=spec.label.replace("/scale.weights", "/shift.bias"),
          source=spec.source.removesuffix(".weight") + ".bias"))
  if head_bias:
    specs.append(TensorSpec(f"{_HEAD}_bias.bias", "lm_head.bias", (vocab,), ("vocabulary",)))
  routed_build = plan.build

  def build() -> model_parts.TransformerLM:
    model = pz.select(routed_build()).at_instances_of(pz.nn.RMSLayerNorm).apply(
        lambda norm: _layer_norm(norm, epsilon))
    model = pz.select(model).at_instances_of(pz.nn.ApplyRoPE).apply(rotary)
    if head_bias:
      model = (pz.select(model).at_instances_of(pz.nn.Linear)
               .where(lambda linear: linear.weights.label == f"{_HEAD}.weights")
               .apply(lambda linear: pz.nn.Sequential([linear, pz.nn.AddBias.from_config(
                   name=f"{_HEAD}_bias", init_base_rng=None, biased_axes={"vocabulary": vocab})])))
    return model

  return Plan(build, tuple(specs), plan.views)


def _read_rope(cfg: Config) -> Callable[[pz.nn.ApplyRoPE], pz.nn.Layer]:
  """Phi-3.5-MoE's RoPE, read here in full (Llama's reader refuses
  ``longrope``; it is then handed the unscaled base alone). Returns the
  function replacing each of Penzai's ``ApplyRoPE`` layers."""
  key, params, kind = longrope.rope_params(cfg, ("longrope",), _LONGROPE_KEYS, "Phi-3.5-MoE")
  theta = longrope.agreeing(cfg, key, params, "rope_theta", cfg.default("rope_theta", FROM_TABLE))
  fraction = longrope.agreeing(cfg, key, params, "partial_rotary_factor", 1.0)
  if fraction != 1:
    raise cfg.unsupported("partial_rotary_factor", fraction,
                          "transformers' Phi-3.5-MoE rotates whole heads (its default RoPE"
                          " ignores the fraction and its longrope fails on it)")
  longrope.base_only(cfg, theta)
  if kind == "default":
    cfg.get("original_max_position_embeddings")  # Read by generate alone: no effect.
    return lambda layer: layer
  name = "original_max_position_embeddings"
  inner = params.get(name)
  # PhimoeConfig fills an absent one in from max_position_embeddings and
  # sets the top-level field from it.
  original = (cfg.checked(f"{key}.{name}", inner) if inner is not None
              else cfg.get("max_position_embeddings", FROM_TABLE))
  original = longrope.original_context(cfg, key, params, original, "outer")
  hidden, heads = cfg.require("hidden_size"), cfg.require("num_attention_heads")
  factors = longrope.factor_lists(cfg, key, params, cfg.get("head_dim", hidden // heads) // 2)
  mscales = {}
  for scale in ("short_mscale", "long_mscale"):
    if params.get(scale) is None:
      raise cfg.unsupported(f"{key}.{scale}", None,
                            "transformers' Phi-3.5-MoE requires it with longrope (it multiplies"
                            " cos and sin by it)")
    mscales[scale] = float(cfg.checked(f"{key}.{scale}", params[scale]))

  def longrope_layer(layer: pz.nn.ApplyRoPE) -> ApplyPhimoeLongRoPE:
    return ApplyPhimoeLongRoPE(
        embedding_axis=layer.embedding_axis, max_wavelength=layer.max_wavelength,
        positions_input_name=layer.positions_input_name,
        original_max_position_embeddings=original, attention_factor=mscales["short_mscale"],
        long_attention_factor=mscales["long_mscale"], **factors)

  return longrope_layer


def _layer_norm(norm: pz.nn.RMSLayerNorm, epsilon: float) -> pz.nn.LayerNorm:
  """The LayerNorm with a bias in place of ``norm``, its scale's slot kept."""
  standardize, scale = norm.sublayers
  name = scale.weights.label.removesuffix("/scale.weights")
  return pz.nn.LayerNorm(sublayers=[
      pz.nn.Standardize(across=standardize.across, epsilon=epsilon), scale,
      pz.nn.AddBias(bias=pz.ParameterSlot(f"{name}/shift.bias"), new_axis_names=())])


def _sparsemixer(layer: moe.MixtureOfExperts) -> bool:
  router = layer.router
  return (isinstance(router, moe.TopKRouter) and router.score == "sparsemixer"
          and router.top_k == 2 and isinstance(router.logits, pz.nn.Linear)
          and layer.shared is None and not layer.weight_inputs and layer.expert_input is None)


def _detect(model: pz.nn.Layer) -> str | None:
  """Sparsemixer-routed mixtures in every block."""
  found = mixtures(model)
  if found and all(layer is not None and _sparsemixer(layer) for layer in found):
    return "phimoe"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only phimoe.
  if not all_layers(model, pz.nn.LayerNorm):
    raise errors.ExportError("Phi-3.5-MoE's norms are LayerNorms with a bias; the model has"
                             " none (export it as mixtral, with like=).")
  fields = expert_fields(model, like, accepts=_sparsemixer)
  fields.pop("norm_topk_prob")  # Sparsemixer has no such choice.
  experts, neurons = fields.pop("_experts"), fields.pop("_neurons")
  router = next(layer for layer in mixtures(model) if layer is not None).router
  found_windows = set(windows(model))
  if len(found_windows) > 1:
    raise errors.ExportError(
        "the model's blocks attend through different windows; Phi-3.5-MoE has one window for"
        f" every layer or none (found {sorted(found_windows, key=str)}).")
  head = [linear for linear in all_layers(model, pz.nn.AddBias)
          if linear.bias.label == f"{_HEAD}_bias.bias"]
  rope = fields["rope_parameters"]
  if rope["rope_type"] == "longrope":
    if "short_mscale" not in rope:
      raise errors.ExportError(
          "the model's ApplyLongRoPE switches to the long factors beyond the original context,"
          " as Phi-3's does; transformers' Phi-3.5-MoE keeps the short ones"
          " (ApplyPhimoeLongRoPE) and cannot compute it.")
    if rope.pop("partial_rotary_factor") != 1:
      raise errors.ExportError("the model's ApplyLongRoPE rotates part of each head;"
                               " transformers' Phi-3.5-MoE rotates whole heads.")
  fields.update({"num_local_experts": experts, "intermediate_size": neurons,
                 "sliding_window": found_windows.pop(), "router_jitter_noise": router.jitter(),
                 "attention_bias": model_biases(model).output, "lm_head_bias": bool(head)})
  return without_default_head_dim(fields)


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "phimoe": {
        "defaults": {**LLAMA_LIKE, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
                     "intermediate_size": 6400, "sliding_window": None, "num_local_experts": 16,
                     "num_experts_per_tok": 2, "router_jitter_noise": 0.01,
                     "input_jitter_noise": 0.0, "lm_head_bias": False,
                     "max_position_embeddings": 131_072},
        "defaults_why": {},
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Phi-3.5-MoE",
    model_types={"phimoe": ModelType(
        phimoe_plan, "PhimoeForCausalLM", **_TRANSFORMERS_DEFAULTS["phimoe"],
        ignored_fields={
            "training only: the load-balancing loss and the input noise": (
                "output_router_logits", "router_aux_loss_coef", "input_jitter_noise"),
            "the Hub's folder names Microsoft's remote code, which transformers' own Phimoe"
            " class (the reference, and what export writes) replaces": ("auto_map",),
        }, foreign_fields=frozenset({"auto_map"}))},
    detect=_detect,
    write_config=_write_config,
    adds=("LayerNorms with a bias (`pz.nn.LayerNorm`), `attention_bias`, `lm_head_bias`, a"
          " mixture of experts in every layer routed by sparsemixer (`SparseMixerRouter`"
          " `score=\"sparsemixer\"`, its gap `router_jitter_noise`; the Hub's per-expert"
          " `w1`/`w3`/`w2`); optional sliding window; Phi-3.5-MoE's `longrope` (`ApplyPhimoeLongRoPE`:"
          " the short factors at every position, as transformers computes, cos and sin scaled by"
          " `short_mscale` / `long_mscale` within / beyond the original context)"),
    refuses=("`num_experts_per_tok` other than 2, an MLP bias, a partial rotary fraction,"
             " `factor` / `attention_factor` in the longrope dict (Phi-3.5-MoE never reads"
             " them)"),
    rank=4,
    fields=FIELDS,
)
