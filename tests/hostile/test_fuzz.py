"""Fuzzing the manifest: whatever the bytes, only pz_persist errors come out.

Valid manifests are mutated (fields deleted, values swapped for other JSON
types, random JSON put at random places, raw bytes truncated or flipped) and
parsed then decoded as `pzp.inspect` does. Each must either decode or raise
a `PzPersistError`: never a KeyError, TypeError, IndexError, RecursionError...
Deterministic (``derandomize``) and a few seconds long.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
import model_zoo
import numpy as np
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from penzai import pz

from pz_persist import errors
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import manifest_queries
from pz_persist.orbax import v0_handler
from pz_persist.storage.reading import restoring
from pz_persist.storage.writing import writer
from pz_persist.tools import diffing

WHERE = "fuzzed/pz_persist.json"
SETTINGS = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
    database=None,
)


@functools.cache
def _valid_manifests() -> tuple[bytes, ...]:
  """Manifests of a model and of a tree with most node types, as bytes."""
  tree = {
      "params": [
          pz.ParameterValue(
              label="p", value=pz.nx.wrap(jnp.ones((2, 3)), "a", "b"),
              metadata={"m": (1, 2.5, "s", None, b"x", np.float32(3))},
          ),
          pz.StateVariableValue(label=("s", 1), value=jnp.zeros(2)),
      ],
      "view": pz.nx.wrap(jnp.ones((2, 3)), "a", "b").untag("a"),
      "key": jax.random.key(0),
      "np": np.arange(3, dtype=np.int8),
      "scalar": np.float32(1.5),
      "slot": pz.ParameterSlot("p"),
      "var": pz.Parameter(label="v", value=jnp.ones(1)),
      "floats": [float("nan"), float("inf"), 1j],
      "dtype": jnp.dtype("float32"),
      "fn": jax.nn.relu,
  }
  return tuple(
      writer.encode_hashed(t)[0].dumps() for t in (model_zoo.mlp(), tree)
  )


def _check(data: bytes) -> None:
  """Parse and decode ``data``, and read it as ``pz-persist inspect`` and
  ``diff`` do; only pz_persist errors may escape."""
  try:
    manifest = manifest_lib.Manifest.loads(data, where=WHERE)
  except errors.PzPersistError:
    return
  valid = manifest_lib.Manifest.loads(_valid_manifests()[0], where=WHERE)
  for use in (
      lambda: restoring.abstract_tree(manifest, where=WHERE),
      lambda: [row.axes_text for row in manifest_queries.array_rows(manifest)],
      lambda: manifest_queries.variables(manifest, where=WHERE),
      lambda: diffing.structure_differences(manifest, valid),
      lambda: diffing.structure_differences(valid, manifest),
  ):
    try:
      use()
    except errors.PzPersistError:
      pass


def test_valid_manifests_decode():
  for data in _valid_manifests():
    manifest = manifest_lib.Manifest.loads(data, where=WHERE)
    restoring.abstract_tree(manifest, where=WHERE)


# Random JSON values, small.
json_values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
        st.sampled_from(["array", "struct", "variable", "named_array", "ref", "t",
                         "os", "system", "..", "/etc/passwd", "penzai.nn", "Linear"]),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(
            st.sampled_from(["t", "v", "ref", "items", "class", "module", "qualname",
                             "fields", "label", "value", "data", "axes", "shape"]),
            children, max_size=3,
        ),
    ),
    max_leaves=8,
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
  """Every path (sequence of keys / indices) into a JSON value."""
  found = [prefix]
  if isinstance(node, dict):
    for key, value in node.items():
      found += _paths(value, prefix + (key,))
  elif isinstance(node, list):
    for index, value in enumerate(node):
      found += _paths(value, prefix + (index,))
  return found


def _parent(root: Any, path: tuple) -> Any:
  for key in path[:-1]:
    root = root[key]
  return root


def _swap_type(value: Any) -> Any:
  """Some value of another JSON type, shaped like a common mistake."""
  if isinstance(value, bool):
    return int(value)
  if isinstance(value, int):
    return [float(value), str(value), bool(value), -value - 1, 2**64][value % 5]
  if isinstance(value, float):
    return int(value) if value == value and abs(value) < 1e18 else None
  if isinstance(value, str):
    return {"t": value}
  if isinstance(value, list):
    return {str(i): v for i, v in enumerate(value)}
  if isinstance(value, dict):
    return list(value.values())
  return True


@SETTINGS
@given(base=st.integers(0, 1), choice=st.integers(0, 10**9), value=json_values,
       action=st.sampled_from(["delete", "swap", "replace"]))
def test_mutated_json_fields(base, choice, value, action):
  raw = json.loads(_valid_manifests()[base])
  paths = [p for p in _paths(raw) if p]
  path = paths[choice % len(paths)]
  parent = _parent(raw, path)
  key = path[-1]
  if action == "delete":
    del parent[key]
  elif action == "swap":
    parent[key] = _swap_type(parent[key])
  else:
    parent[key] = value
  _check(json.dumps(raw).encode())


@SETTINGS
@given(base=st.integers(0, 1), data=st.data())
def test_mutated_bytes(base, data):
  raw = bytearray(_valid_manifests()[base])
  how = data.draw(st.sampled_from(["truncate", "flip", "insert"]))
  position = data.draw(st.integers(0, len(raw) - 1))
  if how == "truncate":
    del raw[position:]
  elif how == "flip":
    raw[position] ^= data.draw(st.integers(1, 255))
  else:
    raw[position:position] = data.draw(
        st.sampled_from([b"[", b"{", b"]", b"}", b",", b'"', b"NaN", b"-0", b"1e999",
                         b"\x00", b"\\u0000", b"\xff"])
    )
  _check(bytes(raw))


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(depth=st.sampled_from([200, 257, 300, 1000, 5000, 100_000]),
       opener=st.sampled_from(['[', '{"t":"list","items":[', '{"a":']))
def test_deep_nesting(depth, opener):
  closer = {"[": "]", '{"t":"list","items":[': "]}", '{"a":': "}"}[opener]
  raw = json.loads(_valid_manifests()[0])
  text = json.dumps(raw)
  nested = opener * depth + "1" + closer * depth
  _check(text.replace('"tree": {', f'"tree": {{"t": "list", "items": [{nested}], "x": ', 1).encode())
  start = text.index('"tree": ') + len('"tree": ')
  end = text.index(', "variables": ')
  _check((text[:start] + nested + text[end:]).encode())


_CONFUSIONS = (None, True, 0, -1, 2**64, 1.5, "", "x", [], {}, [[]], {"t": "list"})
"""A value of every JSON type, and the shapes most often mistaken for others."""


def test_every_field_confused_with_every_type():
  # Deterministic and exhaustive: each field of each valid manifest, in
  # turn, replaced by each value of `_CONFUSIONS`.
  for base in _valid_manifests():
    raw = json.loads(base)
    for path in [p for p in _paths(raw) if p]:
      for value in _CONFUSIONS:
        mutated = json.loads(base)
        parent = _parent(mutated, path)
        if parent[path[-1]] == value:
          continue
        parent[path[-1]] = value
        _check(json.dumps(mutated).encode())
