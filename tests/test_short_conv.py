"""`pz_persist.nn.short_conv`: the short double-gated convolution against a
direct numpy computation of its definition, and its sampling form against
the whole-sequence layer (property tests over generated sizes, kernels and
ways of cutting a sequence into calls)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from penzai import pz

from pz_persist import errors
from pz_persist.nn.short_conv import CachingShortConv
from pz_persist.nn.short_conv import ShortConv


def _layer(channels: int, taps: int, bias: bool, seed: int) -> tuple[ShortConv, dict]:
  """A bound layer and its values by field (numpy, float32)."""
  layer = ShortConv.from_config("conv", embedding=channels, conv_taps=taps, bias=bias)
  rng = np.random.default_rng(seed)
  shapes = {"input_gate.weights": {"embedding": channels, "conv_channels": channels},
            "output_gate.weights": {"embedding": channels, "conv_channels": channels},
            "value.weights": {"embedding": channels, "conv_channels": channels},
            "output.weights": {"conv_channels": channels, "embedding": channels},
            "kernel": {"conv_channels": channels, "conv_taps": taps}}
  if bias:
    shapes.update({f"{p}.bias": {"conv_channels": channels}
                   for p in ("input_gate", "output_gate", "value")})
    shapes.update({"kernel_bias": {"conv_channels": channels},
                   "output.bias": {"embedding": channels}})
  values = {name: rng.normal(size=tuple(shape.values())).astype(np.float32)
            for name, shape in shapes.items()}
  params = [pz.Parameter(label=f"conv/{name}", value=pz.nx.wrap(values[name], *shapes[name]))
            for name in shapes]
  return pz.bind_variables(layer, params), values


def _reference(x: np.ndarray, v: dict, bias: bool) -> np.ndarray:
  """``out(C * conv(B * x))`` for one sequence [seq, embedding], from the
  definition (zeros before the first token)."""
  def proj(name, inputs):
    y = inputs @ v[f"{name}.weights"]
    return y + v[f"{name}.bias"] if bias else y
  b, c, value = proj("input_gate", x), proj("output_gate", x), proj("value", x)
  bx = b * value
  taps = v["kernel"].shape[1]
  padded = np.concatenate([np.zeros((taps - 1, bx.shape[1]), np.float32), bx])
  conv = sum(v["kernel"][:, j] * padded[j:j + len(x)] for j in range(taps))
  if bias:
    conv = conv + v["kernel_bias"]
  return proj("output", c * conv)


_SIZES = st.tuples(st.integers(1, 6), st.integers(1, 5), st.booleans(), st.integers(0, 10**6))


@settings(max_examples=25, deadline=None)
@given(sizes=_SIZES, length=st.integers(1, 9))
def test_forward_is_the_definition(sizes, length):
  channels, taps, bias, seed = sizes
  layer, values = _layer(channels, taps, bias, seed)
  x = np.random.default_rng(seed + 1).normal(size=(2, length, channels)).astype(np.float32)
  out = layer(pz.nx.wrap(x, "batch", "seq", "embedding"))
  got = np.asarray(out.untag("batch", "seq", "embedding").unwrap())
  for i in range(2):
    np.testing.assert_allclose(got[i], _reference(x[i], values, bias), rtol=2e-4, atol=2e-4)


@settings(max_examples=25, deadline=None)
@given(sizes=_SIZES, cuts=st.lists(st.integers(1, 4), min_size=1, max_size=5))
@example(sizes=(6, 3, True, 4433), cuts=[1, 2])  # An output of 0.005 among terms of 30.
def test_calls_in_pieces_are_one_call(sizes, cuts):
  """A sequence fed to `CachingShortConv` in pieces of the generated
  lengths gives, token for token, the uncached layer over the whole."""
  channels, taps, bias, seed = sizes
  layer, _ = _layer(channels, taps, bias, seed)
  length = sum(cuts)
  x = np.random.default_rng(seed + 2).normal(size=(3, length, channels)).astype(np.float32)
  whole = np.asarray(layer(pz.nx.wrap(x, "batch", "seq", "embedding")).untag(
      "batch", "seq", "embedding").unwrap())
  caching = CachingShortConv.from_uncached(layer, {"batch": 3}, label="state")
  pieces, start = [], 0
  for cut in cuts:  # Each call updates the layer's StateVariable.
    out = caching(pz.nx.wrap(x[:, start:start + cut], "batch", "seq", "embedding"))
    pieces.append(np.asarray(out.untag("batch", "seq", "embedding").unwrap()))
    start += cut
  # The cached path sums the same products in another order: float32
  # rounding of the largest terms (up to ~30 here), not of each output.
  atol = 1e-6 * max(1.0, float(np.abs(whole).max()))
  np.testing.assert_allclose(np.concatenate(pieces, 1), whole, rtol=1e-5, atol=atol)


def test_penzai_sampling_mode_is_refused():
  layer, _ = _layer(4, 3, False, 0)
  with pytest.raises(errors.ArgumentError, match="kv_caching_lm"):
    layer(pz.nx.ones({"batch": 1, "seq": 2, "embedding": 4}), cache_end_index=jax.numpy.int32(0))


def test_zero_state_holds_taps_minus_one_inputs():
  layer, _ = _layer(5, 4, True, 0)
  state = layer.zero_state({"batch": 2})["conv"]
  assert dict(state.named_shape) == {"batch": 2, "conv_taps": 3, "conv_channels": 5}
