"""Gemma 4's mixture of experts (26B-A4B), which runs beside each layer's
dense MLP rather than in its place.

Per token ``x`` (the residual stream entering the feed-forward part):

- the router normalises ``x`` (RMS, no learned scale), multiplies it by its
  learned ``scale`` and by ``hidden_size ** -0.5``, projects it to one logit
  per expert (a ``Linear`` from ``embedding`` to ``experts``), takes the
  softmax over all experts (float32) and the ``top_k`` largest, renormalises
  those to sum to one and multiplies each by its expert's learned
  ``per_expert_scale``;
- the experts see ``x`` through their own norm (``pre_feedforward_layernorm_2``):
  each is a GeGLU MLP (tanh GELU) whose weights carry the ``experts`` axis,
  and the output is the routing-weighted sum of the chosen experts, through
  ``post_feedforward_layernorm_2``.

Computation: every expert runs on every token and the results are summed
with a dense weight vector that is zero off the chosen ``top_k`` (exact:
unchosen experts are multiplied by zero). That costs ``experts / top_k``
times the routed FLOPs, but is a few einsums over named axes that JAX
compiles well and that shard over ``experts`` (``AxisRules``); gathering
each token's chosen experts' weights would instead hold ``tokens x top_k``
copies of expert matrices. For studying a model, not serving it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from penzai import pz
from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained.hf.plan import TensorSpec


@pz.pytree_dataclass
class Gemma4Experts(pz.nn.Layer):
  """The routed experts of one Gemma 4 layer (see the module docstring).

  Attributes:
    router_scale: The router's learned scale, over ``embedding``.
    router: The ``Linear`` from ``embedding`` to ``experts``.
    per_expert_scale: Each expert's weight multiplier, over ``experts``.
    input_norm: The experts' input norm (``pre_feedforward_layernorm_2``).
    gate, up: ``[experts, neurons, embedding]``.
    down: ``[experts, embedding, neurons]``.
    output_norm: ``post_feedforward_layernorm_2``.
    top_k: Experts per token.
    epsilon: The router norm's epsilon (``rms_norm_eps``).
  """

  router_scale: pz.ParameterLike[pz.nx.NamedArray]
  router: pz.nn.Linear
  per_expert_scale: pz.ParameterLike[pz.nx.NamedArray]
  input_norm: pz.nn.Layer
  gate: pz.ParameterLike[pz.nx.NamedArray]
  up: pz.ParameterLike[pz.nx.NamedArray]
  down: pz.ParameterLike[pz.nx.NamedArray]
  output_norm: pz.nn.Layer
  top_k: int = dataclasses.field(metadata={"pytree_node": False})
  epsilon: float = dataclasses.field(metadata={"pytree_node": False})

  def routing(self, x: pz.nx.NamedArray) -> pz.nx.NamedArray:
    """Each token's weight for each expert (zero off its ``top_k``), over
    ``experts``, float32."""
    hidden = x.named_shape["embedding"]
    normed = pz.nn.RMSStandardize(across=("embedding",), epsilon=self.epsilon)(x)
    scaled = normed * self.router_scale.value.astype(x.dtype) * jnp.asarray(hidden ** -0.5,
                                                                            x.dtype)
    logits = self.router(scaled)
    scale = self.per_expert_scale.value.untag("experts")

    def route(row: jax.Array, per_expert: jax.Array) -> jax.Array:
      probs = jax.nn.softmax(row.astype(jnp.float32))
      top, index = jax.lax.top_k(probs, self.top_k)
      top = top / top.sum()
      top = top * per_expert[index].astype(jnp.float32)
      return jnp.zeros_like(probs).at[index].add(top)

    return pz.nx.nmap(route)(logits.untag("experts"), scale).tag("experts")

  def __call__(self, x: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    weights = self.routing(x)
    y = self.input_norm(x, **side_inputs)
    gate = pz.nx.nmap(jnp.einsum)("enh,h->en", self.gate.value.untag(
        "experts", "neurons", "embedding"), y.untag("embedding"))
    up = pz.nx.nmap(jnp.einsum)("enh,h->en", self.up.value.untag(
        "experts", "neurons", "embedding"), y.untag("embedding"))
    hidden = pz.nx.nmap(jax.nn.gelu)(gate) * up
    out = pz.nx.nmap(jnp.einsum)("ehn,en->eh", self.down.value.untag(
        "experts", "embedding", "neurons"), hidden)
    mixed = pz.nx.nmap(jnp.einsum)("eh,e->h", out, weights.untag("experts").astype(out.dtype))
    return self.output_norm(mixed.tag("embedding"), **side_inputs)


def build(name: str, config: llamalike_common.LlamalikeTransformerConfig, experts: int,
          top_k: int, width: int, eps: float) -> Gemma4Experts:
  """The skeleton (parameter slots) of block ``name``'s experts."""
  def norm(suffix: str) -> pz.nn.RMSLayerNorm:
    return pz.nn.RMSLayerNorm.from_config(
        name=f"{name}/{suffix}", init_base_rng=None,
        across_axes={"embedding": config.embedding_dim}, epsilon=config.rms_norm_eps,
        dtype=config.parameter_dtype)

  return Gemma4Experts(
      router_scale=pz.ParameterSlot(f"{name}/moe/router_scale"),
      router=pz.nn.Linear.from_config(
          name=f"{name}/moe/router", init_base_rng=None,
          input_axes={"embedding": config.embedding_dim}, output_axes={"experts": experts},
          dtype=config.parameter_dtype),
      per_expert_scale=pz.ParameterSlot(f"{name}/moe/per_expert_scale"),
      input_norm=norm("pre_ffw_norm_2"),
      gate=pz.ParameterSlot(f"{name}/moe/gate"),
      up=pz.ParameterSlot(f"{name}/moe/up"),
      down=pz.ParameterSlot(f"{name}/moe/down"),
      output_norm=norm("post_ffw_norm_2"),
      top_k=top_k, epsilon=eps)


