"""Checkpoints written by every release load, bit for bit, for ever.

Each folder of ``tests/fixtures/releases/`` holds a checkpoint that the
release it is named for wrote (``make_release_fixture.py``, README.md there)
of a model holding every layer class of `pz_persist.nn`, and the description
of that model (``expected.json``). Loaded with today's code, every fixture
must give that same description (classes, static fields, and every
variable's bytes), with each class found under its current name: a class
that moves keeps loading under its former name through the recorded table
of `pz_persist.format.former_names`, and a move without its entry fails here.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import pathlib
import pkgutil
import shutil
from typing import Any

import orbax.checkpoint as ocp
import pytest
from conftest import run_python
from orbax.checkpoint import v1 as ocp_v1

import pz_persist as pzp
import pz_persist.nn
from pz_persist.format import former_names
from pz_persist.format import manifest as manifest_lib
from pz_persist.tools import cli

RELEASES = pathlib.Path(__file__).parent / "fixtures" / "releases"
FIXTURES = sorted(p.name for p in RELEASES.iterdir() if (p / "expected.json").is_file())
NEWEST = FIXTURES[-1]  # Release names sort as their numbers do while below 0.10.

NEW_SINCE_NEWEST_FIXTURE: frozenset[str] = frozenset({
    "pz_persist.nn.learned_positions.AddLearnedPositions",
    "pz_persist.nn.clip_values.ClipValues",
    "pz_persist.nn.longrope.ApplyPhimoeLongRoPE",
    "pz_persist.nn.mamba.Mamba",
    "pz_persist.nn.mamba.CachingMamba",
    "pz_persist.nn.mamba2.Mamba2",
    "pz_persist.nn.mamba2.FalconH1Mamba2",
    "pz_persist.nn.altup.AltUpExpand",
    "pz_persist.nn.altup.AltUpCollapse",
    "pz_persist.nn.altup.AltUpRouter",
    "pz_persist.nn.altup.AltUpLayer",
    "pz_persist.nn.altup.LaurelResidual",
    "pz_persist.nn.altup.GaussianTopK",
    "pz_persist.nn.per_layer_inputs.PerLayerInputsInTable",
    "pz_persist.nn.mixture_of_experts.SparseMixerRouter",
    "pz_persist.nn.mixture_of_experts.LatentMixtureOfExperts",
    "pz_persist.nn.mamba2.CachingMamba2",
    "pz_persist.nn.recurrent_state.CachingRecurrent",
    "pz_persist.nn.recurrent_state.Recurrent",
    "pz_persist.nn.short_conv.ShortConv",
    "pz_persist.nn.short_conv.CachingShortConv",
    "pz_persist.nn.xielu.XIELU",
    "pz_persist.nn.kimi_delta_attention.KimiDeltaAttention",
    "pz_persist.nn.kimi_delta_attention.CachingKimiDeltaAttention",
    "pz_persist.nn.sparse_attention.AppendIndexKey",
    "pz_persist.nn.sparse_attention.IndexedQuery",
    "pz_persist.nn.sparse_attention.IndexerScores",
    "pz_persist.nn.sparse_attention.SparseAttentionLogits",
    "pz_persist.nn.sparse_attention.PublishingSparseAttentionLogits",
    "pz_persist.nn.sparse_attention.SharedChoiceLogits",
    "pz_persist.nn.latent_attention.SizedPick",
})
"""Classes of `pz_persist.nn` added since the newest fixture's release (by
``module.qualname``): each must be in the next release's fixture, and
leaves this set when that fixture is added."""


def _generator() -> Any:
  path = RELEASES / "make_release_fixture.py"
  spec = importlib.util.spec_from_file_location("make_release_fixture", path)
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _expected(release: str) -> dict[str, Any]:
  return json.loads((RELEASES / release / "expected.json").read_text())


def _current(name: str) -> str:
  """``module.qualname`` under the name it has now, through the table only."""
  for (module, qualname), now in former_names.FORMER_NAMES.items():
    if name == f"{module}.{qualname}":
      return ".".join(now)
  return name


def _renamed(description: Any) -> Any:
  """``description`` with each class named as it is now."""
  if isinstance(description, dict):
    return {
        key: _current(value) if key in ("class", "enum") else _renamed(value)
        for key, value in description.items()
    }
  if isinstance(description, list):
    return [_renamed(item) for item in description]
  return description


def _classes(description: Any) -> set[str]:
  if isinstance(description, dict):
    found = {description["class"]} if isinstance(description.get("class"), str) else set()
    return found.union(*(_classes(v) for v in description.values()))
  if isinstance(description, list):
    return set().union(*(_classes(item) for item in description))
  return set()


def _nn_classes() -> set[str]:
  """Every public class `pz_persist.nn` defines."""
  names = set()
  for info in pkgutil.iter_modules(pz_persist.nn.__path__, prefix="pz_persist.nn."):
    module = importlib.import_module(info.name)
    for name, value in vars(module).items():
      if inspect.isclass(value) and value.__module__ == info.name and not name.startswith("_"):
        names.add(f"{info.name}.{value.__qualname__}")
  return names


@pytest.fixture(name="copy")
def _copy(tmp_path):
  """A copy of a fixture's checkpoint (readers take a lock beside it)."""
  def make(release: str) -> pathlib.Path:
    target = tmp_path / release
    shutil.copytree(RELEASES / release / "model", target)
    return target
  return make


