"""Cleaning leftovers never deletes anything outside the directory cleaned.

A leftover's entries, anything inside them, and its marker may be symlinks
planted to lead elsewhere; every deletion of `pz_persist.storage.leftovers` goes
through `leftovers.delete`, which removes links, never what they lead to.
A sentinel directory outside must survive every case, forced or not.
"""

from __future__ import annotations

import json
import os

import pytest

from pz_persist import errors
from pz_persist.storage import leftovers

_FAMILY = ".ckpt.pz_persist-new-0123abcd"


@pytest.fixture
def sentinel(tmp_path):
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "precious").write_text("keep me")
  yield outside
  assert (outside / "precious").read_text() == "keep me"


def _dead_marker() -> str:
  this = leftovers._this_writer()  # pylint: disable=protected-access
  return json.dumps(dict(this, pid=2**22 + 12345, start=None))  # No such pid.


def _run_dir(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  return run


def _plant_entry_symlink(run, sentinel):
  os.symlink(sentinel, run / f"{_FAMILY}.orbax-checkpoint-tmp")
  (run / f"{_FAMILY}.writer").write_text(_dead_marker())


def _plant_symlink_inside(run, sentinel):
  inside = run / f"{_FAMILY}.orbax-checkpoint-tmp" / "penzai"
  inside.mkdir(parents=True)
  os.symlink(sentinel, inside / "d")
  os.symlink(sentinel / "precious", inside / "file")
  (run / f"{_FAMILY}.writer").write_text(_dead_marker())


def _plant_marker_symlink(run, sentinel):
  (sentinel / "marker").write_text(_dead_marker())
  (run / f"{_FAMILY}.orbax-checkpoint-tmp").mkdir()
  os.symlink(sentinel / "marker", run / f"{_FAMILY}.writer")


def _plant_old_symlink(run, sentinel):
  (run / "ckpt").mkdir()
  os.symlink(sentinel, run / ".ckpt.pz_persist-old-99ff")


def _plant_tmp_step_symlink(run, sentinel):
  os.symlink(sentinel, run / "5.orbax-checkpoint-tmp-1")


@pytest.mark.parametrize("plant", [
    _plant_entry_symlink, _plant_symlink_inside, _plant_marker_symlink,
    _plant_old_symlink, _plant_tmp_step_symlink,
])
@pytest.mark.parametrize("force", [False, True])
def test_clean_never_deletes_through_symlinks(tmp_path, sentinel, plant, force):
  run = _run_dir(tmp_path)
  plant(run, sentinel)
  found = leftovers.find_all(run) + leftovers.find(run / "ckpt")
  assert found
  for leftover in found:
    leftovers.remove(leftover, force=force)
  assert sorted(os.listdir(sentinel)) == sorted(
      ["precious"] + (["marker"] if plant is _plant_marker_symlink else [])
  )


def test_a_symlinked_marker_proves_nothing(tmp_path, sentinel):
  """Its contents are not trusted: the family's writer counts as unknown."""
  run = _run_dir(tmp_path)
  _plant_marker_symlink(run, sentinel)
  [found] = leftovers.find(run / "ckpt")
  assert found.status == "unknown"
  assert leftovers.remove_dead(run / "ckpt") == []
  assert not leftovers.remove(found)


@pytest.mark.parametrize("status", ["dead", "unknown", "live"])
def test_remove_refuses_a_leftover_no_save_named(tmp_path, sentinel, status):
  """A hand-made `Leftover` whose name is no family's fails with a
  `PzPersistError` naming it (it raised a bare TypeError), deleting nothing."""
  run = _run_dir(tmp_path)
  (run / "ckpt").mkdir()
  made = leftovers.Leftover(
      name=run / "ckpt", entries=(run / "ckpt", sentinel), nbytes=0,
      status=status, reason="hand-made",
  )
  with pytest.raises(errors.ArgumentError, match="ckpt is not named like"):
    leftovers.remove(made, force=True)
  assert (run / "ckpt").is_dir()
