"""Shared code (no record): a llama-like plan whose feed-forward blocks are,
in some layers, a `pz_persist.nn.mixture_of_experts.MixtureOfExperts`
(Qwen3-MoE, Mixtral).

The family's dense plan (`pz_persist.pretrained.hf.building.decoder.llama_plan`
with its hooks) is built first; `with_experts` then swaps, in each layer that
has experts, the dense MLP's specs and slots for the router's and the
experts'. The experts' tensors are read as transformers stores them on the
Hub, one per expert (``mlp.experts.{e}.gate_proj.weight``), stacked by a
`pz_persist.pretrained.hf.weights.stacked` view into one Penzai parameter
with an ``experts`` axis (so loading 128 experts is one preallocated buffer
per parameter, not 128 arrays), or, for a folder holding transformers 5's
in-memory layout (``mlp.experts.gate_up_proj`` ``[experts, 2 * neurons,
embedding]`` and ``mlp.experts.down_proj``), from those fused tensors, or
from the same tensors stored transposed (``[experts, embedding, 2 *
neurons]``: Qwen3-VL-MoE's Hub files; `transposed_by_shape`).
Export writes whichever layout the plan read (the Hub's by default).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist.nn import mixture_of_experts as moe
from pz_persist.pretrained import errors
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import activation_field
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.config_from_model import projection
from pz_persist.pretrained.hf.config_from_model import rms_norm_fields
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.weights import View
from pz_persist.pretrained.hf.weights import stacked

NUMBER = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")
LAYER_LIST = (lambda v: isinstance(v, list) and all(
    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v),
    "a list of non-negative layer indices")

TRAINING_ONLY = {"output_router_logits": BOOLEAN, "router_aux_loss_coef": NUMBER,
                 "router_jitter_noise": NUMBER}
"""Fields only training reads (the load-balancing loss, router noise):
read, and ignored at inference."""


TRAINING_ONLY_IGNORED = {
    "training only: the load-balancing loss and the router's noise": tuple(TRAINING_ONLY)}
"""`TRAINING_ONLY` as a record's ``ignored_fields``
(`pz_persist.pretrained.hf.record.ModelType`)."""


@dataclasses.dataclass(frozen=True)
class ExpertNames:
  """Where a family keeps a layer's mixture of experts, relative to the
  layer's prefix (``model.layers.{i}.``).

  Attributes:
    block: The module holding router and experts (``mlp``; Mixtral's
      ``block_sparse_moe``).
    router: The router's module under it (``gate``).
    gate, up, down: Each expert's projections (``gate_proj``; Mixtral's
      ``w1``, ``w3``, ``w2``).
  """

  block: str = "mlp"
  router: str = "gate"
  gate: str = "gate_proj"
  up: str = "up_proj"
  down: str = "down_proj"

  def per_expert(self, s: str, e: int | str, part: str) -> str:
    return f"{s}{self.block}.experts.{e}.{part}.weight"

  def fused(self, s: str, part: str) -> str:
    return f"{s}{self.block}.experts.{part}"


@dataclasses.dataclass(frozen=True)
class Experts:
  """A family's mixture of experts, as read from its config.

  Attributes:
    num_experts: Routed experts.
    top_k: Experts per token.
    neurons: Each expert's hidden size.
    normalize: Renormalise the chosen weights (Qwen's ``norm_topk_prob``;
      always in Mixtral).
    layers: The layers that have experts (the others keep the dense MLP).
    names: `ExpertNames`.
    transposed: The fused tensors (``gate_up_proj``, ``down_proj``; names as
      the plan sees them) stored with their last two dimensions swapped
      (`transposed_by_shape`).
  """

  num_experts: int
  top_k: int
  neurons: int
  normalize: bool
  layers: tuple[int, ...]
  names: ExpertNames
  transposed: frozenset[str] = frozenset()


_IN_MEMORY = {"gate_up_proj": lambda hidden, neurons: (2 * neurons, hidden),
              "down_proj": lambda hidden, neurons: (hidden, neurons)}


def transposed_by_shape(shapes: Mapping[str, Sequence[int]], hidden: int, neurons: int
                        ) -> frozenset[str]:
  """Which fused expert tensors (``shapes``: each ``...experts.gate_up_proj``
  / ``...experts.down_proj`` by name, its stored shape from the safetensors
  header) are stored transposed, decided as transformers' Qwen3-VL-MoE
  conversion decides (``Transpose(1, 2, check_dims=True)``): a tensor whose
  shape is not the in-memory one (``[experts, 2 * neurons, hidden]``,
  ``[experts, hidden, neurons]``) is transposed on load. The Hub's files hold
  them transposed, ``save_pretrained`` writes them in memory's layout, and a
  square one is read as stored, as transformers reads it; a shape that is
  neither is refused by the plan's shape check before anything is read."""
  return frozenset(
      name for name, shape in shapes.items()
      if tuple(shape[1:]) != _IN_MEMORY[name.rsplit(".", 1)[1]](hidden, neurons))


