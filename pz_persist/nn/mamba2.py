"""Mamba-2, the state-space token mixer of Bamba, Granite 4 (the H hybrids),
Nemotron-H and Falcon-H1, as a Penzai layer with named axes, and its
KV-cache sampling form.

One projection of the input gives five streams: the gate ``z`` and the
input ``x`` (``ssm_heads`` x ``ssm_head_dim``), the input and output
matrices ``B`` and ``C`` (``ssm_groups`` x ``ssm_state``, each group shared
by ``ssm_heads // ssm_groups`` consecutive heads, as grouped-query
attention shares key heads), and the time step ``dt`` (one per head).
``x``, ``B`` and ``C`` go through a depthwise causal convolution over the
last ``conv_taps`` tokens (with a bias, then SiLU). Each head then runs the
selective state-space recurrence over a state ``h`` (``ssm_head_dim`` x
``ssm_state``)::

  dt = clip(softplus(dt + dt_bias), *time_step_limit)
  h  = exp(dt * A) * h + dt * outer(x, B)        A = -exp(A_log), per head
  y  = h @ C + D * x                             D per head (the skip)

and the output is ``out_proj(norm(y * silu(z)))``, the norm an RMS norm over
each group's ``ssm_heads // ssm_groups`` heads together (transformers'
``RMSNormGated`` with ``n_groups``), scaled by its weight as stored.
Falcon-H1's `FalconH1Mamba2` multiplies the five streams by constants
and puts the norm after the gate, before it, or nowhere (`NORM_ORDERS`).

The recurrence is a ``jax.lax.scan`` over tokens in float32: the function
transformers' chunked ``torch_forward`` (``mamba2_chunk_scan``, the state
space dual) computes, whose chunks only regroup the same sums
(tests/pretrained/test_hf_bamba.py compares them). Its state after the last token and
the convolution's last ``conv_taps - 1`` inputs are what sampling carries
from one call to the next: `CachingMamba2` holds them in a
``pz.StateVariable`` as `pz_persist.nn.gated_delta_net.CachingGatedDeltaNet`
holds a gated DeltaNet's, and `pz_persist.pretrained.kv_caching_lm` makes the
switch (the uncached layer refuses to run in Penzai's own sampling mode
rather than silently forget the past).

Example::

  model = pz_persist.pretrained.load_hf("ibm-ai-platform/Bamba-9B-v2")
  mixers = pz.select(model).at_instances_of(Mamba2).get_sequence()
  sampler = pz_persist.pretrained.kv_caching_lm(model, cache_len=256, batch_axes={"batch": 1})
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from penzai import pz

from pz_persist import errors
from pz_persist.nn import recurrent_state
from pz_persist.nn.recurrent_state import CachingRecurrent

HEAD_AXES = ("ssm_heads", "ssm_head_dim")
GROUP_AXES = ("ssm_groups", "ssm_state")
TAPS = "conv_taps"
_STREAMS = ("input", "input_matrix", "output_matrix")
_AXES = {"input": HEAD_AXES, "input_matrix": GROUP_AXES, "output_matrix": GROUP_AXES}

GATE_THEN_NORM = "gate_then_norm"
"""``norm(y * silu(z))``: Bamba, Granite 4, Nemotron-H (and Falcon-H1 with
``mamba_rms_norm`` and not ``mamba_norm_before_gate``)."""
NORM_THEN_GATE = "norm_then_gate"
"""``norm(y) * silu(z)``: Falcon-H1 with ``mamba_rms_norm`` and
``mamba_norm_before_gate``."""
NO_NORM = "no_norm"
"""``y * silu(z)``, no norm: Falcon-H1 without ``mamba_rms_norm``."""
NORM_ORDERS = (GATE_THEN_NORM, NORM_THEN_GATE, NO_NORM)


@pz.pytree_dataclass
class Mamba2(pz.nn.Layer):
  """A Mamba-2 token mixer (the module docstring has the math).

  Attributes:
    gate: ``embedding`` -> ``ssm_heads``, ``ssm_head_dim`` (``z``).
    input: ``embedding`` -> ``ssm_heads``, ``ssm_head_dim`` (``x``).
    input_matrix: ``embedding`` -> ``ssm_groups``, ``ssm_state`` (``B``).
    output_matrix: ``embedding`` -> ``ssm_groups``, ``ssm_state`` (``C``).
    time_step: ``embedding`` -> ``ssm_heads`` (``dt``).
    input_conv: ``x``'s depthwise convolution kernel (``ssm_heads``,
      ``ssm_head_dim``, ``conv_taps``; tap ``conv_taps - 1`` multiplies the
      current token).
    input_matrix_conv: ``B``'s (``ssm_groups``, ``ssm_state``, ``conv_taps``).
    output_matrix_conv: ``C``'s.
    input_conv_bias: ``x``'s convolution bias, or None (``mamba_conv_bias``
      false).
    input_matrix_conv_bias: ``B``'s, or None.
    output_matrix_conv_bias: ``C``'s, or None.
    log_decay_rate: ``A_log`` (``ssm_heads``).
    time_step_bias: ``dt_bias`` (``ssm_heads``).
    skip: ``D`` (``ssm_heads``).
    norm_scale: The gated norm's weight (``ssm_heads``, ``ssm_head_dim``),
      multiplying as stored (None only in a `FalconH1Mamba2` without a norm).
    output: ``ssm_heads``, ``ssm_head_dim`` -> ``embedding``.
    norm_epsilon: The gated norm's epsilon.
    time_step_limit: ``(low, high)``: the time step is clipped to it.
    conv_activation: Applied after the convolution (SiLU in every family).
  """

  gate: pz.nn.Linear
  input: pz.nn.Linear
  input_matrix: pz.nn.Linear
  output_matrix: pz.nn.Linear
  time_step: pz.nn.Linear
  input_conv: pz.ParameterLike[pz.nx.NamedArray]
  input_matrix_conv: pz.ParameterLike[pz.nx.NamedArray]
  output_matrix_conv: pz.ParameterLike[pz.nx.NamedArray]
  input_conv_bias: pz.ParameterLike[pz.nx.NamedArray] | None
  input_matrix_conv_bias: pz.ParameterLike[pz.nx.NamedArray] | None
  output_matrix_conv_bias: pz.ParameterLike[pz.nx.NamedArray] | None
  log_decay_rate: pz.ParameterLike[pz.nx.NamedArray]
  time_step_bias: pz.ParameterLike[pz.nx.NamedArray]
  skip: pz.ParameterLike[pz.nx.NamedArray]
  norm_scale: pz.ParameterLike[pz.nx.NamedArray] | None
  output: pz.nn.Linear
  norm_epsilon: float = dataclasses.field(metadata={"pytree_node": False})
  time_step_limit: tuple[float, float] = dataclasses.field(
      default=(0.0, float("inf")), metadata={"pytree_node": False})
  conv_activation: Callable[[jax.Array], jax.Array] = dataclasses.field(
      default=jax.nn.silu, metadata={"pytree_node": False})

  @classmethod
  def from_config(cls, name: str, *, embedding: int, heads: int, head_dim: int, groups: int,
                  state: int, conv_taps: int, norm_epsilon: float, conv_bias: bool = True,
                  time_step_limit: tuple[float, float] = (0.0, float("inf"))) -> Mamba2:
    """The layer with a parameter slot for each parameter, labelled
    ``{name}/{field}`` (``.weights`` for the projections), to be bound by
    label as `pz_persist.pretrained.load_hf` does."""
    if heads % groups:
      raise errors.ArgumentError(
          f"Mamba2 {name}: heads={heads} must be a multiple of groups={groups} (each group of"
          " B, C and the norm serves a whole number of heads)")
    sizes = {"ssm_heads": heads, "ssm_head_dim": head_dim}
    matrix = {"ssm_groups": groups, "ssm_state": state}
    embed = {"embedding": embedding}

    def linear(field: str, inputs: dict[str, int], outputs: dict[str, int]) -> pz.nn.Linear:
      return pz.nn.Linear(weights=pz.ParameterSlot(f"{name}/{field}.weights"),
                          in_axis_names=tuple(inputs), out_axis_names=tuple(outputs))

    def bias(field: str) -> pz.ParameterSlot | None:
      return pz.ParameterSlot(f"{name}/{field}_conv_bias") if conv_bias else None

    del conv_taps  # The kernels' size comes with their values.
    return cls(
        gate=linear("gate", embed, sizes), input=linear("input", embed, sizes),
        input_matrix=linear("input_matrix", embed, matrix),
        output_matrix=linear("output_matrix", embed, matrix),
        time_step=linear("time_step", embed, {"ssm_heads": heads}),
        input_conv=pz.ParameterSlot(f"{name}/input_conv"),
        input_matrix_conv=pz.ParameterSlot(f"{name}/input_matrix_conv"),
        output_matrix_conv=pz.ParameterSlot(f"{name}/output_matrix_conv"),
        input_conv_bias=bias("input"), input_matrix_conv_bias=bias("input_matrix"),
        output_matrix_conv_bias=bias("output_matrix"),
        log_decay_rate=pz.ParameterSlot(f"{name}/log_decay_rate"),
        time_step_bias=pz.ParameterSlot(f"{name}/time_step_bias"),
        skip=pz.ParameterSlot(f"{name}/skip"),
        norm_scale=pz.ParameterSlot(f"{name}/norm_scale"),
        output=linear("output", sizes, embed),
        norm_epsilon=norm_epsilon, time_step_limit=tuple(time_step_limit),
    )

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    return recurrent_state.run_uncached(self, inputs, side_inputs, name="Mamba2",
                                        state="convolution and state-space state")

  def zero_state(self, batch_axes: dict[str, int]) -> dict[str, pz.nx.NamedArray]:
    """The state before any token: the convolutions' past inputs (``conv_taps
    - 1`` of them, zeros as transformers pads) and the state-space state
    (``ssm_heads``, ``ssm_head_dim``, ``ssm_state``), in float32."""
    state = {}
    for name in _STREAMS:
      shape = dict(getattr(self, f"{name}_conv").value.named_shape)
      state[name] = pz.nx.zeros({**batch_axes, **{a: n for a, n in shape.items() if a != TAPS},
                                 TAPS: shape[TAPS] - 1}, dtype=jnp.float32)
    heads = dict(self.input_conv.value.named_shape)
    matrix = dict(self.input_matrix_conv.value.named_shape)
    state["ssm"] = pz.nx.zeros(
        {**batch_axes, "ssm_heads": heads["ssm_heads"], "ssm_head_dim": heads["ssm_head_dim"],
         "ssm_state": matrix["ssm_state"]}, dtype=jnp.float32)
    return state

  def run(self, inputs: pz.nx.NamedArray, state: dict[str, pz.nx.NamedArray] | None
          ) -> tuple[pz.nx.NamedArray, dict[str, pz.nx.NamedArray] | None]:
    """The layer over ``inputs`` (axes ``seq``, ``embedding`` and batch
    axes) continuing from ``state`` (None: from the start); returns the
    outputs and the state after the last token (None if ``state`` is None)."""
    streams, gate, time_step = self.projected(inputs)
    if state is None:
      batch = {a: n for a, n in inputs.named_shape.items() if a not in ("seq", "embedding")}
      past = self.zero_state(batch)
    else:
      past = state
    kernels = {name: getattr(self, f"{name}_conv").value.untag(*_AXES[name], TAPS)
               for name in _STREAMS}
    biases = {}
    for name in _STREAMS:
      bias = getattr(self, f"{name}_conv_bias")
      biases[name] = (bias.value.untag(*_AXES[name]) if bias is not None
                      else pz.nx.zeros({}, dtype=kernels[name].dtype))
    scale = (self.norm_scale.value.untag(*HEAD_AXES) if self.norm_scale is not None
             else pz.nx.zeros({}, dtype=gate.dtype))
    out, conv_state, ssm = _mix_named(
        {name: streams[name].untag("seq", *_AXES[name]) for name in _STREAMS},
        gate.untag("seq", *HEAD_AXES), time_step.untag("seq", "ssm_heads"),
        kernels, biases, {name: past[name].untag(TAPS, *_AXES[name]) for name in _STREAMS},
        past["ssm"].untag(*HEAD_AXES, "ssm_state"),
        self.log_decay_rate.value.untag("ssm_heads"), self.time_step_bias.value.untag("ssm_heads"),
        self.skip.value.untag("ssm_heads"), scale,
        norm_epsilon=self.norm_epsilon, limit=tuple(self.time_step_limit),
        activation=self.conv_activation, norm_order=self.gated_norm_order())
    outputs = self.output(out.tag("seq", *HEAD_AXES))
    if state is None:
      return outputs, None
    new_state = {name: conv_state[name].tag(TAPS, *_AXES[name]) for name in _STREAMS}
    new_state["ssm"] = ssm.tag(*HEAD_AXES, "ssm_state")
    return outputs, new_state

  def projected(self, inputs: pz.nx.NamedArray
                ) -> tuple[dict[str, pz.nx.NamedArray], pz.nx.NamedArray, pz.nx.NamedArray]:
    """The input projection's five streams: ``x``, ``B`` and ``C`` (by
    name, before the convolution), the gate ``z`` and the time step."""
    return ({name: getattr(self, name)(inputs) for name in _STREAMS}, self.gate(inputs),
            self.time_step(inputs))

  def gated_norm_order(self) -> str:
    """How the gate and the norm meet: `GATE_THEN_NORM` here (Bamba, Granite
    4, Nemotron-H); `FalconH1Mamba2` says its own."""
    return GATE_THEN_NORM

  def treescope_color(self) -> str:
    return "#7fb8a4"


@functools.partial(jax.jit, static_argnames=("norm_epsilon", "limit", "activation",
                                             "norm_order"))
def _mix_named(*args, norm_epsilon: float, limit: tuple[float, float],
               activation: Callable[[jax.Array], jax.Array], norm_order: str):
  """`_mix` over every batch axis, compiled once per shape and reused by
  every layer and call."""
  return pz.nx.nmap(functools.partial(_mix, norm_epsilon=norm_epsilon, limit=limit,
                                      activation=activation, norm_order=norm_order))(*args)


def _mix(streams, gate, time_step, kernels, biases, conv_past, ssm, log_rate, dt_bias, skip,
         scale, *, norm_epsilon, limit, activation, norm_order=GATE_THEN_NORM):
  """One sequence, positional axes: ``streams[name]`` is [seq, a, b]
  (``x``: heads, head_dim; ``B`` / ``C``: groups, state), ``kernels[name]``
  [a, b, taps], ``conv_past[name]`` [taps - 1, a, b], ``ssm`` [heads,
  head_dim, state], ``gate`` [seq, heads, head_dim], ``time_step`` [seq,
  heads]."""
  length = gate.shape[0]
  dtype = gate.dtype
  # float32 at least (float64 when the model is: a check of the math, not of rounding).
  f32 = jnp.promote_types(dtype, jnp.float32)
  mixed, conv_state = {}, {}
  for name in _STREAMS:
    taps = kernels[name].shape[-1]
    joined = jnp.concatenate([conv_past[name].astype(streams[name].dtype), streams[name]], 0)
    # Tap j multiplies the input taps - 1 - j tokens back (a loop over the taps, not the tokens).
    total = sum(kernels[name][..., j] * joined[j:j + length] for j in range(taps)) + biases[name]
    mixed[name] = activation(total).astype(dtype).astype(f32)
    conv_state[name] = joined[joined.shape[0] - (taps - 1):].astype(f32)
  x, b, c = mixed["input"], mixed["input_matrix"], mixed["output_matrix"]
  heads, groups = x.shape[1], b.shape[1]
  b = jnp.repeat(b, heads // groups, axis=1)  # [seq, heads, state]
  c = jnp.repeat(c, heads // groups, axis=1)
  dt = jax.nn.softplus(time_step.astype(f32) + dt_bias.astype(f32))
  dt = jnp.clip(dt, limit[0], limit[1])
  rate = -jnp.exp(log_rate.astype(f32))

  def step(h, token):
    x_t, b_t, c_t, dt_t = token
    h = h * jnp.exp(dt_t * rate)[:, None, None] + (dt_t[:, None] * x_t)[:, :, None] * b_t[:, None, :]
    return h, jnp.einsum("hpn,hn->hp", h, c_t)

  final, y = jax.lax.scan(step, ssm.astype(f32), (x, b, c, dt))
  y = y + skip.astype(f32)[:, None] * x
  silu_gate = jax.nn.silu(gate.astype(f32))

  def norm(v):
    grouped = v.reshape(length, groups, -1)
    normed = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True)
                                     + norm_epsilon)
    return scale.astype(f32) * normed.reshape(v.shape)

  if norm_order == GATE_THEN_NORM:
    out = norm(y * silu_gate)
  elif norm_order == NORM_THEN_GATE:
    out = norm(y) * silu_gate
  else:
    out = y * silu_gate
  return out.astype(dtype), conv_state, final


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # Mamba2's fields, then ours.
class FalconH1Mamba2(Mamba2):
  """Falcon-H1's Mamba-2 mixer: `Mamba2` with a constant per stream of the
  input projection (transformers' ``mup_vector``, from ``ssm_multipliers``)
  and the gated norm optional, before or after the gate.

  Example::

    mixer = FalconH1Mamba2.from_falcon_config(
        "mamba", embedding=32, heads=4, head_dim=16, groups=1, state=8, conv_taps=4,
        norm_epsilon=1e-5, stream_multipliers=(0.5, 1.0, 1.0, 2.0, 1.0), norm_order=NO_NORM)

  Attributes:
    stream_multipliers: The constants multiplying, in this order, the gate
      ``z``, the input ``x``, ``B``, ``C`` and the time step, right after the
      projection (before the convolution, the time-step bias and the gate).
    norm_order: One of `NORM_ORDERS`; with `NO_NORM`, ``norm_scale`` is None.
  """

  stream_multipliers: tuple[float, float, float, float, float] = dataclasses.field(
      default=(1.0, 1.0, 1.0, 1.0, 1.0), metadata={"pytree_node": False})
  norm_order: str = dataclasses.field(default=NO_NORM, metadata={"pytree_node": False})

  @classmethod
  def from_falcon_config(cls, name: str, *, stream_multipliers: tuple[float, ...],
                         norm_order: str, **sizes) -> FalconH1Mamba2:
    """`Mamba2.from_config`'s layer (``sizes`` its keywords) with Falcon-H1's
    stream constants and norm order (no ``{name}/norm_scale`` slot without
    a norm)."""
    if norm_order not in NORM_ORDERS:
      raise errors.ArgumentError(f"FalconH1Mamba2 {name}: norm_order={norm_order!r} is not one"
                                 f" of {NORM_ORDERS}")
    if len(stream_multipliers) != len(_MULTIPLIED):
      raise errors.ArgumentError(
          f"FalconH1Mamba2 {name}: stream_multipliers needs {len(_MULTIPLIED)} numbers"
          f" ({', '.join(_MULTIPLIED)}), not {len(stream_multipliers)}")
    layer = cls.from_config(name, **sizes)
    return dataclasses.replace(
        layer, stream_multipliers=tuple(float(m) for m in stream_multipliers),
        norm_order=norm_order, norm_scale=None if norm_order == NO_NORM else layer.norm_scale)

  def projected(self, inputs: pz.nx.NamedArray
                ) -> tuple[dict[str, pz.nx.NamedArray], pz.nx.NamedArray, pz.nx.NamedArray]:
    streams, gate, time_step = super().projected(inputs)
    m = dict(zip(_MULTIPLIED, self.stream_multipliers))
    return ({name: value * m[name] for name, value in streams.items()}, gate * m["gate"],
            time_step * m["time_step"])

  def gated_norm_order(self) -> str:
    return self.norm_order


_MULTIPLIED = ("gate", "input", "input_matrix", "output_matrix", "time_step")
"""`FalconH1Mamba2.stream_multipliers`' streams, in transformers' order."""


@pz.pytree_dataclass
class CachingMamba2(CachingRecurrent):
  """A `Mamba2` in sampling mode, carrying the convolutions' last inputs and the state-space state per batch element
  (`pz_persist.nn.recurrent_state.CachingRecurrent`).

  Attributes:
    uncached: The layer.
    state: Its state, ``Mamba2.zero_state``'s structure.
  """

  uncached: Mamba2
  state: pz.StateVariable[dict[str, pz.nx.NamedArray]]
