"""Qwen3-Next (``model_type`` ``qwen3_next``: Qwen3-Next-80B-A3B).

Qwen3.5's predecessor, with its layers
(`pz_persist.pretrained.hf.building.hybrid_decoder`: gated DeltaNet beside
gated attention with query/key norms, partial RoPE, ``1 + w`` norms) and
Qwen3.5-MoE's feed-forward blocks
(`pz_persist.pretrained.hf.building.hybrid_moe`: softmax-routed experts and a
sigmoid-gated shared expert), differing in three ways:

- the DeltaNet's projections are fused per key head: ``in_proj_qkvz`` holds,
  for each key head, its query and key rows, then the values and output
  gates of the value heads it serves; ``in_proj_ba`` the write strengths
  then the decay inputs of those value heads. Each is read as a range of
  the per-key-head rows (`TensorSpec.part`), regrouped into value heads
  (`TensorSpec.regrouped`), into the same `GatedDeltaNet` parameters
  Qwen3.5 reads, and written back fused the same way;
- ``norm_topk_prob`` decides whether the chosen experts' weights are
  renormalised (Qwen3.5-MoE always renormalises);
- only the layers ``i`` with ``(i + 1) % decoder_sparse_step == 0`` and not
  in ``mlp_only_layers`` hold experts; the others a dense SwiGLU MLP of
  ``intermediate_size``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.nn import mixture_of_experts as moe
from pz_persist.pretrained.hf.building import hybrid_decoder
from pz_persist.pretrained.hf.building.defaults import QWEN3_5_DEFAULTS
from pz_persist.pretrained.hf.building.defaults import QWEN3_5_DEFAULTS_WHY
from pz_persist.pretrained.hf.building.hybrid_moe import hybrid_moe_plan
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY_IGNORED
from pz_persist.pretrained.hf.building.moe import mixtures
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_SIZES = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
          "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
          "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
          "linear_value_head_dim": 128, "linear_num_key_heads": 16,
          "linear_num_value_heads": 32, "moe_intermediate_size": 512,
          "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10,
          "num_experts": 512}
"""transformers' ``Qwen3NextConfig`` sizes (the shared Qwen3.5 plan fills
absent ones with Qwen3.5's otherwise)."""

_FIELDS = {**hybrid_decoder.FIELDS, **dict.fromkeys(
    ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
     "shared_expert_intermediate_size", "decoder_sparse_step"), POSITIVE_INT),
    "norm_topk_prob": BOOLEAN,
    "mlp_only_layers": (lambda v: isinstance(v, list) and all(NON_NEGATIVE_INT[0](i) for i in v),
                        "a list of non-negative layer indices"),
    **TRAINING_ONLY}


def expert_layers(count: int, step: int, dense: list[int]) -> tuple[int, ...]:
  """The layers with experts, as ``Qwen3NextDecoderLayer`` chooses them."""
  return tuple(i for i in range(count) if i not in dense and (i + 1) % step == 0)


def qwen3_next_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Qwen3-Next checkpoint (module docstring)."""
  step = cfg.get("decoder_sparse_step", 1)
  dense = cfg.get("mlp_only_layers") or []
  normalize = cfg.get("norm_topk_prob", True)
  layers = cfg.raw.get("num_hidden_layers") or _SIZES["num_hidden_layers"]
  if isinstance(layers, int) and any(i >= layers for i in dense) or len(set(dense)) != len(dense):
    raise cfg.unsupported("mlp_only_layers", dense, f"distinct indices of the"
                          f" num_hidden_layers={layers} layers")
  return hybrid_moe_plan(cfg, weights, defaults=_SIZES,
                         expert_layers=lambda count: expert_layers(count, step, dense),
                         normalize=normalize, normalize_always=False,
                         delta_net_specs=per_key_head_delta_specs)


def per_key_head_delta_specs(name: str, s: str, sizes: hybrid_decoder.Sizes
                             ) -> list[TensorSpec]:
  """The DeltaNet's tensors as Qwen3-Next stores them: ``in_proj_qkvz`` and
  ``in_proj_ba`` grouped by key head (module docstring); the convolution,
  decay, norm and output as Qwen3.5's."""
  hidden, k_heads, v_heads = sizes.hidden, sizes.key_heads, sizes.value_heads
  dk, dv, group = sizes.key_dim, sizes.value_dim, sizes.value_heads // sizes.key_heads
  width = 2 * dk + 2 * group * dv
  qkvz = (k_heads, width, hidden)
  keys, values = ("key_heads", "key_projection", "embedding"), (
      "value_heads", "value_projection", "embedding")
  out = [
      TensorSpec(f"{name}/query.weights", s + "in_proj_qkvz.weight", qkvz, keys,
                 stored=(k_heads * width, hidden), part=(1, 0, dk)),
      TensorSpec(f"{name}/key.weights", s + "in_proj_qkvz.weight", qkvz, keys,
                 stored=(k_heads * width, hidden), part=(1, dk, 2 * dk)),
      TensorSpec(f"{name}/value.weights", s + "in_proj_qkvz.weight", qkvz, values,
                 stored=(k_heads * width, hidden), part=(1, 2 * dk, 2 * dk + group * dv),
                 regrouped=(v_heads, dv, hidden)),
      TensorSpec(f"{name}/output_gate.weights", s + "in_proj_qkvz.weight", qkvz, values,
                 stored=(k_heads * width, hidden), part=(1, 2 * dk + group * dv, width),
                 regrouped=(v_heads, dv, hidden)),
  ]
  ba = (k_heads, 2 * group, hidden)
  out += [
      TensorSpec(f"{name}/{part}.weights", s + "in_proj_ba.weight", ba,
                 ("value_heads", "embedding"), stored=(2 * v_heads, hidden),
                 part=(1, i * group, (i + 1) * group), regrouped=(v_heads, hidden))
      for i, part in enumerate(("write_strength", "decay_input"))]
  fused_elsewhere = ("in_proj_qkv.", "in_proj_z.", "in_proj_b.", "in_proj_a.")
  return out + [spec for spec in hybrid_decoder.fused_qkv_delta_specs(name, s, sizes)
                if not any(spec.source.endswith(f + "weight") for f in fused_elsewhere)]


