"""A mixture-of-experts feed-forward layer with named axes, for the MoE
checkpoints `pz_persist.pretrained.load_hf` reads (Qwen3-MoE, Mixtral,
Qwen3.5-MoE, gpt-oss, Llama 4, DeepSeek-V3, GLM-4.5, Gemma 4, Nemotron-H).

Penzai has no mixture of experts; this one is built from its own pieces so
that treescope shows it and `pz_persist.AxisRules` shards it like the rest:

* the router is a ``pz.nn.Linear`` from ``embedding`` to ``experts`` (with
  an ``AddBias`` for gpt-oss, or any layer giving logits over ``experts``:
  Gemma 4 normalises and scales the router's input first);
* `TopKRouter` turns the logits into one weight per expert per token, zero
  for the experts not chosen; how is data (its fields), covering every
  family's rule: softmax over all experts then top-k (optionally
  renormalised over the k), top-k of the logits then a softmax over the k
  (gpt-oss), sigmoid scores with a selection-only bias and group-limited
  choice times a scaling factor (DeepSeek-V3 / GLM-4.5), sigmoid of the
  chosen logits (Llama 4), a learned per-expert scale (Gemma 4);
* the experts are a Penzai gated MLP (``BranchAndMultiplyTogether`` of a
  gate and a value branch, then an output ``Linear``) whose ``Linear``
  weights carry an ``experts`` axis: ``[experts, embedding, neurons]`` and
  ``[experts, neurons, embedding]``, optional ``AddBias`` over
  ``[experts, neurons]`` / ``[experts, embedding]``; the activation is a
  layer of its own (SiLU, tanh or exact GELU as ``pz.nn.Elementwise``,
  gpt-oss's clamped SwiGLU as `ClampedSwiGLUGate` / `ClampedLinearUp`);
* optional shared experts (a plain Penzai MLP) added for every token,
  optionally times a sigmoid gate (a ``Linear`` from ``embedding`` to no
  axis);
* Nemotron-H's experts: non-gated (``down(relu(up(x)) ** 2)``,
  ``experts_mlp(gated=False)``), optionally in a smaller latent space that
  `LatentMixtureOfExperts` projects into and back out of.

How it computes (inference): every expert runs on every token and the
outputs are summed with the router's weights, zero for the experts not
chosen (a *dense masked sum*). Why: it is an ordinary named-axis einsum over
``experts``, so with ``experts`` sharded over a mesh axis each device runs
only its own experts on every token and one sum over devices combines them
(expert parallelism without all-to-all, and no gathered copy of the
weights); it matches transformers' per-expert loop to float32 rounding (a
zero weight times a finite output adds exactly zero); and it compiles to a
fixed shape for Penzai's KV-cache sampling. Its cost is ``experts / k``
times the FLOPs of running only the chosen experts, which is what a tiny
or sharded model can afford; it is not the layer for serving a large MoE
on one device. No load-balancing loss is computed (inference only).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from penzai import pz

from pz_persist.nn._fields import static

Score = Literal["softmax", "sigmoid", "softmax_of_chosen", "sparsemixer"]
"""How `TopKRouter` turns logits into scores: ``softmax`` over all experts
(Qwen3-MoE, Mixtral, Gemma 4), ``sigmoid`` of each (DeepSeek-V3, GLM-4.5,
Llama 4), the logits themselves chosen then a ``softmax`` over the k
chosen (gpt-oss), or Phi-3.5-MoE's ``sparsemixer`` at inference (see
`TopKRouter`)."""

Activation = Literal["silu", "gelu_tanh", "gelu", "clamped_swiglu", "relu2"]
"""The experts' activations `experts_mlp` builds (after the gate, or after
the only projection of non-gated experts: ``relu2`` is Nemotron-H's squared
ReLU)."""

_RuleFields = tuple[int, int, Score, bool, float, float, int, int, int, float]
"""`TopKRouter`'s routing fields, in `_Rule`'s order: hashable, so `_route`
compiles once per rule."""


@pz.pytree_dataclass
class TopKRouter(pz.nn.Layer):
  """Maps a token's activations to one weight per expert (named axis
  ``experts``), zero for the experts not chosen.

  For each token: ``scores = score(logits)`` (in float32); the experts are
  chosen by the top ``top_k`` of ``scores + selection_bias`` among the
  experts of the ``top_groups`` best groups (when ``groups > 1``: the
  experts split into ``groups`` equal consecutive groups, a group ranked by
  the sum of its ``group_score_k`` best biased scores); the chosen experts'
  weights are their *unbiased* scores (a softmax over the chosen for
  ``softmax_of_chosen``), divided by their sum plus ``normalize_epsilon`` if
  ``normalize``, times ``scale``, times ``expert_scale`` of the expert.
  The result is cast to the activations' dtype.

  ``sparsemixer`` (Phi-3.5-MoE, ``top_k`` 2) chooses the best logit, then
  the best of the others; each chosen expert's weight is its softmax over
  the logits still in the running (the chosen one and the experts not yet
  chosen whose relative gap to it, ``(best - logit) / max(|logit|, best)``,
  is at most ``2 * jitter_eps``; the others count as minus infinity).

  Attributes:
    logits: A layer giving the router logits over ``experts`` (a
      ``pz.nn.Linear`` from ``embedding``, maybe followed by an
      ``AddBias``, or a ``Sequential`` that prepares its input first).
    num_experts: The size of ``experts``.
    top_k: Experts chosen per token.
    score: `Score`.
    normalize: Renormalise the chosen weights to sum to one.
    normalize_epsilon: Added to that sum (DeepSeek-V3 adds 1e-20).
    scale: Multiplies the chosen weights (DeepSeek's
      ``routed_scaling_factor``).
    groups: Expert groups for group-limited choice (1: none).
    top_groups: Groups kept (DeepSeek's ``topk_group``).
    group_score_k: Best scores summed to rank a group (2 in DeepSeek-V3).
    selection_bias: Added to the scores for choosing only (DeepSeek-V3's
      ``e_score_correction_bias``), over ``experts``; or None.
    expert_scale: Multiplies each chosen expert's weight (Gemma 4's
      ``per_expert_scale``), over ``experts``; or None.
  """

  logits: pz.nn.Layer
  num_experts: int = static()
  top_k: int = static()
  score: Score = static("softmax")
  normalize: bool = static(False)
  normalize_epsilon: float = static(0.0)
  scale: float = static(1.0)
  groups: int = static(1)
  top_groups: int = static(1)
  group_score_k: int = static(2)
  selection_bias: pz.ParameterLike[pz.nx.NamedArray] | None = None
  expert_scale: pz.ParameterLike[pz.nx.NamedArray] | None = None

  def jitter(self) -> float:
    """``sparsemixer``'s relative gap (`SparseMixerRouter` sets it)."""
    return 0.0

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    logits = self.logits(inputs, **side_inputs)
    extras = [p.value.untag("experts") if p is not None else None
              for p in (self.selection_bias, self.expert_scale)]
    rule = (self.num_experts, self.top_k, self.score, self.normalize, self.normalize_epsilon,
            self.scale, self.groups, self.top_groups, self.group_score_k, self.jitter())
    weights = pz.nx.nmap(functools.partial(_route, rule))(logits.untag("experts"), *extras)
    return weights.tag("experts").astype(inputs.dtype)



