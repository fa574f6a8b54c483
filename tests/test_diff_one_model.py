"""One model of a diff: the tree; the flat fields are views derived from it.

`CheckpointDiff.structure`, ``only_in_a``, ``only_in_b``, ``changed`` and
``arrays`` used to be a second diff computed beside the tree (a second walk
of both structures). They are now read from the tree and the sides' array
tables; this checks them, on generated pairs of trees, against what the
trees hold (worked out here from the generated values, not from pz_persist).
"""

from __future__ import annotations

import hypothesis
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

import pz_persist as pzp
from pz_persist.tools import diff_tree
from pz_persist.tools import diffing

_KEYS = ("a", "b", "c", "d")
_ARRAYS = st.builds(
    lambda shape, dtype, fill: np.full(shape, fill, dtype=dtype),
    st.sampled_from([(2,), (3,), (2, 2)]),
    st.sampled_from([np.float32, np.int32]),
    st.integers(0, 2),
)
_LEAVES = st.one_of(_ARRAYS, st.sampled_from([0.1, 0.2, "gelu", 3]))
_TREES = st.dictionaries(st.sampled_from(_KEYS), _LEAVES, max_size=len(_KEYS))


def _arrays(tree):
  return {f"tree['{k}']": v for k, v in tree.items() if isinstance(v, np.ndarray)}


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(a=_TREES, b=_TREES)
def test_the_flat_views_say_what_the_trees_hold(a, b):
  result = pzp.diff({k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in a.items()},
                    {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in b.items()},
                    progress=False)
  arrays_a, arrays_b = _arrays(a), _arrays(b)
  assert result.only_in_a == [n for n in arrays_a if n not in arrays_b]
  assert result.only_in_b == [n for n in arrays_b if n not in arrays_a]
  both = [n for n in arrays_a if n in arrays_b]
  assert [c.split(":")[0] for c in result.changed] == [
      n for n in both
      if (arrays_a[n].shape, arrays_a[n].dtype) != (arrays_b[n].shape, arrays_b[n].dtype)]
  same_spec = {n for n in both if (arrays_a[n].shape, arrays_a[n].dtype) == (
      arrays_b[n].shape, arrays_b[n].dtype)}
  assert {x.name: x.identical for x in result.arrays} == {
      n: bool(np.array_equal(arrays_a[n], arrays_b[n])) for n in same_spec}

  # `structure`: a line for each change of structure, none for values alone.
  plain_a = {k: v for k, v in a.items() if not isinstance(v, np.ndarray)}
  plain_b = {k: v for k, v in b.items() if not isinstance(v, np.ndarray)}
  same_structure = (a.keys() == b.keys() and plain_a == plain_b
                    and {n: (x.shape, x.dtype) for n, x in arrays_a.items()}
                    == {n: (x.shape, x.dtype) for n, x in arrays_b.items()})
  assert (result.structure == []) == same_structure, result.structure
  paths = {node.path for node in result.changes()}
  assert all(line.split(": ")[0] in paths for line in result.structure)

  # One verdict: the tree's, which the views agree with.
  values_same = all(np.array_equal(arrays_a[n], arrays_b[n]) for n in same_spec)
  assert result.identical == (same_structure and values_same)
  assert result.identical == (result.tree is not None and result.tree.status == "unchanged")
  record = diffing.record(result)
  for field in ("structure", "only_in_a", "only_in_b", "changed"):
    assert record[field] == getattr(result, field)
  assert [x["name"] for x in record["arrays"]] == [x.name for x in result.arrays]


def test_structure_differences_is_the_trees_lines():
  """`structure_differences` of two manifests is `diff_tree.structure_lines`
  of their diff tree: no second walk of the structures."""
  result = pzp.diff({"lr": 0.1, "w": jnp.ones(3)}, {"lr": 0.2, "w": jnp.zeros(3)},
                    progress=False)
  assert result.structure == ["tree['lr']: float (0.1 -> 0.2)"]
  assert result.structure == diff_tree.structure_lines(result.tree)
  assert not hasattr(diffing, "_StructureDiff")