def read_experts(cfg: Config, count_key: str, neurons_key: str, aliases: Sequence[str] = ()
                 ) -> tuple[int, int, int]:
  """``(experts, experts per token, neurons)``: the count under ``count_key``
  or one of its ``aliases`` (transformers 5 writes Qwen3-MoE's
  ``num_experts`` as ``num_local_experts``; both must agree)."""
  counts = {key: cfg.get(key) for key in (count_key, *aliases)}
  given = {key: value for key, value in counts.items() if value is not None}
  if len(set(given.values())) > 1:
    raise cfg.unsupported(", ".join(given), tuple(given.values()),
                          "the fields name one expert count and must agree")
  if not given:
    raise errors.UnsupportedConfigError(f"{cfg.where}: required field {count_key!r} is missing.")
  experts = next(iter(given.values()))
  top_k = cfg.require("num_experts_per_tok")
  if top_k > experts:
    raise cfg.unsupported("num_experts_per_tok", top_k,
                          f"more experts per token than the {experts} experts")
  return experts, top_k, cfg.require(neurons_key)


def config_activation(cfg: Config) -> moe.Activation:
  """The experts' activation for ``hidden_act`` (already checked by
  `pz_persist.pretrained.hf.building.decoder.llama_plan`: SiLU, or a tanh
  GELU)."""
  return "silu" if cfg.get("hidden_act", FROM_TABLE) == "silu" else "gelu_tanh"


def routed_layers(cfg: Config) -> Callable[[int], tuple[int, ...]]:
  """The layers with experts, as transformers' Qwen2-MoE and Qwen3-MoE
  decide (``i`` not in ``mlp_only_layers`` and ``(i + 1) %
  decoder_sparse_step == 0``), given the layer count (called once it is
  checked against the weights; the fields are read here)."""
  step = cfg.get("decoder_sparse_step", 1)
  dense = cfg.get("mlp_only_layers") or []

  def routed(layers: int) -> tuple[int, ...]:
    if any(i >= layers for i in dense):
      raise cfg.unsupported("mlp_only_layers", dense, f"the layers are 0..{layers - 1}")
    return tuple(i for i in range(layers) if i not in set(dense) and (i + 1) % step == 0)

  return routed


def sparse_step_fields(model: pz.nn.Layer, like: Mapping[str, Any]) -> dict[str, Any]:
  """``decoder_sparse_step`` and ``mlp_only_layers`` saying which of the
  model's blocks are mixtures (`routed_layers`' rule): like's when they
  say so, else a step of 1 and the dense layers listed."""
  found = mixtures(model)
  routed = tuple(i for i, layer in enumerate(found) if layer is not None)
  step, dense = like.get("decoder_sparse_step"), like.get("mlp_only_layers") or []
  if not (isinstance(step, int) and step > 0 and isinstance(dense, list) and routed == tuple(
      i for i in range(len(found)) if i not in dense and (i + 1) % step == 0)):
    step, dense = 1, [i for i, layer in enumerate(found) if layer is None]
  return {"decoder_sparse_step": step, "mlp_only_layers": dense}


