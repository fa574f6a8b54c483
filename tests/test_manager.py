"""CheckpointManager: items, retention, metrics, intervals, optimizer states."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import model_zoo
import optax
import pytest
from penzai import pz
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist import errors


def _params():
  return pz.unbind_params(model_zoo.mlp(), freeze=True)[1]


def test_save_and_restore_any_items(tmp_path):
  params = _params()
  opt = optax.adamw(optax.exponential_decay(1e-3, 10, 0.5))
  opt_state = opt.init(params)
  items = {
      "params": params,
      "opt_state": opt_state,
      "rng": jax.random.key(4),
      "data": {"epoch": 2, "position": 1536, "files": ["a.tfrecord", "b.tfrecord"]},
  }
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    assert manager.save(10, **items, metrics={"loss": 0.5})
    manager.wait_until_finished()
    restored = manager.restore()
  assert set(restored) == set(items)
  for name, tree in items.items():
    assert_identical(restored[name], tree)
  assert type(restored["opt_state"][0]) is optax.ScaleByAdamState
  assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(opt_state)


def test_save_is_asynchronous_by_default(tmp_path):
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, params=_params())
    manager.save(2, params=_params())  # Waits for step 1's write first.
    manager.wait_until_finished()
    assert manager.all_steps() == [1, 2]
  with pzp.CheckpointManager(tmp_path / "sync", async_save=False) as manager:
    manager.save(1, params=_params())
    assert manager.all_steps() == [1]


def test_latest_steps_are_kept(tmp_path):
  with pzp.CheckpointManager(tmp_path / "run", max_to_keep=2) as manager:
    for step in range(5):
      manager.save(step, x=jnp.float32(step))
    manager.wait_until_finished()
    assert manager.all_steps() == [3, 4] and manager.latest_step() == 4


@pytest.mark.parametrize("mode, best", [("min", [1, 3]), ("max", [0, 4])])
def test_best_steps_are_kept_by_metric(tmp_path, mode, best):
  losses = [5.0, 1.0, 4.0, 0.5, 9.0]
  with pzp.CheckpointManager(
      tmp_path / "run", max_to_keep=1, keep_best=2, best_metric="loss", best_mode=mode
  ) as manager:
    for step, loss in enumerate(losses):
      manager.save(step, x=jnp.float32(step), metrics={"loss": loss})
    manager.wait_until_finished()
    steps = manager.all_steps()
    assert steps == sorted(set(best) | {4})  # Best two plus the latest.
    assert manager.best_step() == (3 if mode == "min" else 4)
    assert manager.metrics(manager.best_step()) == {"loss": 0.5 if mode == "min" else 9.0}


def test_every_nth_step_is_kept(tmp_path):
  with pzp.CheckpointManager(tmp_path / "run", max_to_keep=1, keep_every_n_steps=4) as manager:
    for step in range(10):
      manager.save(step, x=jnp.float32(step))
    manager.wait_until_finished()
    assert manager.all_steps() == [0, 4, 8, 9]


def test_save_interval_and_force(tmp_path):
  with pzp.CheckpointManager(tmp_path / "run", save_interval_steps=5) as manager:
    saved = [manager.save(step, x=jnp.float32(step)) for step in range(12)]
    assert manager.save(12, x=jnp.float32(12), force=True)
    manager.wait_until_finished()
    assert [s for s, ok in enumerate(saved) if ok] == [0, 5, 10]
    assert manager.all_steps() == [0, 5, 10, 12]


def test_restore_a_step_and_some_items(tmp_path):
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    for step in (1, 2):
      manager.save(step, a=jnp.float32(step), b=[step])
    manager.wait_until_finished()
    assert manager.restore(1) == {"a": jnp.float32(1), "b": [1]}
    assert manager.restore(2, items=["b"]) == {"b": [2]}
    assert manager.item_names(2) == ["a", "b"]
    with pytest.raises(errors.NotACheckpointError, match="no step 7; it has \\[1, 2\\]"):
      manager.restore(7)
    with pytest.raises(errors.NotACheckpointError, match="no item\\(s\\) \\['c'\\]"):
      manager.restore(2, items=["c"])


def test_empty_directory_and_bad_arguments(tmp_path):
  with pzp.CheckpointManager(tmp_path / "run", best_metric="loss") as manager:
    assert manager.latest_step() is None and manager.all_steps() == []
    with pytest.raises(errors.NotACheckpointError, match="no checkpoint yet"):
      manager.restore()
    with pytest.raises(ValueError, match="at least one item"):
      manager.save(1)
    with pytest.raises(ValueError, match="reserved"):
      manager.save(1, metrics={"loss": 1.0}, descriptor=1)
    with pytest.raises(ValueError, match="lack best_metric 'loss'"):
      manager.save(1, x=1, metrics={"acc": 1.0})
    with pytest.raises(errors.EncodingError, match=r"tree\['f'\]"):
      manager.save(1, x={"f": object()})
    assert manager.all_steps() == []
  with pytest.raises(ValueError, match="keep_best needs best_metric"):
    pzp.CheckpointManager(tmp_path / "other", keep_best=2)


def test_optimizer_state_is_checked_against_the_optimizer(tmp_path):
  params = _params()
  adam = optax.adam(optax.exponential_decay(1e-3, 10, 0.5))
  state = adam.init(params)
  state = adam.update(jax.tree.map(jnp.ones_like, params), state, params)[1]
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, params=params, opt_state=state)
    manager.wait_until_finished()
    restored = manager.restore(optimizer=adam)
    assert_identical(restored["opt_state"], state)
    assert int(restored["opt_state"][1].count) == 1
    # Adam without the schedule: its state lacks the schedule's count.
    with pytest.raises(
        errors.OptimizerMismatchError,
        match=r"has EmptyState at state\[1\], the restored state has ScaleByScheduleState",
    ):
      manager.restore(optimizer=optax.adam(1e-3))


def test_retention_removes_a_step_in_one_rename(tmp_path, monkeypatch):
  """Orbax deletes a step file by file; killed half-way, the step would look
  whole but not load. Steps leave in one rename instead; the trash is emptied
  afterwards, by this manager or the next."""
  run = tmp_path / "run"
  monkeypatch.setattr(pzp.training.manager.safe_io, "empty_directory", lambda path: None)  # Never emptied.
  with pzp.CheckpointManager(run, max_to_keep=1) as manager:
    for step in range(3):
      manager.save(step, x=jnp.float32(step))
    manager.wait_until_finished()
    assert manager.all_steps() == [2]
  assert sorted(p.name for p in run.iterdir()) == [".pz_persist-run.lock", ".pz_persist_deleted", "2"]
  assert sorted(p.name for p in (run / ".pz_persist_deleted").iterdir()) == ["0", "1"]
  monkeypatch.undo()
  with pzp.CheckpointManager(run) as manager:
    assert manager.restore() == {"x": jnp.float32(2)}
  assert list((run / ".pz_persist_deleted").iterdir()) == []
