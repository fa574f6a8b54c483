"""Nemotron-H's mixture-of-experts layers (``E`` in
``hybrid_override_pattern``, ``moe`` in ``layers_block_type``), read from
``config.json`` and mapped onto `pz_persist.nn.mixture_of_experts`.

transformers' ``NemotronHMoE``: DeepSeek-V3's router
(`pz_persist.pretrained.hf.building.deepseek_moe`: sigmoid scores in float32,
``e_score_correction_bias`` for choosing only, group-limited top-k, the
chosen scores renormalised if ``norm_topk_prob``, times
``routed_scaling_factor``) over ``n_routed_experts`` non-gated squared-ReLU
experts (``down(relu(up(x)) ** 2)``, of ``moe_intermediate_size``); with
``moe_latent_size`` the experts work in a latent space
(``fc1_latent_proj`` before them, ``fc2_latent_proj`` after their weighted
sum: `pz_persist.nn.mixture_of_experts.LatentMixtureOfExperts`); then one
shared squared-ReLU expert of ``moe_shared_expert_intermediate_size``, on
the layer's input, always added. The Hub's files (and ``save_pretrained``'s)
hold each expert's matrices apart (``mixer.experts.{e}.up_proj.weight``):
they are read as one stack per layer (`pz_persist.pretrained.hf.weights.stacked`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from penzai import pz

from pz_persist.nn import mixture_of_experts as moe
from pz_persist.pretrained.errors import ExportError
from pz_persist.pretrained.hf.building.deepseek_moe import Routing
from pz_persist.pretrained.hf.building.deepseek_moe import check_expert_count
from pz_persist.pretrained.hf.building.deepseek_moe import routing_rule
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.weights import View
from pz_persist.pretrained.hf.weights import Weights
from pz_persist.pretrained.hf.weights import stacked

DEFAULTS: dict[str, Any] = {
    "n_routed_experts": 8, "n_shared_experts": 1, "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688, "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
}
"""transformers' ``NemotronHConfig``'s value of each mixture-of-experts field
(``moe_latent_size`` is None there: no latent projection)."""


def relu2_mlp(name: str) -> pz.nn.Sequential:
  """Nemotron-H's MLP, ``down(relu(up(x)) ** 2)`` with no gate, slots
  ``{name}/up.weights`` and ``{name}/down.weights`` (the sizes come with the
  values bound): the ``-`` layers' mixer and the shared expert."""
  def linear(field: str, inputs: str, outputs: str) -> pz.nn.Linear:
    return pz.nn.Linear(weights=pz.ParameterSlot(f"{name}/{field}.weights"),
                        in_axis_names=(inputs,), out_axis_names=(outputs,))
  return pz.nn.Sequential([
      linear("up", "embedding", "neurons"), pz.nn.Elementwise(jax.nn.relu),
      pz.nn.Elementwise(jnp.square), linear("down", "neurons", "embedding")])


@dataclasses.dataclass(frozen=True)
class NemotronExperts:
  """A checked Nemotron-H mixture of experts.

  Attributes:
    routing: The router's rule and the experts' count and width
      (``routing.shared`` is 1: transformers builds one shared expert).
    shared: The shared expert's width.
    latent: The experts' latent width, or None (they read ``embedding``).
  """

  routing: Routing
  shared: int
  latent: int | None

  @property
  def axis(self) -> str:
    """The experts' input and output axis."""
    return "embedding" if self.latent is None else "latent"

  def specs(self, p: str, s: str, views: list[View]) -> list[TensorSpec]:
    """The tensors of block ``p`` (Penzai) from layer ``s``
    (``backbone.layers.{i}.``); each expert's matrices stacked by a view
    appended to ``views``."""
    r, m, x = self.routing, f"{s}mixer.", f"{p}mlp/"
    e, n, h = r.experts, r.neurons, r.hidden
    width = h if self.latent is None else self.latent
    specs = [
        TensorSpec(f"{x}router.weights", f"{m}gate.weight", (e, h), ("experts", "embedding")),
        TensorSpec(f"{x}router/selection_bias", f"{m}gate.e_score_correction_bias", (e,),
                   ("experts",)),
    ]
    for part, shape, axes in (("up", (e, n, width), ("experts", "neurons", self.axis)),
                              ("down", (e, width, n), ("experts", self.axis, "neurons"))):
      name = f"{m}experts.{part}_proj.weight"  # Not a stored name: the stack of the experts'.
      views.append(stacked(name, [f"{m}experts.{i}.{part}_proj.weight" for i in range(e)]))
      specs.append(TensorSpec(f"{x}experts/{part}.weights", name, shape, axes))
    specs += [
        TensorSpec(f"{x}shared/up.weights", f"{m}shared_experts.up_proj.weight",
                   (self.shared, h), ("neurons", "embedding")),
        TensorSpec(f"{x}shared/down.weights", f"{m}shared_experts.down_proj.weight",
                   (h, self.shared), ("embedding", "neurons")),
    ]
    if self.latent is not None:
      specs += [
          TensorSpec(f"{x}latent_in.weights", f"{m}fc1_latent_proj.weight", (self.latent, h),
                     ("latent", "embedding")),
          TensorSpec(f"{x}latent_out.weights", f"{m}fc2_latent_proj.weight", (h, self.latent),
                     ("embedding", "latent")),
      ]
    return specs

  def layer(self, name: str) -> moe.MixtureOfExperts:
    """The mixture of block ``name`` (``transformer/block_{i}/mlp``)."""
    r = self.routing
    experts = moe.experts_mlp(f"{name}/experts", r.experts,
                              r.hidden if self.latent is None else self.latent, r.neurons,
                              activation="relu2", gated=False, axis=self.axis)
    router, shared = r.router(name, jnp.float32), relu2_mlp(f"{name}/shared")
    if self.latent is None:
      return moe.MixtureOfExperts(router=router, experts=experts, shared=shared)

    def linear(part: str, inputs: str, outputs: str) -> pz.nn.Linear:
      return pz.nn.Linear(weights=pz.ParameterSlot(f"{name}/{part}.weights"),
                          in_axis_names=(inputs,), out_axis_names=(outputs,))
    return moe.LatentMixtureOfExperts(
        router=router, experts=experts, shared=shared,
        expert_input=linear("latent_in", "embedding", "latent"),
        expert_output=linear("latent_out", "latent", "embedding"))


