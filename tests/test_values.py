"""Every value type and dtype pz_persist supports comes back exactly."""

from __future__ import annotations

import collections
import json

import jax
import jax.numpy as jnp
import numpy as np
import manifest_json
import pytest
from penzai import pz
from penzai.nn import layer_stack
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist.format import array_specs as arrays_lib

DTYPES_32 = [
    name for name in arrays_lib.SUPPORTED_DTYPES
    if name not in ("float64", "int64", "uint64", "complex128")
]


def _sample(dtype: np.dtype, shape=(2, 3)) -> np.ndarray:
  count = int(np.prod(shape))
  if dtype == np.bool_:
    return (np.arange(count) % 3 == 0).reshape(shape)
  values = np.arange(count) % 4
  return values.astype(dtype).reshape(shape)


@pytest.mark.parametrize("dtype_name", sorted(arrays_lib.SUPPORTED_DTYPES))
def test_numpy_arrays_every_dtype(dtype_name, ckpt):
  dtype = arrays_lib.SUPPORTED_DTYPES[dtype_name]
  tree = {"x": _sample(dtype), "scalar": _sample(dtype, ())[()]}
  pzp.save(ckpt, tree)
  loaded = pzp.load(ckpt)
  assert_identical(loaded, tree)
  assert type(loaded["x"]) is np.ndarray


@pytest.mark.parametrize("dtype_name", DTYPES_32)
def test_jax_arrays_every_dtype(dtype_name, ckpt):
  try:
    x = jnp.asarray(_sample(arrays_lib.SUPPORTED_DTYPES[dtype_name])) + 0
  except Exception:  # pylint: disable=broad-exception-caught
    pytest.skip(f"this JAX backend has no {dtype_name} arrays")
  tree = {"x": x, "named": pz.nx.wrap(x, "rows", "cols")}
  pzp.save(ckpt, tree)
  assert_identical(pzp.load(ckpt), tree)


def test_jax_64_bit_arrays(ckpt):
  with jax.enable_x64(True):
    tree = [jnp.arange(3, dtype=dt) for dt in ("float64", "int64", "uint64", "complex128")]
    pzp.save(ckpt, tree)
    assert_identical(pzp.load(ckpt), tree)


def test_64_bit_jax_array_without_x64_is_refused(ckpt):
  with jax.enable_x64(True):
    pzp.save(ckpt, {"x": jnp.arange(3, dtype=jnp.float64)})
  with pytest.raises(pzp.PzPersistError, match=r"jax_enable_x64.*\['x'\]|\['x'\].*jax_enable_x64"):
    pzp.load(ckpt)


def test_prng_keys(ckpt):
  tree = {
      "typed": jax.random.key(3),
      "batch": jax.random.split(jax.random.key(4), 5),
      "rbg": jax.random.key(5, impl="rbg"),
      "raw": jax.random.PRNGKey(6),
  }
  pzp.save(ckpt, tree)
  loaded = pzp.load(ckpt)
  assert_identical(loaded, tree)
  assert jax.random.key_impl(loaded["rbg"]) == jax.random.key_impl(tree["rbg"])


def test_weak_type_is_kept(ckpt):
  tree = {"weak": jnp.sqrt(8.0), "weak_vec": jnp.zeros(3) + 1.0, "strong": jnp.float32(2.0)}
  assert tree["weak"].weak_type
  pzp.save(ckpt, tree)
  loaded = pzp.load(ckpt)
  assert_identical(loaded, tree)
  # Weak types change promotion: bfloat16 stays bfloat16 only with a weak scalar.
  assert (jnp.ones(2, jnp.bfloat16) * loaded["weak"]).dtype == jnp.bfloat16


def test_named_arrays_and_views(ckpt):
  base = jnp.arange(24.0).reshape(2, 3, 4)
  tree = {
      "named": pz.nx.wrap(base, "a", "b", "c"),
      "positional_prefix": pz.nx.NamedArray(
          named_axes=collections.OrderedDict(c=4), data_array=base
      ),
      "view": pz.nx.wrap(base, "a", "b", "c").untag("b"),
      "reordered_view": pz.nx.wrap(base, "a", "b", "c").untag_prefix("c"),
      "scalar_named": pz.nx.wrap(jnp.float32(1.5)),
      "tuple_axis_names": pz.nx.wrap(base, ("tuple", 1), ("x", ("y",)), "c"),
  }
  assert isinstance(tree["view"], pz.nx.NamedArrayView)
  pzp.save(ckpt, tree)
  loaded = pzp.load(ckpt)
  assert_identical(loaded, tree)
  assert list(loaded["named"].named_axes) == ["a", "b", "c"]


