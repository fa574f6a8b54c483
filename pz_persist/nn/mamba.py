"""Mamba (Mamba-1), the selective state-space token mixer of Jamba, as a
Penzai layer with named axes, and its KV-cache sampling form.

Two projections of the input give the input ``x`` and the gate ``z``, each
over ``ssm_channels`` (``mamba_expand * hidden_size`` in Jamba). ``x`` goes
through a depthwise causal convolution over the last ``conv_taps`` tokens
(optionally with a bias, then SiLU); from the convolved ``x`` three more
projections give the time step's low-rank input (``time_step_rank``) and the
input and output matrices ``B`` and ``C`` (``ssm_state`` each, one per token
shared by every channel). Jamba puts an RMS norm on each of the three (its
``dt_layernorm``, ``b_layernorm``, ``c_layernorm``: optional here, a
``pz.nn.Identity`` where a Mamba has none; each standardizes in
float32, as transformers' ``JambaRMSNorm`` does). The time step is projected back
to every channel, and each channel ``d`` runs its own recurrence over a
state ``h[d]`` of ``ssm_state`` numbers::

  dt = softplus(time_step(dt_in) + dt_bias)            per channel
  h  = exp(dt * A) * h + dt * x * B                    A = -exp(A_log), [channels, state]
  y  = h @ C + D * x                                   D per channel (the skip)

and the output is ``output(y * silu(z))``. Unlike Mamba-2
(`pz_persist.nn.mamba2.Mamba2`), ``A`` is a full matrix (one decay per
channel and state entry, not a scalar per head), the time step is a low-rank
projection of the *convolved* input, and there is no gated norm.

The recurrence is a ``jax.lax.scan`` over tokens in float32 (transformers'
``mamba_selective_scan`` without the CUDA kernels is the same loop). Its
state after the last token and the convolution's last ``conv_taps - 1``
inputs are what sampling carries from one call to the next: `CachingMamba`
holds them in a ``pz.StateVariable``
(`pz_persist.nn.recurrent_state.CachingRecurrent`), and
`pz_persist.pretrained.kv_caching_lm` makes the switch (the uncached layer
refuses to run in Penzai's own sampling mode rather than silently forget the
past).

Every projection and norm is an ordinary Penzai layer applied as a layer,
so LoRA and other surgery reach them as they reach attention's.

Example (a fresh layer, randomly initialised, over a batch of sequences)::

  import jax
  from penzai import pz
  from pz_persist.nn.mamba import Mamba

  layer = Mamba.from_config("mamba", embedding=8, channels=16, state=4, time_step_rank=2,
                            conv_taps=3, norm_epsilon=1e-6, init_base_rng=jax.random.key(0))
  out = layer(pz.nx.ones({"batch": 2, "seq": 5, "embedding": 8}))
  assert dict(out.named_shape) == {"batch": 2, "seq": 5, "embedding": 8}
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
from penzai import pz

from pz_persist import errors
from pz_persist.nn import recurrent_state
from pz_persist.nn._fields import static
from pz_persist.nn.recurrent_state import CachingRecurrent

CHANNELS = "ssm_channels"
STATE = "ssm_state"
RANK = "time_step_rank"
TAPS = "conv_taps"


@pz.pytree_dataclass
class Mamba(pz.nn.Layer):
  """A Mamba-1 selective state-space token mixer (the module docstring has
  the math).

  Attributes:
    input: ``embedding`` -> ``ssm_channels`` (``x``).
    gate: ``embedding`` -> ``ssm_channels`` (``z``).
    conv: The depthwise convolution kernel (``ssm_channels``, ``conv_taps``;
      tap ``conv_taps - 1`` multiplies the current token).
    conv_bias: Added after the convolution (``ssm_channels``), or None.
    time_step_input: ``ssm_channels`` -> ``time_step_rank`` (from the
      convolved ``x``).
    input_matrix: ``ssm_channels`` -> ``ssm_state`` (``B``).
    output_matrix: ``ssm_channels`` -> ``ssm_state`` (``C``).
    time_step_norm: Applied to the time step's low-rank input (Jamba's
      ``dt_layernorm``; ``pz.nn.Identity`` for none).
    input_matrix_norm: Applied to ``B`` (``b_layernorm``).
    output_matrix_norm: Applied to ``C`` (``c_layernorm``).
    time_step: ``time_step_rank`` -> ``ssm_channels`` (``dt_proj``, without
      its bias).
    time_step_bias: ``dt_proj``'s bias (``ssm_channels``), added before the
      softplus.
    log_decay_rate: ``A_log`` (``ssm_channels``, ``ssm_state``).
    skip: ``D`` (``ssm_channels``).
    output: ``ssm_channels`` -> ``embedding``.
    conv_activation: Applied after the convolution (SiLU in Jamba).
  """

  input: pz.nn.Layer
  gate: pz.nn.Layer
  conv: pz.ParameterLike[pz.nx.NamedArray]
  conv_bias: pz.ParameterLike[pz.nx.NamedArray] | None
  time_step_input: pz.nn.Layer
  input_matrix: pz.nn.Layer
  output_matrix: pz.nn.Layer
  time_step_norm: pz.nn.Layer
  input_matrix_norm: pz.nn.Layer
  output_matrix_norm: pz.nn.Layer
  time_step: pz.nn.Layer
  time_step_bias: pz.ParameterLike[pz.nx.NamedArray]
  log_decay_rate: pz.ParameterLike[pz.nx.NamedArray]
  skip: pz.ParameterLike[pz.nx.NamedArray]
  output: pz.nn.Layer
  conv_activation: Callable[[jax.Array], jax.Array] = static(jax.nn.silu)

  @classmethod
  def from_config(cls, name: str, *, embedding: int, channels: int, state: int,
                  time_step_rank: int, conv_taps: int, norm_epsilon: float | None,
                  conv_bias: bool = True, init_base_rng: jax.Array | None = None) -> Mamba:
    """The layer, its parameters labelled ``{name}/{field}`` (``.weights``
    for the projections, ``{name}/{norm}/scale.weights`` for the norms').
    ``norm_epsilon`` None: no norms on the time step, ``B`` and ``C``
    (plain Mamba); else RMS norms with that epsilon (Jamba). With
    ``init_base_rng`` None, each parameter is a slot to be bound by label,
    as `pz_persist.pretrained.load_hf` does; with a key, they are
    initialised as Mamba initialises them (``A_log = log(1..state)``, ``D``
    and norm scales one, the rest random), so a new layer can be inserted
    into a model."""
    for what, size in (("embedding", embedding), ("channels", channels), ("state", state),
                       ("time_step_rank", time_step_rank), ("conv_taps", conv_taps)):
      if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise errors.ArgumentError(f"Mamba {name}: {what}={size!r} must be a positive integer")
    embed, chans = {"embedding": embedding}, {CHANNELS: channels}

    def param(field: str, value: Callable[[], pz.nx.NamedArray]) -> pz.ParameterLike:
      if init_base_rng is None:
        return pz.ParameterSlot(f"{name}/{field}")
      return pz.Parameter(value=value(), label=f"{name}/{field}")

    def linear(field: str, inputs: dict[str, int], outputs: dict[str, int]) -> pz.nn.Linear:
      if init_base_rng is None:
        return pz.nn.Linear(weights=pz.ParameterSlot(f"{name}/{field}.weights"),
                            in_axis_names=tuple(inputs), out_axis_names=tuple(outputs))
      return pz.nn.Linear.from_config(name=f"{name}/{field}", init_base_rng=init_base_rng,
                                      input_axes=inputs, output_axes=outputs)

    def norm(field: str, axis: str, size: int) -> pz.nn.Layer:
      if norm_epsilon is None:
        return pz.nn.Identity()
      return pz.nn.RMSLayerNorm.from_config(name=f"{name}/{field}", init_base_rng=init_base_rng,
                                            across_axes={axis: size}, epsilon=norm_epsilon)

    def kernel() -> pz.nx.NamedArray:
      assert init_base_rng is not None
      key = jax.random.fold_in(init_base_rng, zlib.crc32(f"{name}/conv".encode()))
      return pz.nx.wrap(jax.random.normal(key, (channels, conv_taps)) * conv_taps ** -0.5,
                        CHANNELS, TAPS)

    def log_rate() -> pz.nx.NamedArray:
      rates = jnp.broadcast_to(jnp.arange(1, state + 1, dtype=jnp.float32), (channels, state))
      return pz.nx.wrap(jnp.log(rates), CHANNELS, STATE)

    return cls(
        input=linear("input", embed, chans), gate=linear("gate", embed, chans),
        conv=param("conv", kernel),
        conv_bias=param("conv_bias", lambda: pz.nx.zeros(chans)) if conv_bias else None,
        time_step_input=linear("time_step_input", chans, {RANK: time_step_rank}),
        input_matrix=linear("input_matrix", chans, {STATE: state}),
        output_matrix=linear("output_matrix", chans, {STATE: state}),
        time_step_norm=norm("time_step_norm", RANK, time_step_rank),
        input_matrix_norm=norm("input_matrix_norm", STATE, state),
        output_matrix_norm=norm("output_matrix_norm", STATE, state),
        time_step=linear("time_step", {RANK: time_step_rank}, chans),
        time_step_bias=param("time_step_bias", lambda: pz.nx.zeros(chans)),
        log_decay_rate=param("log_decay_rate", log_rate),
        skip=param("skip", lambda: pz.nx.ones(chans)),
        output=linear("output", chans, embed),
    )

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    return recurrent_state.run_uncached(self, inputs, side_inputs, name="Mamba",
                                        state="convolution and state-space state")

  def zero_state(self, batch_axes: dict[str, int]) -> dict[str, pz.nx.NamedArray]:
    """The state before any token: the convolution's last ``conv_taps - 1``
    inputs (zeros, as transformers pads) and the state-space state
    (``ssm_channels``, ``ssm_state``), in float32."""
    shape = dict(self.log_decay_rate.value.named_shape)
    taps = dict(self.conv.value.named_shape)[TAPS]
    return {"conv": pz.nx.zeros({**batch_axes, TAPS: taps - 1, CHANNELS: shape[CHANNELS]},
                                dtype=jnp.float32),
            "ssm": pz.nx.zeros({**batch_axes, **shape}, dtype=jnp.float32)}

  def run(self, inputs: pz.nx.NamedArray, state: dict[str, pz.nx.NamedArray] | None
          ) -> tuple[pz.nx.NamedArray, dict[str, pz.nx.NamedArray] | None]:
    """The layer over ``inputs`` (axes ``seq``, ``embedding`` and batch
    axes) continuing from ``state`` (None: from the start); returns the
    outputs and the state after the last token (None if ``state`` is None)."""
    x = self.input(inputs)
    if state is None:
      batch = {a: n for a, n in inputs.named_shape.items() if a not in ("seq", "embedding")}
      past = self.zero_state(batch)
    else:
      past = state
    bias = (pz.nx.zeros({}, dtype=x.dtype) if self.conv_bias is None
            else self.conv_bias.value.untag(CHANNELS))
    convolved, kept = _convolve_named(
        x.untag("seq", CHANNELS), past["conv"].untag(TAPS, CHANNELS),
        self.conv.value.untag(CHANNELS, TAPS), bias, activation=self.conv_activation)
    x = convolved.tag("seq", CHANNELS)
    time_step = self.time_step(_in_float32(self.time_step_norm, self.time_step_input(x)))
    b = _in_float32(self.input_matrix_norm, self.input_matrix(x))
    c = _in_float32(self.output_matrix_norm, self.output_matrix(x))
    y, ssm = _scan_named(
        x.untag("seq", CHANNELS), self.gate(inputs).untag("seq", CHANNELS),
        time_step.untag("seq", CHANNELS), b.untag("seq", STATE), c.untag("seq", STATE),
        past["ssm"].untag(CHANNELS, STATE), self.time_step_bias.value.untag(CHANNELS),
        self.log_decay_rate.value.untag(CHANNELS, STATE), self.skip.value.untag(CHANNELS))
    outputs = self.output(y.tag("seq", CHANNELS))
    if state is None:
      return outputs, None
    return outputs, {"conv": kept.tag(TAPS, CHANNELS), "ssm": ssm.tag(CHANNELS, STATE)}

  def treescope_color(self) -> str:
    return "#8fbf94"


def _in_float32(norm: pz.nn.Layer, value: pz.nx.NamedArray) -> pz.nx.NamedArray:
  """``norm(value)`` with its standardization in float32 at least, back in
  ``value``'s dtype before the scale, as transformers' ``JambaRMSNorm``
  computes: these norms run over a few entries (the time-step rank, the
  state), where a bfloat16 mean of squares doubles the model's bfloat16
  error. A norm other than ``pz.nn.RMSLayerNorm`` (an ``Identity``, a
  replacement) runs as it is."""
  if not isinstance(norm, pz.nn.RMSLayerNorm) or not norm.sublayers:
    return norm(value)
  wide = jnp.promote_types(value.dtype, jnp.float32)
  standardized = norm.sublayers[0](value.astype(wide)).astype(value.dtype)
  return pz.nn.Sequential(list(norm.sublayers[1:]))(standardized)


@functools.partial(jax.jit, static_argnames=("activation",))
def _convolve_named(*args, activation: Callable[[jax.Array], jax.Array]):
  """`_convolve` over every batch axis, compiled once per shape."""
  return pz.nx.nmap(functools.partial(_convolve, activation=activation))(*args)


def _convolve(inputs: jax.Array, past: jax.Array, kernel: jax.Array, bias: jax.Array, *,
              activation: Callable[[jax.Array], jax.Array]) -> tuple[jax.Array, jax.Array]:
  """One sequence, positional axes: ``inputs`` [seq, channels], ``past``
  [taps - 1, channels], ``kernel`` [channels, taps], ``bias`` [channels] (or
  a scalar zero). Returns the activated convolution [seq, channels] and the
  last ``taps - 1`` inputs (float32, as ``past``)."""
  length, taps = inputs.shape[0], kernel.shape[-1]
  joined = jnp.concatenate([past.astype(inputs.dtype), inputs], 0)
  # Summed in float32 at least and rounded once, as a convolution kernel
  # accumulates, then activated in the model's dtype, as transformers does.
  wide = jnp.promote_types(inputs.dtype, jnp.float32)
  kernel, stream = kernel.astype(wide), joined.astype(wide)
  # Tap j multiplies the input taps - 1 - j tokens back (a loop over the few taps).
  total = functools.reduce(
      jnp.add, (kernel[:, j] * stream[j:j + length] for j in range(taps))) + bias.astype(wide)
  return (activation(total.astype(inputs.dtype)),
          joined[joined.shape[0] - (taps - 1):].astype(past.dtype))


@jax.jit
def _scan_named(*args):
  """`_scan` over every batch axis, compiled once per shape."""
  return pz.nx.nmap(_scan)(*args)


def _scan(x: jax.Array, gate: jax.Array, time_step: jax.Array, b: jax.Array, c: jax.Array,
          ssm: jax.Array, dt_bias: jax.Array, log_rate: jax.Array, skip: jax.Array
          ) -> tuple[jax.Array, jax.Array]:
  """One sequence, positional axes: ``x``, ``gate``, ``time_step`` [seq,
  channels], ``b``, ``c`` [seq, state], ``ssm`` [channels, state]. Returns
  ``y * silu(gate)`` [seq, channels] (in ``x``'s dtype) and the final state
  (float32)."""
  dtype = x.dtype
  # The state in float32 at least (float64 when the model is: a check of the
  # math, not of rounding). In a narrower model the time step, the state read
  # out and the gate are rounded to its dtype where transformers' scan rounds
  # them, so that a bfloat16 model's errors are transformers' own.
  f32 = jnp.promote_types(dtype, jnp.float32)

  def rounded(v: jax.Array) -> jax.Array:
    return v.astype(dtype).astype(f32)

  dt = rounded(jax.nn.softplus(rounded(time_step.astype(f32) + rounded(dt_bias.astype(f32)))))
  rate = -jnp.exp(log_rate.astype(f32))
  xf, bf, cf = x.astype(f32), b.astype(f32), c.astype(f32)

  def step(h, token):
    x_t, b_t, c_t, dt_t = token
    h = jnp.exp(dt_t[:, None] * rate) * h + (dt_t * x_t)[:, None] * b_t[None, :]
    return h, rounded(rounded(h) @ c_t)

  final, y = jax.lax.scan(step, ssm.astype(f32), (xf, bf, cf, dt))
  y = (y + skip.astype(f32) * xf) * rounded(jax.nn.silu(gate.astype(f32)))
  return y.astype(dtype), final.astype(ssm.dtype)


@pz.pytree_dataclass
class CachingMamba(CachingRecurrent):
  """A `Mamba` in sampling mode, carrying the convolution's last inputs and
  the state-space state per batch element
  (`pz_persist.nn.recurrent_state.CachingRecurrent`).

  Example:
    >>> import jax
    >>> from penzai import pz
    >>> from pz_persist.nn.mamba import CachingMamba, Mamba
    >>> layer = Mamba.from_config("m", embedding=4, channels=8, state=2, time_step_rank=1,
    ...                           conv_taps=2, norm_epsilon=1e-6,
    ...                           init_base_rng=jax.random.key(0))
    >>> cached = CachingMamba.from_uncached(layer, {"batch": 1}, label="mamba_state")
    >>> x = pz.nx.ones({"batch": 1, "seq": 3, "embedding": 4})
    >>> cached(x).named_shape == x.named_shape
    True

  Attributes:
    uncached: The layer.
    state: Its state, ``Mamba.zero_state``'s structure.
  """

  uncached: Mamba
  state: pz.StateVariable[dict[str, pz.nx.NamedArray]]
