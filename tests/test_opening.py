"""`pz_persist.storage.reading.opening`: the one way every reader opens a checkpoint item."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os

import jax
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz
from penzai.models import simple_mlp

import pz_persist as pzp
from pz_persist import checkpoint
from pz_persist import errors
from pz_persist.format import manifest as manifest_lib
from pz_persist.safety import safe_io
from pz_persist.storage.integrity import containment
from pz_persist.storage.reading import opening
from pz_persist.tools import viewing


def _mlp():
  return simple_mlp.MLP.from_config(
      name="mlp", init_base_rng=jax.random.key(0), feature_sizes=[4, 8, 4]
  )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Checkpoints of one model written every way the entry points read."""
  root = tmp_path_factory.mktemp("opening")
  mlp = _mlp()
  _, params = pz.unbind_params(mlp, freeze=True)
  paths = {"model": root / "model", "params": root / "params",
           "run": root / "run", "v1": root / "v1"}
  pzp.save_model(paths["model"], mlp)
  pzp.save(paths["params"], params)
  with ocp.CheckpointManager(paths["run"]) as manager:
    manager.save(1, args=ocp.args.Composite(params=pzp.PenzaiSave(params)))
    manager.wait_until_finished()
  ocp_v1.save_checkpointables(paths["v1"], {"model": params})
  return paths, mlp


def _manager_restore(paths):
  registry = pzp.handler_registry("params")
  with ocp.CheckpointManager(paths["run"], handler_registry=registry) as manager:
    return manager.restore(1).params


ENTRY_POINTS = {
    # name: (read, items opened, whether arrays are read)
    "load": (lambda p, mlp: pzp.load(p["params"], progress=False), 1, True),
    "inspect": (lambda p, mlp: pzp.inspect(p["params"]), 1, False),
    "read_manifest": (lambda p, mlp: checkpoint.read_manifest(p["params"]), 1, False),
    "load_model": (lambda p, mlp: pzp.load_model(p["model"], progress=False), 1, True),
    "load_model_into": (
        lambda p, mlp: pzp.load_into(p["model"], mlp, progress=False), 1, True
    ),
    "diff": (lambda p, mlp: pzp.diff(p["params"], p["params"], progress=False), 2, True),
    "verify": (lambda p, mlp: pzp.verify(p["params"], progress=False), 1, True),
    "describe": (
        lambda p, mlp: viewing.describe_checkpoint(p["model"]), 1, False
    ),
    "manager_restore": (lambda p, mlp: _manager_restore(p), 1, True),
    "v0_handler": (
        lambda p, mlp: ocp.Checkpointer(pzp.PenzaiCheckpointHandler()).restore(
            p["run"] / "1" / "params"
        ), 1, True,
    ),
    "v1_load": (lambda p, mlp: ocp_v1.load_checkpointables(p["v1"]), 1, True),
}


@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
def test_each_entry_point_reads_the_manifest_once_and_walks_once_before_reading(
    saved, monkeypatch, entry_point
):
  """Before `opening`: `load` read the manifest 3 times and walked the
  directory 4 times, `load_model(path)` 4 and 5 times, the others walked 3
  times (twice before reading any array)."""
  paths, mlp = saved
  read, items, reads_arrays = ENTRY_POINTS[entry_point]
  counts = collections.Counter()
  read_small_file, check_contained = safe_io.read_small_file, containment.check_contained

  def counting_read(path, *args, **kwargs):
    if os.fspath(path).endswith(manifest_lib.MANIFEST_FILENAME):
      counts["manifest"] += 1
    return read_small_file(path, *args, **kwargs)

  def counting_walk(*args, **kwargs):
    counts["walks"] += 1
    return check_contained(*args, **kwargs)

  monkeypatch.setattr(safe_io, "read_small_file", counting_read)
  monkeypatch.setattr(containment, "check_contained", counting_walk)
  read(paths, mlp)
  assert counts["manifest"] == items
  # One walk to open each item; one more after its arrays were read (that
  # nothing was swapped during the read: `containment.files_unchanged`).
  assert counts["walks"] == items * (2 if reads_arrays else 1)


def test_open_item_holds_what_was_read_once(saved):
  paths, _ = saved
  opened = opening.read(paths["params"], lambda opened: opened)
  item = paths["params"] / checkpoint.ITEM_NAME
  assert opened.path == paths["params"] and opened.item == item
  data = (item / manifest_lib.MANIFEST_FILENAME).read_bytes()
  assert opened.digest == hashlib.sha256(data).digest()
  assert opened.manifest == manifest_lib.read(item)
  assert opened.snapshot == containment.check_contained(item)  # Not walked again.
  assert opened.unchanged()
  with pytest.raises(dataclasses.FrozenInstanceError):
    opened.item = paths["params"]  # type: ignore[misc]


def test_part_of_a_snapshot_is_the_snapshot_of_the_part(saved):
  paths, _ = saved
  whole = containment.check_contained(paths["params"])
  item = paths["params"] / checkpoint.ITEM_NAME
  assert containment.part(whole, item) == containment.check_contained(item)
  assert containment.part(None, item) is None


def test_opened_item_is_unchanged_until_replaced(tmp_path):
  path = tmp_path / "ckpt"
  pzp.save(path, {"x": 1})
  opened = opening.read(path, lambda opened: opened)
  assert opened.unchanged()
  pzp.save(path, {"x": 1}, overwrite=True)  # The same tree, a new checkpoint.
  assert not opened.unchanged()


def test_find_item_still_answers_for_checkpoint_and_item(saved):
  paths, _ = saved
  item = paths["params"] / checkpoint.ITEM_NAME
  assert checkpoint.find_item(paths["params"]) == item
  assert checkpoint.find_item(item) == item


@pytest.mark.parametrize("how", ["v0_handler", "v1_load", "load_model_into", "verify"])
def test_every_entry_point_gives_up_when_replaced_during_every_attempt(
    saved, monkeypatch, how
):
  """The retry that only `pzp.load` had now covers each entry point."""
  paths, mlp = saved
  changes = iter(range(1000))
  monkeypatch.setattr(opening, "_identity", lambda *_: next(changes))
  with pytest.raises(errors.ConcurrentSaveError, match="replaced by other saves"):
    ENTRY_POINTS[how][0](paths, mlp)


def test_handler_raises_real_errors_at_once(tmp_path, monkeypatch):
  path = tmp_path / "ckpt"
  pzp.save(path, {"x": jax.numpy.arange(3)})
  attempts = []
  identity = opening._identity
  monkeypatch.setattr(opening, "_identity", lambda *a: attempts.append(1) or identity(*a))
  item = path / checkpoint.ITEM_NAME
  for name in os.listdir(item / "d"):
    os.remove(item / "d" / name)  # Damaged, but not being replaced.
  with pytest.raises(errors.PzPersistError) as raised:
    pzp.PenzaiCheckpointHandler().restore(item)
  assert not isinstance(raised.value, errors.ConcurrentSaveError)
  assert len(attempts) == 3  # One attempt: before finding, before and after reading.


def test_verify_reports_a_damaged_manifest_instead_of_raising(tmp_path):
  path = tmp_path / "ckpt"
  pzp.save(path, {"x": 1})
  (path / checkpoint.ITEM_NAME / manifest_lib.MANIFEST_FILENAME).write_text("{")
  report = pzp.verify(path, progress=False)
  assert not report.ok
  assert any(manifest_lib.MANIFEST_FILENAME in line for line in report.damaged)
