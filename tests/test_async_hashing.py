"""Checksums are off the save's critical path: building `PenzaiSave` only
validates and encodes, and an async save hashes in its background work, from
host copies taken before it returned; the manifest is complete before the
checkpoint is final."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import pz_persist as pzp
from pz_persist.format import manifest as manifest_lib
from pz_persist.storage.integrity import checksums
from pz_persist.storage.writing import writer


@pytest.fixture
def hashing_threads(monkeypatch):
  """The threads `checksums.digest_of` runs in, one entry per array hashed."""
  threads = []
  real = checksums.digest_of

  def recording(data):
    threads.append(threading.current_thread())
    return real(data)

  monkeypatch.setattr(checksums, "digest_of", recording)
  return threads


def _tree():
  return {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(5), "n": np.arange(3)}


def test_building_the_arguments_hashes_nothing(hashing_threads):
  args = pzp.PenzaiSave(_tree())
  assert hashing_threads == []
  assert all(spec.checksums is None for spec in args.manifest.arrays)


def test_an_async_save_hashes_in_the_background(tmp_path, hashing_threads):
  tree = _tree()
  with ocp.AsyncCheckpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
    checkpointer.save(tmp_path / "c", args=pzp.PenzaiSave(tree))
    blocking = list(hashing_threads)
    for value in tree.values():  # The copies were taken: deleting is safe.
      if isinstance(value, jnp.ndarray):
        value.delete()
    checkpointer.wait_until_finished()
  assert threading.main_thread() not in blocking
  assert len(hashing_threads) == 3
  assert threading.main_thread() not in hashing_threads
  manifest = manifest_lib.read(tmp_path / "c")
  assert all(spec.checksums for spec in manifest.arrays)
  restored = pzp.PenzaiCheckpointHandler().restore(tmp_path / "c", pzp.PenzaiRestore())
  np.testing.assert_array_equal(restored["w"], np.arange(12.0).reshape(3, 4))


def test_a_save_records_the_same_checksums_as_before(ckpt):
  """What is recorded equals hashing the arrays directly (`encode_manifest`)."""
  tree = _tree()
  pzp.save(ckpt, tree)
  expected, _ = writer.encode_hashed(tree)
  assert pzp.checkpoint.read_manifest(ckpt).arrays == expected.arrays
  assert pzp.verify(ckpt).ok


def test_hashing_stops_once_the_save_is_abandoned():
  """An interrupted save stops hashing before the next array (it waited for
  all of them before: seconds per GiB, all spent before Ctrl-C took effect)."""
  import concurrent.futures  # pylint: disable=import-outside-toplevel

  copies = checksums.host_copies({"a": np.arange(3), "b": np.ones(4)})
  stop = threading.Event()
  assert set(copies.digests(stop=stop)) == {"a", "b"}
  stop.set()
  with pytest.raises(concurrent.futures.CancelledError):
    copies.digests(stop=stop)


def test_accelerator_arrays_are_copied_through_pinned_host_memory(monkeypatch):
  """On a GPU the host copies go through pinned memory (40x faster than
  pageable on an H200: `checksums.host_copies`); the CPU backend has pinned
  host memory too, so the path runs here with the CPU test treated as an
  accelerator, and must hash exactly what the plain copies hash."""
  tree = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(5, jnp.bfloat16)}
  expected = checksums.host_copies(tree).digests()
  moved = []
  real_put = checksums.jax.device_put

  def recording_put(data, sharding):
    moved.append(sharding.memory_kind)
    return real_put(data, sharding)

  monkeypatch.setattr(checksums, "_on_cpu", lambda array: False)
  monkeypatch.setattr(checksums.jax, "device_put", recording_put)
  copies = checksums.host_copies(tree)
  assert moved == ["pinned_host", "pinned_host"]
  assert all(isinstance(slot.local_data, np.ndarray) for slot in copies.slots)
  assert copies.digests() == expected
