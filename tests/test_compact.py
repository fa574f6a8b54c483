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
