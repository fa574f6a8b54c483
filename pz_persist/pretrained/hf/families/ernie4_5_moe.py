"""ERNIE 4.5 mixture-of-experts checkpoints (``model_type`` ``ernie4_5_moe``).

ERNIE 4.5's dense layout (adjacent-pair RoPE:
`pz_persist.pretrained.hf.building.interleaved_rope`; ``use_bias`` is refused) with a mixture of
experts in the layers ``i`` with ``(i + 1) % moe_layer_interval == 0`` and
``moe_layer_start_index <= i <= moe_layer_end_index`` (-1: the last), the
others keeping the dense MLP. Each mixture, as transformers'
``Ernie4_5_MoeSparseMoeBlock`` computes it:

- the router's logits in float32, a softmax over every expert; the top
  ``moe_k`` chosen by the softmax *plus* ``e_score_correction_bias``
  (``mlp.moe_statics``), weighted by their unbiased scores renormalised to
  sum to one (`pz_persist.nn.mixture_of_experts.TopKRouter`'s
  ``selection_bias``);
- ``moe_num_shared_experts`` shared experts, one SwiGLU MLP of
  ``moe_intermediate_size * moe_num_shared_experts``, always added.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist.nn import mixture_of_experts as moe
from pz_persist.pretrained import errors
from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import attention_size_fields
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.deepseek_moe import shared_mlp
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.interleaved_rope import interleaved_everywhere
from pz_persist.pretrained.hf.building.interleaved_rope import with_interleaved_rope
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY
from pz_persist.pretrained.hf.building.moe import ExpertNames
from pz_persist.pretrained.hf.building.moe import Experts
from pz_persist.pretrained.hf.building.moe import check_experts
from pz_persist.pretrained.hf.building.moe import mixtures
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config_from_model import all_layers
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
from pz_persist.pretrained.hf.weights import stacked

_PARTS = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))
_MAX_NORM_MIN = 1e-6
"""The largest ``moe_norm_min`` read: transformers divides by ``max(sum,
moe_norm_min)``, the sum of the chosen softmax scores, which is the sum
itself unless the chosen experts' scores are all but zero."""