def check_experts(cfg: Config, weights: Any, experts: Experts, key: str) -> None:
  """Refuses an expert count other than the experts the weights hold (the
  first layer with experts), before anything is built: the stacked views
  list every expert, so a forged count (10**9) must not reach them. A folder
  of transformers 5's fused layout is left to its shape checks (its specs
  do not grow with the count)."""
  if not experts.layers or getattr(weights, "stand_in", False):  # Export: the model's own.
    return
  names = weights.names
  s = f"model.layers.{experts.layers[0]}."
  prefix = f"{s}{experts.names.block}.experts."
  pattern = re.compile(re.escape(prefix) + r"(\d{1,9})\.")
  held = sorted({int(m.group(1)) for name in names if (m := pattern.match(name))})
  count = experts.num_experts
  if len(held) == count and held[-1] == count - 1:  # Sorted and distinct: 0..count-1.
    return
  if not held:
    if experts.names.fused(s, "gate_up_proj") in names:
      return
    raise errors.SafetensorsFormatError(
        f"{cfg.where}: the checkpoint holds no experts for layer {experts.layers[0]}: neither"
        f" {experts.names.per_expert(s, 0, experts.names.gate)!r} and the other experts'"
        f" tensors (the Hub's layout) nor {experts.names.fused(s, 'gate_up_proj')!r}"
        " (transformers 5's); the config says this layer has a mixture of experts.")
  shown = (f"experts 0..{held[-1]}" if held[-1] == len(held) - 1
           else f"experts {held[:10]}{'...' if len(held) > 10 else ''}")
  raise cfg.invalid(key, count, "a positive integer matching the weights",
                    f" but layer {experts.layers[0]} holds {shown}")


def _specs(p: str, s: str, experts: Experts, hidden: int, names: set[str]
           ) -> tuple[list[TensorSpec], list[View]]:
  """Layer ``s``'s router and experts (Penzai block ``p``), and the views
  stacking the per-expert tensors."""
  n, e, h = experts.names, experts.num_experts, experts.neurons
  m = f"{p}mlp/"
  specs = [TensorSpec(f"{m}router.weights", f"{s}{n.block}.{n.router}.weight", (e, hidden),
                      ("experts", "embedding"))]
  views: list[View] = []
  gate_up = n.fused(s, "gate_up_proj")
  if gate_up in names:  # transformers 5's in-memory layout, or its transpose.
    if gate_up in experts.transposed:  # [e, hidden, 2h]: the gate's h columns, then the up's.
      specs += [
          TensorSpec(f"{m}experts/{part}.weights", gate_up, (e, hidden, 2, h),
                     ("experts", "embedding", "neurons"), take=(2, i), stored=(e, hidden, 2 * h))
          for i, part in enumerate(("gate", "up"))]
    else:
      specs += [
          TensorSpec(f"{m}experts/{part}.weights", gate_up, (e, 2, h, hidden),
                     ("experts", "neurons", "embedding"), take=(1, i), stored=(e, 2 * h, hidden))
          for i, part in enumerate(("gate", "up"))]
    down = n.fused(s, "down_proj")
    down_axes = (("experts", "neurons", "embedding") if down in experts.transposed
                 else ("experts", "embedding", "neurons"))
    down_shape = {"experts": e, "neurons": h, "embedding": hidden}
    specs.append(TensorSpec(f"{m}experts/down.weights", down,
                            tuple(down_shape[axis] for axis in down_axes), down_axes))
    return specs, views
  for part, hf, shape, axes in (("gate", n.gate, (e, h, hidden), ("neurons", "embedding")),
                                ("up", n.up, (e, h, hidden), ("neurons", "embedding")),
                                ("down", n.down, (e, hidden, h), ("embedding", "neurons"))):
    name = n.fused(s, f"{hf}.weight")  # Not a stored name: the stack of the experts'.
    views.append(stacked(name, [n.per_expert(s, i, hf) for i in range(e)]))
    specs.append(TensorSpec(f"{m}experts/{part}.weights", name, shape, ("experts", *axes)))
  return specs, views


