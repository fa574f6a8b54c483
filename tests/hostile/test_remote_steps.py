"""A CheckpointManager step on an object store is whole or gone.

Deleting a step there takes one request per object; a run killed part-way
through retention (or a reader listing the steps meanwhile) must never find
a step listed as committed, by pz_persist or by Orbax, that does not restore.
The kill is simulated at the object level: every object deletion the step's
deleter makes goes through gcsfs's ``_rm_file`` (the emulator is served one
object at a time, as a real batch is applied), and the "process dies" after
the first ``cut`` of them.
"""

from __future__ import annotations

import uuid

import gcsfs
import jax.numpy as jnp
import pytest

import pz_persist as pzp
from pz_persist.storage import steps


class _Killed(Exception):
  """The process died here."""


def _cut_after(monkeypatch, cut: int) -> list[str]:
  """Lets the first ``cut`` object deletions through, then kills; returns
  the objects deleted."""
  deleted: list[str] = []
  real = gcsfs.GCSFileSystem._rm_file  # pylint: disable=protected-access

  async def rm_file(self, path, **kwargs):
    if len(deleted) >= cut:
      raise _Killed(path)
    deleted.append(path)
    return await real(self, path, **kwargs)

  monkeypatch.setattr(gcsfs.GCSFileSystem, "_rm_file", rm_file)
  return deleted


def test_a_step_cut_anywhere_in_its_deletion_is_never_listed_half(gcs, monkeypatch):
  run = f"{gcs.root()}/{uuid.uuid4().hex[:12]}/run"
  # "batch_stats" lists before Orbax's commit marker: deleting in listing
  # order (as Orbax does) would take its files while the step still looks
  # committed.
  cuts = (1, 2, 3, 5, 8)
  with pzp.CheckpointManager(run, async_save=False) as manager:
    for step in range(len(cuts) + 1):
      manager.save(step, batch_stats={"mean": jnp.arange(3.0) + step}, x=jnp.float32(step))
  for step, cut in enumerate(cuts):
    with pzp.CheckpointManager(run, async_save=False) as manager:
      deleted = _cut_after(monkeypatch, cut)
      with pytest.raises(_Killed):
        manager._manager._checkpoint_deleter.delete(step)  # pylint: disable=protected-access
      monkeypatch.undo()
    assert deleted, "nothing was deleted: the cut tests nothing"
    ours = {s.step for s in steps.list_steps(run) if s.committed}
    with pzp.CheckpointManager(run) as manager:
      orbax = set(manager.all_steps())
      assert ours == orbax, f"pz_persist lists {sorted(ours)}, Orbax {sorted(orbax)}"
      if step in orbax:  # Still listed: it must restore, whole.
        try:
          restored = manager.restore(step)
        except Exception as e:  # pylint: disable=broad-exception-caught
          pytest.fail(f"step {step} is listed after {deleted} were deleted, but"
                      f" does not restore: {type(e).__name__}: {e}"[:2000])
        assert float(restored["x"]) == step
        assert restored["batch_stats"]["mean"].tolist() == [step, step + 1, step + 2]