@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # TopKRouter's, then its own.
class SparseMixerRouter(TopKRouter):
  """Phi-3.5-MoE's router: a `TopKRouter` scoring by ``sparsemixer`` with
  its relative gap. A class of its own, not one more field of `TopKRouter`,
  so that checkpoints holding a `TopKRouter` keep loading field for field.

  Example:
    >>> import jax
    >>> from penzai import pz
    >>> from pz_persist.nn import mixture_of_experts as moe
    >>> router = moe.SparseMixerRouter(
    ...     logits=pz.nn.Linear.from_config(
    ...         name="router", init_base_rng=jax.random.key(0),
    ...         input_axes={"embedding": 4}, output_axes={"experts": 3}),
    ...     num_experts=3, top_k=2, score="sparsemixer", jitter_eps=0.01)
    >>> router(pz.nx.ones({"seq": 2, "embedding": 4})).named_shape
    {'seq': 2, 'experts': 3}

  Attributes:
    jitter_eps: The relative gap (Phi-3.5-MoE's ``router_jitter_noise``).
  """

  jitter_eps: float = static(0.0)

  def jitter(self) -> float:
    return self.jitter_eps

@functools.partial(jax.jit, static_argnums=0)
def _route(rule: _RuleFields, logits: jax.Array, bias: jax.Array | None,
           expert_scale: jax.Array | None) -> jax.Array:
  """One token's dense weights from its logits (all 1-D over experts), by
  the `TopKRouter` fields in ``rule``. Compiled once per rule: also fast
  when the model is called eagerly, outside ``jax.jit``."""
  return _Rule(*rule).route(logits, bias, expert_scale)


