"""DeepSeek-V3's mixture of experts (and GLM-4.5's, the same rule), read from
``config.json`` and mapped onto
`pz_persist.nn.mixture_of_experts`.

The rule (transformers' ``DeepseekV3TopkRouter``): sigmoid scores of the
router logits (float32); ``e_score_correction_bias`` added for choosing
only; the experts split into ``n_group`` consecutive groups, each ranked by
the sum of its two best biased scores, the ``topk_group`` best kept; the
``num_experts_per_tok`` best biased scores of the kept experts chosen;
their weights the *unbiased* scores, divided by their sum (plus 1e-20) if
``norm_topk_prob``, times ``routed_scaling_factor``. Then
``n_shared_experts`` shared experts, one SwiGLU MLP of
``moe_intermediate_size * n_shared_experts``, always added.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from jax.typing import DTypeLike
from penzai import pz

from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import STRING
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.plan import DECODER_LAYERS
from pz_persist.pretrained.hf.plan import LeftOut
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import left_out_layers

Source = Callable[..., str]
"""``src(stored name, stored shape, parts=None)``: the tensor a spec reads
for a stored matrix (or the stack of the stored ``parts``), FP8 ones
dequantised (`pz_persist.pretrained.hf.quantized_fp8.source`)."""

_PROJECTIONS = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))


@dataclasses.dataclass(frozen=True)
class Routing:
  """A checked DeepSeek-style routing: sizes and rule."""

  hidden: int
  experts: int
  neurons: int
  shared: int
  top_k: int
  groups: int
  top_groups: int
  normalize: bool
  scale: float

  def specs(self, p: str, s: str, src: Source) -> list[TensorSpec]:
    """The tensors of MoE block ``p`` (Penzai) from layer ``s``: the router
    and its correction bias, each expert's three matrices stacked on a new
    ``experts`` dimension (a `pz_persist.pretrained.hf.weights.stacked`
    view), the shared experts."""
    h, e, n = self.hidden, self.experts, self.neurons
    specs = [
        TensorSpec(f"{p}mlp/router.weights", f"{s}mlp.gate.weight", (e, h),
                   ("experts", "embedding")),
        TensorSpec(f"{p}mlp/router/selection_bias", f"{s}mlp.gate.e_score_correction_bias",
                   (e,), ("experts",)),
    ]
    for part, hf in _PROJECTIONS:
      stored = (n, h) if part != "down" else (h, n)
      axes = ("neurons", "embedding") if part != "down" else ("embedding", "neurons")
      source = src(f"{s}mlp.experts.{hf}.weight", stored,
                   [f"{s}mlp.experts.{i}.{hf}.weight" for i in range(e)])
      specs.append(TensorSpec(f"{p}mlp/experts/{part}.weights", source, (e, *stored),
                              ("experts", *axes)))
    width = n * self.shared
    for part, hf in _PROJECTIONS:
      stored = (width, h) if part != "down" else (h, width)
      axes = ("neurons", "embedding") if part != "down" else ("embedding", "neurons")
      specs.append(TensorSpec(f"{p}mlp/shared/{part}.weights",
                              src(f"{s}mlp.shared_experts.{hf}.weight", stored), stored, axes))
    return specs

  def layer(self, name: str, dtype: DTypeLike) -> pz.nn.Layer:
    """The Penzai layer of MoE block ``name``'s MLP."""
    from pz_persist.nn import mixture_of_experts as moe  # pylint: disable=import-outside-toplevel
    return moe.MixtureOfExperts(
        router=self.router(name, dtype),
        experts=moe.experts_mlp(f"{name}/experts", self.experts, self.hidden, self.neurons,
                                activation="silu", dtype=dtype),
        shared=shared_mlp(f"{name}/shared", self.hidden, self.neurons * self.shared, dtype))


  def router(self, name: str, dtype: DTypeLike) -> pz.nn.Layer:
    """The `TopKRouter` of MoE block ``name`` (``{name}/router.weights``,
    ``{name}/router/selection_bias``), by this rule."""
    from pz_persist.nn import mixture_of_experts as moe  # pylint: disable=import-outside-toplevel
    # transformers computes the router's logits in float32 (its weight kept in
    # float32, the activations cast): the same here, from the stored weight.
    logits = pz.nn.Sequential([pz.nn.CastToDType(jnp.float32),
                               moe.router_linear(f"{name}/router", self.experts, self.hidden,
                                                 dtype=dtype)])
    return moe.TopKRouter(
        logits=logits,
        num_experts=self.experts, top_k=self.top_k, score="sigmoid", normalize=self.normalize,
        normalize_epsilon=1e-20 if self.normalize else 0.0, scale=self.scale,
        groups=self.groups, top_groups=self.top_groups, group_score_k=2,
        selection_bias=moe.expert_vector(f"{name}/router/selection_bias", self.experts, dtype))


