"""The object-store commit protocol: layout, round trips, replacement, damage.

Races, readers during overwrites and killed saves are in
``tests/hostile/test_remote_commit.py``; here, what one process sees.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from penzai import pz
from penzai.models import simple_mlp

import pz_persist as pzp
from pz_persist.storage import stores
from pz_persist.storage.stores import base
from pz_persist.storage.stores import commit_objects
from pz_persist.storage.stores import urls


def _tree(value: float = 1.0) -> dict:
  return {
      "w": pz.nx.wrap(np.full((4, 3), value, np.float32)).tag("a", "b"),
      "n": np.arange(5),
      "label": "x",
  }


def test_layout_is_one_commit_naming_one_generation(remote):
  pzp.save(remote, _tree())
  names = stores.for_path(remote).names(remote)
  assert len(names) == 2 and names[1] == base.commit_name(1), names
  commit = commit_objects.current(stores.for_path(remote), remote)
  assert commit.checkpoint.name == names[0] and names[0].startswith("gen-")
  record = json.loads(stores.for_path(commit.object).read(commit.object, 4096))
  assert record == {"pz_persist_commit": 1, "checkpoint": names[0]}


def test_round_trip_inspect_and_plain_orbax(remote):
  pzp.save(remote, _tree(2.0))
  loaded = pzp.load(remote)
  assert loaded["w"].named_axes == {"a": 4, "b": 3} and loaded["label"] == "x"
  np.testing.assert_array_equal(loaded["w"].unwrap("a", "b"), np.full((4, 3), 2.0))
  assert pzp.inspect(remote)["n"].shape == (5,)
  # Plain Orbax restores the arrays at the folder the commit names.
  item = commit_objects.current(stores.for_path(remote), remote).checkpoint / "penzai"
  with ocp.PyTreeCheckpointer() as checkpointer:
    raw = checkpointer.restore(item)
  assert any(np.array_equal(np.asarray(v), np.arange(5)) for v in jax.tree.leaves(raw))


def test_overwrite_publishes_a_new_generation_and_retires_the_old(remote):
  pzp.save(remote, _tree(1.0))
  first = commit_objects.current(stores.for_path(remote), remote)
  with pytest.raises(pzp.errors.CheckpointExistsError):
    pzp.save(remote, _tree(2.0))
  pzp.save(remote, _tree(3.0), overwrite=True)
  second = commit_objects.current(stores.for_path(remote), remote)
  assert second.sequence == 2 and second.checkpoint != first.checkpoint
  assert stores.for_path(remote).names(remote) == [second.checkpoint.name, base.commit_name(2)]
  np.testing.assert_array_equal(pzp.load(remote)["w"].unwrap("a", "b"), np.full((4, 3), 3.0))


def test_a_path_holding_only_orphans_takes_a_first_save(remote):
  stores.for_path(remote).write_whole(f"{remote}/gen-0123456789abcdef/penzai/partial", b"x")
  pzp.save(remote, _tree())  # No checkpoint there yet: no overwrite needed.
  orphans = commit_objects.orphans(stores.for_path(remote), remote)
  assert [p.name for p in orphans] == ["gen-0123456789abcdef"]
  assert pzp.load(remote)["label"] == "x"


def test_a_checkpoint_of_the_old_layout_is_replaced_only_with_overwrite(remote, tmp_path):
  local = tmp_path / "old"
  pzp.save(local, _tree(5.0))
  stores.for_path(remote).filesystem(remote).put(str(local), urls.key(remote), recursive=True)
  assert pzp.load(remote)["label"] == "x"  # Still readable where it is.
  with pytest.raises(pzp.errors.CheckpointExistsError):
    pzp.save(remote, _tree(6.0))
  pzp.save(remote, _tree(6.0), overwrite=True)
  names = stores.for_path(remote).names(remote)
  assert len(names) == 2 and names[1] == base.commit_name(1), names
  np.testing.assert_array_equal(pzp.load(remote)["w"].unwrap("a", "b"), np.full((4, 3), 6.0))


@pytest.mark.parametrize("content", [
    b"not json", b'{"pz_persist_commit": 1, "checkpoint": "../../elsewhere"}',
    b'{"pz_persist_commit": 2, "checkpoint": "gen-0123456789abcdef"}', b"x" * 5000,
])
def test_a_damaged_commit_object_is_refused_by_name(remote, content):
  pzp.save(remote, _tree())
  stores.for_path(remote).write_whole(f"{remote}/{base.commit_name(7)}", content)
  with pytest.raises(pzp.errors.ManifestError, match=base.commit_name(7)):
    pzp.load(remote)


def test_save_model_and_load_model(remote):
  mlp = simple_mlp.MLP.from_config(
      name="mlp", init_base_rng=jax.random.key(0), feature_sizes=[4, 8, 4]
  )
  pzp.save_model(remote, mlp)
  restored = pzp.load_model(remote)
  x = pz.nx.wrap(np.ones((4,), np.float32)).tag("features")
  np.testing.assert_array_equal(restored(x).unwrap("features"), mlp(x).unwrap("features"))