def _int_or_last(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= -1


_INDEX = (_int_or_last, "a layer index, or -1 for the last")


def moe_layers(cfg: Config, layers: int) -> tuple[int, ...]:
  """The layers with experts, as ``Ernie4_5_MoeDecoderLayer`` chooses them
  (``layers`` already checked against the weights)."""
  start = cfg.get("moe_layer_start_index", FROM_TABLE)
  end = cfg.get("moe_layer_end_index", FROM_TABLE)
  interval = cfg.get("moe_layer_interval", FROM_TABLE)
  end = layers - 1 if end == -1 else end
  return tuple(i for i in range(layers) if (i + 1) % interval == 0 and start <= i <= end)


def _specs(p: str, s: str, experts: Experts, shared: int, hidden: int
           ) -> tuple[list[TensorSpec], list[Any]]:
  e, n = experts.num_experts, experts.neurons
  specs = [
      TensorSpec(f"{p}mlp/router.weights", f"{s}mlp.gate.weight", (e, hidden),
                 ("experts", "embedding")),
      TensorSpec(f"{p}mlp/router/selection_bias", f"{s}mlp.moe_statics.e_score_correction_bias",
                 (e,), ("experts",), stored=(1, e)),
  ]
  views = []
  for part, hf in _PARTS:
    stored = (n, hidden) if part != "down" else (hidden, n)
    axes = ("neurons", "embedding") if part != "down" else ("embedding", "neurons")
    name = f"{s}mlp.experts.{hf}.weight"  # Not stored: the stack of the experts'.
    views.append(stacked(name, [f"{s}mlp.experts.{i}.{hf}.weight" for i in range(e)]))
    specs.append(TensorSpec(f"{p}mlp/experts/{part}.weights", name, (e, *stored),
                            ("experts", *axes)))
  width = n * shared
  for part, hf in _PARTS:
    stored = (width, hidden) if part != "down" else (hidden, width)
    axes = ("neurons", "embedding") if part != "down" else ("embedding", "neurons")
    specs.append(TensorSpec(f"{p}mlp/shared/{part}.weights", f"{s}mlp.shared_experts.{hf}.weight",
                            stored, axes))
  return specs, views


def _layer(name: str, experts: Experts, shared: int, hidden: int, dtype: Any) -> pz.nn.Layer:
  # transformers computes the router in float32 (weight and activations).
  logits = pz.nn.Sequential([pz.nn.CastToDType(jnp.float32),
                             moe.router_linear(f"{name}/router", experts.num_experts, hidden,
                                               dtype=dtype)])
  router = moe.TopKRouter(
      logits=logits, num_experts=experts.num_experts, top_k=experts.top_k, score="softmax",
      normalize=True,
      selection_bias=moe.expert_vector(f"{name}/router/selection_bias", experts.num_experts))
  return moe.MixtureOfExperts(
      router=router,
      experts=moe.experts_mlp(f"{name}/experts", experts.num_experts, hidden, experts.neurons,
                              activation="silu", dtype=dtype),
      shared=shared_mlp(f"{name}/shared", hidden, experts.neurons * shared, dtype) if shared
      else None)


def ernie4_5_moe_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps an ERNIE 4.5 MoE checkpoint (module docstring)."""
  # transformers' use_bias also biases the shared experts and the output
  # head here; the Hub's ERNIE 4.5 MoE folders have none, and neither is built.
  bool_field(cfg, "use_bias", False, False, "biases on the shared experts and the output head"
             " are not read for ERNIE 4.5 MoE (its published folders have none)")
  count = cfg.get("moe_num_experts", FROM_TABLE)
  top_k = cfg.get("moe_k", FROM_TABLE)
  if top_k > count:
    raise cfg.unsupported("moe_k", top_k, f"more experts per token than the {count} experts")
  neurons = cfg.require("moe_intermediate_size")
  shared = cfg.get("moe_num_shared_experts", FROM_TABLE)
  norm_min = cfg.get("moe_norm_min", FROM_TABLE)
  if norm_min > _MAX_NORM_MIN:
    raise cfg.unsupported("moe_norm_min", norm_min, f"pz_persist reads at most {_MAX_NORM_MIN}"
                          " (the chosen scores' sum is then the divisor)")
  for key in ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval"):
    cfg.get(key, FROM_TABLE)
  if cfg.get("moe_layer_interval", FROM_TABLE) == 0:
    raise cfg.unsupported("moe_layer_interval", 0, "must be a positive integer")

  def edit(model: model_parts.TransformerLM, config: Any) -> model_parts.TransformerLM:
    del config
    return with_interleaved_rope(model)

  # llama_plan checks the layer count against the weights.
  plan = llama_plan(cfg, weights, biases=Biases(), edit=edit)
  layers = cfg.require("num_hidden_layers")
  experts = Experts(num_experts=count, top_k=top_k, neurons=neurons, normalize=True,
                    layers=moe_layers(cfg, layers), names=ExpertNames())
  check_experts(cfg, weights, experts, "moe_num_experts")
  hidden = cfg.require("hidden_size")
  chosen = set(experts.layers)
  specs = [spec for spec in plan.tensors if not (
      (match := spec.label.split("/")) and len(match) > 2 and match[1].startswith("block_")
      and int(match[1][6:]) in chosen and match[2] == "mlp")]
  views = list(plan.views)
  for i in experts.layers:
    more, more_views = _specs(f"transformer/block_{i}/", f"model.layers.{i}.", experts, shared,
                              hidden)
    specs += more
    views += more_views
  dtype = weights.dtype

  def build() -> model_parts.TransformerLM:
    model = plan.build()
    for i in experts.layers:
      block = pz.select(model).at_instances_of(model_parts.TransformerBlock).pick_nth_selected(i)
      model = block.at_instances_of(model_parts.TransformerFeedForward).apply(
          lambda ffw, i=i: model_parts.TransformerFeedForward([
              _layer(f"transformer/block_{i}/mlp", experts, shared, hidden, dtype)]))
    return model

  return Plan(build, tuple(specs), tuple(views))


def _detect(model: pz.nn.Layer) -> str | None:
  """ERNIE 4.5's attention, and mixtures of experts routed by a softmax with
  a selection bias (Llama 4's route by a sigmoid)."""
  found = [layer for layer in mixtures(model) if layer is not None]
  routers = [layer.router for layer in found]
  ernie = routers and all(isinstance(r, moe.TopKRouter) and r.score == "softmax"
                          and r.selection_bias is not None for r in routers)
  return "ernie4_5_moe" if ernie and interleaved_everywhere(model) else None


def _placement(found: list[Any]) -> dict[str, int]:
  """``moe_layer_start_index`` / ``end_index`` / ``interval`` giving exactly
  the blocks with experts, or `ExportError`."""
  chosen = [i for i, layer in enumerate(found) if layer is not None]
  start, end = chosen[0], chosen[-1]
  for interval in range(1, len(found) + 1):
    if [i for i in range(len(found)) if (i + 1) % interval == 0 and start <= i <= end] == chosen:
      return {"moe_layer_start_index": start, "moe_layer_end_index": end,
              "moe_layer_interval": interval}
  raise errors.ExportError(f"the blocks with experts, {chosen[:10]}, are not every k-th block"
                           " between two indices, which is all ERNIE 4.5 can say.")


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only ernie4_5_moe.
  found = mixtures(model)
  first = next(layer for layer in found if layer is not None)
  gate = named_shape(all_layers(first.experts, pz.nn.Linear)[0])
  shared = (named_shape(all_layers(first.shared, pz.nn.Linear)[0])["neurons"] // gate["neurons"]
            if first.shared is not None else 0)
  dense = [ffw for ffw, layer in zip(all_layers(model, model_parts.TransformerFeedForward), found)
           if layer is None]
  intermediate = (named_shape(all_layers(dense[0], pz.nn.Linear)[0])["neurons"] if dense
                  else like.get("intermediate_size") or gate["neurons"])
  return {**attention_size_fields(model), **rms_norm_fields(model), **rope_fields(model),
          **tied_field(model, like), "hidden_act": "silu", "intermediate_size": intermediate,
          "use_bias": False,
          "moe_num_experts": first.router.num_experts, "moe_k": first.router.top_k,
          "moe_intermediate_size": gate["neurons"], "moe_num_shared_experts": shared,
          **_placement(found)}


_DEFAULTS: dict[str, Any] = {
    **{k: v for k, v in LLAMA_LIKE.items() if k != "attention_bias"}, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True, "use_bias": False, "num_key_value_heads": 4,
    "max_position_embeddings": 131_072, "rope_theta": 500_000.0, "moe_num_experts": 64,
    "moe_k": 6, "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
    "moe_layer_end_index": -1, "moe_layer_interval": 1, "moe_norm_min": 1e-12}


RECORD = Family(
    title="ERNIE 4.5 MoE",
    model_types={"ernie4_5_moe": ModelType(
        ernie4_5_moe_plan, "Ernie4_5_MoeForCausalLM", defaults=_DEFAULTS,
        left_out=(left_out_matching(
            (r"(^|\.)mtp[._]",), "the multi-token-prediction block (mtp_block, mtp_*_norm...)",
            "the causal LM does not run it (transformers drops it too)", reported=True),),
        defaults_why={"moe_layer_end_index": (
            "the class turns -1 into the last layer's index as it is built; -1 means the same")},
        ignored_fields={"training only: the load-balancing loss": (
            "router_aux_loss_coef", "output_router_logits")})},
    detect=_detect,
    write_config=_write_config,
    adds=("ERNIE 4.5's dense layout with mixtures of experts every `moe_layer_interval`-th"
          " layer from `moe_layer_start_index` to `moe_layer_end_index`: softmax routing chosen"
          " with `e_score_correction_bias` (`TopKRouter.selection_bias`), renormalised; shared"
          " experts"),
    refuses="`use_bias` (which also biases shared experts and head), `moe_norm_min` above 1e-6;"
            " what Llama refuses",
    rank=3,
    fields={"use_bias": BOOLEAN, "moe_num_experts": POSITIVE_INT, "moe_k": POSITIVE_INT,
            "moe_intermediate_size": POSITIVE_INT, "moe_num_shared_experts": NON_NEGATIVE_INT,
            "moe_layer_start_index": NON_NEGATIVE_INT, "moe_layer_end_index": _INDEX,
            "moe_layer_interval": NON_NEGATIVE_INT, "moe_norm_min": POSITIVE_NUMBER,
            **{key: TRAINING_ONLY[key] for key in ("router_aux_loss_coef",
                                                   "output_router_logits")}},
)
