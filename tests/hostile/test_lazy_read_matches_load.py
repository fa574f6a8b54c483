"""A lazy read is the full load, indexed: a differential property test.

For generated values (plain arrays of either kind, ``NamedArray``\\ s and
``NamedArrayView``\\ s whose positional axes are in any data order and mixed
with named ones, NumPy scalars, 0-d arrays, Python scalars; every dtype
family, sub-byte and float8 ones included) and generated valid indexes (ints,
NumPy ints, negative ints, slices with any step and out-of-range bounds,
empty slices, ``...``, dicts by axis name and by position), ``ckpt.read(label,
index)`` must be what `pz_persist.load` returns indexed the same way, and
``ckpt[label]`` what it returns: the same class, kind, dtype, shape, axis
names and their order, and bytes.

"Indexed the same way" is written out here independently of the library
(`_expected`): a tuple indexes the stored dimensions (``data_array``'s) as
NumPy does; a dict's names index named axes and its ints the positional axes
as ``positional_shape`` counts them. Where Penzai has its own indexing (a dict
by name, positions as a positional index) the result is also checked against
Penzai's (`_penzai_agrees`).
"""

from __future__ import annotations

import collections
import math
import os
import tempfile

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from penzai import pz

import pz_persist as pzp
from pz_persist.format import array_specs as arrays_lib

DTYPES = ("float32", "bfloat16", "int4", "uint4", "bool", "float8_e4m3fn", "float8_e4m3",
          "float8_e5m2", "int8", "uint2", "float16", "complex64", "int32")
NUMPY_ONLY = ("float64", "int64")
NAMES = ("a", "b", "c", "d", "e")
READS = collections.Counter()


