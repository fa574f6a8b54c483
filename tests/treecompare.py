"""Strict comparison of trees: what "restored exactly" means in these tests."""

from __future__ import annotations

import functools
import math
import struct
from typing import Any

import jax
import numpy as np
from penzai import pz


def _is_variable(x: Any) -> bool:
  return isinstance(x, pz.AbstractVariable)


def _flatten(tree: Any):
  return jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)


def _sharing(leaves: list[Any]) -> list[int]:
  """For each leaf, the index of the first leaf that is the same variable."""
  first: dict[int, int] = {}
  return [
      first.setdefault(id(leaf), i) if _is_variable(leaf) else i
      for i, leaf in enumerate(leaves)
  ]


def bits(x: Any) -> bytes:
  x = np.asarray(x)
  return x.tobytes()


def assert_identical(actual: Any, expected: Any) -> None:
  """Same treedef, leaf classes, dtypes, weak types, shapes, bits and sharing."""
  actual_flat, actual_def = _flatten(actual)
  expected_flat, expected_def = _flatten(expected)
  assert actual_def == expected_def, f"treedefs differ:\n{actual_def}\n{expected_def}"
  actual_leaves = [leaf for _, leaf in actual_flat]
  expected_leaves = [leaf for _, leaf in expected_flat]
  assert _sharing(actual_leaves) == _sharing(expected_leaves), "variable sharing differs"
  for (path, a), e in zip(actual_flat, expected_leaves):
    _assert_leaf(a, e, jax.tree_util.keystr(path))


def _assert_leaf(a: Any, e: Any, where: str) -> None:
  assert type(a) is type(e) or (
      isinstance(a, jax.Array) and isinstance(e, jax.Array)
  ), f"{where}: {type(a)} != {type(e)}"
  if _is_variable(e):
    assert a.label == e.label and a.metadata == e.metadata, where
    assert_identical(a.freeze(), e.freeze())
  elif isinstance(e, jax.Array):
    assert a.shape == e.shape and a.dtype == e.dtype, f"{where}: {a.dtype}{a.shape} != {e.dtype}{e.shape}"
    if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
      a, e = jax.random.key_data(a), jax.random.key_data(e)
    assert a.weak_type == e.weak_type, f"{where}: weak_type"
    assert bits(a) == bits(e), f"{where}: values differ"
  elif isinstance(e, (np.ndarray, np.generic)):
    assert a.dtype == e.dtype and np.shape(a) == np.shape(e), where
    assert bits(a) == bits(e), f"{where}: values differ"
  elif isinstance(e, float):
    assert struct.pack("<d", a) == struct.pack("<d", e) or (
        math.isnan(a) and math.isnan(e)
    ), where
  elif isinstance(e, complex):
    _assert_leaf(a.real, e.real, where)
    _assert_leaf(a.imag, e.imag, where)
  else:
    assert a == e, f"{where}: {a!r} != {e!r}"


def assert_same_outputs(a: Any, b: Any) -> None:
  """Bit-identical model outputs (NamedArrays or arrays)."""
  a = a.data_array if isinstance(a, pz.nx.NamedArrayBase) else a
  b = b.data_array if isinstance(b, pz.nx.NamedArrayBase) else b
  assert a.dtype == b.dtype and a.shape == b.shape
  assert bits(a) == bits(b), "outputs differ"


def _same_static(a: Any, e: Any) -> bool:
  """Equality for static field values; partials compare by what they call."""
  if isinstance(e, functools.partial):
    return (
        isinstance(a, functools.partial)
        and a.func is e.func
        and a.args == e.args
        and a.keywords == e.keywords
    )
  return type(a) is type(e) and a == e


def assert_same_model(actual: Any, expected: Any, where: str = "model") -> None:
  """Same layer classes and fields, same variables (values, labels, sharing).

  ``jax.tree.structure`` equality is too strict for models: a layer's static
  ``functools.partial`` (say, GELU with approximate=True) is rebuilt as an
  equal but new object, and partials compare by identity.
  """
  _compare_model(actual, expected, where, {}, {})


def _compare_model(a, e, where, seen_a, seen_e):
  assert type(a) is type(e), f"{where}: {type(a).__name__} != {type(e).__name__}"
  if isinstance(e, pz.AbstractVariable):
    # Sharing: the n-th distinct variable of one is the n-th of the other.
    assert seen_a.setdefault(id(a), len(seen_a)) == seen_e.setdefault(id(e), len(seen_e)), (
        f"{where}: variable sharing differs"
    )
    assert a.label == e.label and a.metadata == e.metadata, where
    assert_identical(a.freeze(), e.freeze())
  elif isinstance(e, pz.Struct) and not isinstance(e, pz.nx.NamedArrayBase):
    fields_a, fields_e = a.attributes_dict(), e.attributes_dict()
    assert fields_a.keys() == fields_e.keys(), where
    for name in fields_e:
      _compare_model(fields_a[name], fields_e[name], f"{where}.{name}", seen_a, seen_e)
  elif isinstance(e, (list, tuple)) and not hasattr(e, "_fields"):
    assert len(a) == len(e), where
    for i, (x, y) in enumerate(zip(a, e)):
      _compare_model(x, y, f"{where}[{i}]", seen_a, seen_e)
  elif isinstance(e, dict):
    assert list(a) == list(e), where
    for k in e:
      _compare_model(a[k], e[k], f"{where}[{k!r}]", seen_a, seen_e)
  elif isinstance(e, (jax.Array, np.ndarray, np.generic, pz.nx.NamedArrayBase)):
    assert_identical(a, e)
  else:
    assert _same_static(a, e), f"{where}: {a!r} != {e!r}"