@dataclasses.dataclass(frozen=True)
class _Rule:
  """`TopKRouter`'s static fields (see there)."""

  num_experts: int
  top_k: int
  score: Score
  normalize: bool
  normalize_epsilon: float
  scale: float
  groups: int
  top_groups: int
  group_score_k: int
  jitter_eps: float

  def route(self, logits: jax.Array, bias: jax.Array | None,
            expert_scale: jax.Array | None) -> jax.Array:
    logits = logits.astype(jnp.float32)
    if self.score == "sparsemixer":
      return self.sparsemixer(logits)
    if self.score == "softmax":
      scores = jax.nn.softmax(logits)
    elif self.score == "sigmoid":
      scores = jax.nn.sigmoid(logits)
    else:
      scores = logits
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if self.groups > 1:
      per_group = self.num_experts // self.groups
      grouped = choice.reshape(self.groups, per_group)
      group_scores = jax.lax.top_k(grouped, self.group_score_k)[0].sum(axis=-1)
      _, kept = jax.lax.top_k(group_scores, self.top_groups)
      keep = jnp.zeros(self.groups, bool).at[kept].set(True)
      choice = jnp.where(jnp.repeat(keep, per_group), choice, -jnp.inf)
    _, chosen = jax.lax.top_k(choice, self.top_k)
    weights = scores[chosen]
    if self.score == "softmax_of_chosen":
      weights = jax.nn.softmax(weights)
    if self.normalize:
      weights = weights / (weights.sum() + self.normalize_epsilon)
    if self.scale != 1.0:
      weights = weights * self.scale
    if expert_scale is not None:
      weights = weights * expert_scale.astype(jnp.float32)[chosen]
    return jnp.zeros_like(scores).at[chosen].set(weights)


  def sparsemixer(self, logits: jax.Array) -> jax.Array:
    """Phi-3.5-MoE's inference routing (`TopKRouter`), ``top_k`` rounds of
    choosing the best remaining logit."""
    weights = jnp.zeros_like(logits)
    remaining = logits
    for _ in range(self.top_k):
      chosen = jnp.argmax(remaining)
      best = remaining[chosen]
      gap = (best - logits) / jnp.maximum(jnp.abs(logits), best)
      kept = jnp.where(gap > 2 * self.jitter_eps, -jnp.inf, remaining)
      weights = weights.at[chosen].set(jax.nn.softmax(kept)[chosen])
      remaining = remaining.at[chosen].set(-jnp.inf)
    return weights


@pz.pytree_dataclass
class ClampedSwiGLUGate(pz.nn.Layer):
  """gpt-oss's gate activation: ``g = min(x, limit)``, ``g * sigmoid(alpha * g)``."""

  alpha: float = static()
  limit: float = static()

  def __call__(self, inputs: pz.nx.NamedArray, **_unused_side_inputs) -> pz.nx.NamedArray:
    def gate(x):
      x = jnp.minimum(x, self.limit)
      return x * jax.nn.sigmoid(x * self.alpha)
    return pz.nx.nmap(gate)(inputs)


@pz.pytree_dataclass
class ClampedLinearUp(pz.nn.Layer):
  """gpt-oss's value branch after its projection: ``clip(x, -limit, limit) + 1``."""

  limit: float = static()

  def __call__(self, inputs: pz.nx.NamedArray, **_unused_side_inputs) -> pz.nx.NamedArray:
    return pz.nx.nmap(lambda x: jnp.clip(x, -self.limit, self.limit) + 1)(inputs)


