"""Two processes (jax.distributed on localhost) save and load on gs://.

The run of ``tests/multiprocess_run.py``, with its directory on the GCS
emulator: each process writes its own shards into the one ``gen-*`` folder,
the primary alone publishes it, and each reads its shards back, also after
an overwrite, through a ``CheckpointManager`` and ``load_model``.
"""

from __future__ import annotations

import uuid

from test_multiprocess import _run

import pz_persist as pzp
from pz_persist.storage import stores
from pz_persist.storage.stores import commit_objects


def test_two_processes_save_and_load_on_gcs(gcs):
  remote = f"{gcs.root()}/{uuid.uuid4().hex[:12]}"
  reports = _run(2, remote)
  for report in reports:
    for key in ("load_shards", "overwrite_shards", "manager_shards", "bound_shards"):
      assert report[key] > 0, key
    assert report["manager_steps"] == [2]
  assert [r["saved_manifest_writes"] for r in reports] == [1, 0]
  path = f"{remote}/ckpt"
  current = commit_objects.current(stores.for_path(path), path)
  assert current.sequence == 2  # First save, then one overwrite.
  assert commit_objects.orphans(stores.for_path(path), path) == []
  assert pzp.verify(path).ok
