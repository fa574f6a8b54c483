"""Hunyuan mixture-of-experts checkpoints (``model_type`` ``hunyuan_v1_moe``:
Hunyuan-A13B).

Hunyuan's attention (`pz_persist.pretrained.hf.building.hunyuan`: query/key
RMS norms after RoPE, ``dynamic`` RoPE with ``alpha`` as its fixed base) on
Llama's layout, with a mixture of experts in place of every layer's MLP, as
transformers' ``HunYuanMoEV1Moe`` computes it:

- the router (``mlp.gate.wg``) in float32, input and weight, a softmax over
  the ``num_experts`` experts, the top ``moe_topk`` (one count, or one per
  layer) renormalised to sum to one;
- SwiGLU experts of ``intermediate_size``;
- one shared SwiGLU MLP of ``intermediate_size`` (``mlp.shared_mlp``),
  always added, ungated.

The Hub's configs (written for Tencent's own code) also carry
``moe_intermediate_size`` and ``num_shared_expert``, ints or per-layer
lists, which transformers does not read: its experts and shared MLP are all
of ``intermediate_size``, one shared MLP. They are read, and refused unless
they say the same (every ``moe_intermediate_size`` equal to
``intermediate_size``, every ``num_shared_expert`` 1, as in Hunyuan-A13B),
since a folder meaning otherwise computes one thing in transformers and
another in the code it was written for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from penzai import pz

from pz_persist.nn import mixture_of_experts as moe
from pz_persist.pretrained import errors
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.hunyuan import ADDS
from pz_persist.pretrained.hf.building.hunyuan import FIELDS as HUNYUAN_FIELDS
from pz_persist.pretrained.hf.building.hunyuan import hunyuan_plan
from pz_persist.pretrained.hf.building.hunyuan import norms_after_rope
from pz_persist.pretrained.hf.building.moe import ExpertNames
from pz_persist.pretrained.hf.building.moe import Experts
from pz_persist.pretrained.hf.building.moe import check_experts
from pz_persist.pretrained.hf.building.moe import config_activation
from pz_persist.pretrained.hf.building.moe import expert_fields
from pz_persist.pretrained.hf.building.moe import mixtures
from pz_persist.pretrained.hf.building.moe import with_experts
from pz_persist.pretrained.hf.building.moe import with_shared_expert
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights


def _positive_ints(value: Any) -> bool:
  return POSITIVE_INT[0](value) or (
      isinstance(value, list) and bool(value) and all(POSITIVE_INT[0](v) for v in value))


_PER_LAYER = (_positive_ints, "a positive integer or a non-empty list of them (one per layer)")

_NAMES = ExpertNames(router="gate.wg")
"""Where transformers keeps a layer's router (``mlp.gate.wg.weight``); the
experts as every MoE family stores them."""


def _per_layer(cfg: Config, key: str, value: Any, layers: int) -> tuple[int, ...]:
  """``value`` (``key``'s: an int, or a list indexed by layer) for each of
  the ``layers`` layers; a list too short for them is refused (transformers
  fails building such a model; a longer one's tail is unread, as there)."""
  if isinstance(value, int):
    return (value,) * layers
  if len(value) < layers:
    raise cfg.unsupported(key, value, f"a list needs an entry for each of the {layers} layers")
  return tuple(value[:layers])


def _read_alias(cfg: Config, key: str, alias: str) -> Any:
  """``key``, or its alias of transformers' ``attribute_map`` (which wins
  there when both are given, so both must agree)."""
  value, other = cfg.get(key), cfg.get(alias)
  if value is not None and other is not None and value != other:
    raise cfg.unsupported(f"{key}, {alias}", (value, other),
                          "transformers reads both as one field; they must agree")
  return other if value is None else value


def _same_everywhere(cfg: Config, key: str, value: Any, layers: int, means: int,
                     why: str) -> None:
  """Refuses ``value``, ``key``'s (a Hub field transformers leaves unread),
  unless it says ``means`` for every layer: what transformers builds (module
  docstring)."""
  if value is not None and set(_per_layer(cfg, key, value, layers)) != {means}:
    raise cfg.unsupported(key, value, why)


def hunyuan_v1_moe_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Hunyuan MoE checkpoint (module docstring)."""
  # Read before the dense plan, which refuses the fields nobody read; judged
  # per layer once it has checked the layer count against the weights.
  count = _read_alias(cfg, "num_experts", "num_local_experts")
  count = cfg.default("num_experts", FROM_TABLE) if count is None else count
  top_k = _read_alias(cfg, "moe_topk", "num_experts_per_tok")
  top_k = cfg.default("moe_topk", FROM_TABLE) if top_k is None else top_k
  widths, shared = cfg.get("moe_intermediate_size"), cfg.get("num_shared_expert")
  plan = hunyuan_plan(cfg, weights)
  layers = cfg.require("num_hidden_layers")
  neurons = cfg.require("intermediate_size")
  top_ks = _per_layer(cfg, "moe_topk", top_k, layers)
  if max(top_ks) > count:
    raise cfg.unsupported("moe_topk", top_k, f"more experts per token than the {count} experts")
  _same_everywhere(cfg, "moe_intermediate_size", widths, layers, neurons,
                   f"transformers' experts are of intermediate_size ({neurons}) in every layer")
  _same_everywhere(cfg, "num_shared_expert", shared, layers, 1,
                   "transformers builds one shared MLP in every layer")
  experts = Experts(num_experts=count, top_k=max(top_ks), neurons=neurons, normalize=True,
                    layers=tuple(range(layers)), names=_NAMES)
  check_experts(cfg, weights, experts, "num_experts")
  dtype = weights.dtype

  def router(name: str, experts: Experts, hidden: int) -> pz.nn.Layer:
    # transformers computes the router in float32 (its weight and its input).
    block = int(name.split("/")[1].removeprefix("block_"))
    return moe.TopKRouter(
        logits=pz.nn.Sequential([pz.nn.CastToDType(jnp.float32), moe.router_linear(
            f"{name}/router", experts.num_experts, hidden, dtype=dtype)]),
        num_experts=experts.num_experts, top_k=top_ks[block], score="softmax", normalize=True)

  hidden = cfg.require("hidden_size")
  activation = config_activation(cfg)
  plan = with_experts(plan, experts, hidden, weights.names, router, activation)
  return with_shared_expert(plan, {i: f"model.layers.{i}.mlp." for i in experts.layers},
                            neurons, hidden, activation, module="shared_mlp", gate=None)


def _hunyuan_routed(layer: moe.MixtureOfExperts) -> bool:
  """Hunyuan's mixture: a float32 softmax top-k, renormalised, and an
  ungated shared expert."""
  router = layer.router
  return (isinstance(router, moe.TopKRouter) and isinstance(router.logits, pz.nn.Sequential)
          and [type(sub) for sub in router.logits.sublayers] == [pz.nn.CastToDType, pz.nn.Linear]
          and router.logits.sublayers[0].dtype == jnp.float32
          and router.score == "softmax" and router.normalize and router.normalize_epsilon == 0
          and router.groups == 1 and router.scale == 1.0 and router.selection_bias is None
          and router.expert_scale is None and layer.shared is not None
          and layer.shared_gate is None and not layer.weight_inputs
          and layer.expert_input is None)


def _detect(model: pz.nn.Layer) -> str | None:
  """Every block a Hunyuan mixture (`_hunyuan_routed`), beside Hunyuan's
  query/key norms after RoPE."""
  found = mixtures(model)
  return ("hunyuan_v1_moe" if found and all(layer is not None and _hunyuan_routed(layer)
                                            for layer in found) and norms_after_rope(model)
          else None)


def _spelled_like(like: Mapping[str, Any], key: str, per_layer: list[int]) -> Any:
  """``like``'s ``key`` when it says ``per_layer`` (its int or list kept),
  else one int if every layer has the same, else the list."""
  given = like.get(key)
  if (given == per_layer[0] and len(set(per_layer)) == 1) or (
      isinstance(given, list) and given[:len(per_layer)] == per_layer):
    return given
  return per_layer[0] if len(set(per_layer)) == 1 else per_layer


def _sizes(layer: moe.MixtureOfExperts) -> tuple[int, int, int]:
  """A mixture's experts, their width and its shared expert's width."""
  gate = named_shape(all_layers(layer.experts, pz.nn.Linear)[0])
  return gate["experts"], gate["neurons"], named_shape(all_layers(layer.shared, pz.nn.Linear)[0])[
      "neurons"]


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only hunyuan_v1_moe.
  found = mixtures(model)
  if not all(layer is not None for layer in found):
    raise errors.ExportError("a block of the model has no MixtureOfExperts: every Hunyuan MoE"
                             " layer has experts, so transformers could not read it.")
  odd = [i for i, layer in enumerate(found) if layer is not None and not _hunyuan_routed(layer)]
  if odd:
    raise errors.ExportError(
        f"block {odd[0]}'s MixtureOfExperts is not Hunyuan MoE's (a float32 softmax top-k router,"
        " renormalised, with no selection bias or scale, and an ungated shared MLP), which is"
        " all transformers' HunYuanMoEV1ForCausalLM computes.")
  fields = expert_fields(model, like, accepts=_hunyuan_routed)
  routed = [layer for layer in found if layer is not None]
  sizes = sorted({_sizes(layer) for layer in routed})
  experts, neurons, shared = sizes[0]
  if len(sizes) != 1 or shared != neurons:
    raise errors.ExportError(
        f"the model's mixtures have sizes {sizes[:4]} (experts, neurons, shared neurons);"
        " Hunyuan MoE has one expert count, and one width, intermediate_size, for every"
        " expert and shared MLP.")
  for key in ("num_experts_per_tok", "norm_topk_prob", "_experts", "_neurons"):
    fields.pop(key)
  layers = len(found)
  fields.update({
      "intermediate_size": neurons, "num_experts": experts,
      "moe_topk": _spelled_like(like, "moe_topk", [layer.router.top_k for layer in routed]),
      "attention_bias": model_biases(model).output})
  for key, means in (("moe_intermediate_size", neurons), ("num_shared_expert", 1)):
    if like.get(key) is not None and _spelled_like(like, key, [means] * layers) == like[key]:
      fields[key] = like[key]  # The Hub's field, saying what transformers builds.
  return fields


RECORD = Family(
    title="Hunyuan MoE",
    model_types={"hunyuan_v1_moe": ModelType(
        hunyuan_v1_moe_plan, "HunYuanMoEV1ForCausalLM",
        defaults={**LLAMA_LIKE, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
                  "num_experts": 1, "moe_topk": 1},
        ignored_fields={"the end-of-document token id, read by no layer": ("eod_token_id",),
                        "training only: the load-balancing loss": ("output_router_logits",)})},
    detect=_detect,
    write_config=_write_config,
    adds=(f"{ADDS}; a mixture of experts in every layer (`MixtureOfExperts`: float32 softmax"
          " router, renormalised top `moe_topk`, one count or one per layer) and an ungated"
          " shared MLP (`shared_mlp`)"),
    refuses=("`moe_intermediate_size` other than `intermediate_size`, `num_shared_expert` other"
             " than 1, a per-layer `num_experts`; what Hunyuan dense refuses"),
    rank=336,
    fields={**HUNYUAN_FIELDS, "num_experts": POSITIVE_INT, "num_local_experts": POSITIVE_INT,
            "moe_topk": _PER_LAYER, "num_experts_per_tok": _PER_LAYER,
            "moe_intermediate_size": _PER_LAYER, "num_shared_expert": _PER_LAYER,
            "output_router_logits": BOOLEAN},
)
