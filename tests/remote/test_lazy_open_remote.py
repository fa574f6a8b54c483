"""`pz_persist.open` on gs:// and s3:// (the emulators): the same reads as
on a local disk, and a checkpoint saved again is never mixed into a handle
opened on the old one."""

from __future__ import annotations

import numpy as np
import pytest
from penzai import pz

import pz_persist as pzp
from pz_persist import errors


@pytest.fixture
def writable(remote, store) -> str:
  if store.scheme == "s3":
    pytest.importorskip("pz_persist.storage.stores.s3_kvstore").enable_orbax_s3()
  return remote


def _tree(shift: float) -> dict:
  table = np.arange(600 * 8, dtype=np.float32).reshape(600, 8) + shift
  return {
      "embed": pz.ParameterValue(value=pz.nx.wrap(table, "vocabulary", "embedding"), label="embed"),
      "w": pz.ParameterValue(value=pz.nx.wrap(np.ones((4, 3), np.float32) * shift, "a", "b"),
                             label="block/w"),
  }


def test_open_reads_and_detects_replacement_on_object_stores(writable):
  path = f"{writable}/ckpt"
  pzp.save(path, _tree(0.0))
  with pzp.open(path) as ckpt:
    assert ckpt.labels == ("embed", "block/w")
    rows = ckpt.read("embed", {"vocabulary": slice(10, 13)})
    assert np.array_equal(np.asarray(rows.data_array), np.arange(80, 104, dtype=np.float32).reshape(3, 8))
    loaded = pzp.load(path)
    whole = ckpt.load()
    assert np.array_equal(np.asarray(whole["embed"].value.data_array),
                          np.asarray(loaded["embed"].value.data_array))
    assert float(np.asarray(ckpt["block/w"].data_array)[0, 0]) == 0.0
    pzp.save(path, _tree(1.0), overwrite=True)
    with pytest.raises(errors.CheckpointReplacedError, match=r"replaced since it was opened"):
      ckpt.read("embed", 0)
    with pytest.raises(errors.CheckpointReplacedError):
      ckpt["block/w"]
  assert float(np.asarray(pzp.open(path)["block/w"].data_array)[0, 0]) == 1.0
