"""The node table is the one place node types are declared: every consumer
(encoder, decoder, catalog, diff, viewer) must handle every row of it.

Adding a row to `nodes.NODE_TYPES` without a decode function, an encoding,
the children the tools walk or the axes the viewer names fails here.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from pz_persist import errors
from pz_persist.format import decode as decode_lib
from pz_persist.format import encode as encode_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import manifest_queries
from pz_persist.format import nodes
from pz_persist.safety import allowlist
from pz_persist.tools import diff_tree
from pz_persist.tools import diffing

Pair = collections.namedtuple("Pair", ["first", "second"])


class Color(enum.Enum):
  RED = 1


@dataclasses.dataclass
class Box:
  content: Any


def _named() -> pz.nx.NamedArray:
  return pz.nx.wrap(jnp.arange(6.0).reshape(2, 3)).tag("rows", "cols")


SAMPLES: dict[str, Any] = {
    "none": None,
    "bool": True,
    "int": 3,
    "float": 1.5,
    "complex": 1 + 2j,
    "str": "s",
    "bytes": b"\x00\x01",
    "np_scalar": pz.ParameterValue(
        value=jnp.zeros(1), label="np", metadata={"x": np.float32(2.0)}
    ),
    "list": [jnp.ones(2)],
    "tuple": (jnp.ones(2),),
    "set": pz.ParameterValue(value=jnp.zeros(1), label="set", metadata={"s": {1, 2}}),
    "frozenset": pz.ParameterValue(
        value=jnp.zeros(1), label="fs", metadata={"s": frozenset({1})}
    ),
    "namedtuple": Pair(jnp.ones(2), jnp.zeros(3)),
    "dict": {"a": jnp.ones(2)},
    "ordered_dict": collections.OrderedDict(a=jnp.ones(2)),
    "struct": pz.nn.Linear(
        weights=pz.Parameter(
            value=pz.nx.wrap(jnp.ones((2, 3))).tag("i", "o"), label="lin.w"
        ),
        in_axis_names=("i",),
        out_axis_names=("o",),
    ),
    "dataclass": Box(jnp.ones(2)),
    "enum": {"c": Color.RED, "x": jnp.ones(1)},
    "dtype": {"d": np.dtype("float32"), "x": jnp.ones(1)},
    "type": {"t": pz.nn.Linear, "x": jnp.ones(1)},
    "function": {"f": jax.nn.relu, "x": jnp.ones(1)},
    "partial": {"p": functools.partial(jax.nn.gelu, approximate=True), "x": jnp.ones(1)},
    "mesh": {"m": jax.make_mesh((1,), ("data",)), "x": jnp.ones(1)},
    "partition_spec": {"p": jax.sharding.PartitionSpec(("data", "model"), None), "x": jnp.ones(1)},
    "named_sharding": {
        "s": jax.sharding.NamedSharding(
            jax.make_mesh((1, 1), ("data", "model")), jax.sharding.PartitionSpec("model")
        ),
        "x": jnp.ones(1),
    },
    "array": jnp.ones(2),
    "prng_key": jax.random.key(0),
    "named_array": _named(),
    "named_array_view": _named().untag("rows"),
    "parameter_value": pz.ParameterValue(value=jnp.ones(2), label="pv"),
    "state_variable_value": pz.StateVariableValue(value=jnp.ones(2), label="sv"),
    "parameter_slot": pz.ParameterSlot(label="slot"),
    "state_variable_slot": pz.StateVariableSlot(label="sslot"),
    "variable": pz.StateVariable(value=jnp.ones(2), label="var"),
}
"""For every tag, a value whose encoding holds a node of that tag."""


def _encoded(tag: str) -> encode_lib.EncodedTree:
  with allowlist.scoped_allowance([__name__]):
    return encode_lib.encode(SAMPLES[tag])


def _all_dicts(value: Any) -> list[dict[str, Any]]:
  """Every JSON object in ``value``, found without the node table."""
  if isinstance(value, dict):
    return [value, *(d for v in value.values() for d in _all_dicts(v))]
  if isinstance(value, list):
    return [d for v in value for d in _all_dicts(v)]
  return []


def _manifest(encoded: encode_lib.EncodedTree) -> manifest_lib.Manifest:
  return manifest_lib.Manifest(
      tree=encoded.tree, variables=tuple(encoded.variables), arrays=tuple(encoded.arrays)
  )


def test_every_node_type_has_a_sample():
  assert set(SAMPLES) == set(nodes.NODE_TYPES), (
      "add a value to SAMPLES for each new node type"
  )


def test_every_node_type_has_one_decode_function():
  assert set(decode_lib.DECODERS) == set(nodes.NODE_TYPES)


@pytest.mark.parametrize("tag", sorted(nodes.NODE_TYPES))
def test_encoder_emits_each_node_type_as_the_table_says(tag):
  encoded = _encoded(tag)
  found = [
      d for d in _all_dicts([encoded.tree, encoded.variables]) if d.get("t") == tag
  ]
  assert found, f"encoding SAMPLES[{tag!r}] made no {tag!r} node"
  for node in found:
    assert list(node) == ["t", *(f.name for f in nodes.NODE_TYPES[tag].fields)]
    nodes.check_shape(node, "tree")


@pytest.mark.parametrize("tag", sorted(nodes.NODE_TYPES))
def test_decoder_round_trips_each_node_type(tag):
  encoded = _encoded(tag)
  with allowlist.scoped_allowance([__name__]):
    decoded = decode_lib.decode(
        encoded.tree, encoded.variables, encoded.values,
        labels=[spec.label for spec in encoded.arrays],
    )
    again = encode_lib.encode(decoded)
  assert json.dumps([again.tree, again.variables]) == json.dumps(
      [encoded.tree, encoded.variables]
  )


@pytest.mark.parametrize("tag", sorted(nodes.NODE_TYPES))
def test_catalog_finds_every_array_under_each_node_type(tag):
  """The catalog walks children through the table: an array under a field the
  table does not mark as holding children would be missed by every tool."""
  encoded = _encoded(tag)
  manifest = _manifest(encoded)
  roots = [encoded.tree, *(entry["value"] for entry in encoded.variables)]
  by_table = sorted(
      ref for root in roots for ref in manifest_queries.array_refs(root)
  )
  by_brute_force = sorted(
      d["ref"] for d in _all_dicts(roots) if d.get("t") == "array"
  )
  assert by_table == by_brute_force
  assert sum(n.get("t") == "array" for n in manifest_queries.all_nodes(manifest)) == len(by_brute_force)


@pytest.mark.parametrize("tag", sorted(nodes.NODE_TYPES))
def test_viewer_names_the_axes_of_each_named_node_type(tag):
  """Each node type that decodes to a NamedArray must name its array's axes in
  the table of arrays (`manifest_queries.array_rows`, what `describe_checkpoint` prints)."""
  encoded = _encoded(tag)
  with allowlist.scoped_allowance([__name__]):
    decoded = decode_lib.decode(
        encoded.tree, encoded.variables, [spec.abstract() for spec in encoded.arrays],
        abstract=True,
    )
  leaves = jax.tree.leaves(decoded, is_leaf=nodes.fits_its_axes)
  expected = {
      name for x in leaves if nodes.fits_its_axes(x) for name in x.named_shape
  }
  rows = manifest_queries.array_rows(_manifest(encoded))
  assert {name for row in rows for name in row.axes if name is not None} == expected


@pytest.mark.parametrize("tag", sorted(nodes.NODE_TYPES))
def test_diff_sees_a_changed_array_under_each_node_type(tag):
  """The diff descends into every node type's children (or describes the
  node as a whole): a changed array shape below any node is reported."""
  encoded = _encoded(tag)
  a = _manifest(encoded)
  assert diffing.structure_differences(a, a) == []
  if not encoded.arrays:
    return
  changed = tuple(
      dataclasses.replace(spec, shape=(*spec.shape, 7)) for spec in encoded.arrays
  )
  b = dataclasses.replace(a, tree=copy.deepcopy(a.tree), arrays=changed)
  differences = diffing.structure_differences(a, b)
  assert differences and all(", 7])" in d for d in differences), differences


@pytest.mark.parametrize("tag", sorted(nodes.NODE_TYPES))
def test_diff_tree_reaches_every_array_under_each_node_type(tag):
  """The tree `pzp.diff` renders (`diff_tree.Matcher`) reaches every array
  below any node type as a leaf to compare, and notes a changed shape there."""
  encoded = _encoded(tag)
  a = _manifest(encoded)
  names = diff_tree.array_names(a)
  same = diff_tree.Matcher(a, a, (names, names)).build()
  same.settle()
  assert same.status == "unchanged"
  assert {n.refs for n in same.walk() if n.refs != (None, None)} == {
      (i, i) for i in range(len(encoded.arrays))}
  if not encoded.arrays:
    return
  changed = tuple(
      dataclasses.replace(spec, shape=(*spec.shape, 7)) for spec in encoded.arrays
  )
  b = dataclasses.replace(a, tree=copy.deepcopy(a.tree), arrays=changed)
  tree = diff_tree.Matcher(a, b, (names, diff_tree.array_names(b))).build()
  leaves = [n for n in tree.walk() if n.refs != (None, None)]
  assert len(leaves) == len(encoded.arrays)
  assert all(any(note.startswith("shape") and ", 7]" in note for note in n.notes)
             for n in leaves), [n.notes for n in leaves]


def test_node_refuses_fields_the_table_does_not_list():
  with pytest.raises(AssertionError):
    nodes.node("int", v=1, extra=2)
  assert list(nodes.node("complex", im=1.0, re=2.0)) == ["t", "re", "im"]


def test_location_names_the_file_and_the_path():
  location = errors.Location("/ckpt/item", "variables[0] (label 'a: b')", "a: b")
  assert str(location) == "/ckpt/item: variables[0] (label 'a: b')"
  assert str(location.joined(".value")) == "/ckpt/item: variables[0] (label 'a: b').value"
  assert str(errors.Location(None, "tree")) == "tree"


def test_variables_table_is_named_in_its_file_even_when_a_label_holds_colons():
  """The decoder used to find the file by splitting the root's text at its
  last ': ', which a label holding ': ' cut in the wrong place."""
  manifest = _manifest(_encoded("variable"))
  variables = list(manifest.variables)
  broken = dict(variables[0], kind="neither")
  with pytest.raises(errors.ManifestError) as raised:
    decode_lib.decode(
        manifest.tree, [broken], [jnp.ones(2)],
        root=errors.Location("/ckpt/item", "tree (label 'x: y').value"),
    )
  assert str(raised.value) == (
      "/ckpt/item: variables[0]: unknown variable kind 'neither'."
  )


@pytest.mark.parametrize(
    "tag", sorted(t for t, row in nodes.NODE_TYPES.items() if row.field("class"))
)
def test_diff_names_the_class_of_each_node_type_that_has_one(tag):
  encoded = _encoded(tag)
  a = _manifest(encoded)
  tree = copy.deepcopy(a.tree)
  variables = copy.deepcopy(list(a.variables))
  for node in _all_dicts([tree, variables]):
    if node.get("t") == tag:
      node["class"]["qualname"] = "Other"
  b = dataclasses.replace(a, tree=tree, variables=tuple(variables))
  differences = diffing.structure_differences(a, b)
  assert differences and all("Other" in d for d in differences), differences


def test_duplicate_label_message_names_the_first_variable_when_labels_hold_colons():
  """The catalog used to find the first variable's place by splitting its
  text at ': ', which cut a label holding ': ' in two."""
  entry = {
      "kind": "parameter",
      "label": {"t": "str", "v": "a: b"},
      "metadata": {"t": "dict", "items": []},
      "value": {"t": "none"},
  }
  manifest = manifest_lib.Manifest(
      tree={"t": "list", "items": []}, variables=(entry, dict(entry)), arrays=()
  )
  with pytest.raises(errors.ManifestError) as raised:
    manifest_queries.variables(manifest, where="/ckpt/item")
  assert str(raised.value) == (
      "/ckpt/item: variables[1] has label 'a: b', like variables[0] (label"
      " 'a: b'); labels of variables must be unique."
  )
