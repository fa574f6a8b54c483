"""Every hostile checkpoint of the catalogue is refused, clearly, by every loader.

Refused means: a pz_persist error of the expected class whose message names
the file, label or tree path at fault; never a bare KeyError / TypeError /
RecursionError / MemoryError, a hang or a crash; never a module imported that
the allow-list forbids; and never a model left changed or partly bound.
"""

from __future__ import annotations

import os
import sys

import jax
import model_zoo
import numpy as np
import pytest
from penzai import pz
from penzai.models import simple_mlp

import pz_persist as pzp
from hostile import catalogue
from pz_persist import errors

LOADERS = {
    catalogue.LOAD: lambda path, model: pzp.load(path),
    catalogue.INSPECT: lambda path, model: pzp.inspect(path),
    catalogue.LOAD_MODEL: lambda path, model: pzp.load_model(path),
    catalogue.INTO: lambda path, model: pzp.load_into(path, model),
    catalogue.LAZY: lambda path, model: pzp.open(path).load(),
    catalogue.LAZY_PARTS: lambda path, model: _read_parts(path),
}


def _read_parts(path) -> None:
  """Each variable of a `pzp.open` handle, and a slice of each, one by one:
  each reads, or refuses with a pz_persist error (the damage may lie in
  another variable), never a bare error, a hang or a crash."""
  with pzp.open(path) as ckpt:
    for label in ckpt.labels:
      for read in (lambda: ckpt[label], lambda: ckpt.read(label, slice(0, 2))):
        try:
          read()
        except errors.PzPersistError:
          pass


def _refuses(case, entry) -> bool:
  if entry == catalogue.LAZY:
    return catalogue.LOAD in case.entry_points
  if entry == catalogue.LAZY_PARTS:
    return False  # Harmless or a pz_persist error (see `_read_parts`).
  return entry in case.entry_points


def _fresh_model() -> pz.nn.Layer:
  """The catalogue's model with other values, so a bind would show."""
  return simple_mlp.MLP.from_config(
      name="mlp", init_base_rng=jax.random.key(7), feature_sizes=[8, 16, 8]
  )


def _snapshot(model) -> list:
  """The model's variables: which objects, and their values."""
  _, variables = pz.unbind_variables(model)
  return [
      (id(var), var.label, [np.asarray(x) for x in jax.tree.leaves(var.value)])
      for var in variables
  ]


def _same(a: list, b: list) -> bool:
  return len(a) == len(b) and all(
      x[:2] == y[:2] and all(np.array_equal(p, q) for p, q in zip(x[2], y[2]))
      for x, y in zip(a, b)
  )


def test_catalogue_is_large_and_names_are_unique():
  names = [case.name for case in catalogue.CASES]
  assert len(names) >= 32
  assert len(set(names)) == len(names)
  for case in catalogue.CASES:
    classes = case.error if isinstance(case.error, tuple) else (case.error,)
    assert all(issubclass(c, errors.PzPersistError) for c in classes), case.name
    assert case.entry_points <= catalogue.ALL and case.entry_points, case.name


@pytest.mark.timeout(120)  # A FIFO or /dev/zero read by mistake would hang.
# TensorStore's failed reads leave callbacks for Orbax's closed event loop.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("case", catalogue.CASES, ids=lambda case: case.name)
def test_hostile_checkpoint_is_refused(case, tmp_path, monkeypatch):
  ckpt = tmp_path / "ckpt"
  pzp.save_model(ckpt, model_zoo.mlp())
  case.build(ckpt, monkeypatch)
  if case.unimported:
    assert case.unimported not in sys.modules
  target = _fresh_model()
  before = _snapshot(target)
  for entry, loader in LOADERS.items():
    if _refuses(case, entry):
      with pytest.raises(case.error, match=case.match) as info:
        loader(ckpt, target)
      assert isinstance(info.value, errors.PzPersistError)
    else:  # Harmless here: loads, or refuses with a pz_persist error.
      try:
        loader(ckpt, target)
      except errors.PzPersistError:
        pass
    assert _same(_snapshot(target), before), f"{entry} changed the model"
  if case.unimported:
    assert case.unimported not in sys.modules


def test_catalogue_builds_from_a_valid_checkpoint(tmp_path):
  """The base checkpoint loads through every loader (so failures are the cases')."""
  ckpt = tmp_path / "ckpt"
  pzp.save_model(ckpt, model_zoo.mlp())
  target = _fresh_model()
  for loader in LOADERS.values():
    loader(ckpt, target)


def test_symlink_to_the_whole_checkpoint_is_fine(tmp_path):
  ckpt = tmp_path / "ckpt"
  pzp.save_model(ckpt, model_zoo.mlp())
  link = tmp_path / "link"
  link.symlink_to(ckpt)
  assert isinstance(pzp.load_model(link), pz.nn.Layer)
  assert isinstance(pzp.load_model(link / "penzai"), pz.nn.Layer)
  pzp.inspect(link)


def test_symlink_inside_the_checkpoint_is_fine(tmp_path):
  ckpt = tmp_path / "ckpt"
  pzp.save_model(ckpt, model_zoo.mlp())
  files = catalogue.data_files(ckpt)
  moved = ckpt / "penzai" / "moved_data"
  os.rename(files[-1], moved)
  files[-1].symlink_to(os.path.relpath(moved, files[-1].parent))
  pzp.load_model(ckpt)


def test_a_label_is_a_name_never_a_path(tmp_path):
  """A label spelled like a path, consistently in the whole manifest, is only a
  name: it loads as it is, and nothing is read or written where it points."""
  ckpt = tmp_path / "ckpt"
  pzp.save(ckpt, [pz.ParameterValue(label="../../../etc/x", value=np.ones(3))])
  data = catalogue.read_manifest(ckpt)
  assert data["arrays"][0]["label"] == "../../../etc/x"
  assert "/" not in data["arrays"][0]["key"] and ".." not in data["arrays"][0]["key"]
  before = sorted(os.listdir(tmp_path))
  (loaded,) = pzp.load(ckpt)
  assert loaded.label == "../../../etc/x"
  assert sorted(os.listdir(tmp_path)) == before


def test_labels_with_control_characters_are_not_saved(tmp_path):
  with pytest.raises(errors.EncodingError, match=r"label 'a\\x00b' holds control"):
    pzp.save(tmp_path / "ckpt", [pz.ParameterValue(label="a\x00b", value=np.ones(3))])
  assert not (tmp_path / "ckpt").exists()


def test_disallowed_module_is_not_imported_in_a_fresh_process(tmp_path):
  """Checked in a fresh interpreter too, where nothing imported it before."""
  ckpt = tmp_path / "ckpt"
  pzp.save_model(ckpt, model_zoo.mlp())
  catalogue.set_class(0, "antigravity", "fly")(ckpt, None)
  from conftest import run_python  # pylint: disable=g-import-not-at-top

  out = run_python(f"""
      import sys
      import pz_persist as pzp
      try:
        pzp.load({str(ckpt)!r})
      except pzp.errors.DisallowedModuleError as e:
        print("refused", "antigravity" in sys.modules)
  """, timeout=120)
  assert out.strip() == "refused False"
