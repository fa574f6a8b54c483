"""`TensorSpec.regrouped` (a range of per-key-head rows regrouped into value
heads, Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``): `stored_layout`
undoes `penzai_layout` bit for bit, and each value head reads the rows
transformers' ``fix_query_key_value_ordering`` gives it, over generated
head counts and widths."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from pz_persist.pretrained.hf import plan as hf_plan
from pz_persist.pretrained.hf.building.hybrid_decoder import Sizes
from pz_persist.pretrained.hf.families.qwen3_next import per_key_head_delta_specs

_HEADS = st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 4), st.integers(1, 4),
                   st.integers(1, 5), st.integers(0, 2**31))


@settings(max_examples=60, deadline=None)
@given(heads=_HEADS)
def test_per_key_head_parts_round_trip_and_land_on_their_heads(heads):
  k_heads, group, dk, dv, hidden, seed = heads
  sizes = Sizes(hidden=hidden, heads=1, kv_heads=1, head_dim=2, key_heads=k_heads,
                value_heads=k_heads * group, key_dim=dk, value_dim=dv, taps=2)
  specs = per_key_head_delta_specs("n", "s.", sizes)
  rng = np.random.default_rng(seed)
  for source in ("s.in_proj_qkvz.weight", "s.in_proj_ba.weight"):
    fused = [spec for spec in specs if spec.source == source]
    stored = rng.normal(size=fused[0].file_shape).astype(np.float32)
    parts = {spec.label: hf_plan.penzai_layout(spec, stored) for spec in fused}
    for spec in fused:
      assert parts[spec.label].shape == spec.parameter_shape
    order = list(range(len(fused)))
    random.Random(seed).shuffle(order)
    back = hf_plan.stored_layout([fused[i] for i in order], [parts[fused[i].label] for i in order])
    assert back.tobytes() == stored.tobytes()
    grouped = stored.reshape(k_heads, -1, hidden)
    for v in range(k_heads * group):  # Value head v is the (v % group)-th of key head v // group.
      key, within = divmod(v, group)
      if source.endswith("qkvz.weight"):
        values = grouped[key, 2 * dk:2 * dk + group * dv].reshape(group, dv, hidden)
        np.testing.assert_array_equal(parts["n/value.weights"][v], values[within])
        gates = grouped[key, 2 * dk + group * dv:].reshape(group, dv, hidden)
        np.testing.assert_array_equal(parts["n/output_gate.weights"][v], gates[within])
      else:
        np.testing.assert_array_equal(parts["n/write_strength.weights"][v],
                                      grouped[key, within])
        np.testing.assert_array_equal(parts["n/decay_input.weights"][v],
                                      grouped[key, group + within])
