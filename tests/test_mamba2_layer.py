"""`pz_persist.nn.mamba2.Mamba2` on its own: feeding a sequence in pieces,
each continuing from the state the last one left (what `CachingMamba2`
does between sampling calls), gives what one call over the whole sequence
gives, for generated sizes and split points (a property test)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from penzai import pz

from pz_persist.nn.mamba2 import Mamba2


def _layer(rng: np.random.Generator, *, heads: int, head_dim: int, groups: int, state: int,
           taps: int, conv_bias: bool, embedding: int = 6) -> Mamba2:
  """A `Mamba2` with random values in every slot (its labels as
  ``from_config`` gives them)."""
  skeleton = Mamba2.from_config("m", embedding=embedding, heads=heads, head_dim=head_dim,
                                groups=groups, state=state, conv_taps=taps, norm_epsilon=1e-5,
                                conv_bias=conv_bias)
  shapes = {
      "m/gate.weights": {"embedding": embedding, "ssm_heads": heads, "ssm_head_dim": head_dim},
      "m/input.weights": {"embedding": embedding, "ssm_heads": heads, "ssm_head_dim": head_dim},
      "m/input_matrix.weights": {"embedding": embedding, "ssm_groups": groups, "ssm_state": state},
      "m/output_matrix.weights": {"embedding": embedding, "ssm_groups": groups,
                                  "ssm_state": state},
      "m/time_step.weights": {"embedding": embedding, "ssm_heads": heads},
      "m/input_conv": {"ssm_heads": heads, "ssm_head_dim": head_dim, "conv_taps": taps},
      "m/input_matrix_conv": {"ssm_groups": groups, "ssm_state": state, "conv_taps": taps},
      "m/output_matrix_conv": {"ssm_groups": groups, "ssm_state": state, "conv_taps": taps},
      "m/input_conv_bias": {"ssm_heads": heads, "ssm_head_dim": head_dim},
      "m/input_matrix_conv_bias": {"ssm_groups": groups, "ssm_state": state},
      "m/output_matrix_conv_bias": {"ssm_groups": groups, "ssm_state": state},
      "m/log_decay_rate": {"ssm_heads": heads}, "m/time_step_bias": {"ssm_heads": heads},
      "m/skip": {"ssm_heads": heads}, "m/norm_scale": {"ssm_heads": heads, "ssm_head_dim": head_dim},
      "m/output.weights": {"ssm_heads": heads, "ssm_head_dim": head_dim, "embedding": embedding},
  }

  def fill(slot: pz.ParameterSlot) -> pz.Parameter:
    shape = shapes[slot.label]
    value = rng.normal(size=tuple(shape.values())).astype(np.float32) * 0.5
    return pz.Parameter(value=pz.nx.wrap(jnp.asarray(value), *shape), label=slot.label)

  return pz.select(skeleton).at_instances_of(pz.ParameterSlot).apply(fill)


@pytest.mark.slow  # 25 cases, each compiled anew: about 2.5 minutes on 2 busy cores.
@settings(max_examples=25, deadline=None)
@given(heads_per_group=st.integers(1, 3), groups=st.integers(1, 2), head_dim=st.integers(1, 3),
       state=st.integers(1, 4), taps=st.integers(1, 4), conv_bias=st.booleans(),
       cuts=st.lists(st.integers(1, 8), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_pieces_continue_where_the_last_left_off(heads_per_group, groups, head_dim, state, taps,
                                                 conv_bias, cuts, seed):
  rng = np.random.default_rng(seed)
  layer = _layer(rng, heads=heads_per_group * groups, head_dim=head_dim, groups=groups,
                 state=state, taps=taps, conv_bias=conv_bias)
  length = sum(cuts)
  inputs = pz.nx.wrap(jnp.asarray(rng.normal(size=(2, length, 6)).astype(np.float32)),
                      "batch", "seq", "embedding")
  whole = layer(inputs).untag("batch", "seq", "embedding").unwrap()
  carried = layer.zero_state({"batch": 2})
  pieces, start = [], 0
  for cut in cuts:
    piece = inputs[{"seq": pz.slice[start:start + cut]}]
    out, carried = layer.run(piece, carried)
    pieces.append(out.untag("batch", "seq", "embedding").unwrap())
    start += cut
  np.testing.assert_allclose(np.concatenate(pieces, 1), whole, atol=2e-5, rtol=2e-5)