def _values(dtype: np.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
  """Values distinct enough to tell dimensions apart, exact in every dtype."""
  n = math.prod(shape)
  raw = (np.arange(n) * 7 + seed) % 13
  if dtype == np.bool_:
    return (raw % 2).astype(bool).reshape(shape)
  if dtype.name.startswith(("uint2", "int2")):
    raw = raw % 2
  elif dtype.name.startswith("u") or "int4" in dtype.name:
    raw = raw % 7
  else:
    raw = raw - 6
  return raw.astype(np.float32).astype(dtype).reshape(shape)


@st.composite
def values(draw):
  """A value to save as a variable: its array, named or not, or a scalar."""
  form = draw(st.sampled_from(
      ["plain", "plain", "named", "view", "view", "numpy_scalar", "zero_d", "python"]))
  if form == "python":
    return draw(st.sampled_from([1.5, -2, True, 3 + 4j]))
  name = draw(st.sampled_from(DTYPES + NUMPY_ONLY))
  dtype = arrays_lib.SUPPORTED_DTYPES[name]
  kind = "numpy" if name in NUMPY_ONLY else draw(st.sampled_from(["numpy", "jax"]))
  seed = draw(st.integers(0, 12))
  if form == "numpy_scalar":
    return _values(dtype, (), seed)[()]
  rank = 0 if form == "zero_d" else draw(st.integers(1 if form != "plain" else 0, 4))
  shape = tuple(draw(st.lists(st.integers(0, 5), min_size=rank, max_size=rank)))
  data = _values(dtype, shape, seed)
  array = jnp.asarray(data) if kind == "jax" else data
  if form in ("plain", "zero_d"):
    return array
  names = draw(st.permutations(NAMES))
  if form == "named":
    named = draw(st.integers(0, rank))
    return pz.nx.NamedArray(
        named_axes=collections.OrderedDict(zip(names, shape[rank - named:])),
        data_array=array,
    )
  order = draw(st.permutations(range(rank)))
  positional = draw(st.integers(0, rank))
  return pz.nx.NamedArrayView(
      data_shape=shape,
      data_axis_for_logical_axis=tuple(order[:positional]),
      data_axis_for_name={names[i]: dim for i, dim in enumerate(order[positional:])},
      data_array=array,
  )


def _structure(value):
  """``(axis name or None per stored dimension, stored dimension of each
  positional axis in logical order)``."""
  shape = np.shape(value.data_array if isinstance(value, pz.nx.NamedArrayBase) else value)
  if isinstance(value, pz.nx.NamedArrayView):
    names = [None] * len(shape)
    for name, dim in value.data_axis_for_name.items():
      names[dim] = name
    return names, list(value.data_axis_for_logical_axis)
  if isinstance(value, pz.nx.NamedArray):
    first = len(shape) - len(value.named_axes)
    return [None] * first + list(value.named_axes), list(range(first))
  return [None] * len(shape), list(range(len(shape)))


@st.composite
def parts(draw, n: int, allow_int: bool = True):
  """One dimension's index: an int (maybe NumPy's, maybe negative) or a
  slice (any step, bounds in and out of range, maybe empty)."""
  if n and allow_int and draw(st.booleans()):
    at = draw(st.integers(-n, n - 1))
    return draw(st.sampled_from([int, np.int64, np.int32]))(at)
  bound = st.none() | st.integers(-2 * n - 3, 2 * n + 3)
  step = st.none() | st.integers(-3, 3).filter(lambda s: s != 0)
  return slice(draw(bound), draw(bound), draw(step))


@st.composite
def indexes(draw, value):
  """A valid index of ``value``, in one of the forms `read` takes."""
  if not hasattr(value, "shape") and not isinstance(value, pz.nx.NamedArrayBase):
    return draw(st.sampled_from([..., (), {}, (...,)]))  # A Python scalar: whole.
  if isinstance(value, np.generic):
    return draw(st.sampled_from([..., (), {}]))
  names, positional = _structure(value)
  shape = np.shape(value.data_array if isinstance(value, pz.nx.NamedArrayBase) else value)
  form = draw(st.sampled_from(["whole", "tuple", "tuple", "one", "dict", "dict"]))
  if form == "whole" or not shape:
    return draw(st.sampled_from([..., (), {}]))
  if form == "one":
    return draw(parts(shape[0]))
  if form == "tuple":
    count = draw(st.integers(0, len(shape)))
    if not draw(st.booleans()):
      return tuple(draw(parts(n)) for n in shape[:count])
    before = draw(st.integers(0, count))  # Then ..., then the last dimensions.
    return (tuple(draw(parts(n)) for n in shape[:before]) + (...,)
            + tuple(draw(parts(n)) for n in shape[len(shape) - (count - before):]))
  dims = draw(st.lists(st.integers(0, len(shape) - 1), unique=True))
  index = {}
  for dim in dims:
    if names[dim] is not None:
      key = names[dim]
    else:
      at = positional.index(dim)
      key = draw(st.sampled_from([at, at - len(positional), np.int64(at)]))
    index[key] = draw(parts(shape[dim]))
  return index


def _per_dim(value, index):
  """``index`` as one part per stored dimension, and whether NumPy gives a
  scalar for it (ints everywhere, no ``...``)."""
  names, positional = _structure(value)
  rank = len(names)
  if isinstance(index, dict):
    per_dim = [slice(None)] * rank
    for key, part in index.items():
      per_dim[names.index(key) if key in names and key is not None
              else positional[int(key)]] = part
    return per_dim, bool(index)
  given = list(index) if isinstance(index, tuple) else [index]
  if ... in given:
    at = given.index(...)
    given[at:at + 1] = [slice(None)] * (rank - len(given) + 1)
    return given + [slice(None)] * (rank - len(given)), False
  return given + [slice(None)] * (rank - len(given)), True


def _expected(loaded, index):
  """The loaded value indexed as `read` documents, written without the library."""
  if not isinstance(loaded, np.ndarray | jax.Array | pz.nx.NamedArrayBase):
    return loaded  # A NumPy or Python scalar: only whole indexes are valid.
  data = loaded.data_array if isinstance(loaded, pz.nx.NamedArrayBase) else loaded
  per_dim, scalar = _per_dim(loaded, index)
  part = np.asarray(data)[tuple(per_dim)]
  kept = [dim for dim, p in enumerate(per_dim) if isinstance(p, slice)]
  if isinstance(data, jax.Array):
    part = jnp.asarray(np.asarray(part))
  elif not (scalar and not kept and not isinstance(loaded, pz.nx.NamedArrayBase)):
    part = np.asarray(part)
  if not isinstance(loaded, pz.nx.NamedArrayBase):
    return part
  new = {dim: at for at, dim in enumerate(kept)}
  names, positional = _structure(loaded)
  if isinstance(loaded, pz.nx.NamedArray):
    return pz.nx.NamedArray(
        named_axes=collections.OrderedDict(
            (names[dim], part.shape[new[dim]]) for dim in kept if names[dim] is not None),
        data_array=part)
  return pz.nx.NamedArrayView(
      data_shape=part.shape,
      data_axis_for_logical_axis=tuple(new[d] for d in positional if d in new),
      data_axis_for_name={n: new[d] for n, d in loaded.data_axis_for_name.items() if d in new},
      data_array=part)


def _bytes(x) -> bytes:
  return np.ascontiguousarray(np.asarray(x)).tobytes()


def assert_same(got, want, what: str) -> None:
  """Same class, kind, dtype, shape, axes (and their order) and bytes."""
  assert type(got) is type(want), f"{what}: {type(got)} is not {type(want)}"
  if isinstance(want, pz.nx.NamedArrayBase):
    if isinstance(want, pz.nx.NamedArray):
      assert list(got.named_axes.items()) == list(want.named_axes.items()), what
    else:
      assert got.data_shape == want.data_shape, what
      assert got.data_axis_for_logical_axis == want.data_axis_for_logical_axis, what
      assert list(got.data_axis_for_name.items()) == list(want.data_axis_for_name.items()), what
    assert got.positional_shape == want.positional_shape, what
    assert_same(got.data_array, want.data_array, f"{what}.data_array")
    return
  if isinstance(want, np.ndarray | np.generic | jax.Array):
    assert isinstance(got, jax.Array) == isinstance(want, jax.Array), what
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got, want)
    assert _bytes(got) == _bytes(want), (what, got, want)
    assert getattr(got, "weak_type", None) == getattr(want, "weak_type", None), what
    return
  assert got == want, what