@pytest.mark.parametrize("release", FIXTURES)
def test_the_fixture_was_written_by_its_release(release):
  expected = _expected(release)
  assert expected["release"] == release
  assert release.startswith(expected["written_by"]), expected["written_by"]
  (manifest,) = (RELEASES / release / "model").rglob(manifest_lib.MANIFEST_FILENAME)
  assert json.loads(manifest.read_text())["writer"] == f"pz_persist {expected['written_by']}"


@pytest.mark.parametrize("release", FIXTURES)
def test_every_entry_point_loads_it_bit_for_bit(release, copy, capsys):
  path = copy(release)
  describe = _generator().describe
  want = _renamed(_expected(release)["model"])
  assert describe(pzp.load_model(path)) == want
  assert describe(pzp.load(path)) == want
  assert describe(pzp.open(path).load()) == want
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    assert describe(checkpointer.restore(path).penzai) == want
  assert describe(ocp_v1.load_checkpointables(path)["penzai"]) == want
  assert pzp.verify(path).ok
  capsys.readouterr()
  assert cli.main(["inspect", str(path)]) == 0
  assert "sinks/sinks" in capsys.readouterr().out


@pytest.mark.parametrize("release", FIXTURES)
def test_every_class_is_found_under_its_current_name(release, copy):
  """Each class the manifest names is the class its name has now: itself,
  or through the table (never a guess), and each moved one is in
  `pz_persist.nn`."""
  loaded = _classes(_generator().describe(pzp.load_model(copy(release))))
  written = _classes(_expected(release)["model"])
  assert loaded == {_current(name) for name in written}
  for name in written:
    module, _, qualname = name.rpartition(".")
    if former_names.is_former(module, qualname):
      now_module, now_qualname = former_names.current_name(module, qualname)
      cls = vars(importlib.import_module(now_module))[now_qualname]
      assert (cls.__module__, cls.__qualname__) == (now_module, now_qualname)
      assert now_module.startswith("pz_persist.nn."), name
  assert _nn_classes() & loaded, "the fixture holds no layer of pz_persist.nn"


def test_former_names_load_in_a_fresh_process_without_pretrained(copy):
  """``import pz_persist`` imports neither ``pz_persist.pretrained`` nor the
  layers; loading a checkpoint that names them by their former names imports
  the current modules only (listed in `allowlist.IMPORTABLE_MODULES`)."""
  out = run_python(f"""
      import sys
      import pz_persist as pzp
      assert not [m for m in sys.modules if m.startswith(("pz_persist.nn", "pz_persist.pretr"))]
      model = pzp.load_model({str(copy(NEWEST))!r})
      print(type(model.sublayers[0]).__module__)
      print(sorted({{m.split(".")[1] for m in sys.modules if m.startswith("pz_persist.pre")}}))
  """)
  assert out.split("\n")[:2] == ["pz_persist.nn.attention_sinks", "[]"], out


@pytest.mark.parametrize("release", FIXTURES)
def test_saved_again_it_names_current_classes_and_diffs_as_equal(release, copy, tmp_path):
  """Saving what a fixture loads writes each class's current name, and
  ``diff`` between the two finds no difference: a move changes no model."""
  path = copy(release)
  again = tmp_path / "again"
  pzp.save_model(again, pzp.load_model(path))
  (manifest,) = again.rglob(manifest_lib.MANIFEST_FILENAME)
  assert "pz_persist.pretrained" not in manifest.read_text()
  result = pzp.diff(path, again, progress=False)
  assert result.identical, result.table()


def test_every_nn_class_is_in_the_newest_fixture_or_declared_new():
  covered = {_current(name) for name in _classes(_expected(NEWEST)["model"])}
  missing = _nn_classes() - covered - NEW_SINCE_NEWEST_FIXTURE
  assert not missing, (
      f"{sorted(missing)} are in no release fixture: add them to the next release's"
      " (tests/fixtures/releases/README.md) and to NEW_SINCE_NEWEST_FIXTURE until then."
  )
  assert not NEW_SINCE_NEWEST_FIXTURE & covered, "already in a fixture"
  assert NEW_SINCE_NEWEST_FIXTURE <= _nn_classes(), "not a class of pz_persist.nn"


@pytest.mark.parametrize("release", FIXTURES)
def test_the_fixture_stays_small(release):
  """The repository carries one per release, for ever: tiny sizes only."""
  size = sum(f.stat().st_size for f in (RELEASES / release).rglob("*") if f.is_file())
  assert size < 200_000, size