def specs(p: str, s: str, hidden: int, experts: int, width: int) -> list[TensorSpec]:
  """Block ``p``'s expert tensors from layer ``s``: the fused
  ``experts.gate_up_proj`` ``[experts, 2 * width, hidden]`` split in halves
  (gate first), as stored by transformers and on the Hub."""
  fused = (experts, 2, width, hidden)
  axes = ("experts", "neurons", "embedding")
  return [
      TensorSpec(p + "moe/router.weights", s + "router.proj.weight", (experts, hidden),
                 ("experts", "embedding")),
      TensorSpec(p + "moe/router_scale", s + "router.scale", (hidden,), ("embedding",)),
      TensorSpec(p + "moe/per_expert_scale", s + "router.per_expert_scale", (experts,),
                 ("experts",)),
      TensorSpec(p + "moe/gate", s + "experts.gate_up_proj", fused, axes,
                 take=(1, 0), stored=(experts, 2 * width, hidden)),
      TensorSpec(p + "moe/up", s + "experts.gate_up_proj", fused, axes,
                 take=(1, 1), stored=(experts, 2 * width, hidden)),
      TensorSpec(p + "moe/down", s + "experts.down_proj", (experts, hidden, width),
                 ("experts", "embedding", "neurons")),
      TensorSpec(p + "pre_ffw_norm_2/scale.weights", s + "pre_feedforward_layernorm_2.weight",
                 (hidden,), ("embedding",)),
      TensorSpec(p + "post_ffw_norm_1/scale.weights", s + "post_feedforward_layernorm_1.weight",
                 (hidden,), ("embedding",)),
      TensorSpec(p + "post_ffw_norm_2/scale.weights", s + "post_feedforward_layernorm_2.weight",
                 (hidden,), ("embedding",)),
  ]