_BLOCK = re.compile(r"transformer/block_(\d+)/")


def with_experts(plan: Plan, experts: Experts, hidden: int, names: set[str],
                 make_router: Callable[[str, Experts, int], pz.nn.Layer],
                 activation: moe.Activation = "silu") -> Plan:
  """``plan`` with the dense MLP of each of ``experts.layers`` replaced by a
  `MixtureOfExperts` (inside Penzai's ``TransformerFeedForward``, so the
  block reads like Penzai's own), its specs by the router's and experts'."""
  moe_layers = set(experts.layers)

  def dense_mlp_of_moe_layer(spec: TensorSpec) -> bool:
    match = _BLOCK.match(spec.label)
    return bool(match and int(match.group(1)) in moe_layers
                and spec.label.startswith(f"{match.group(0)}mlp/"))

  specs = [spec for spec in plan.tensors if not dense_mlp_of_moe_layer(spec)]
  views = list(plan.views)
  for i in experts.layers:
    more, more_views = _specs(f"transformer/block_{i}/", f"model.layers.{i}.", experts, hidden,
                              names)
    specs += more
    views += more_views
  dtype_of = plan.build

  def build() -> model_parts.TransformerLM:
    skeleton = dtype_of()

    def replace(ffw: model_parts.TransformerFeedForward) -> Any:
      slots = jax.tree_util.tree_leaves(ffw, is_leaf=lambda x: isinstance(x, pz.ParameterSlot))
      match = _BLOCK.match(slots[0].label) if slots else None
      if not match or int(match.group(1)) not in moe_layers:
        return ffw
      name = f"{match.group(0)}mlp"
      return model_parts.TransformerFeedForward([moe.MixtureOfExperts(
          router=make_router(name, experts, hidden),
          experts=moe.experts_mlp(f"{name}/experts", experts.num_experts, hidden,
                                  experts.neurons, activation=activation))])

    return pz.select(skeleton).at_instances_of(model_parts.TransformerFeedForward).apply(replace)

  return Plan(build, tuple(specs), tuple(views))


def softmax_router(normalize_always: bool = False
                   ) -> Callable[[str, Experts, int], pz.nn.Layer]:
  """Qwen3-MoE's and Mixtral's router: a softmax over every expert, the top
  k, renormalised over the k if ``normalize`` (Mixtral: always)."""

  def make(name: str, experts: Experts, hidden: int) -> pz.nn.Layer:
    return moe.TopKRouter(
        logits=moe.router_linear(f"{name}/router", experts.num_experts, hidden),
        num_experts=experts.num_experts, top_k=experts.top_k, score="softmax",
        normalize=normalize_always or experts.normalize)

  return make


def gated_mlp(name: str, activation: moe.Activation = "silu") -> pz.nn.Sequential:
  """A gated MLP over ``embedding`` (a shared expert) with slots
  ``{name}/gate.weights``, ``{name}/up.weights``, ``{name}/down.weights``;
  its sizes come from the weights loaded into them."""
  def linear(part: str, inputs: str, outputs: str) -> pz.nn.Linear:
    return pz.nn.Linear(weights=pz.ParameterSlot(f"{name}/{part}.weights"),
                        in_axis_names=(inputs,), out_axis_names=(outputs,))
  after_gate, _ = moe.expert_activation(activation)
  return pz.nn.Sequential([
      pz.nn.BranchAndMultiplyTogether(branches=[
          pz.nn.NamedGroup("gate", [linear("gate", "embedding", "neurons"), *after_gate]),
          pz.nn.NamedGroup("up", [linear("up", "embedding", "neurons")]),
      ]),
      linear("down", "neurons", "embedding"),
  ])