def _penzai_agrees(got, loaded, index) -> None:
  """A dict index, as Penzai indexes the loaded value: positions as a
  positional index, names as a dict; the same axes and elements."""
  if not isinstance(loaded, pz.nx.NamedArrayBase) or not isinstance(index, dict):
    return
  if loaded.dtype.name in ("int4", "uint4", "uint2") + NUMPY_ONLY:
    return  # Penzai indexes through jnp: 32 bits at most (x64 is off), no sub-byte types.
  npos = len(loaded.positional_shape)
  positional = [slice(None)] * npos
  def plain(part):  # Penzai takes Python ints only.
    return part if isinstance(part, slice) else int(part)

  for key, part in index.items():
    if not isinstance(key, str):
      positional[int(key)] = plain(part)
  names = {key: plain(part) for key, part in index.items() if isinstance(key, str)}
  ref = loaded[tuple(positional)] if npos else loaded
  ref = ref[names] if names else ref
  assert dict(got.named_shape) == dict(ref.named_shape)
  assert got.positional_shape == ref.positional_shape
  order = sorted(got.named_shape)
  mine = np.asarray(got.untag_prefix(*order).with_positional_prefix().data_array) if order else \
      np.asarray(got.with_positional_prefix().data_array)
  theirs = np.asarray(ref.untag_prefix(*order).with_positional_prefix().data_array) if order \
      else np.asarray(ref.with_positional_prefix().data_array)
  assert _bytes(mine) == _bytes(theirs)


@hypothesis.settings(
    max_examples=int(os.environ.get("PZ_PERSIST_LAZY_READ_EXAMPLES", "30")),
    deadline=None, database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)
