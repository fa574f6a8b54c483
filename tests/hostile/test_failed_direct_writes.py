"""A save that fails or is interrupted anywhere in the direct write path
(`pz_persist.storage.direct_write`) leaves the previous checkpoint as it was.

The path has its own stages (issuing the writes, waiting for them, Orbax's
metadata files, the manifest); an error or Ctrl-C in each must end like one
in Orbax's path: the old checkpoint loads and verifies, and the next save
removes what the failed one left.
"""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import pytest
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist.format import manifest as manifest_lib
from pz_persist.storage import direct_write

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

  monkeypatch.setattr(module, name, fail)
  with pytest.raises(error):
    pzp.save(path, NEW, overwrite=True)
  monkeypatch.undo()
  for thread in threading.enumerate():  # The failed save's trash, deleted in the background.
    if thread.name == "pz_persist_delete":
      thread.join(60)
  assert_identical(pzp.load(path), OLD)
  pzp.verify(path)
  pzp.save(path, NEW, overwrite=True)  # Removes what the failed save left.
  assert_identical(pzp.load(path), NEW)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
