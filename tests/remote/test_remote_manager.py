"""CheckpointManager on object stores: saves, restores, retention, and a
dropped step whole or gone (its commit marker deleted first)."""

from __future__ import annotations

import jax.numpy as jnp
import model_zoo
import optax
import pytest
from penzai import pz
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist.storage import stores
from pz_persist.storage.lifecycle import steps


@pytest.fixture
def run(remote, store) -> str:
  """A run directory on a store Orbax can write arrays to."""
  if store.scheme == "s3":  # Orbax writes S3 arrays once helper s3's kvstore spec lands.
    pytest.importorskip("pz_persist.storage.stores.s3_kvstore").enable_orbax_s3()
  return f"{remote}/run"


def _committed(run: str) -> list[int]:
  """The steps pz_persist lists as committed (what ``pz-persist ls`` shows)."""
  return [s.step for s in steps.list_steps(run) if s.committed]


def _orbax_steps(run: str) -> list[int]:
  """The steps a fresh Orbax-backed manager finds (its own listing)."""
  with pzp.CheckpointManager(run) as manager:
    return manager.all_steps()


def test_save_restore_with_optimizer_and_retention(run):
  params = pz.unbind_params(model_zoo.mlp(), freeze=True)[1]
  opt = optax.adam(1e-3)
  with pzp.CheckpointManager(run, max_to_keep=2) as manager:  # Asynchronous.
    for step in range(4):
      manager.save(step, params=params, opt_state=opt.init(params), data={"step": step})
    manager.wait_until_finished()
    assert manager.all_steps() == [2, 3]
  assert _committed(run) == [2, 3]
  # Retention deleted the dropped steps whole: nothing of them is left.
  assert sorted({name.split("/")[0] for name in stores.for_path(run).tree(run)}) == ["2", "3"]
  with pzp.CheckpointManager(run) as manager:
    restored = manager.restore(optimizer=opt)
  assert_identical(restored["params"], params)
  assert type(restored["opt_state"][0]) is optax.ScaleByAdamState
  assert restored["data"] == {"step": 3}


def test_keep_best_and_synchronous_saves(run):
  losses = [5.0, 1.0, 4.0, 0.5, 9.0]
  with pzp.CheckpointManager(run, max_to_keep=1, keep_best=2, best_metric="loss",
                             async_save=False) as manager:
    for step, loss in enumerate(losses):
      manager.save(step, x=jnp.float32(step), metrics={"loss": loss})
    assert manager.all_steps() == [1, 3, 4]
    assert manager.best_step() == 3
  assert _committed(run) == _orbax_steps(run) == [1, 3, 4]


def test_a_step_whose_deletion_was_cut_is_gone_for_every_reader(run, monkeypatch):
  """Retention killed after the first request: pz_persist, Orbax and the
  next manager all see the step gone, never listed with files missing;
  the next manager removes what is left of it."""
  with pzp.CheckpointManager(run, async_save=False) as manager:
    for step in range(3):
      manager.save(step, x=jnp.float32(step))
  removed = []
  store = stores.for_path(run)
  real_remove = store.remove

  def killed_after_first(path):
    if removed:
      raise KeyboardInterrupt  # The process dies here.
    removed.append(str(path))
    real_remove(path)

  monkeypatch.setattr(store, "remove", killed_after_first)
  with pzp.CheckpointManager(run, async_save=False) as manager:
    with pytest.raises(KeyboardInterrupt):
      manager._manager._checkpoint_deleter.delete(2)  # pylint: disable=protected-access
  monkeypatch.undo()
  assert removed == [f"{run}/2/{steps.COMMIT_MARKER}"]  # The marker went first.
  assert any(name.startswith("2/x/") for name in stores.for_path(run).tree(run))  # Files remain.
  listed = {s.step: s.committed for s in steps.list_steps(run)}
  assert listed == {0: True, 1: True, 2: False}
  with pzp.CheckpointManager(run) as manager:
    assert manager.all_steps() == [0, 1]
    assert manager.restore() == {"x": jnp.float32(1)}
    manager.save(3, x=jnp.float32(3))  # Waits for Orbax's cleanup of the rest.
  assert not any(name.startswith("2/") for name in stores.for_path(run).tree(run))


def test_retention_deletes_the_marker_before_any_other_object(run, monkeypatch):
  """Orbax's own deletion on GCS goes object by object in listing order, the
  marker among them; pz_persist's first request is the marker's."""
  first = []
  store = stores.for_path(run)
  real_remove = store.remove

  def record(path):
    first.append(str(path))
    real_remove(path)

  monkeypatch.setattr(store, "remove", record)
  with pzp.CheckpointManager(run, max_to_keep=1, async_save=False) as manager:
    manager.save(0, x=jnp.float32(0))
    manager.save(1, x=jnp.float32(1))
  assert first == [f"{run}/0/{steps.COMMIT_MARKER}", f"{run}/0"]