def test_variable_values_slots_and_labels(ckpt):
  label_with_separators = "transformer/blocks.0/attn.query/w"
  tree = [
      pz.ParameterValue(label=label_with_separators, value=pz.nx.wrap(jnp.ones(3), "x")),
      pz.StateVariableValue(
          label=pz.ScopedStateVarLabel(group="decode", index=2),
          value=(jnp.zeros(2), {"count": jnp.int32(3)}),
          metadata={"layerstack_axes": {"blocks": layer_stack.LayerStackVarBehavior.PER_LAYER}},
      ),
      pz.StateVariable(jnp.ones(2)),  # AutoStateVarLabel
      pz.ParameterSlot(label="slot/label"),
      pz.StateVariableSlot(label=pz.ScopedStateVarLabel(group=None, index=0)),
      pz.Parameter(
          label=("tuple", 1),
          value=jnp.ones(2),
          metadata={1: frozenset({"a"}), "nested": [None, True, 2.5, b"raw", np.float32(0.5)]},
      ),
  ]
  pzp.save(ckpt, tree)
  loaded = pzp.load(ckpt)
  assert_identical(loaded, tree)
  assert isinstance(loaded[2].label, pz.AutoStateVarLabel)
  assert loaded[1].metadata["layerstack_axes"]["blocks"] is layer_stack.LayerStackVarBehavior.PER_LAYER


def test_python_values_and_containers(ckpt):
  tree = {
      "scalars": (1, -2**70, 2.5, -0.0, float("inf"), float("nan"), 1 + 2j, True, None),
      "text": ["plain", "ünïcode", b"\x00\xff"],
      "ordered": collections.OrderedDict([("z", 1), ("a", 2)]),
      "int_keys": {3: [], 1: {}, 2: ()},
  }
  pzp.save(ckpt, tree)
  loaded = pzp.load(ckpt)
  assert_identical(loaded, tree)
  assert list(loaded["ordered"]) == ["z", "a"]
  assert isinstance(loaded["scalars"], tuple)


Point = collections.namedtuple("Point", ["x", "y"])


def test_namedtuple_needs_its_module_allowed(ckpt):
  tree = {"p": Point(jnp.ones(2), 3)}
  with pytest.raises(pzp.errors.DisallowedModuleError, match=r"tree\['p'\].*allow_modules"):
    pzp.save(ckpt, tree)
  assert not ckpt.exists()

  pzp.save(ckpt, tree, allow_modules=[__name__])
  with pytest.raises(pzp.errors.DisallowedModuleError):
    pzp.load(ckpt)
  loaded = pzp.load(ckpt, allow_modules=[__name__])
  assert_identical(loaded, tree)
  assert type(loaded["p"]) is Point


def test_zero_size_arrays(ckpt):
  tree = {
      "jax": jnp.zeros((0, 3), jnp.bfloat16),
      "np": np.zeros((2, 0), np.int8),
      "named": pz.nx.wrap(jnp.zeros((0, 4)), "empty", "x"),
  }
  pzp.save(ckpt, tree)
  assert_identical(pzp.load(ckpt), tree)


def test_tree_without_arrays(ckpt):
  tree = {"step": 3, "name": "run-1", "nothing": None}
  pzp.save(ckpt, tree)
  assert pzp.load(ckpt) == tree
  assert pzp.inspect(ckpt) == tree


def test_manifest_records_what_the_issue_asks(ckpt):
  """Kind, label, metadata, axis layout, shape and dtype of every value."""
  value = pz.ParameterValue(
      label="w", value=pz.nx.wrap(jnp.ones((2, 3), jnp.bfloat16), "a", "b"),
      metadata={"lr_scale": 0.5},
  )
  pzp.save(ckpt, [value])
  written = json.loads((ckpt / "penzai" / "pz_persist.json").read_text())
  assert written["format"] == "pz_persist"
  assert written["format_version"] == pzp.format.manifest.WRITTEN_FORMAT
  manifest = manifest_json.read(ckpt / "penzai" / "pz_persist.json")  # As formats 2 and 3 say it.
  node = manifest["tree"]["items"][0]
  assert node["t"] == "parameter_value"
  assert node["label"] == {"t": "str", "v": "w"}
  assert node["metadata"]["items"][0][1] == {"t": "float", "v": 0.5}
  assert [axis[0]["v"] for axis in node["value"]["axes"]] == ["a", "b"]
  (array,) = manifest["arrays"]
  assert array["shape"] == [2, 3] and array["dtype"] == "bfloat16"
  assert array["label"] == "w"
