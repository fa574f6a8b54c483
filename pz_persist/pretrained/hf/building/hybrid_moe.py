"""Shared code (no record): Qwen3.5's hybrid layers
(`pz_persist.pretrained.hf.building.hybrid_decoder`) with mixtures of
experts and a sigmoid-gated shared expert, the feed-forward blocks of
Qwen3.5-MoE (every layer) and Qwen3-Next (the layers ``decoder_sparse_step``
and ``mlp_only_layers`` choose; the others keep a dense MLP).

Each mixture (`pz_persist.nn.mixture_of_experts.MixtureOfExperts`): a
softmax router over ``num_experts``, the top ``num_experts_per_tok``
renormalised over the chosen (always in Qwen3.5-MoE, whose
``Qwen3_5MoeTopKRouter`` divides whatever ``norm_topk_prob`` says; as
``norm_topk_prob`` says in Qwen3-Next), SwiGLU experts of
``moe_intermediate_size``, plus a shared SwiGLU expert of
``shared_expert_intermediate_size`` whose output is multiplied by
``sigmoid(shared_expert_gate(x))`` (one logit per token).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable

from pz_persist.pretrained.hf.building import hybrid_decoder
from pz_persist.pretrained.hf.building.moe import ExpertNames
from pz_persist.pretrained.hf.building.moe import Experts
from pz_persist.pretrained.hf.building.moe import check_experts
from pz_persist.pretrained.hf.building.moe import read_experts
from pz_persist.pretrained.hf.building.moe import softmax_router
from pz_persist.pretrained.hf.building.moe import with_experts
from pz_persist.pretrained.hf.building.moe import with_gated_shared_expert
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.weights import Stacked
from pz_persist.pretrained.hf.weights import Weights


def hybrid_moe_plan(cfg: Config, weights: Weights, root: str = "model.",
                    tied: bool | None = None, *,
                    defaults: dict | None = None,
                    expert_layers: Callable[[int], tuple[int, ...]] | None = None,
                    normalize: bool = True, normalize_always: bool = True,
                    delta_net_specs: Callable[..., list[TensorSpec]] | None = None) -> Plan:
  """Qwen3.5's plan with the MLP of ``expert_layers(layer count)`` (every
  layer if None) a mixture of experts and a gated shared expert, the text
  model's tensors under ``root``. ``defaults``: transformers' values of
  absent sizes (Qwen3.5-MoE's config class differs from the dense one's);
  ``delta_net_specs``: the DeltaNet layers' tensors (Qwen3-Next fuses
  them otherwise)."""
  cfg.fill_absent(defaults or {})
  count, top_k, neurons = read_experts(cfg, "num_experts", "moe_intermediate_size")
  shared = cfg.require("shared_expert_intermediate_size")
  # No dense MLP: the dense plan's placeholder size is the experts' (its
  # MLPs are all replaced before anything is allocated).
  if expert_layers is None and cfg.raw.get("intermediate_size") is None:
    cfg.raw["intermediate_size"] = neurons
  plan = hybrid_decoder.qwen3_5_text_plan(cfg, weights, root=root, tied=tied,
                                          delta_net_specs=delta_net_specs)
  layers = cfg.require("num_hidden_layers")
  hidden = cfg.require("hidden_size")
  chosen = tuple(range(layers)) if expert_layers is None else expert_layers(layers)
  experts = Experts(count, top_k, neurons, normalize, chosen, ExpertNames())
  # The experts' shared loader names layers ``model.layers.{i}.``: it is
  # given the names as if under that root, and its specs are moved back.
  names = {_LAYERS + n[len(root) + len("layers."):] if n.startswith(root + "layers.") else n
           for n in weights.names}
  check_experts(cfg, types.SimpleNamespace(names=names,
                                           stand_in=getattr(weights, "stand_in", False)),
                experts, "num_experts")
  routed = with_experts(plan, experts, hidden, names,
                        softmax_router(normalize_always=normalize_always))
  plan = Plan(routed.build, tuple(_moved(spec, root) if spec.label.split("/")[2:3] == ["mlp"]
                                  else spec for spec in routed.tensors),
              tuple(Stacked(_rooted(v.name, root), tuple(_rooted(p, root) for p in v.parts))
                    if isinstance(v, Stacked) else v for v in routed.views))
  return with_gated_shared_expert(plan, {i: f"{root}layers.{i}.mlp." for i in chosen},
                                  shared, hidden)


_LAYERS = "model.layers."


def _rooted(name: str, root: str) -> str:
  return root + "layers." + name[len(_LAYERS):] if name.startswith(_LAYERS) else name


def _moved(spec: TensorSpec, root: str) -> TensorSpec:
  return dataclasses.replace(spec, source=_rooted(spec.source, root))
