"""The save fast path (`pz_persist.storage.writing.direct_write`).

A single-process save of arrays each whole in host memory or on one device
writes Orbax's files itself. The promise is that nothing tells the two apart:
the same key-value entries in the OCDBT store byte for byte, the same Orbax
metadata files, plain Orbax restoring every array, and the Orbax path still
taken wherever the fast one does not apply.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from penzai import pz
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist import checkpoint
from pz_persist import errors
from pz_persist.storage.writing import direct_write

ORBAX_FILES = ("_METADATA", "_sharding", "array_metadatas/process_0")


def _stored():
  """The flat ``{key: array}`` dicts a save hands Orbax: every dtype family,
  ranks 0 to 3, NumPy and JAX, an array of several chunks, a key with a
  quote."""
  rng = np.random.default_rng(0)
  return {
      "f32": jnp.asarray(rng.standard_normal((3, 4), dtype=np.float32)),
      "bf16": jnp.asarray(rng.standard_normal((5,)), dtype=jnp.bfloat16),
      "f16_0d": jnp.asarray(1.5, jnp.float16),
      "f8": np.arange(12, dtype=np.float32).reshape(2, 2, 3).astype(ml_dtypes.float8_e4m3fn),
      "i8": jnp.arange(-3, 5, dtype=jnp.int8),
      "u32": np.arange(7, dtype=np.uint32),
      "i64": np.arange(4, dtype=np.int64),
      "bool": np.array([True, False, True]),
      "c64": np.array([1 + 2j, 3 - 4j], np.complex64),
      "it's": jnp.ones((2, 2)),
      "multi_chunk": jnp.asarray(rng.standard_normal((1100, 1024), dtype=np.float32)),
  }


def _entries(directory) -> dict[bytes, bytes]:
  store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{directory}"}).result()
  return {key: store.read(key).result().value for key in store.list().result()}


def _save_with(directory, stored, **options) -> None:
  with ocp.Checkpointer(pzp.PenzaiCheckpointHandler(**options)) as checkpointer:
    checkpointer.save(directory, args=pzp.PenzaiSave(stored))


def test_the_files_are_the_ones_orbax_writes(tmp_path, monkeypatch):
  stored = _stored()
  taken = []
  monkeypatch.setattr(direct_write, "start", _recording(direct_write.start, taken))
  _save_with(tmp_path / "direct", stored)
  assert len(taken) == 1, "the direct path was not taken"
  _save_with(tmp_path / "orbax", stored, direct_writes=False)
  assert len(taken) == 1, "direct_writes=False must not take it"
  for name in ORBAX_FILES:
    direct = json.loads((tmp_path / "direct" / name).read_text())
    orbax = json.loads((tmp_path / "orbax" / name).read_text())
    assert direct == orbax, name
  direct, orbax = _entries(tmp_path / "direct"), _entries(tmp_path / "orbax")
  assert set(direct) == set(orbax)
  for key in direct:
    assert direct[key] == orbax[key], key


def test_plain_orbax_restores_every_array_by_itself(tmp_path):
  stored = _stored()
  tree = {**stored, "f32": pz.Parameter(
      value=pz.nx.wrap(stored["f32"]).tag("a", "b"), label="w")}
  pzp.save(tmp_path / "ck", tree)
  restored = ocp.PyTreeCheckpointer().restore(tmp_path / "ck" / "penzai")
  saved = checkpoint.read_manifest(tmp_path / "ck").arrays
  assert len(restored) == len(saved) == len(stored)
  for spec in saved:  # Each stored array, found by the tree path it came from.
    (name,) = [key for key in stored if repr(key) in spec.path]
    got, want = np.asarray(restored[spec.key]), np.asarray(stored[name])
    assert got.dtype == want.dtype, name
    assert np.array_equal(got, want, equal_nan=True), name
  assert_identical(pzp.load(tmp_path / "ck"), tree)


@pytest.mark.parametrize("case", ["sharded", "compressed", "zarr3"])
def test_other_saves_keep_orbax_path(tmp_path, monkeypatch, case):
  stored = {"x": jnp.arange(16.0)}
  options = {}
  if case == "sharded":
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    stored["x"] = jax.device_put(
        stored["x"], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    )
  else:
    options = {"use_compression": True} if case == "compressed" else {"use_zarr3": True}
  taken = []
  monkeypatch.setattr(direct_write, "start", _recording(direct_write.start, taken))
  _save_with(tmp_path / "ck", stored, **options)
  assert not taken
  restored = ocp.PyTreeCheckpointer().restore(tmp_path / "ck")
  (array,) = restored.values()
  assert np.array_equal(array, np.arange(16.0))


def test_a_save_with_a_failed_hash_writes_nothing(tmp_path, monkeypatch):
  from pz_persist.storage.integrity import checksums  # pylint: disable=import-outside-toplevel

  def fail(self, exchange=None, stop=None):
    raise RuntimeError("hashing failed (injected)")

  monkeypatch.setattr(checksums.HostCopies, "digests", fail)
  with pytest.raises(RuntimeError, match="hashing failed"):
    pzp.save(tmp_path / "ck", {"a": jnp.ones(3)})
  assert list(tmp_path.iterdir()) == []  # Nor anything hidden beside it.
  with pytest.raises(errors.PzPersistError):
    pzp.load(tmp_path / "ck")


def _recording(function, calls):
  def recorded(*args, **kwargs):
    calls.append(args)
    return function(*args, **kwargs)
  return recorded
