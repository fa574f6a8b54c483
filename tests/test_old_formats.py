"""Checkpoints of every older manifest format load, bit for bit, for ever.

The fixtures under ``tests/fixtures/formats/`` were written by the release
named in their manifests (``make_fixtures.py`` says how) and are never
rewritten: each is loaded by every entry point and compared, bit for bit,
with the model built again today. A reader that stops reading a format, or
reads one differently, fails here.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil

import jax
import pytest
from penzai import pz
from treecompare import assert_identical
from treecompare import assert_same_model

import pz_persist as pzp
from pz_persist import checkpoint
from pz_persist.format import manifest as manifest_lib
from pz_persist.tools import cli

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "formats"
FORMATS = {"format1": 1, "format2": 2, "format3": 3}
WHOLE = ("format1", "format2")  # Saved by save_model: classes recorded.


def _fixture_model():
  spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.fixture_model()


@pytest.fixture(name="copy")
def _copy(tmp_path):
  """A copy of a fixture (readers take a lock file beside the checkpoint)."""
  def make(name: str) -> pathlib.Path:
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    return target
  return make


def _item(root: pathlib.Path) -> pathlib.Path:
  (manifest,) = root.rglob(manifest_lib.MANIFEST_FILENAME)
  return manifest.parent


def _variables(tree):
  kinds = (pz.Parameter, pz.StateVariable, pz.ParameterValue, pz.StateVariableValue)
  leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, kinds))
  return {leaf.label: leaf for leaf in leaves if isinstance(leaf, kinds)}


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_fixture_declares_its_format(name):
  raw = json.loads((_item(FIXTURES / name) / manifest_lib.MANIFEST_FILENAME).read_text())
  assert raw["format_version"] == FORMATS[name]
  assert checkpoint.read_manifest(FIXTURES / name).format_version == FORMATS[name]


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_entry_point_reads_it_bit_for_bit(name, copy, capsys):
  path = copy(name)
  expected = _fixture_model()
  saved = {label: v.freeze() for label, v in _variables(expected).items()}

  loaded = pzp.load(path)
  got = {label: v.freeze() for label, v in _variables(loaded).items()}
  assert got.keys() == saved.keys()
  for label, value in saved.items():
    assert_identical(got[label], value)

  abstract = _variables(pzp.inspect(path))
  assert abstract.keys() == saved.keys()
  for label, value in saved.items():
    named = abstract[label].value
    assert named.named_axes == value.value.named_axes, label
    assert named.data_array.dtype == value.value.data_array.dtype, label
    assert abstract[label].metadata == value.metadata, label

  into = pzp.load_into(path, expected)
  assert_same_model(into, expected)
  if name in WHOLE:
    whole = pzp.load_model(path)
    assert_same_model(whole, expected)  # Classes, fields, sharing, bits.

  report = pzp.verify(path)
  assert report.ok, report  # Format 1: nothing to check, and it says so.
  assert report.arrays_checked == (0 if FORMATS[name] == 1 else 7), report
  capsys.readouterr()
  for command in (["inspect", str(path)], ["inspect", "--json", str(path)]):
    assert cli.main(command) == 0, command
    out = capsys.readouterr().out
    assert "linear.weights" in out and "bfloat16" in out, command
  assert cli.main(["verify", str(path)]) == 0
  out = capsys.readouterr().out
  assert ("have no checksums" in out) == (FORMATS[name] == 1), out
