"""A save that fails or is interrupted anywhere in the direct write path
(`pz_persist.storage.writing.direct_write`) leaves the previous checkpoint as it was.

The path has its own stages (issuing the writes, waiting for them, Orbax's
metadata files, the manifest); an error or Ctrl-C in each must end like one
in Orbax's path: the old checkpoint loads and verifies. And since no write
of the failed save outlives it (every write it issued has ended before the
error goes on, `direct_write.settle`), nothing of it is left at all: no
late write can create again what was deleted, or be deleted under the next
save (a hidden folder that stayed after the next save, on a loaded machine).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist.format import manifest as manifest_lib
from pz_persist.storage.writing import direct_write

OLD = {"a": jnp.zeros(3), "b": np.ones(2), "big": jnp.zeros((1100, 1024))}
NEW = {"a": jnp.ones(3), "b": np.zeros(2), "big": jnp.ones((1100, 1024))}

STAGES = {
    "issuing a raw write": (direct_write, "_c_bytes"),
    "waiting for the writes": (direct_write.Started, "finish"),
    "Orbax's metadata files": (direct_write, "orbax_files"),
    "the manifest": (manifest_lib, "write"),
}


@pytest.mark.parametrize("error", [OSError, KeyboardInterrupt])
@pytest.mark.parametrize("stage", sorted(STAGES))
def test_the_previous_checkpoint_survives(tmp_path, monkeypatch, stage, error):
  path = tmp_path / "ck"
  pzp.save(path, OLD)
  module, name = STAGES[stage]

  def fail(*args, **kwargs):
    raise error(f"injected at {stage}")

  slow = _SlowWrite()
  real_start = direct_write.start

  def start(*args, **kwargs):  # One more write, still under way when the stage fails.
    started = real_start(*args, **kwargs)
    return dataclasses.replace(started, writes=(*started.writes, slow))

  monkeypatch.setattr(direct_write, "start", start)
  monkeypatch.setattr(module, name, fail)
  with pytest.raises(error):
    pzp.save(path, NEW, overwrite=True)
  monkeypatch.undo()
  if stage not in ("issuing a raw write", "Orbax's metadata files"):  # Not inside `start`.
    assert slow.waited, "the save gave up while one of its writes was under way"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # At once: nothing in the background.
  assert_identical(pzp.load(path), OLD)
  pzp.verify(path)
  pzp.save(path, NEW, overwrite=True)
  assert_identical(pzp.load(path), NEW)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


class _SlowWrite:
  """A write that ends only once the save waits for it (a TensorStore future's
  ``exception`` / ``result`` / ``done``): records whether the save waited."""

  def __init__(self):
    self.waited = False

  def exception(self, *args, **kwargs):
    self.waited = True
    return None

  def result(self, *args, **kwargs):
    self.waited = True
    return None

  def done(self) -> bool:
    return self.waited


def _through_manager(tmp_path):
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, params=NEW)
    manager.wait_until_finished()


def _through_orbax_checkpointer(tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  with ocp.AsyncCheckpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
    checkpointer.save(tmp_path / "c", args=pzp.PenzaiSave(NEW))
    checkpointer.wait_until_finished()


def _through_save_model(tmp_path):
  import model_zoo  # pylint: disable=import-outside-toplevel

  pzp.save_model(tmp_path / "m", model_zoo.mlp())


@pytest.mark.parametrize("entry", [_through_manager, _through_orbax_checkpointer, _through_save_model],
                         ids=["CheckpointManager", "ocp.AsyncCheckpointer", "save_model"])
def test_no_write_outlives_a_failed_save_on_any_entry_point(tmp_path, monkeypatch, entry):
  """The save's background work waits for every write it issued before it
  ends, whichever entry point started it, so no write lands after the error."""
  slow = _SlowWrite()
  real_start = direct_write.start

  def start(*args, **kwargs):
    started = real_start(*args, **kwargs)
    return dataclasses.replace(started, writes=(*started.writes, slow))

  def fail(*args, **kwargs):
    assert not slow.waited  # Fails before the writes were waited for.
    raise OSError("injected while waiting for the writes")

  monkeypatch.setattr(direct_write, "start", start)
  monkeypatch.setattr(direct_write.Started, "finish", fail)
  with pytest.raises(Exception, match="injected while waiting for the writes"):
    entry(tmp_path)
  assert slow.waited
