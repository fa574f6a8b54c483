"""Property-based round trips: random trees mixing every type and dtype."""

from __future__ import annotations

import collections
import dataclasses
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz
from penzai.nn import layer_stack
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import checksum_records
from pz_persist.format import encode
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import nodes
from pz_persist.safety import allowlist
from pz_persist.storage.reading import placements
from pz_persist.storage.reading import reader
from pz_persist.storage.reading import restoring

Pair = collections.namedtuple("Pair", ["first", "second"])


@functools.cache
def _jax_dtypes() -> tuple[str, ...]:
  """Dtypes this JAX backend can hold, without 64-bit types (x64 is off)."""
  names = []
  for name, dtype in arrays_lib.SUPPORTED_DTYPES.items():
    if name in ("float64", "int64", "uint64", "complex128"):
      continue
    try:
      jnp.zeros(1, dtype) + 0
    except Exception:  # pylint: disable=broad-exception-caught
      continue
    names.append(name)
  return tuple(names)


def _values(dtype: np.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if dtype.kind == "b":
    return np.asarray(rng.integers(0, 2, shape)).astype(bool)
  if dtype.kind in "iu" or "int" in dtype.name:  # ml_dtypes ints have kind "V".
    narrow = "int2" in dtype.name or "int4" in dtype.name
    low = 0 if dtype.name.startswith("u") else (-2 if narrow else -100)
    return np.asarray(rng.integers(low, 2 if narrow else 100, shape)).astype(dtype)
  values = np.asarray(rng.standard_normal(shape), np.float32) * 4
  if values.size:
    values.flat[0] = np.inf
  if dtype.kind == "c":
    out = np.empty(shape, dtype)
    out.real, out.imag = values, values * 0.5
    return out
  return values.astype(dtype)


@st.composite
def arrays(draw, *, allow_numpy=True):
  kind = draw(st.sampled_from(["jax", "numpy", "numpy_scalar"] if allow_numpy else ["jax"]))
  if kind == "jax":
    name = draw(st.sampled_from(_jax_dtypes()))
  else:
    name = draw(st.sampled_from(sorted(arrays_lib.SUPPORTED_DTYPES)))
  dtype = arrays_lib.SUPPORTED_DTYPES[name]
  shape = () if kind == "numpy_scalar" else tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
  values = _values(dtype, shape, draw(st.integers(0, 2**16)))
  if kind == "numpy_scalar":
    return values[()]
  if kind == "numpy":
    return values
  if draw(st.booleans()) and dtype.kind == "f" and shape == () and name in ("float32",):
    return jnp.asarray(float(values))  # Weakly typed.
  return jnp.asarray(values)


prng_keys = st.builds(
    lambda seed, impl, count: jax.random.split(jax.random.key(seed, impl=impl), count)
    if count else jax.random.key(seed, impl=impl),
    st.integers(0, 1000),
    st.sampled_from(sorted(nodes.PRNG_IMPLS)),
    st.integers(0, 3),
)

text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
label_text = st.text(alphabet="ab/._-0", min_size=1, max_size=10)
labels = st.one_of(
    label_text,
    st.builds(pz.AutoStateVarLabel, var_id=st.integers(0, 2**62)),
    st.builds(pz.ScopedStateVarLabel, group=st.one_of(st.none(), label_text, st.integers()), index=st.integers(0, 99)),
    st.tuples(label_text, st.integers(0, 5)),
)

static_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),  # NaN != NaN would make equal metadata unequal.
    text,
    st.binary(max_size=8),
    st.sampled_from(list(layer_stack.LayerStackVarBehavior)),
)
metadata = st.dictionaries(
    st.one_of(text, st.integers()),
    st.recursive(
        static_leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.tuples(inner, inner),
            st.dictionaries(text, inner, max_size=3),
        ),
        max_leaves=6,
    ),
    max_size=3,
)

axis_names = st.one_of(
    st.text(alphabet="abcxyz_", min_size=1, max_size=6),
    st.tuples(st.text(alphabet="abc", min_size=1, max_size=3), st.integers(0, 3)),
)


@st.composite
def named_arrays(draw):
  data = draw(arrays(allow_numpy=False))
  named_count = draw(st.integers(0, data.ndim))
  names = draw(st.lists(axis_names, min_size=named_count, max_size=named_count, unique=True))
  named = pz.nx.NamedArray(
      named_axes=collections.OrderedDict(
          zip(names, data.shape[data.ndim - named_count :])
      ),
      data_array=data,
  )
  if names and named_count == data.ndim and draw(st.booleans()):
    return named.untag(*draw(st.lists(st.sampled_from(names), min_size=1, unique=True)))
  return named


leaves = st.one_of(
    arrays(),
    prng_keys,
    named_arrays(),
    st.integers(),
    st.floats(),
    st.complex_numbers(),
    st.booleans(),
    text,
    st.binary(max_size=8),
)


