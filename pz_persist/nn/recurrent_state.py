"""The sampling form shared by layers whose past is a state, not keys and values.

A gated DeltaNet, a Mamba-2 mixer and a short convolution each carry their
past as a small state (a convolution's last inputs, a recurrence's matrix)
rather than as keys and values in a KV cache. Each exposes the same two
methods, ``zero_state(batch_axes)`` and ``run(inputs, state) -> (outputs,
state)``, and `CachingRecurrent` turns any such layer into its sampling
form: one class holding the rule, subclassed per layer only so that a
saved sampler names what it wraps.
"""

from __future__ import annotations

from typing import Any
from typing import Protocol
from typing import Self

from penzai import pz

from pz_persist import errors


class Recurrent(Protocol):
  """A layer whose past is a state: what `CachingRecurrent` wraps."""

  def zero_state(self, batch_axes: dict[str, int]) -> dict[str, pz.nx.NamedArray]:
    """The state before the first token, per batch element."""

  def run(self, inputs: pz.nx.NamedArray, state: dict[str, pz.nx.NamedArray] | None
          ) -> tuple[pz.nx.NamedArray, dict[str, pz.nx.NamedArray]]:
    """The outputs for ``inputs`` continuing from ``state`` (None: the zero
    state), and the state after."""


def run_uncached(layer: Recurrent, inputs: pz.nx.NamedArray, side_inputs: dict[str, Any], *,
                 name: str, state: str) -> pz.nx.NamedArray:
  """A recurrent layer's ordinary call: ``inputs`` run from the zero state.

  Refused inside Penzai's own KV-cache sampling mode (its side inputs hold
  ``cache_end_index``): there each call would start again from the zero
  state and forget the tokens before it. ``name`` and ``state`` say which
  layer and what state it lacks, for the message.
  """
  if "cache_end_index" in side_inputs:
    raise errors.ArgumentError(
        f"A {name} layer is running inside Penzai's KV-cache sampling mode without its"
        f" {state}: KVCachingTransformerLM.from_uncached converts only pz.nn.Attention"
        " layers, so each call would forget the tokens before it. Build the sampler with"
        " pz_persist.pretrained.kv_caching_lm(model, cache_len, batch_axes) instead.")
  outputs, _ = layer.run(inputs, None)
  return outputs


@pz.pytree_dataclass
class CachingRecurrent(pz.nn.Layer):
  """A `Recurrent` layer in sampling mode: each call continues from the
  state the previous call left (per batch element), so feeding a sequence
  in pieces gives what one call over the whole sequence gives.

  Example:
    >>> import jax
    >>> from penzai import pz
    >>> from pz_persist.nn.short_conv import CachingShortConv, ShortConv
    >>> conv = ShortConv.from_config("conv", embedding=4, conv_taps=3,
    ...                              init_base_rng=jax.random.key(0))
    >>> cached = CachingShortConv.from_uncached(conv, {"batch": 1}, label="conv_state")
    >>> x = pz.nx.ones({"batch": 1, "seq": 2, "embedding": 4})
    >>> cached(x).named_shape == x.named_shape
    True

  Attributes:
    uncached: The layer.
    state: Its state, ``uncached.zero_state``'s structure.
  """

  uncached: Any
  state: pz.StateVariable[dict[str, pz.nx.NamedArray]]

  @classmethod
  def from_uncached(cls, uncached: Recurrent, batch_axes: dict[str, int], label: str) -> Self:
    """``uncached`` with a zero state for ``batch_axes``, labelled ``label``."""
    return cls(uncached=uncached,
               state=pz.StateVariable(value=uncached.zero_state(batch_axes), label=label))

  def __call__(self, inputs: pz.nx.NamedArray, **_unused_side_inputs) -> pz.nx.NamedArray:
    outputs, state = self.uncached.run(inputs, self.state.value)
    self.state.value = state
    return outputs
