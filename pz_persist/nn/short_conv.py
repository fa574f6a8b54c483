"""Short double-gated causal convolution, the token mixer of LiquidAI's LFM2
(and LFM2-MoE) in place of attention in most layers, as a Penzai layer with
named axes, and its KV-cache sampling form.

From the layer's input three projections are taken, over one axis of
``conv_channels`` (as wide as the embedding in LFM2): an input gate ``B``, an
output gate ``C`` and a value ``x``. ``B * x`` goes through a depthwise causal
convolution over the last ``conv_taps`` tokens (tap ``conv_taps - 1``
multiplies the current token, tap 0 the one ``conv_taps - 1`` tokens back;
zeros before the first token), plus an optional per-channel bias; ``C``
multiplies the result, and an output projection returns to ``embedding``:
``out(C * conv(B * x))``. No activation anywhere: the two gates are what
makes it non-linear.

What carries the past from one sampling call to the next is the last
``conv_taps - 1`` values of ``B * x``, nothing else (there is no recurrent
state): `CachingShortConv` holds them in a ``pz.StateVariable``, and
`pz_persist.pretrained.kv_caching_lm` puts a model with these layers into
Penzai's KV-cache sampling mode, as it does Qwen3.5's
`pz_persist.nn.gated_delta_net.GatedDeltaNet`. Penzai's own
``KVCachingTransformerLM.from_uncached`` converts only ``pz.nn.Attention``
layers; the uncached layer refuses to run in its sampling mode rather than
silently forget the past.

The projections are ordinary Penzai layers (a ``pz.nn.Linear``, optionally
followed by a ``pz.nn.AddBias``), so LoRA and other surgery reach them as
they reach attention's.

Example (a fresh layer, randomly initialised, over a batch of sequences)::

  import jax
  from penzai import pz
  from pz_persist.nn.short_conv import ShortConv

  layer = ShortConv.from_config("conv", embedding=8, conv_taps=3,
                                init_base_rng=jax.random.key(0))
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

from pz_persist.nn import recurrent_state
from pz_persist.nn.recurrent_state import CachingRecurrent

CHANNELS = "conv_channels"
TAPS = "conv_taps"


@pz.pytree_dataclass
class ShortConv(pz.nn.Layer):
  """A short double-gated causal convolution (the module docstring has the
  math).

  Attributes:
    input_gate: ``embedding`` -> ``conv_channels`` (``B``).
    output_gate: ``embedding`` -> ``conv_channels`` (``C``).
    value: ``embedding`` -> ``conv_channels`` (``x``).
    kernel: The depthwise kernel (``conv_channels``, ``conv_taps``; tap
      ``conv_taps - 1`` multiplies the current token).
    kernel_bias: Added after the convolution (``conv_channels``), or None.
    output: ``conv_channels`` -> ``embedding``.
  """

  input_gate: pz.nn.Layer
  output_gate: pz.nn.Layer
  value: pz.nn.Layer
  kernel: pz.ParameterLike[pz.nx.NamedArray]
  kernel_bias: pz.ParameterLike[pz.nx.NamedArray] | None
  output: pz.nn.Layer

  @classmethod
  def from_config(cls, name: str, *, embedding: int, conv_taps: int, bias: bool = False,
                  init_base_rng: jax.Array | None = None) -> ShortConv:
    """The layer, its parameters labelled ``{name}/{field}`` (``.weights``
    for the projections' matrices, ``.bias`` for their biases when
    ``bias``). ``embedding`` is the width of both the embedding and the
    channels (LFM2's). With ``init_base_rng`` None, each parameter is a slot
    to be bound by label, as `pz_persist.pretrained.load_hf` does; with a
    key, they are initialised as Penzai's own layers are (the kernel from a
    normal distribution scaled by ``conv_taps ** -0.5``, biases zero), so a
    new layer can be inserted into a model."""
    channels = {CHANNELS: embedding}

    def param(label: str, value: Callable[[], pz.nx.NamedArray]) -> pz.ParameterLike:
      if init_base_rng is None:
        return pz.ParameterSlot(label)
      return pz.Parameter(value=value(), label=label)

    def projection(field: str, inputs: dict[str, int], outputs: dict[str, int]) -> pz.nn.Layer:
      if init_base_rng is None:
        linear = pz.nn.Linear(weights=pz.ParameterSlot(f"{name}/{field}.weights"),
                              in_axis_names=tuple(inputs), out_axis_names=tuple(outputs))
      else:
        linear = pz.nn.Linear.from_config(name=f"{name}/{field}", init_base_rng=init_base_rng,
                                          input_axes=inputs, output_axes=outputs)
      if not bias:
        return linear
      return pz.nn.Sequential([linear, pz.nn.AddBias(bias=param(
          f"{name}/{field}.bias", lambda: pz.nx.zeros(outputs)), new_axis_names=())])

    def kernel() -> pz.nx.NamedArray:
      assert init_base_rng is not None
      key = jax.random.fold_in(init_base_rng, zlib.crc32(f"{name}/kernel".encode()))
      return pz.nx.wrap(jax.random.normal(key, (embedding, conv_taps)) * conv_taps ** -0.5,
                        CHANNELS, TAPS)

    embed = {"embedding": embedding}
    return cls(
        input_gate=projection("input_gate", embed, channels),
        output_gate=projection("output_gate", embed, channels),
        value=projection("value", embed, channels),
        kernel=param(f"{name}/kernel", kernel),
        kernel_bias=param(f"{name}/kernel_bias", lambda: pz.nx.zeros(channels)) if bias else None,
        output=projection("output", channels, embed),
    )

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    return recurrent_state.run_uncached(self, inputs, side_inputs, name="ShortConv",
                                        state="convolution state")

  @property
  def conv_taps(self) -> int:
    return dict(self.kernel.value.named_shape)[TAPS]

  def zero_state(self, batch_axes: dict[str, int]) -> dict[str, pz.nx.NamedArray]:
    """The state before any token: the last ``conv_taps - 1`` inputs of the
    convolution, zeros (as transformers pads)."""
    channels = dict(self.kernel.value.named_shape)[CHANNELS]
    return {"conv": pz.nx.zeros({**batch_axes, TAPS: self.conv_taps - 1, CHANNELS: channels},
                                dtype=jnp.float32)}

  def run(self, inputs: pz.nx.NamedArray, state: dict[str, pz.nx.NamedArray] | None
          ) -> tuple[pz.nx.NamedArray, dict[str, pz.nx.NamedArray] | None]:
    """The layer over ``inputs`` (axes ``seq``, ``embedding`` and batch
    axes) continuing from ``state`` (None: from the start); returns the
    outputs and the state after the last token (None if ``state`` is None)."""
    gated = self.input_gate(inputs) * self.value(inputs)
    if state is None:
      batch = {a: n for a, n in inputs.named_shape.items() if a not in ("seq", "embedding")}
      past = self.zero_state(batch)["conv"]
    else:
      past = state["conv"]
    bias = (pz.nx.zeros({CHANNELS: dict(self.kernel.value.named_shape)[CHANNELS]},
                        dtype=gated.dtype)
            if self.kernel_bias is None else self.kernel_bias.value)
    mixed, kept = _convolve_named(gated.untag("seq", CHANNELS), past.untag(TAPS, CHANNELS),
                                  self.kernel.value.untag(CHANNELS, TAPS), bias.untag(CHANNELS))
    outputs = self.output(self.output_gate(inputs) * mixed.tag("seq", CHANNELS))
    if state is None:
      return outputs, None
    return outputs, {"conv": kept.tag(TAPS, CHANNELS)}

  def treescope_color(self) -> str:
    return "#6bb8a8"


@jax.jit
def _convolve_named(*args):
  """`_convolve` over every batch axis, compiled once per shape."""
  return pz.nx.nmap(_convolve)(*args)


def _convolve(inputs: jax.Array, past: jax.Array, kernel: jax.Array, bias: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
  """One sequence, positional axes: ``inputs`` [seq, channels], ``past``
  [taps - 1, channels], ``kernel`` [channels, taps], ``bias`` [channels].
  Returns the convolution [seq, channels] and the last ``taps - 1`` inputs
  (float32, as ``past``)."""
  length, taps = inputs.shape[0], kernel.shape[-1]
  joined = jnp.concatenate([past.astype(inputs.dtype), inputs], 0)
  # Tap j multiplies the input taps - 1 - j tokens back (a loop over the few
  # taps, not over tokens).
  total = functools.reduce(
      jnp.add, (kernel[:, j] * joined[j:j + length] for j in range(taps))) + bias
  return total.astype(inputs.dtype), joined[joined.shape[0] - (taps - 1):].astype(past.dtype)


@pz.pytree_dataclass
class CachingShortConv(CachingRecurrent):
  """A `ShortConv` in sampling mode, carrying the convolution's last inputs per batch element
  (`pz_persist.nn.recurrent_state.CachingRecurrent`).

  Attributes:
    uncached: The layer.
    state: Its state, ``ShortConv.zero_state``'s structure.
  """

  uncached: ShortConv
  state: pz.StateVariable[dict[str, pz.nx.NamedArray]]
