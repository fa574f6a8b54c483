"""A CheckpointManager step on an object store is whole or gone.

Deleting a step there takes one request per object; a run killed part-way
through retention (or a reader listing the steps meanwhile) must never find
a step listed as committed, by pz_persist or by Orbax, that does not restore.
The kill is simulated at the object level: every object deletion the step's
deleter makes is served one object at a time (gcsfs's ``_rm_file``; s3fs's
``DeleteObjects`` batch split into single deletes, as the store applies a
batch: not atomically), and the "process dies" after the first ``cut``.
"""

from __future__ import annotations

import gcsfs
import jax.numpy as jnp
import pytest
import s3fs

import pz_persist as pzp
from pz_persist.storage.lifecycle import steps


class _Killed(Exception):
  """The process died here."""


def _cut_after(monkeypatch, scheme: str, cut: int) -> list[str]:
  """Lets the first ``cut`` object deletions through, then kills; returns
  the objects deleted."""
  deleted: list[str] = []

  def allow(path) -> None:
    if len(deleted) >= cut:
      raise _Killed(path)
    deleted.append(path)

  if scheme == "gs":
    real = gcsfs.GCSFileSystem._rm_file  # pylint: disable=protected-access

    async def rm_file(self, path, **kwargs):
      allow(path)
      return await real(self, path, **kwargs)

    monkeypatch.setattr(gcsfs.GCSFileSystem, "_rm_file", rm_file)
  else:
    async def bulk_delete(self, paths, **kwargs):
      for path in paths:
        allow(path)
        await self._rm_file(path)  # pylint: disable=protected-access
      return list(paths)

    monkeypatch.setattr(s3fs.S3FileSystem, "_bulk_delete", bulk_delete)
  return deleted


def test_a_step_cut_anywhere_in_its_deletion_is_never_listed_half(remote, store, monkeypatch):
  if store.scheme == "s3":  # Orbax writes S3 arrays once helper s3's kvstore spec lands.
    pytest.importorskip("pz_persist.storage.stores.s3_kvstore").enable_orbax_s3()
  run = f"{remote}/run"
  # "batch_stats" lists before Orbax's commit marker: deleting in listing
  # order (as Orbax does) would take its files while the step still looks
  # committed.
  cuts = (1, 2, 3, 5, 8)
  with pzp.CheckpointManager(run, async_save=False) as manager:
    for step in range(len(cuts) + 1):
      manager.save(step, batch_stats={"mean": jnp.arange(3.0) + step}, x=jnp.float32(step))
  for step, cut in enumerate(cuts):
    with pzp.CheckpointManager(run, async_save=False) as manager:
      deleted = _cut_after(monkeypatch, store.scheme, cut)
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