def with_gated_shared_expert(plan: Plan, sources: Mapping[int, str], width: int, hidden: int,
                             activation: moe.Activation = "silu") -> Plan:
  """``plan`` (built by `with_experts`) with a shared expert beside each
  `MixtureOfExperts`, its output times ``sigmoid(shared_expert_gate(x))``
  (Qwen2-MoE, Qwen3.5-MoE): `with_shared_expert` of the module
  ``shared_expert`` and the gate's one logit from
  ``{source}shared_expert_gate.weight`` (``[1, hidden]``)."""
  return with_shared_expert(plan, sources, width, hidden, activation)


def with_shared_expert(plan: Plan, sources: Mapping[int, str], width: int, hidden: int,
                       activation: moe.Activation = "silu", *, module: str = "shared_expert",
                       gate: str | None = "shared_expert_gate") -> Plan:
  """``plan`` (built by `with_experts`) with a shared expert beside each
  `MixtureOfExperts`: a gated MLP of ``width`` read from
  ``{source}{module}.{gate,up,down}_proj.weight``, where ``sources`` maps
  each layer with experts to its MLP's Hugging Face prefix
  (``model.layers.{i}.mlp.``); its output times ``sigmoid(gate(x))`` whose
  one logit is read from ``{source}{gate}.weight`` (``[1, hidden]``), or
  added as it is when ``gate`` is None (Hunyuan MoE's ``shared_mlp``)."""
  specs = list(plan.tensors)
  for i, s in sources.items():
    m = f"transformer/block_{i}/mlp/"
    specs += [
        TensorSpec(f"{m}shared/gate.weights", f"{s}{module}.gate_proj.weight",
                   (width, hidden), ("neurons", "embedding")),
        TensorSpec(f"{m}shared/up.weights", f"{s}{module}.up_proj.weight",
                   (width, hidden), ("neurons", "embedding")),
        TensorSpec(f"{m}shared/down.weights", f"{s}{module}.down_proj.weight",
                   (hidden, width), ("embedding", "neurons")),
    ]
    if gate is not None:
      specs.append(TensorSpec(f"{m}shared_gate.weights", f"{s}{gate}.weight", (hidden,),
                              ("embedding",), stored=(1, hidden)))
  routed_build = plan.build

  def build() -> model_parts.TransformerLM:
    def add_shared(layer: moe.MixtureOfExperts) -> moe.MixtureOfExperts:
      name = _router_label(layer).removesuffix("/router.weights")
      shared_gate = None if gate is None else pz.nn.Linear(
          weights=pz.ParameterSlot(f"{name}/shared_gate.weights"),
          in_axis_names=("embedding",), out_axis_names=())
      return dataclasses.replace(layer, shared=gated_mlp(f"{name}/shared", activation),
                                 shared_gate=shared_gate)
    return pz.select(routed_build()).at_instances_of(moe.MixtureOfExperts).apply(add_shared)

  return Plan(build, tuple(specs), plan.views)


def _router_label(layer: moe.MixtureOfExperts) -> str:
  """The label of ``layer``'s router weights (its ``Linear``, maybe inside a
  ``Sequential`` that casts its input first)."""
  return all_layers(layer.router, pz.nn.Linear)[0].weights.label


# --- export: what a model with experts says about its config -----------------


def mixtures(model: pz.nn.Layer) -> list[moe.MixtureOfExperts | None]:
  """Each block's `MixtureOfExperts`, or None for a dense block."""
  found = []
  for block in blocks(model):
    layers = all_layers(block, moe.MixtureOfExperts)
    found.append(layers[0] if layers else None)
  return found


