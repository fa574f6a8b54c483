"""Gated DeltaNet, the linear-attention layer of Qwen3.5 / 3.6 and Qwen3-Next,
as a Penzai layer with named axes, and its KV-cache sampling form.

Where a full-attention layer keeps every past key and value, a gated DeltaNet
keeps one matrix per value head, the recurrent state ``S`` (``key_projection``
x ``value_projection``), and updates it token by token with the delta rule:
decay the state by ``exp(g)``, read what it predicts for the token's key,
write back ``beta`` times the difference from the token's value. A token's
output is its query read out of the updated state. Before that, the query, key
and value streams go through a depthwise causal convolution over the last
``conv_taps`` tokens (then SiLU), and the query and key are L2-normalised (the
query also scaled by ``key_projection ** -0.5``); after, each head's output is
RMS-normalised, scaled and gated by ``silu(z)``, ``z`` a projection of the
layer's input. The decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and the
write strength ``beta = sigmoid(b)`` are per value head and token, ``a`` and
``b`` projections of the input. Key heads are shared by consecutive value
heads (``value_heads // key_heads`` of them), as grouped-query attention
shares key heads.

The sequence is processed by a ``jax.lax.scan`` over tokens in float32, the
recurrence transformers' ``torch_recurrent_gated_delta_rule`` computes (its
chunked form, ``torch_chunk_gated_delta_rule``, used for whole sequences, is
the same function rearranged; tests/pretrained/test_hf_qwen3_5.py measures the
difference). Its state after the last token, and the convolution's last
``conv_taps - 1`` inputs, are what sampling carries from one call to the next:
`CachingGatedDeltaNet` holds them in a ``pz.StateVariable``, and
`pz_persist.pretrained.kv_caching_lm` puts a model with these layers into Penzai's KV-cache sampling
mode (``KVCachingTransformerLM.from_uncached`` converts only
``pz.nn.Attention`` layers, and the uncached layer refuses to run there rather
than silently forget the past).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
from penzai import pz

from pz_persist.nn import recurrent_state
from pz_persist.nn.recurrent_state import CachingRecurrent

KEY_AXES = ("key_heads", "key_projection")
VALUE_AXES = ("value_heads", "value_projection")
TAPS = "conv_taps"
_STATE_KEYS = ("query", "key", "value")


@pz.pytree_dataclass
class GatedDeltaNet(pz.nn.Layer):
  """A gated DeltaNet token mixer (the module docstring has the math).

  Attributes:
    query: ``embedding`` -> ``key_heads``, ``key_projection``.
    key: ``embedding`` -> ``key_heads``, ``key_projection``.
    value: ``embedding`` -> ``value_heads``, ``value_projection``.
    output_gate: ``embedding`` -> ``value_heads``, ``value_projection``
      (``z``, gating the normalised output through SiLU).
    write_strength: ``embedding`` -> ``value_heads`` (``b``; ``beta =
      sigmoid(b)``).
    decay_input: ``embedding`` -> ``value_heads`` (``a``).
    query_conv: The query stream's depthwise convolution kernel
      (``key_heads``, ``key_projection``, ``conv_taps``; tap ``conv_taps - 1``
      multiplies the current token).
    key_conv: The key stream's, over the same axes.
    value_conv: The value stream's (``value_heads``, ``value_projection``,
      ``conv_taps``).
    log_decay_rate: ``A_log`` (``value_heads``).
    decay_bias: ``dt_bias`` (``value_heads``).
    norm_scale: The output norm's weight (``value_projection``), multiplying
      as stored (not ``1 + w``).
    output: ``value_heads``, ``value_projection`` -> ``embedding``.
    norm_epsilon: The output norm's epsilon.
    conv_activation: Applied after the convolution (transformers applies
      the config's ``hidden_act``: SiLU).
  """

  query: pz.nn.Linear
  key: pz.nn.Linear
  value: pz.nn.Linear
  output_gate: pz.nn.Linear
  write_strength: pz.nn.Linear
  decay_input: pz.nn.Linear
  query_conv: pz.ParameterLike[pz.nx.NamedArray]
  key_conv: pz.ParameterLike[pz.nx.NamedArray]
  value_conv: pz.ParameterLike[pz.nx.NamedArray]
  log_decay_rate: pz.ParameterLike[pz.nx.NamedArray]
  decay_bias: pz.ParameterLike[pz.nx.NamedArray]
  norm_scale: pz.ParameterLike[pz.nx.NamedArray]
  output: pz.nn.Linear
  norm_epsilon: float = dataclasses.field(metadata={"pytree_node": False})
  conv_activation: Callable[[jax.Array], jax.Array] = dataclasses.field(default=jax.nn.silu, metadata={"pytree_node": False})

  @classmethod
  def from_config(cls, name: str, *, embedding: int, key_heads: int, value_heads: int,
                  key_projection: int, value_projection: int, conv_taps: int,
                  norm_epsilon: float) -> GatedDeltaNet:
    """The layer with a parameter slot for each parameter, labelled
    ``{name}/{field}`` (``.weights`` for the projections), to be bound by
    label as `pz_persist.pretrained.load_hf` does."""
    keys = {"key_heads": key_heads, "key_projection": key_projection}
    values = {"value_heads": value_heads, "value_projection": value_projection}

    def linear(field: str, inputs: dict[str, int], outputs: dict[str, int]) -> pz.nn.Linear:
      return pz.nn.Linear(weights=pz.ParameterSlot(f"{name}/{field}.weights"),
                          in_axis_names=tuple(inputs), out_axis_names=tuple(outputs))

    del conv_taps  # The kernels' size comes with their values.
    embed = {"embedding": embedding}
    return cls(
        query=linear("query", embed, keys), key=linear("key", embed, keys),
        value=linear("value", embed, values), output_gate=linear("output_gate", embed, values),
        write_strength=linear("write_strength", embed, {"value_heads": value_heads}),
        decay_input=linear("decay_input", embed, {"value_heads": value_heads}),
        query_conv=pz.ParameterSlot(f"{name}/query_conv"),
        key_conv=pz.ParameterSlot(f"{name}/key_conv"),
        value_conv=pz.ParameterSlot(f"{name}/value_conv"),
        log_decay_rate=pz.ParameterSlot(f"{name}/log_decay_rate"),
        decay_bias=pz.ParameterSlot(f"{name}/decay_bias"),
        norm_scale=pz.ParameterSlot(f"{name}/norm_scale"),
        output=linear("output", values, embed),
        norm_epsilon=norm_epsilon,
    )

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    return recurrent_state.run_uncached(self, inputs, side_inputs, name="GatedDeltaNet",
                                        state="recurrent state")

  def zero_state(self, batch_axes: dict[str, int]) -> dict[str, pz.nx.NamedArray]:
    """The state before any token: the convolutions' past inputs (``conv_taps
    - 1`` of them, zeros as transformers pads) and the recurrent state."""
    conv = {name: _named_shape(getattr(self, f"{name}_conv").value) for name in _STATE_KEYS}
    state = {
        name: pz.nx.zeros({**batch_axes, **{a: n for a, n in shape.items() if a != TAPS},
                           TAPS: shape[TAPS] - 1}, dtype=jnp.float32)
        for name, shape in conv.items()}
    heads = _named_shape(self.log_decay_rate.value)["value_heads"]
    state["recurrent"] = pz.nx.zeros(
        {**batch_axes, "value_heads": heads,
         "key_projection": conv["key"]["key_projection"],
         "value_projection": conv["value"]["value_projection"]}, dtype=jnp.float32)
    return state

  # The axes of the decay input and bias beside ``seq`` (per value head
  # here; a subclass's decay may be finer), and the compiled mixing function
  # (`_mix`'s signature): class attributes, not fields, so saved layers keep
  # exactly their fields.
  decay_axes: ClassVar[tuple[str, ...]] = ("value_heads",)

  def mixing_function(self) -> Callable[..., tuple]:
    """The compiled per-sequence mixing (`_mix_named`)."""
    return _mix_named

  def run(self, inputs: pz.nx.NamedArray, state: dict[str, pz.nx.NamedArray] | None
          ) -> tuple[pz.nx.NamedArray, dict[str, pz.nx.NamedArray] | None]:
    """The layer over ``inputs`` (axes ``seq``, ``embedding`` and batch
    axes) continuing from ``state`` (None: from the start); returns the
    outputs and the state after the last token (None if ``state`` is None)."""
    streams = {"query": self.query(inputs), "key": self.key(inputs), "value": self.value(inputs)}
    gate = self.output_gate(inputs)
    write = self.write_strength(inputs)
    decay = self.decay_input(inputs)
    axes = {"query": KEY_AXES, "key": KEY_AXES, "value": VALUE_AXES}
    if state is None:
      batch = {a: n for a, n in inputs.named_shape.items() if a not in ("seq", "embedding")}
      past = self.zero_state(batch)
    else:
      past = state
    kernel = {name: getattr(self, f"{name}_conv").value.untag(*axes[name], TAPS)
              for name in _STATE_KEYS}
    out, conv_state, recurrent = self.mixing_function()(
        {name: streams[name].untag("seq", *axes[name]) for name in _STATE_KEYS},
        gate.untag("seq", *VALUE_AXES), write.untag("seq", "value_heads"),
        decay.untag("seq", *self.decay_axes), kernel,
        {name: past[name].untag(TAPS, *axes[name]) for name in _STATE_KEYS},
        past["recurrent"].untag("value_heads", "key_projection", "value_projection"),
        self.log_decay_rate.value.untag("value_heads"),
        self.decay_bias.value.untag(*self.decay_axes),
        self.norm_scale.value.untag("value_projection"), norm_epsilon=self.norm_epsilon,
        activation=self.conv_activation)
    outputs = self.output(out.tag("seq", *VALUE_AXES))
    if state is None:
      return outputs, None
    new_state = {name: conv_state[name].tag(TAPS, *axes[name]) for name in _STATE_KEYS}
    new_state["recurrent"] = recurrent.tag("value_heads", "key_projection", "value_projection")
    return outputs, new_state

  def treescope_color(self) -> str:
    return "#a58de0"


@functools.partial(jax.jit, static_argnames=("norm_epsilon", "activation"))
def _mix_named(*args, norm_epsilon: float, activation: Callable[[jax.Array], jax.Array]):
  """`_mix` over every batch axis, compiled once per shape and reused by
  every layer and call (the scan's body is otherwise traced and compiled
  anew at each eager call)."""
  return pz.nx.nmap(functools.partial(_mix, norm_epsilon=norm_epsilon, activation=activation))(
      *args)


def _mix(streams, gate, write, decay, kernel, conv_past, recurrent, log_rate, bias, scale, *,
         norm_epsilon, activation):
  """One sequence, positional axes: ``streams[name]`` is [seq, heads,
  dim], ``kernel[name]`` [heads, dim, taps], ``conv_past[name]`` [taps - 1,
  heads, dim], ``recurrent`` [value_heads, key_dim, value_dim]."""
  # float32 at least (float64 when the model is: a check of the math, not of rounding).
  f32 = jnp.promote_types(gate.dtype, jnp.float32)
  mixed, conv_state = causal_convolutions(streams, kernel, conv_past, activation, f32)
  query, key, value = (mixed[name].astype(f32) for name in _STATE_KEYS)
  query = _l2_normalized(query) * (query.shape[-1] ** -0.5)
  key = _l2_normalized(key)
  group = value.shape[1] // query.shape[1]
  query, key = jnp.repeat(query, group, axis=1), jnp.repeat(key, group, axis=1)
  beta = jax.nn.sigmoid(write.astype(f32))
  g = -jnp.exp(log_rate.astype(f32)) * jax.nn.softplus(
      decay.astype(f32) + bias.astype(f32))

  def step(state, token):
    q, k, v, g_t, beta_t = token
    state = state * jnp.exp(g_t)[:, None, None]
    predicted = jnp.einsum("hk,hkv->hv", k, state)
    delta = (v - predicted) * beta_t[:, None]
    state = state + k[:, :, None] * delta[:, None, :]
    return state, jnp.einsum("hk,hkv->hv", q, state)

  final, out = jax.lax.scan(step, recurrent.astype(f32), (query, key, value, g, beta))
  dtype = gate.dtype
  out = out.astype(dtype).astype(f32)
  normed = out * jax.lax.rsqrt(jnp.mean(out * out, axis=-1, keepdims=True) + norm_epsilon)
  gated = (scale * normed.astype(dtype)).astype(f32) * jax.nn.silu(
      gate.astype(f32))
  return gated.astype(dtype), conv_state, final


def causal_convolutions(streams, kernel, conv_past, activation, f32
                        ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """The query, key and value streams ([seq, heads, dim]) through their
  depthwise causal convolutions (``kernel[name]`` [heads, dim, taps]) after
  ``conv_past[name]`` (the last ``taps - 1`` inputs), then ``activation``;
  and each stream's last ``taps - 1`` inputs (in ``f32``), the state the
  next call continues from."""
  length = streams[_STATE_KEYS[0]].shape[0]
  mixed, conv_state = {}, {}
  for name in _STATE_KEYS:
    taps = kernel[name].shape[-1]
    joined = jnp.concatenate([conv_past[name].astype(streams[name].dtype), streams[name]], 0)
    # Tap j of the kernel multiplies the input taps - 1 - j tokens back
    # (a loop over the few taps, not over tokens).
    total = sum(kernel[name][..., j] * joined[j:j + length] for j in range(taps))
    mixed[name] = activation(total).astype(streams[name].dtype)
    conv_state[name] = joined[joined.shape[0] - (taps - 1):].astype(f32)
  return mixed, conv_state


def _l2_normalized(x: jax.Array) -> jax.Array:
  """``x`` over its last axis divided by its norm, as transformers (and the
  FLA kernels) compute it: ``x * rsqrt(sum(x**2) + 1e-6)``."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _named_shape(value: pz.nx.NamedArray) -> dict[str, int]:
  return dict(value.named_shape)


@pz.pytree_dataclass
class CachingGatedDeltaNet(CachingRecurrent):
  """A `GatedDeltaNet` in sampling mode, carrying the convolutions' last inputs and the recurrent state per batch element
  (`pz_persist.nn.recurrent_state.CachingRecurrent`).

  Attributes:
    uncached: The layer.
    state: Its state, ``GatedDeltaNet.zero_state``'s structure.
  """

  uncached: GatedDeltaNet
  state: pz.StateVariable[dict[str, pz.nx.NamedArray]]