def read_experts(cfg: Config, hidden: int) -> NemotronExperts:
  """The mixture's sizes and rule from ``config.json`` (read only when a
  layer is ``E`` / ``moe``), checked against each other as transformers
  uses them (`routing_rule`)."""
  routing = routing_rule(cfg, hidden, DEFAULTS)
  if routing.shared != 1:
    raise cfg.unsupported("n_shared_experts", routing.shared,
                          "transformers' Nemotron-H always adds one shared expert of"
                          " moe_shared_expert_intermediate_size, whatever this says")
  cfg.get("moe_shared_expert_overlap")  # How Megatron schedules it: no change to the sums.
  return NemotronExperts(routing=routing,
                         shared=cfg.get("moe_shared_expert_intermediate_size",
                                        DEFAULTS["moe_shared_expert_intermediate_size"]),
                         latent=cfg.get("moe_latent_size"))


def check_count(cfg: Config, weights: Any, layer: int, prefix: str, experts: int) -> None:
  """Refuses an ``n_routed_experts`` other than the experts layer ``layer``
  (the first ``moe`` one, under ``prefix``) holds, before a list of experts
  is made; export's stand-in (the model itself) is trusted."""
  if isinstance(weights, Weights):
    check_expert_count(cfg, weights.names, layer, experts,
                       prefix=f"{prefix}{layer}.mixer.experts.", part="up_proj")


def _refusal(layer: moe.MixtureOfExperts) -> str | None:
  """Why ``layer`` is not Nemotron-H's mixture, or None."""
  router = layer.router
  if type(router) is not moe.TopKRouter:  # Not SparseMixerRouter either.
    return f"its router is a {type(router).__name__}, not a TopKRouter"
  rule_ok = (router.score == "sigmoid" and router.selection_bias is not None
             and router.expert_scale is None and router.group_score_k == 2
             and router.normalize_epsilon == (1e-20 if router.normalize else 0.0))
  if not rule_ok:
    return ("its router is not DeepSeek's sigmoid rule (a correction bias, groups ranked by"
            " their best two, 1e-20 added when renormalising)")
  if layer.weight_inputs or layer.shared is None or layer.shared_gate is not None:
    return "it must add one ungated shared expert and weight the experts' outputs"
  if all_layers(layer.experts, pz.nn.BranchAndMultiplyTogether):
    return "its experts are gated (Nemotron-H's are squared-ReLU MLPs without a gate)"
  latent = isinstance(layer, moe.LatentMixtureOfExperts) and layer.expert_input is not None
  if latent != (isinstance(layer, moe.LatentMixtureOfExperts) and layer.expert_output is not None):
    return "it projects into a latent space without projecting back, or the reverse"
  if not latent and layer.expert_input is not None:
    return "it transforms the experts' input"
  return None


def experts_fields(layer: moe.MixtureOfExperts) -> dict[str, Any]:
  """The config fields saying ``layer`` (for export); refuses a mixture
  transformers' Nemotron-H cannot express."""
  why = _refusal(layer)
  if why is not None:
    raise ExportError(f"the model's MixtureOfExperts is not Nemotron-H's: {why}.")
  router = layer.router
  assert isinstance(router, moe.TopKRouter)
  up = named_shape(all_layers(layer.experts, pz.nn.Linear)[0])
  latent = (named_shape(all_layers(layer.expert_input, pz.nn.Linear)[0])["latent"]
            if isinstance(layer, moe.LatentMixtureOfExperts) and layer.expert_input is not None
            else None)
  shared = named_shape(all_layers(layer.shared, pz.nn.Linear)[0])["neurons"]
  return {"n_routed_experts": router.num_experts, "n_shared_experts": 1,
          "moe_intermediate_size": up["neurons"], "moe_shared_expert_intermediate_size": shared,
          "moe_latent_size": latent, "num_experts_per_tok": router.top_k,
          "n_group": router.groups, "topk_group": router.top_groups,
          "norm_topk_prob": router.normalize, "routed_scaling_factor": router.scale}


def unused_fields(like: Mapping[str, Any]) -> dict[str, Any]:
  """The mixture's fields of a model without an ``moe`` layer: ``like``'s,
  else transformers' defaults (they change nothing)."""
  keys = (*DEFAULTS, "moe_latent_size")
  return {k: like.get(k, DEFAULTS.get(k)) for k in keys}