def softmax_routed(layer: moe.MixtureOfExperts, gated_shared: bool = False) -> bool:
  """Whether ``layer`` is the plain softmax-top-k mixture of Qwen3-MoE and
  Mixtral (no input weighting, a plain ``Linear`` router), without shared
  experts or, with ``gated_shared``, with Qwen2-MoE's sigmoid-gated one."""
  router = layer.router
  shared = ((layer.shared is not None and layer.shared_gate is not None) if gated_shared
            else (layer.shared is None and layer.shared_gate is None))
  return (isinstance(router, moe.TopKRouter) and isinstance(router.logits, pz.nn.Linear)
          and router.score == "softmax" and router.groups == 1 and router.scale == 1.0
          and router.selection_bias is None and router.expert_scale is None
          and shared and not layer.weight_inputs and layer.expert_input is None)


def expert_fields(model: pz.nn.Layer, like: Mapping[str, Any], gated_shared: bool = False,
                  accepts: Callable[[moe.MixtureOfExperts], bool] | None = None
                  ) -> dict[str, Any]:
  """The llama-like fields of a model whose feed-forward blocks may be
  mixtures (sizes, norms, RoPE, activation, tied head), plus
  ``num_experts_per_tok`` and ``norm_topk_prob`` and the sizes
  ``intermediate_size`` (a dense block's; else ``like``'s or the experts')
  and the experts' (returned under ``"_experts"`` and ``"_neurons"`` for the
  family to name); ``gated_shared`` as in `softmax_routed`, or ``accepts``
  telling the family's routing instead (Phi-3.5-MoE's sparsemixer)."""
  embed = named_shape(first_layer(model, pz.nn.EmbeddingTable, "token embeddings"))
  attn = attention(model)
  query, key = projection(attn.input_to_query), projection(attn.input_to_key)
  heads = [size for axis, size in query.items() if axis in ("heads", "head_groups",
                                                            "query_heads")]
  kv_heads = [size for axis, size in key.items() if axis in ("heads", "head_groups")]
  found = mixtures(model)
  routed = [layer for layer in found if layer is not None]
  if not routed:
    raise errors.ExportError("the model has no MixtureOfExperts layer, so it is not a mixture of"
                      " experts; export it as its dense family (name it with like=).")
  first = routed[0]
  router = first.router
  fits = accepts(first) if accepts is not None else softmax_routed(first, gated_shared)
  if not fits or not isinstance(router, moe.TopKRouter):
    raise errors.ExportError(f"the model's MixtureOfExperts has a router {type(router).__name__}"
                      " other than the softmax top-k one of Qwen3-MoE and Mixtral.")
  gate = named_shape(first_layer(first.experts, pz.nn.Linear, "experts"))
  dense = [ffw for ffw, layer in zip(all_layers(model, model_parts.TransformerFeedForward),
                                     found) if layer is None]
  if dense:
    intermediate = named_shape(first_layer(dense[0], pz.nn.Linear, "MLP"))["neurons"]
  else:
    # No dense block shows it: the model's own metadata keeps the size the
    # load read (Qwen3-30B-A3B's 6144 beside experts of 768), which the plan
    # rebuilds the metadata from; else ``like``'s, else the experts'.
    intermediate = (getattr(getattr(model, "metadata", None), "mlp_hidden_dim", None)
                    or like.get("intermediate_size") or gate["neurons"])
  product = 1
  for size in heads:
    product *= size
  fields = {
      "hidden_size": embed["embedding"], "vocab_size": embed["vocabulary"],
      "num_attention_heads": product, "num_key_value_heads": (kv_heads or [1])[0],
      "head_dim": query["projection"], "num_hidden_layers": len(found),
      "intermediate_size": intermediate, "num_experts_per_tok": router.top_k,
      "norm_topk_prob": router.normalize, "_experts": gate["experts"],
      "_neurons": gate["neurons"],
      **rms_norm_fields(model), **rope_fields(model), **activation_field(model, like),
      **tied_field(model, like),
  }
  return fields