def _detect(model: pz.nn.Layer) -> str | None:
  """Gated DeltaNet layers with mixtures of experts that Qwen3.5-MoE cannot
  hold: a dense layer among them, a router that does not renormalise, or a
  dense width other than the experts' (the rest is Qwen3.5-MoE's structure, whose record claims it)."""
  found = mixtures(model)
  routed = [layer for layer in found if layer is not None]
  if not hybrid_decoder.has_delta_net(model) or not routed:
    return None
  router = routed[0].router
  if None in found or (isinstance(router, moe.TopKRouter) and not router.normalize):
    return "qwen3_next"
  # Qwen3.5-MoE's config has no dense width: its models' placeholder is the
  # experts' width, and a model holding another came from Qwen3-Next's.
  neurons = named_shape(all_layers(routed[0].experts, pz.nn.Linear)[0])["neurons"]
  if getattr(model, "metadata", None) is not None and model.metadata.mlp_hidden_dim != neurons:
    return "qwen3_next"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only qwen3_next.
  fields = hybrid_decoder.hybrid_fields(model, like)
  found = mixtures(model)
  first = next(layer for layer in found if layer is not None)
  router = first.router
  assert isinstance(router, moe.TopKRouter), "Qwen3-Next's router is a TopKRouter"
  gate = named_shape(all_layers(first.experts, pz.nn.Linear)[0])
  shared = named_shape(all_layers(first.shared, pz.nn.Linear)[0])
  fields.update(num_experts=gate["experts"], moe_intermediate_size=gate["neurons"],
                num_experts_per_tok=router.top_k, norm_topk_prob=router.normalize,
                shared_expert_intermediate_size=shared["neurons"],
                intermediate_size=model.metadata.mlp_hidden_dim)
  chosen = tuple(i for i, layer in enumerate(found) if layer is not None)
  step, dense = like.get("decoder_sparse_step", 1), like.get("mlp_only_layers") or []
  if not (isinstance(step, int) and step > 0 and isinstance(dense, list)
          and expert_layers(len(found), step, dense) == chosen):
    step, dense = 1, [i for i, layer in enumerate(found) if layer is None]
  fields.update(decoder_sparse_step=step, mlp_only_layers=dense)
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_next": {
        "defaults": {**QWEN3_5_DEFAULTS, **_SIZES, "decoder_sparse_step": 1,
                     "norm_topk_prob": True},
        "defaults_why": dict(QWEN3_5_DEFAULTS_WHY),
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Qwen3-Next",
    model_types={
        "qwen3_next": ModelType(qwen3_next_plan, "Qwen3NextForCausalLM",
                                **_TRANSFORMERS_DEFAULTS["qwen3_next"],
                                ignored_fields={**hybrid_decoder.TEXT_IGNORED,
                                                **TRAINING_ONLY_IGNORED},
                                foreign_fields=hybrid_decoder.TEXT_FOREIGN | {"router_jitter_noise"},
                                left_out=(hybrid_decoder.MTP_HEAD,)),
    },
    detect=_detect,
    write_config=_write_config,
    adds=("Qwen3.5-MoE's layers (gated DeltaNet, gated attention, experts with a gated shared"
          " expert) with the DeltaNet's `in_proj_qkvz` / `in_proj_ba` fused per key head (read"
          " by ranges, regrouped into value heads), `norm_topk_prob`, dense MLPs where"
          " `decoder_sparse_step` / `mlp_only_layers` say"),
    refuses="what Qwen3.5 refuses; the multi-token-prediction head (not read)",
    rank=282,
    fields=_FIELDS,
)