def shared_mlp(name: str, hidden: int, neurons: int, dtype: DTypeLike) -> pz.nn.Sequential:
  """A SwiGLU MLP (``{name}/gate``, ``/up``, ``/down``), as a plain
  ``Sequential`` (not a ``TransformerFeedForward``: it is part of one)."""
  import jax  # pylint: disable=import-outside-toplevel

  def linear(part: str, inputs: dict[str, int], outputs: dict[str, int]) -> pz.nn.Linear:
    return pz.nn.Linear.from_config(name=f"{name}/{part}", init_base_rng=None,
                                    input_axes=inputs, output_axes=outputs, dtype=dtype)

  embedding, hidden_axes = {"embedding": hidden}, {"neurons": neurons}
  return pz.nn.Sequential([
      pz.nn.BranchAndMultiplyTogether(branches=[
          pz.nn.NamedGroup("gate", [linear("gate", embedding, hidden_axes),
                                    pz.nn.Elementwise(jax.nn.silu)]),
          linear("up", embedding, hidden_axes),
      ]),
      linear("down", hidden_axes, embedding),
  ])


DEEPSEEK_DEFAULTS = {"n_routed_experts": 256, "n_group": 8, "topk_group": 4,
                     "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                     "n_shared_experts": 1, "routed_scaling_factor": 2.5}
"""``DeepseekV3Config``'s defaults for an absent field."""

ROUTER_DEFAULTS_WHY = {
    "scoring_func": (
        "DeepSeek's router field (GLM-4.5 has DeepSeek's router); transformers 5 "
        "always computes sigmoid scores"),
    "topk_method": (
        "DeepSeek's router field (GLM-4.5 has DeepSeek's router); transformers 5 "
        "always computes noaux_tc (a selection-only bias)"),
    "moe_layer_freq": (
        "DeepSeek's router field (GLM-4.5 has DeepSeek's router); transformers 5 "
        "always computes every layer from first_k_dense_replace on as MoE"),
}
"""Why the router fields of DeepSeek-V3 and GLM-4.5 (which has DeepSeek's
router) have defaults of their own: one text for both families' tables."""


def read_routing(cfg: Config, hidden: int,
                 defaults: Mapping[str, Any] = DEEPSEEK_DEFAULTS) -> Routing:
  """The routing fields (``defaults``: the family's transformers defaults),
  checked against each other as transformers uses them (a group needs two
  experts; the choice must fit the kept groups)."""
  cfg.expect("scoring_func", {"sigmoid"}, "sigmoid",
             why="; DeepSeek-V3's router scores are sigmoids")
  cfg.expect("topk_method", {"noaux_tc"}, "noaux_tc",
             why="; transformers' DeepSeek-V3 router implements the noaux_tc choice only")
  cfg.expect("moe_layer_freq", {1}, 1, why="; every layer from first_k_dense_replace on is MoE")
  return routing_rule(cfg, hidden, defaults)


def routing_rule(cfg: Config, hidden: int, defaults: Mapping[str, Any]) -> Routing:
  """`read_routing`'s sizes and rule, for a family whose config has no
  DeepSeek-only router fields (Nemotron-H: transformers' router is the same
  rule whatever the config says)."""
  experts = cfg.get("n_routed_experts", defaults["n_routed_experts"])
  groups = cfg.get("n_group", defaults["n_group"])
  top_groups = cfg.get("topk_group", defaults["topk_group"])
  top_k = cfg.get("num_experts_per_tok", defaults["num_experts_per_tok"])
  if experts % groups or experts // groups < 2:
    raise cfg.unsupported("n_group", groups, f"must split n_routed_experts={experts} into"
                          " groups of two experts or more (a group is ranked by its best two)")
  if top_groups > groups:
    raise cfg.unsupported("topk_group", top_groups, f"at most n_group={groups}")
  if top_k > top_groups * (experts // groups):
    raise cfg.unsupported("num_experts_per_tok", top_k, f"at most the {top_groups * (experts // groups)}"
                          " experts of the topk_group groups kept")
  return Routing(hidden=hidden, experts=experts,
                 neurons=cfg.get("moe_intermediate_size", defaults["moe_intermediate_size"]),
                 shared=cfg.get("n_shared_experts", defaults["n_shared_experts"]), top_k=top_k,
                 groups=groups, top_groups=top_groups, normalize=cfg.get("norm_topk_prob", True),
                 scale=float(cfg.get("routed_scaling_factor", defaults["routed_scaling_factor"])))


def routing_fields(model: pz.nn.Layer, like: Mapping[str, Any], dense_layers: int) -> dict[str, Any]:
  """The routing fields of ``model`` (its first MoE layer's), for export;
  ``like``'s where the model has no MoE layer."""
  from pz_persist.nn import mixture_of_experts as moe  # pylint: disable=import-outside-toplevel
  keys = ("n_routed_experts", "moe_intermediate_size", "n_shared_experts", "num_experts_per_tok",
          "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")
  fields: dict[str, Any] = {"first_k_dense_replace": dense_layers}
  layers = all_layers(model, moe.MixtureOfExperts)
  if not layers:
    fields.update({key: like[key] for key in keys if key in like})
    return fields
  layer = layers[0]
  router = layer.router
  neurons = named_shape(all_layers(layer.experts, pz.nn.Linear)[0])["neurons"]
  shared = named_shape(all_layers(layer.shared, pz.nn.Linear)[0])["neurons"]
  fields.update(n_routed_experts=router.num_experts, moe_intermediate_size=neurons,
                n_shared_experts=max(shared // neurons, 1), num_experts_per_tok=router.top_k,
                n_group=router.groups, topk_group=router.top_groups,
                norm_topk_prob=router.normalize, routed_scaling_factor=router.scale)
  return fields


def check_expert_count(cfg: Config, names: set[str], layer: int, experts: int, *,
                       prefix: str | None = None, part: str = "gate_proj") -> None:
  """Refuses an ``n_routed_experts`` other than the experts layer ``layer``
  (the first with experts) holds, before any list of experts is made: a
  forged count (10**9) must not reach the per-expert specs. ``prefix``: where
  the layer's experts are (``model.layers.{layer}.mlp.experts.``), ``part``
  one of each expert's matrices (for the message)."""
  prefix = f"model.layers.{layer}.mlp.experts." if prefix is None else prefix
  pattern = re.compile(re.escape(prefix) + r"(\d{1,9})\.")
  held = sorted({int(m.group(1)) for name in names if (m := pattern.match(name))})
  if len(held) == experts and held[-1] == experts - 1:  # Sorted and distinct: 0..experts-1.
    return
  if not held:
    found = "no per-expert tensors"
    if any(name.startswith(prefix) for name in names):
      found += " (experts fused in one tensor, a layout pz_persist does not read for this family)"
  elif held[-1] == len(held) - 1:
    found = f"experts 0..{held[-1]}"
  else:
    found = f"experts {held[:10]}{'...' if len(held) > 10 else ''}"
  raise cfg.invalid("n_routed_experts", experts, "a positive integer matching the weights",
                    f" but layer {layer} holds {found} ({prefix}{{e}}.{part}.weight...)")



def mtp_layers(layers: int, mtp: int) -> LeftOut:
  """The multi-token prediction layers (``model.layers.{layers}`` ..
  ``layers + mtp - 1``), which the causal LM does not run: declared left out
  (`pz_persist.pretrained.hf.plan.Plan.left_out`), as transformers drops
  them (its ``_keys_to_ignore_on_load_unexpected``)."""
  return left_out_layers(DECODER_LAYERS, layers, mtp, "the multi-token-prediction layers",
                         "the causal LM does not run them (transformers drops them too)")


def main_layers(names: set[str], layers: int, mtp: int) -> set[str]:
  """``names`` without those of the multi-token prediction layers
  (`mtp_layers`)."""
  is_mtp = mtp_layers(layers, mtp).covers
  return {name for name in names if not is_mtp(name)}


MOE_FIELDS = {
    "first_k_dense_replace": NON_NEGATIVE_INT,
    "moe_intermediate_size": POSITIVE_INT,
    "n_routed_experts": POSITIVE_INT,
    "n_shared_experts": POSITIVE_INT,
    "num_experts_per_tok": POSITIVE_INT,
    "n_group": POSITIVE_INT,
    "topk_group": POSITIVE_INT,
    "routed_scaling_factor": POSITIVE_NUMBER,
    "norm_topk_prob": BOOLEAN,
    "num_nextn_predict_layers": NON_NEGATIVE_INT,
    "moe_layer_freq": POSITIVE_INT,
    "scoring_func": STRING,
    "topk_method": STRING,
}
"""The ``config.json`` fields of DeepSeek's mixture of experts (and its
multi-token prediction layers), as DeepSeek-V3 and GLM-4.5 read them."""

MOE_IGNORED = {
    "training or parallelism only (the balancing loss, expert parallelism), not the forward"
    " pass": ("aux_loss_alpha", "seq_aux", "ep_size", "output_router_logits",
              "router_aux_loss_coef"),
    "the Hub's remote code, which transformers' own class replaces": ("auto_map",),
}
"""The fields of DeepSeek's mixture of experts its plans leave unread, as
DeepSeek-V3's and GLM-4.5's records declare them."""

MOE_FOREIGN = frozenset({"auto_map", "aux_loss_alpha", "ep_size", "router_aux_loss_coef",
                         "seq_aux"})
"""Those of `MOE_IGNORED` that only the Hub's configs (DeepSeek's remote code)
hold: transformers' config classes lack them."""
