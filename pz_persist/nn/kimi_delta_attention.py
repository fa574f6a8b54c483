"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi-Linear, as
a `GatedDeltaNet` whose gates are per channel, and its KV-cache sampling form.

KDA is the gated delta rule of `pz_persist.nn.gated_delta_net` (decay the
state, read what it predicts for the token's key, write back ``beta`` times
the difference from the token's value, read the query out) with four
differences, all in how the gates are computed:

- the decay is per *key channel* of each head, not per head: ``g =
  -exp(A_log[head]) * softplus(f_b(f_a(x)) + dt_bias)`` over (heads,
  ``key_projection``), ``f_a`` / ``f_b`` a low-rank pair of projections
  (rank ``head_dim``), ``dt_bias`` one number per channel; the state
  ``S`` (heads x key x value) is multiplied by ``exp(g)`` along its key
  axis;
- the output gate is a low-rank pair too (``g_a``, ``g_b``), and gates the
  RMS-normalised output through a *sigmoid* (a gated DeltaNet's is SiLU),
  the norm computed in float32 and its weight not rounded to the model's
  dtype first;
- there is one head count: queries, keys and values have the same heads
  (no grouping) and the same width;
- the L2 norm of the queries and keys divides by ``sqrt(sum(x**2) +
  1e-6)`` (the FLA kernel's form, which transformers' KDA reproduces).

The write strength ``beta = sigmoid(b_proj(x))`` per head, the depthwise
causal convolutions of the three streams (then SiLU) and the recurrence in
float32 are the gated DeltaNet's. The sequence is a ``jax.lax.scan`` over
tokens: transformers' ``recurrent_kimi_delta_attention`` (its chunked
form for prompts is the same function rearranged;
tests/pretrained/test_hf_kimi_linear.py measures the difference).

`KimiDeltaAttention` subclasses `GatedDeltaNet` without adding a field: the
low-rank gates sit in its ``output_gate`` and ``decay_input`` fields as a
``Sequential`` of two ``Linear`` layers, and ``decay_bias`` is per channel;
only the mixing function differs. `CachingKimiDeltaAttention` is its
sampling form (`pz_persist.nn.recurrent_state.CachingRecurrent`), which
`pz_persist.pretrained.kv_caching_lm` puts in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
from penzai import pz

from pz_persist.nn.gated_delta_net import GatedDeltaNet
from pz_persist.nn.gated_delta_net import causal_convolutions
from pz_persist.nn.recurrent_state import CachingRecurrent

LOW_RANK = "gate_rank"
"""The axis of the low-rank gates' inner width (``head_dim`` in Kimi-Linear)."""


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # pytype: disable=wrong-keyword-args
class KimiDeltaAttention(GatedDeltaNet):
  """Kimi Delta Attention (the module docstring has the math).

  The fields are `GatedDeltaNet`'s, with ``key_heads`` equal to
  ``value_heads`` and ``key_projection`` to ``value_projection``, and:

  Attributes:
    output_gate: ``Sequential[g_a, g_b]``: ``embedding`` -> ``gate_rank`` ->
      ``value_heads``, ``value_projection`` (gating the normalised output
      through a sigmoid).
    decay_input: ``Sequential[f_a, f_b]``: ``embedding`` -> ``gate_rank`` ->
      ``value_heads``, ``key_projection`` (the per-channel decay's input).
    decay_bias: ``dt_bias`` over ``value_heads``, ``key_projection``.

  Example:
    >>> from pz_persist.nn.kimi_delta_attention import KimiDeltaAttention
    >>> layer = KimiDeltaAttention.from_config(
    ...     "kda", embedding=8, heads=2, head_dim=4, conv_taps=3, norm_epsilon=1e-5)
    >>> layer.decay_axes
    ('value_heads', 'key_projection')
  """

  output_gate: pz.nn.Layer
  decay_input: pz.nn.Layer

  decay_axes: ClassVar[tuple[str, ...]] = ("value_heads", "key_projection")

  @classmethod
  def from_config(cls, name: str, *, embedding: int, heads: int,  # type: ignore[override]
                  head_dim: int, conv_taps: int, norm_epsilon: float) -> KimiDeltaAttention:
    """The layer with a parameter slot for each parameter, labelled
    ``{name}/{field}`` (``.weights`` for the projections; the low-rank
    pairs ``{name}/output_gate_a``, ``_b`` and ``{name}/decay_input_a``,
    ``_b``), to be bound by label as `pz_persist.pretrained.load_hf` does.
    ``conv_taps`` comes with the kernels' values."""
    del conv_taps

    def linear(field: str, inputs: dict[str, int], outputs: dict[str, int]) -> pz.nn.Linear:
      return pz.nn.Linear(weights=pz.ParameterSlot(f"{name}/{field}.weights"),
                          in_axis_names=tuple(inputs), out_axis_names=tuple(outputs))

    embed, rank = {"embedding": embedding}, {LOW_RANK: head_dim}
    keys = {"key_heads": heads, "key_projection": head_dim}
    values = {"value_heads": heads, "value_projection": head_dim}
    return cls(
        query=linear("query", embed, keys), key=linear("key", embed, keys),
        value=linear("value", embed, values),
        output_gate=pz.nn.Sequential([linear("output_gate_a", embed, rank),
                                      linear("output_gate_b", rank, values)]),
        write_strength=linear("write_strength", embed, {"value_heads": heads}),
        decay_input=pz.nn.Sequential([
            linear("decay_input_a", embed, rank),
            linear("decay_input_b", rank, {"value_heads": heads, "key_projection": head_dim})]),
        query_conv=pz.ParameterSlot(f"{name}/query_conv"),
        key_conv=pz.ParameterSlot(f"{name}/key_conv"),
        value_conv=pz.ParameterSlot(f"{name}/value_conv"),
        log_decay_rate=pz.ParameterSlot(f"{name}/log_decay_rate"),
        decay_bias=pz.ParameterSlot(f"{name}/decay_bias"),
        norm_scale=pz.ParameterSlot(f"{name}/norm_scale"),
        output=linear("output", values, embed),
        norm_epsilon=norm_epsilon,
    )

  def mixing_function(self) -> Callable[..., tuple]:
    """KDA's compiled per-sequence mixing (`_mix_kda`)."""
    return _mix_kda_named

  def treescope_color(self) -> str:
    return "#8d9ee0"


@functools.partial(jax.jit, static_argnames=("norm_epsilon", "activation"))
def _mix_kda_named(*args, norm_epsilon: float, activation: Callable[[jax.Array], jax.Array]):
  """`_mix_kda` over every batch axis, compiled once per shape."""
  return pz.nx.nmap(functools.partial(_mix_kda, norm_epsilon=norm_epsilon,
                                      activation=activation))(*args)


def _mix_kda(streams, gate, write, decay, kernel, conv_past, recurrent, log_rate, bias, scale, *,
             norm_epsilon, activation):
  """One sequence, positional axes (as `gated_delta_net._mix`, but ``decay``
  is [seq, heads, key_dim] and ``bias`` [heads, key_dim])."""
  dtype = gate.dtype
  f32 = jnp.promote_types(dtype, jnp.float32)
  mixed, conv_state = causal_convolutions(streams, kernel, conv_past, activation, f32)
  query, key, value = (mixed[name].astype(f32) for name in ("query", "key", "value"))
  query = _l2_normalized(query) * (query.shape[-1] ** -0.5)
  key = _l2_normalized(key)
  # transformers takes the sigmoid in the model's dtype, then computes in float32.
  beta = jax.nn.sigmoid(write.astype(f32)).astype(dtype).astype(f32)
  before = decay.astype(f32) + bias.astype(f32)
  # Softplus as transformers writes it: log(1 + exp(x)), x itself above 20.
  softplus = jnp.where(before > 20.0, before, jnp.log(1.0 + jnp.exp(jnp.minimum(before, 20.0))))
  g = -jnp.exp(log_rate.astype(f32))[:, None] * softplus

  def step(state, token):
    q, k, v, g_t, beta_t = token
    state = state * jnp.exp(g_t)[:, :, None]
    predicted = jnp.einsum("hk,hkv->hv", k, state)
    delta = (v - predicted) * beta_t[:, None]
    state = state + k[:, :, None] * delta[:, None, :]
    return state, jnp.einsum("hk,hkv->hv", q, state)

  final, out = jax.lax.scan(step, recurrent.astype(f32), (query, key, value, g, beta))
  out = out.astype(dtype).astype(f32)
  normed = out * jax.lax.rsqrt(jnp.mean(out * out, axis=-1, keepdims=True) + norm_epsilon)
  gated = scale.astype(f32) * normed * jax.nn.sigmoid(gate.astype(f32))
  return gated.astype(dtype), conv_state, final


def _l2_normalized(x: jax.Array) -> jax.Array:
  """``x / sqrt(sum(x**2) + 1e-6)`` over the last axis (transformers' KDA
  ``l2norm``, the FLA kernel's form)."""
  return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


@pz.pytree_dataclass
class CachingKimiDeltaAttention(CachingRecurrent):
  """A `KimiDeltaAttention` in sampling mode, carrying the convolutions'
  last inputs and the recurrent state per batch element
  (`pz_persist.nn.recurrent_state.CachingRecurrent`).

  Attributes:
    uncached: The layer.
    state: Its state, ``KimiDeltaAttention.zero_state``'s structure.
  """

  uncached: KimiDeltaAttention
  state: pz.StateVariable[dict[str, pz.nx.NamedArray]]

