"""Manifest format 4 (`pz_persist.format.compact`): what it writes, and that
reading it gives what formats 1 to 3 gave."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax.numpy as jnp
import model_zoo
from penzai import pz

import pz_persist as pzp
from pz_persist import checkpoint
from pz_persist.format import manifest as manifest_lib

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "formats"


def _tree(count: int):
  return [
      pz.ParameterValue(
          value=pz.nx.wrap(jnp.full((2, 3), i, jnp.float32), "rows", "cols"),
          label=f"block_{i}.w", metadata={"lr_scale": 0.5, "tags": ("a", "b")},
      )
      for i in range(count)
  ]


def test_repeated_values_are_written_once(tmp_path):
  pzp.save(tmp_path / "c", _tree(50))
  raw = json.loads((tmp_path / "c" / "penzai" / manifest_lib.MANIFEST_FILENAME).read_text())
  assert raw["format_version"] == 4
  text = json.dumps(raw)
  assert text.count('"rows"') == 1 and text.count("lr_scale") == 1
  assert raw["arrays"]["shapes"] == [[2, 3]] and raw["arrays"]["dtypes"] == ["float32"]
  assert raw["arrays"]["count"] == 50 and len(raw["arrays"]["checksums"]) == 50


def test_a_shared_mutable_value_loads_as_one_object_per_use(tmp_path):
  pzp.save(tmp_path / "c", _tree(3))
  for loaded in (pzp.load(tmp_path / "c"), pzp.inspect(tmp_path / "c")):
    first, second = loaded[0].metadata, loaded[1].metadata
    assert first == second == {"lr_scale": 0.5, "tags": ("a", "b")}
    assert first is not second  # As inline values loaded, in formats 1 to 3.
    first["lr_scale"] = 2.0
    assert second["lr_scale"] == 0.5


def test_half_the_bytes_of_format_2_for_the_same_content(tmp_path):
  pzp.save_model(tmp_path / "c", model_zoo.llamalike_transformer())
  manifest = checkpoint.read_manifest(tmp_path / "c")
  compact = len(manifest.dumps())
  older = len(dataclasses.replace(manifest, format_version=2).dumps())
  assert compact * 2 < older, (compact, older)


def test_an_older_manifest_rewritten_as_format_4_says_the_same():
  older = checkpoint.read_manifest(FIXTURES / "format2")
  rewritten = manifest_lib.Manifest.loads(
      dataclasses.replace(older, format_version=4).dumps(), where="memory")
  assert rewritten.arrays == older.arrays
  assert rewritten.tree == older.tree and rewritten.variables == older.variables
  leaf = checkpoint.read_manifest(FIXTURES / "format3")
  assert leaf.leaf_keys
  again = manifest_lib.Manifest.loads(
      dataclasses.replace(leaf, format_version=4).dumps(), where="memory")
  assert again.leaf_keys and again.arrays == leaf.arrays and again.tree == leaf.tree


def test_the_tree_is_expanded_only_when_asked(tmp_path):
  pzp.save(tmp_path / "c", _tree(2))
  manifest = checkpoint.read_manifest(tmp_path / "c")
  assert "tree" not in vars(manifest)  # Loading and inspecting never ask.
  pzp.inspect(tmp_path / "c")
  assert manifest.tree["t"] == "list" and "tree" in vars(manifest)


def _mutations(value, rng, count):
  """``count`` copies of ``value`` (JSON), each with one random list element
  replaced by a value a damaged manifest might hold there."""
  import copy

  slots = []

  def walk(node):
    if isinstance(node, list):
      for i, item in enumerate(node):
        slots.append((node, i))
        walk(item)

  walk(value)
  out = []
  for _ in range(count if slots else 0):
    target = rng.randrange(len(slots))
    replacement = rng.choice([-1, 0, 1, 7, 999, True, None, 1.5, "x", [], [0], [99], [[0]]])
    copied = copy.deepcopy(value)
    slots.clear()
    walk(copied)
    node, i = slots[target]
    node[i] = replacement
    out.append(copied)
  return out


def test_the_fast_node_check_passes_exactly_what_the_naming_check_passes(tmp_path):
  """`_Checker.fast` (no location text) decides what `_Checker.check` decides
  on damaged trees, variables and shared entries: a manifest it passes is
  never refused by the check that names where, and one it refuses is."""
  import random

  from pz_persist import errors
  from pz_persist.format import compact

  tree = [
      pz.ParameterValue(
          value=pz.nx.wrap(jnp.zeros((2, 3)), "rows", "cols"), label=f"w{i}",
          metadata={"lr_scale": 0.5, "tags": ("a", "b"), "n": None},
      )
      for i in range(3)
  ]
  state = pz.StateVariable(jnp.zeros(()), label="count", metadata={"k": [1, 2]})
  pzp.save_model(tmp_path / "c", pz.nn.Sequential([pz.nn.Identity(), *tree, state]))
  raw = json.loads((tmp_path / "c" / "penzai" / manifest_lib.MANIFEST_FILENAME).read_text())
  assert raw["variables"] and raw["shared"]
  checker = compact._Checker(raw, "m", 4)  # pylint: disable=protected-access
  rng = random.Random(0)
  decided = {True: 0, False: 0}
  roots = [(raw["tree"], 0, False), (raw["variables"][0][3], 1, False)]
  roots += [(entry, 0, True) for entry in raw["shared"]]
  for root, depth, in_shared in roots:
    for damaged in [root, *_mutations(root, rng, 150)]:
      fast = checker.fast(damaged, depth, in_shared) >= 0  # (Its depth, or -1.)
      try:
        checker.check(damaged, "node", depth, in_shared)
        passed = True
      except errors.ManifestError:
        passed = False
      assert fast == passed, damaged
      decided[passed] += 1
  assert decided[True] > 10 and decided[False] > 10, decided