@hypothesis.given(st.data())
def test_a_lazy_read_is_the_load_indexed(data):
  saved = data.draw(st.lists(values(), min_size=1, max_size=4))
  tree = [pz.ParameterValue(value=v, label=f"v{i}") for i, v in enumerate(saved)]
  with tempfile.TemporaryDirectory() as tmp:
    pzp.save(f"{tmp}/ckpt", tree)
    loaded = [p.value for p in pzp.load(f"{tmp}/ckpt")]
    with pzp.open(f"{tmp}/ckpt") as ckpt:
      for i, value in enumerate(loaded):
        label = f"v{i}"
        assert_same(ckpt[label], value, f"ckpt[{label!r}]")
        assert_same(ckpt.read(label), value, f"read({label!r})")
        READS["values"] += 1
        for index in data.draw(st.lists(indexes(value), min_size=1, max_size=6)):
          got = ckpt.read(label, index, verify=data.draw(st.booleans()))
          assert_same(got, _expected(value, index), f"read({label!r}, {index!r})")
          _penzai_agrees(got, value, index)
          READS["reads"] += 1
  print(f"lazy reads checked so far: {dict(READS)}")


def test_a_view_in_another_order_reads_in_its_own_order(tmp_path):
  """The reported case: positional axes not in data order."""
  data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
  view = pz.nx.NamedArrayView(data_shape=(2, 3, 4), data_axis_for_logical_axis=(2, 0),
                              data_axis_for_name={"b": 1}, data_array=data)
  pzp.save(tmp_path / "c", {"v": pz.ParameterValue(value=view, label="v")})
  loaded = pzp.load(tmp_path / "c")["v"].value
  with pzp.open(tmp_path / "c") as ckpt:
    whole = ckpt.read("v")
    assert_same(whole, loaded, "read")
    assert whole.positional_shape == (4, 2)
    first = ckpt.read("v", {0: slice(1, 3)})  # Logical positional axis 0: data dimension 2.
    assert first.positional_shape == (2, 2)
    assert np.array_equal(first.with_positional_prefix().data_array,
                          view[1:3].with_positional_prefix().data_array)


def test_numpy_scalars_and_zero_d_arrays_keep_their_shape(tmp_path):
  tree = {"s": pz.ParameterValue(value=np.float32(2.5), label="s"),
          "z": pz.ParameterValue(value=np.array(3, np.int8), label="z"),
          "b": pz.ParameterValue(value=ml_dtypes.bfloat16(1.5), label="b"),
          "p": pz.ParameterValue(value=0.25, label="p")}
  pzp.save(tmp_path / "c", tree)
  with pzp.open(tmp_path / "c") as ckpt:
    assert_same(ckpt.read("s"), np.float32(2.5), "s")
    assert_same(ckpt.read("z"), np.array(3, np.int8), "z")
    assert_same(ckpt.read("z", ()), np.int8(3), "z[()]")  # As NumPy: a scalar.
    assert_same(ckpt.read("b"), ml_dtypes.bfloat16(1.5), "b")
    assert ckpt.read("p") == 0.25 and ckpt.read("p", {}) == 0.25


def test_a_whole_read_of_any_value_is_the_value(tmp_path):
  """Values that are not one array (a PRNG key, containers, several arrays):
  ``read(label)`` is ``ckpt[label]``; an index into them is refused by label."""
  tree = {"k": pz.ParameterValue(value=jax.random.key(3), label="k"),
          "t": pz.ParameterValue(value=(np.ones(2), np.zeros(3)), label="t"),
          "d": pz.ParameterValue(value={"w": np.arange(6.0).reshape(2, 3)}, label="d")}
  pzp.save(tmp_path / "c", tree)
  with pzp.open(tmp_path / "c") as ckpt:
    for label in ("k", "t", "d"):
      for whole in (..., {}, ()):
        got, want = ckpt.read(label, whole), ckpt[label]
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    assert jax.random.key_data(ckpt.read("k")).tolist() == jax.random.key_data(
        jax.random.key(3)).tolist()
    assert np.array_equal(ckpt.read("d", slice(1, 2)), np.arange(3.0, 6.0).reshape(1, 3))
    for label in ("k", "t"):
      with pytest.raises(pzp.errors.ArgumentError, match=rf"'{label}' holds .*ckpt\[label\]"):
        ckpt.read(label, 0)