@st.composite
def variable_values(draw, values):
  cls = draw(st.sampled_from([pz.ParameterValue, pz.StateVariableValue]))
  return cls(label=draw(labels), value=draw(values), metadata=draw(metadata))


def containers(children):
  return st.one_of(
      st.lists(children, max_size=3),
      st.lists(children, max_size=3).map(tuple),
      st.dictionaries(st.text(alphabet="kv", max_size=3), children, max_size=3),
      st.dictionaries(st.text(alphabet="kv", max_size=3), children, max_size=3).map(
          collections.OrderedDict
      ),
      st.builds(Pair, children, children),
  )


values = st.recursive(leaves, containers, max_leaves=6)
# A mutable variable converts its value with jnp.asarray: arrays only.
array_values = st.recursive(
    st.one_of(arrays(allow_numpy=False), prng_keys, named_arrays()),
    containers,
    max_leaves=4,
)
slots = st.one_of(
    st.builds(pz.ParameterSlot, label=labels),
    st.builds(pz.StateVariableSlot, label=labels),
)


@st.composite
def trees(draw):
  """A tree of values, frozen variables, slots and (possibly shared) mutables."""
  pool = []

  def mutable():
    if pool and draw(st.booleans()):
      return draw(st.sampled_from(pool))
    value = draw(array_values)
    if draw(st.booleans()):
      variable = pz.Parameter(label=draw(labels), value=value, metadata=draw(metadata))
    else:
      variable = pz.StateVariable(value, label=draw(labels), metadata=draw(metadata))
    pool.append(variable)
    return variable

  node = st.one_of(
      values,
      variable_values(values),
      slots,
      st.just(None).map(lambda _: mutable()),
  )
  return draw(st.recursive(node, containers, max_leaves=8))


def _in_memory_round_trip(tree):
  with allowlist.scoped_allowance([__name__]):
    encoded = encode.encode(tree)
    # Format 1: the codec alone, without the checksums a save computes (format
    # 2 requires them; test_disk_round_trips_random_trees covers saving).
    manifest = manifest_lib.Manifest(
        tree=encoded.tree, variables=tuple(encoded.variables), arrays=tuple(encoded.arrays),
        format_version=1,
    )
    parsed = manifest_lib.Manifest.loads(manifest.dumps(), where="memory")
    values = reader.values(
        parsed, encoded.stored_arrays(), where="memory",
        placed=placements.placements(parsed, None),
    )
    return restoring.decode(parsed, values, where="memory")


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(trees())
def test_codec_round_trips_random_trees(tree):
  assert_identical(_in_memory_round_trip(tree), tree)


def _compact_round_trip(tree):
  """Format 4 in memory: written compactly, parsed, its typed JSON expanded
  back equal to what was encoded, and decoded from its compact nodes."""
  with allowlist.scoped_allowance([__name__]):
    encoded = encode.encode(tree)
    specs = tuple(
        dataclasses.replace(spec, checksums=(checksum_records.ShardChecksum(
            checksum_records.full_index(spec.shape), "0" * 32),) if spec.is_stored else None)
        for spec in encoded.arrays
    )
    manifest = manifest_lib.Manifest(
        tree=encoded.tree, variables=tuple(encoded.variables), arrays=specs, format_version=4,
    )
    parsed = manifest_lib.Manifest.loads(manifest.dumps(), where="memory")
    assert parsed.compact is not None and parsed.arrays == specs
    decoded = restoring.decode(parsed, reader.values(
        parsed, encoded.stored_arrays(), where="memory",
        placed=placements.placements(parsed, None),
    ), where="memory")
    assert parsed.tree == encoded.tree  # Expanded on demand, as formats 1 to 3 say it.
    assert list(parsed.variables) == encoded.variables
    return decoded


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(trees())
def test_format_4_round_trips_random_trees(tree):
  assert_identical(_compact_round_trip(tree), tree)


@hypothesis.settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(tree=trees())
def test_disk_round_trips_random_trees(tree, tmp_path_factory):
  path = tmp_path_factory.mktemp("random") / "ckpt"
  pzp.save(path, tree, allow_modules=[__name__])
  assert_identical(pzp.load(path, allow_modules=[__name__]), tree)
  abstract = pzp.inspect(path, allow_modules=[__name__])
  frozen = pz.freeze_variables(tree)
  assert jax.tree.structure(abstract) == jax.tree.structure(frozen)
  for a, e in zip(jax.tree.leaves(abstract), jax.tree.leaves(frozen)):
    if isinstance(a, jax.ShapeDtypeStruct):
      assert (a.shape, a.dtype) == (np.shape(e), e.dtype)
    else:
      assert type(a) is type(e)