@pz.pytree_dataclass
class MixtureOfExperts(pz.nn.Layer):
  """A routed mixture of experts, plus optional shared experts.

  ``out = sum over experts of weights[e] * experts(x)[e]`` where ``weights =
  router(x)`` (zero for experts not chosen); with ``weight_inputs`` (Llama 4)
  the weight multiplies the expert's *input* instead: ``sum over e of
  experts(weights[e] * x)[e]``. ``expert_input`` (Gemma 4's separate norm)
  transforms the experts' input but not the router's. Then ``shared(x)``
  is added, times ``sigmoid(shared_gate(x))`` if there is a gate.

  Attributes:
    router: A `TopKRouter`.
    experts: A layer from ``embedding`` (and ``experts`` when
      ``weight_inputs``) to ``[..., experts, embedding]`` (`experts_mlp`).
    weight_inputs: Whether the routing weight scales the input (Llama 4).
    expert_input: Applied to the input of the experts only, or None.
    shared: Shared experts (a plain MLP over ``embedding``), or None.
    shared_gate: Gives the shared experts' gate logit (no new axis), or None.
  """

  router: pz.nn.Layer
  experts: pz.nn.Layer
  weight_inputs: bool = static(False)
  expert_input: pz.nn.Layer | None = None
  shared: pz.nn.Layer | None = None
  shared_gate: pz.nn.Layer | None = None

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    weights = self.router(inputs, **side_inputs)
    routed_in = inputs if self.expert_input is None else self.expert_input(inputs, **side_inputs)
    if self.weight_inputs:
      outputs = self.experts(routed_in * weights, **side_inputs)
      out = outputs.untag("experts").sum().astype(inputs.dtype)
    else:
      outputs = self.experts(routed_in, **side_inputs)
      out = pz.nn.contract("experts", outputs, weights).astype(inputs.dtype)
    out = self.after_routing(out, **side_inputs)
    if self.shared is not None:
      shared = self.shared(inputs, **side_inputs)
      if self.shared_gate is not None:
        shared = shared * pz.nx.nmap(jax.nn.sigmoid)(self.shared_gate(inputs, **side_inputs))
      out = out + shared
    return out

  def after_routing(self, routed: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    """The routed experts' weighted sum as it joins the shared experts':
    unchanged here (`LatentMixtureOfExperts` projects it back)."""
    del side_inputs
    return routed

  def treescope_color(self) -> str:
    return "#c7a4e0"


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # MixtureOfExperts', then its own.
class LatentMixtureOfExperts(MixtureOfExperts):
  """A `MixtureOfExperts` whose experts work in a smaller latent space
  (Nemotron-H's ``moe_latent_size``): ``expert_input`` projects the input
  down (the router still reads the full input), and ``expert_output``
  projects the routed experts' weighted sum back up, once, before the
  shared experts' output is added. A class of its own, not one more field
  of `MixtureOfExperts`, so that checkpoints holding a `MixtureOfExperts`
  keep loading field for field.

  Example:
    >>> import jax
    >>> from penzai import pz
    >>> from pz_persist.nn import mixture_of_experts as moe
    >>> def linear(name, inputs, outputs, **experts):
    ...   return pz.nn.Linear.from_config(name=name, init_base_rng=jax.random.key(0),
    ...                                   input_axes=inputs, output_axes=outputs, **experts)
    >>> experts = {"experts": 4}
    >>> layer = moe.LatentMixtureOfExperts(
    ...     router=moe.TopKRouter(logits=linear("router", {"embedding": 8}, experts),
    ...                           num_experts=4, top_k=2, score="sigmoid"),
    ...     experts=pz.nn.Sequential([
    ...         linear("up", {"latent": 3}, {"neurons": 5}, parallel_broadcast_axes=experts),
    ...         *moe.expert_activation("relu2")[0],
    ...         linear("down", {"neurons": 5}, {"latent": 3}, parallel_axes=experts)]),
    ...     expert_input=linear("down", {"embedding": 8}, {"latent": 3}),
    ...     expert_output=linear("up", {"latent": 3}, {"embedding": 8}))
    >>> layer(pz.nx.ones({"seq": 2, "embedding": 8})).named_shape
    {'seq': 2, 'embedding': 8}

  Attributes:
    expert_output: Applied to the routed experts' weighted sum (over the
      experts' own axis, ``latent``) before the shared experts are added, or
      None.
  """

  expert_output: pz.nn.Layer | None = None

  def after_routing(self, routed: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    if self.expert_output is None:
      return routed
    return self.expert_output(routed, **side_inputs)


def expert_activation(activation: Activation, alpha: float = 1.702, limit: float = 7.0
                      ) -> tuple[list[pz.nn.Layer], list[pz.nn.Layer]]:
  """The layers after a gated MLP's gate and after its value projection
  (the second list empty but for gpt-oss's clamped SwiGLU).

  Example:
    >>> from pz_persist.nn import mixture_of_experts as moe
    >>> after_gate, after_up = moe.expert_activation("silu")
    >>> len(after_gate), after_up
    (1, [])
  """
  if activation == "silu":
    return [pz.nn.Elementwise(jax.nn.silu)], []
  if activation == "gelu_tanh":
    return [pz.nn.Elementwise(functools.partial(jax.nn.gelu, approximate=True))], []
  if activation == "gelu":
    return [pz.nn.Elementwise(functools.partial(jax.nn.gelu, approximate=False))], []
  if activation == "clamped_swiglu":
    return [ClampedSwiGLUGate(alpha=alpha, limit=limit)], [ClampedLinearUp(limit=limit)]
  if activation == "relu2":
    return [pz.nn.Elementwise(jax.nn.relu), pz.nn.Elementwise(jnp.square)], []
  raise ValueError(f"unknown expert activation {activation!r}")


def experts_mlp(
    name: str,
    num_experts: int,
    embedding_dim: int,
    neurons: int,
    *,
    activation: Activation = "silu",
    biases: bool = False,
    inputs_have_experts: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    dtype: jax.typing.DTypeLike = jnp.float32,
    gated: bool = True,
    axis: str = "embedding",
) -> pz.nn.Sequential:
  """The experts' gated MLP, with parameter slots (no values) named
  ``{name}/gate.weights``, ``{name}/up.weights``, ``{name}/down.weights``
  (and ``{name}/gate_bias.bias``... with ``biases``).

  Weights: gate and up ``[experts, embedding, neurons]``, down ``[experts,
  neurons, embedding]``. With ``inputs_have_experts`` (Llama 4, whose input
  is scaled per expert) the input carries ``experts``; otherwise it is
  broadcast over it. Without ``gated`` (Nemotron-H) there is no gate:
  ``down(activation(up(x)))``. ``axis`` names the experts' input and output
  axis (``latent`` where a `LatentMixtureOfExperts` projects into a smaller
  space first).
  """
  experts = {"experts": num_experts}
  axes = ({"parallel_axes": experts} if inputs_have_experts
          else {"parallel_broadcast_axes": experts})

  def project(part: str, size_in: dict[str, int], size_out: dict[str, int],
              parallel: dict[str, dict[str, int]]) -> list[pz.nn.Layer]:
    layers: list[pz.nn.Layer] = [pz.nn.Linear.from_config(
        name=f"{name}/{part}", init_base_rng=None, input_axes=size_in, output_axes=size_out,
        dtype=dtype, **parallel)]
    if biases:
      layers.append(pz.nn.AddBias.from_config(name=f"{name}/{part}_bias", init_base_rng=None,
                                              biased_axes={**experts, **size_out}, dtype=dtype))
    return layers

  after_gate, after_up = expert_activation(activation, alpha, limit)
  embedding, hidden = {axis: embedding_dim}, {"neurons": neurons}
  if not gated:
    return pz.nn.Sequential([*project("up", embedding, hidden, axes), *after_gate, *after_up,
                             *project("down", hidden, embedding, {"parallel_axes": experts})])
  return pz.nn.Sequential([
      pz.nn.BranchAndMultiplyTogether(branches=[
          pz.nn.NamedGroup("gate", [*project("gate", embedding, hidden, axes), *after_gate]),
          pz.nn.NamedGroup("up", [*project("up", embedding, hidden, axes), *after_up]),
      ]),
      *project("down", hidden, embedding, {"parallel_axes": experts}),
  ])


def router_linear(name: str, num_experts: int, embedding_dim: int, *, bias: bool = False,
                  dtype: jax.typing.DTypeLike = jnp.float32) -> pz.nn.Layer:
  """The router's ``Linear`` from ``embedding`` to ``experts``
  (``{name}.weights``), with an ``AddBias`` (``{name}_bias.bias``) if ``bias``."""
  linear = pz.nn.Linear.from_config(name=name, init_base_rng=None,
                                    input_axes={"embedding": embedding_dim},
                                    output_axes={"experts": num_experts}, dtype=dtype)
  if not bias:
    return linear
  return pz.nn.Sequential([linear, pz.nn.AddBias.from_config(
      name=f"{name}_bias", init_base_rng=None, biased_axes={"experts": num_experts},
      dtype=dtype)])


def expert_vector(name: str, num_experts: int, dtype: jax.typing.DTypeLike = jnp.float32) -> pz.ParameterSlot:
  """A parameter slot over ``experts`` (a router's ``selection_bias`` or
  ``expert_scale``), labelled ``name``."""
  del num_experts, dtype  # The slot is filled by the loader with the stored values.
  return pz.ParameterSlot(name)
