"""Outsider attacks on issue 38's new surfaces, kept as tests (round 5).

Each test is a class of hole found by using the extension surface, the
binding options, former names, the deprecation shims and the Penzai seam
as a user or a hostile checkpoint author would; the fix lives where the
guarantee is enforced, named in each test's docstring.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import threading
import warnings

import jax
import numpy as np
import pytest
from penzai import pz
from penzai.models.transformer.variants import gemma

import pz_persist as pzp
from hostile import catalogue
from pz_persist import errors
from pz_persist import extension
from pz_persist import model as model_lib
from pz_persist import penzai_seam
from pz_persist.storage.stores import local
from pz_persist.tools import cli


def _small_model():
  return pz.nn.Linear.from_config(
      name="l", init_base_rng=jax.random.key(0),
      input_axes={"i": 2}, output_axes={"o": 2})


def _publish(folder, name="config.json"):
  with extension.publishing_export(folder) as new:
    extension.write_small_file(new / name, b"{}")


def _precious_folder(tmp_path):
  folder = tmp_path / "mine"
  folder.mkdir()
  (folder / "notes.txt").write_text("precious")
  return folder


def _precious_file(tmp_path):
  path = tmp_path / "mine.txt"
  path.write_text("precious")
  return path


def _a_checkpoint(tmp_path):
  path = tmp_path / "ck"
  pzp.save_model(path, _small_model())
  return path


@pytest.mark.parametrize("make", [_precious_folder, _precious_file, _a_checkpoint],
                         ids=["someone's folder", "a file", "a checkpoint"])
def test_publishing_an_export_never_replaces_what_an_export_did_not_write(make, tmp_path):
  """`extension.publishing_export` replaced whatever was at its folder (a
  checkpoint, a user's folder, a file) when a loader called it without
  `check_export_destination` first: the guarantee "only what an export wrote
  may be replaced" lived in a check callers had to remember. It now lives
  in `extension.publishing_export` too (`extension._export_folder`,
  `destinations.check_replaceable`), checked before its identity is taken."""
  target = make(tmp_path)
  before = sorted(os.listdir(target)) if target.is_dir() else target.read_text()
  with pytest.raises(errors.CheckpointExistsError, match="export_hf|not a folder"):
    _publish(target)
  after = sorted(os.listdir(target)) if target.is_dir() else target.read_text()
  assert after == before
  assert sorted(os.listdir(tmp_path)) == sorted([target.name])  # No hidden leftovers.


@pytest.mark.parametrize("spell", [
    lambda tmp: str(_a_checkpoint(tmp) / "export"),
    lambda tmp: "gs://bucket/export",
    lambda tmp: "file://" + str(tmp / "export"),
    lambda tmp: str(tmp / "ex\0port"),
], ids=["inside a checkpoint", "a gs:// URL", "a file:// URL", "a NUL"])
@pytest.mark.parametrize("entry", ["check_export_destination", "publishing_export"])
def test_an_export_folder_no_export_may_write_is_refused_by_both_entry_points(
    spell, entry, tmp_path, monkeypatch):
  """`publishing_export("gs://b/x")` created the local folder ``gs:/b/x``
  in the working directory; it and `check_export_destination` let an export
  land inside a checkpoint; a NUL passed the check. Both now share
  `extension._export_folder` (local, then the destination rule)."""
  monkeypatch.chdir(tmp_path)
  folder = spell(tmp_path)
  listing = sorted(os.listdir(tmp_path))
  with pytest.raises(errors.ArgumentError):
    if entry == "publishing_export":
      _publish(folder)
    else:
      extension.check_export_destination(folder, overwrite=True)
  assert sorted(os.listdir(tmp_path)) == listing


class _Interrupted(BaseException):
  pass


@pytest.mark.parametrize("where", ["in the block", "at the move"])
def test_an_interrupted_export_leaves_no_trace(where, tmp_path, monkeypatch):
  """A failure of the move into place (a lock interrupted, a rename error)
  left the hidden ``.export-*`` folder beside the destination, and a failed
  export left the parent folders it had created. `publishing_export`
  removes both on any failure, wherever it comes from."""
  if where == "at the move":
    def fail(*args):
      raise _Interrupted()
    monkeypatch.setattr(local.LocalStore, "publish", fail)
  folder = tmp_path / "a" / "b" / "export"
  with pytest.raises(_Interrupted):
    with extension.publishing_export(str(folder)) as new:
      extension.write_small_file(new / "config.json", b"{}")
      if where == "in the block":
        raise _Interrupted()
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize("write", [
    lambda path: extension.write_small_file(path, b"{}"),
    lambda path: extension.writing_file(path).__enter__(),
], ids=["write_small_file", "writing_file"])
def test_the_extension_writers_hold_the_destination_rule(write, tmp_path):
  """`write_small_file` and `writing_file` wrote inside a checkpoint (over
  its own files too), and raised bare ``ValueError``/``IsADirectoryError``
  for a NUL or a folder. Both now go through `destinations.check_output`
  (without sources), so a loader's file never lands inside a checkpoint."""
  checkpoint = _a_checkpoint(tmp_path)
  files = sorted(os.listdir(checkpoint))
  for path in (checkpoint / "evil.json", checkpoint / files[0], tmp_path, str(tmp_path / "a\0b")):
    with pytest.raises(errors.ArgumentError):
      write(path)
  assert sorted(os.listdir(checkpoint)) == files


@dataclasses.dataclass(frozen=True)
class _Planned:
  key: str
  shape: tuple[int, ...]
  dtype: np.dtype = np.dtype(np.float32)

  def describe(self) -> str:
    return self.key


@pytest.mark.parametrize("hidden", [-(2**63), -1, float("nan"), 1.5])
def test_an_allocation_size_that_is_not_a_count_of_bytes_is_refused(hidden):
  """`check_allocation` summed the sizes, so one negative size (a loader's
  product of a damaged shape) hid a 2**63-byte array from the limit, and a
  NaN or fraction passed. `limits.check_allocation` refuses each size that
  is not an integer >= 0, naming the array, before summing."""
  arrays = [_Planned("huge", (2**61,)), _Planned("bad", (1,))]
  with pytest.raises(errors.UnsafeCheckpointError, match="'bad'"):
    extension.check_allocation(arrays, {"huge": 2**63, "bad": hidden}, where="f")


def test_the_extension_refuses_bad_arguments_with_its_own_errors():
  """`aligned_empty((-1,), ...)` raised ``OSError: Invalid argument`` from
  mmap and `variable_class("nope")` a bare ``KeyError``; now
  `host_memory.aligned_empty` and `extension.variable_class` raise
  `ArgumentError` saying what is allowed."""
  with pytest.raises(errors.ArgumentError, match="at least 0"):
    extension.aligned_empty((-1,), np.float32)
  with pytest.raises(errors.ArgumentError, match="parameter"):
    extension.variable_class("paramter")


def _bind_entry_points(checkpoint, model, tmp_path):
  """Every way binding options reach a load, each given ``**options``."""
  def deprecated_into(**options):
    with pytest.warns(DeprecationWarning, match="2027-06-01"):
      return pzp.load_model(checkpoint, into=model, **options)
  return {
      "load_into keywords": lambda **o: pzp.load_into(checkpoint, model, **o),
      "load_into options": lambda **o: pzp.load_into(checkpoint, model, pzp.BindOptions(**o)),
      "load_model(into=)": deprecated_into,
      "migrate": lambda **o: pzp.migrate(checkpoint, tmp_path / "migrated", model, **o),
  }


MISTYPED = {
    "allow_lossy='no'": ({"allow_lossy": "no", "dtype": np.float16}, "allow_lossy='no'"),
    "overlay='yes'": ({"overlay": "yes"}, "overlay='yes'"),
    "rename_axes=['i']": ({"rename_axes": ["i"]}, "rename_axes"),
    "sharding='cpu'": ({"sharding": "cpu"}, "sharding='cpu'"),
}


@pytest.mark.parametrize("case", list(MISTYPED))
@pytest.mark.parametrize("entry", ["load_into keywords", "load_into options",
                                   "load_model(into=)", "migrate"])
def test_a_mistyped_binding_option_is_refused_by_every_entry_point(case, entry, tmp_path):
  """``allow_lossy="no"`` (truthy) allowed the lossy casts it meant to
  refuse, ``overlay="yes"`` passed, and a list for ``rename_axes`` or a
  string for ``sharding`` failed deep in the read with ``AttributeError``.
  `BindOptions.__post_init__` refuses them wherever the value is made
  (`casts.lossy_allowed`, `sharding.check_target`)."""
  checkpoint = _a_checkpoint(tmp_path)
  options, named = MISTYPED[case]
  load = _bind_entry_points(checkpoint, _small_model(), tmp_path)[entry]
  with pytest.raises(errors.ArgumentTypeError, match=named.replace("[", r"\[")):
    load(**options)
  assert not (tmp_path / "migrated").exists()


@pytest.mark.parametrize("load", [
    lambda path: pzp.load_model(path, dtype=np.float16, allow_lossy="no"),
    lambda path: pzp.load_model(path, sharding="cpu"),
    lambda path: pzp.load(path, sharding=3),
    lambda path: extension.cast(np.ones(2) / 3, np.float16, allow_lossy="no", where="t"),
], ids=["load_model allow_lossy", "load_model sharding", "load sharding", "extension.cast"])
def test_a_mistyped_cast_or_placement_option_is_refused_without_binding(load, tmp_path):
  """The same options outside binding: `casts.lossy_allowed` (every cast
  asks it, `binding._cast_value` too) and `sharding.check_target` (every
  read's placements, `placements.placements`)."""
  with pytest.raises(errors.ArgumentTypeError):
    load(_a_checkpoint(tmp_path))


def test_a_misspelt_binding_option_names_its_close_match(tmp_path):
  """``onyl=`` listed all eight options but not the one meant;
  `BindOptions.with_keywords` now says ``did you mean only?``, through every
  entry point (they all build the options there)."""
  checkpoint = _a_checkpoint(tmp_path)
  for name, load in _bind_entry_points(checkpoint, _small_model(), tmp_path).items():
    if name == "load_into options":
      continue  # The dataclass itself names the keyword.
    with pytest.raises(errors.ArgumentTypeError, match="did you mean only"):
      load(onyl=["l.*"])
  with pytest.raises(errors.ArgumentTypeError, match="did you mean only"):
    pzp.load_model(checkpoint, onyl=["l.*"])


@pytest.mark.parametrize("module", ["mylib.layers", "pz_persist.pretrained.layers.scaled_rope"])
def test_diff_tells_two_classes_of_one_qualname_apart(module, tmp_path, capsys):
  """``diff`` compared classes by qualname only: a checkpoint whose layer
  claims ``mylib.layers.Linear`` (or a former name the table does not hold)
  diffed as identical to one holding Penzai's ``Linear``, though loading
  refuses one and not the other. `diff_tree._class_identity` compares the
  whole name, read through the former-name table, for the library's diff and
  the CLI's alike."""
  model = pz.nn.Sequential([_small_model()])
  pzp.save_model(tmp_path / "a", model)
  pzp.save_model(tmp_path / "b", model)
  catalogue.set_class(0, module, "Linear")(tmp_path / "a", None)
  text = str(pzp.diff(tmp_path / "a", tmp_path / "b"))
  assert "replaced" in text and f"{module}.Linear" in text, text
  capsys.readouterr()
  assert cli.main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
  assert f"{module}.Linear" in capsys.readouterr().out


@pytest.mark.parametrize("module,typo,meant", [
    ("pz_persist.binding", "BindingErorr", "BindingError"),
    ("pz_persist.binding", "BindOption", "BindOptions"),
    ("pz_persist.orbax.v0_handler", "DEFAULT_CHUNK_BYTE", "DEFAULT_CHUNK_BYTES"),
])
def test_a_typo_of_a_former_spelling_is_an_attribute_error_naming_the_close_ones(
    module, typo, meant):
  """A module ``__getattr__`` serving former spellings replaced Python's
  error with a bare "has no attribute", losing the "did you mean"; now
  `deprecations.missing` names the module's names (and former spellings)
  most like the typo, warns of nothing, and keeps ``name``/``obj`` set so
  Python's own suggestion works too."""
  held = importlib.import_module(module)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with pytest.raises(AttributeError, match=f"did you mean '{meant}'") as raised:
      getattr(held, typo)
    assert not hasattr(held, typo)
  assert raised.value.name == typo and raised.value.obj is held


def test_the_penzai_seam_hands_out_no_penzai_dict_to_edit():
  """`penzai_seam.gemma_presets()` was a read-only view of Penzai's table
  whose values were Penzai's own dicts: ``presets["gemma_2b"]["x"] = 1``
  changed every later Gemma conversion of the process. Each preset's
  keywords are read-only views now (`penzai_seam.gemma_presets`)."""
  table = gemma._GEMMA_PRESETS  # pylint: disable=protected-access
  before = {name: dict(kwargs) for name, kwargs in table.items()}
  for kwargs in penzai_seam.gemma_presets().values():
    with pytest.raises(TypeError):
      kwargs["num_decoder_blocks"] = 1  # type: ignore[index]
  assert {name: dict(kwargs) for name, kwargs in table.items()} == before


def _held(*variables):
  return pz.nn.Sequential(list(variables))


BINDABLE = {
    "one variable at two places": lambda p, q: _held(p, p),
    "a frozen value and a variable of one label": lambda p, q: _held(
        pz.ParameterValue(value=np.ones(2, np.float32), label="w"), q),
    "two frozen values of one label": lambda p, q: _held(
        pz.ParameterValue(value=np.ones(2, np.float32), label="w"),
        pz.ParameterValue(value=np.zeros(2, np.float32), label="w")),
    "two slots of one label": lambda p, q: _held(pz.ParameterSlot("w"), pz.ParameterSlot("w")),
}
UNBINDABLE = {
    "two parameters": lambda p, q: _held(p, q),
    "two state variables": lambda p, q: _held(
        pz.StateVariable(value=np.ones(2, np.float32), label="w"),
        pz.StateVariable(value=np.zeros(2, np.float32), label="w")),
    "a parameter and a state variable": lambda p, q: _held(
        p, pz.StateVariable(value=np.zeros(2, np.float32), label="w")),
    "nested models": lambda p, q: _held(_held(p), _held(_held(q))),
    "a slot and a variable": lambda p, q: _held(pz.ParameterSlot("w"), q),
}


@pytest.mark.parametrize("case", list(BINDABLE) + list(UNBINDABLE))
def test_a_model_save_model_accepts_is_one_load_model_rebuilds(case, tmp_path):
  """A parameter and a state variable of one label passed `save_model`
  (Penzai's slots differ in kind, so ``pz.unbind_variables`` accepts them)
  and then `load_model` and `load_into` refused the checkpoint as damaged
  (a manifest names variables by label alone). `model._check_bindable`
  now refuses, before writing, each model whose mutable variables share a
  label (however nested, of whichever kind), and every model it lets
  through loads back equal (frozen values and slots may share labels:
  nothing binds them)."""
  p = pz.Parameter(value=np.ones(2, np.float32), label="w")
  q = pz.Parameter(value=np.zeros(2, np.float32), label="w")
  model = {**BINDABLE, **UNBINDABLE}[case](p, q)
  if case in UNBINDABLE:
    with pytest.raises(errors.EncodingError, match="label of its own"):
      pzp.save_model(tmp_path / "m", model)
    assert not (tmp_path / "m").exists()
    return
  pzp.save_model(tmp_path / "m", model)
  loaded = pzp.load_model(tmp_path / "m")
  frozen, want = pz.freeze_params(loaded), pz.freeze_params(model)
  assert jax.tree_util.tree_structure(frozen) == jax.tree_util.tree_structure(want)
  for a, b in zip(jax.tree_util.tree_leaves(frozen), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  if case == "one variable at two places":
    assert loaded.sublayers[0] is loaded.sublayers[1]  # Still one variable.


def test_the_bindable_check_walks_a_model_once(monkeypatch):
  """`model._check_bindable` on a model of 5,000 variables calls
  ``pz.unbind_variables`` once (a count, not a time: linear by construction)."""
  calls = []
  unbind = pz.unbind_variables

  def counted(*args, **kwargs):
    calls.append(1)
    return unbind(*args, **kwargs)

  monkeypatch.setattr(model_lib.pz, "unbind_variables", counted)
  big = _held(*(pz.Parameter(value=np.zeros((), np.float32), label=f"p{i}") for i in range(5000)))
  model_lib._check_bindable("big", big)  # pylint: disable=protected-access
  assert len(calls) == 1


def test_concurrent_exports_to_one_folder_publish_one_whole(tmp_path):
  """Checked, not found broken: four threads publishing one folder at once
  (each waiting for the others before its move): one export is published
  whole, the others raise `ConcurrentSaveError` and leave nothing behind."""
  folder = tmp_path / "export"
  ready = threading.Barrier(4)
  outcomes: list[str] = []

  def publish(i: int) -> None:
    try:
      with extension.publishing_export(str(folder)) as new:
        extension.write_small_file(new / "config.json", str(i).encode())
        ready.wait()
      outcomes.append("published")
    except errors.ConcurrentSaveError:
      outcomes.append("refused")

  threads = [threading.Thread(target=publish, args=(i,)) for i in range(4)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert sorted(outcomes) == ["published"] + ["refused"] * 3
  assert os.listdir(tmp_path) == ["export"]
  assert sorted(os.listdir(folder)) == ["config.json", "pz_persist.export.json"]
