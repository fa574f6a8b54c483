"""Staging buffers: a load's reads on their way to an accelerator share a few
reused, page-locked slabs (`pz_persist.storage.reading.staging`).

CI has no accelerator, so these tests stage CPU copies: the placer is told
to stage every placement and given a ``put`` that copies, either at once or,
like a DMA, only when waited for (`_LazyCopy`): a slab reused before the
copies from it were waited for would then hand back another array's bytes.
Page-locking is a fake `Locker` that records what is locked, so the tests
check that every lock is undone, also when a load fails.
"""

from __future__ import annotations

import ctypes

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import array_specs as arrays_lib
from pz_persist.storage.reading import host_memory
from pz_persist.storage.reading import page_locking
from pz_persist.storage.reading import staging
from pz_persist.storage.reading import streaming
import test_random_trees
from hostile import catalogue

pytestmark = pytest.mark.unit

_KIB = 1024


class _FakeLocker:
  """Records locked buffers by address; ``fail`` makes every lock fail."""

  def __init__(self, fail: bool = False):
    self.fail = fail
    self.locked: dict[int, int] = {}
    self.closed = False
    self.ever_locked = 0

  def lock(self, buffer: np.ndarray) -> bool:
    if self.fail:
      return False
    assert buffer.ctypes.data not in self.locked
    self.locked[buffer.ctypes.data] = buffer.nbytes
    self.ever_locked += 1
    return True

  def unlock(self, buffer: np.ndarray) -> None:
    assert self.locked.pop(buffer.ctypes.data) == buffer.nbytes

  def close(self) -> None:
    assert not self.locked, "a buffer is still locked when the locker closes"
    self.closed = True


def _use_small_slabs(patch: pytest.MonkeyPatch) -> None:
  """Slabs of 8 KiB within 32 KiB, so a few small arrays exercise reuse."""
  patch.setattr(staging, "SLAB_BYTES", 8 * _KIB)
  patch.setattr(staging, "LIMIT_BYTES", 32 * _KIB)
  patch.setattr(streaming, "BATCH_BYTES", 4 * _KIB)
  patch.setattr(streaming, "WINDOW_BYTES", 12 * _KIB)


def _stage_every_placement(patch: pytest.MonkeyPatch) -> _FakeLocker:
  """Loads stage every array placed on a device, as on an accelerator."""
  locker = _FakeLocker()
  patch.setattr(streaming, "copies_to_device", lambda target: target is not None)
  patch.setattr(streaming, "device_put", _copying_put)
  patch.setattr(page_locking, "locker_for", lambda device: locker)
  return locker


@pytest.fixture
def small_slabs(monkeypatch):
  _use_small_slabs(monkeypatch)


def test_small_arrays_share_a_slab_aligned_and_apart(small_slabs):
  buffers = staging.StagingBuffers(_FakeLocker(), make_room=lambda: False)
  taken = [buffers.take((n,), np.dtype(np.float32)) for n in (3, 100, 1, 17)]
  slabs = {id(slab) for _, slab in taken}
  assert len(slabs) == 1
  starts = [view.ctypes.data for view, _ in taken]
  assert all(start % host_memory.ALIGNMENT == 0 for start in starts)
  for (view, _), nxt in zip(taken, starts[1:]):
    assert view.ctypes.data + view.nbytes <= nxt


def test_a_large_array_gets_a_slab_of_its_size(small_slabs):
  buffers = staging.StagingBuffers(None, make_room=lambda: False)
  view, slab = buffers.take((5000,), np.dtype(np.float32))
  assert view.shape == (5000,) and slab.capacity >= 20000 and not slab.locked


def test_a_released_slab_is_reused(small_slabs):
  locker = _FakeLocker()
  buffers = staging.StagingBuffers(locker, make_room=lambda: False)
  first, slab = buffers.take((2 * _KIB,), np.dtype(np.float32))  # Fills a slab.
  buffers.release(slab)
  second, again = buffers.take((2 * _KIB,), np.dtype(np.float32))
  assert again is slab and second.ctypes.data == first.ctypes.data
  assert locker.ever_locked == 1


def test_slabs_stay_within_the_limit_while_copies_can_be_waited_for(small_slabs):
  held: list[staging.Slab] = []
  buffers = staging.StagingBuffers(_FakeLocker(), make_room=lambda: False)

  def make_room() -> bool:
    if not held:
      return False
    buffers.release(held.pop(0))
    return True

  buffers._make_room = make_room  # pylint: disable=protected-access
  for _ in range(20):
    _, slab = buffers.take((2 * _KIB,), np.dtype(np.float32))
    held.append(slab)
    assert buffers.nbytes <= staging.LIMIT_BYTES


def test_the_limit_is_passed_rather_than_waiting_for_nothing(small_slabs):
  buffers = staging.StagingBuffers(None, make_room=lambda: False)
  for _ in range(6):
    buffers.take((2 * _KIB,), np.dtype(np.float32))  # Never released.
  assert buffers.nbytes == 6 * staging.SLAB_BYTES > staging.LIMIT_BYTES


def test_close_unlocks_every_slab_and_failed_locks_are_pageable(small_slabs):
  locker = _FakeLocker()
  buffers = staging.StagingBuffers(locker, make_room=lambda: False)
  for n in (10, 3000, 10, 9000):
    buffers.take((n,), np.dtype(np.float32))
  assert buffers.locked_bytes == buffers.nbytes > 0
  buffers.close()
  assert not locker.locked and locker.closed
  failing = _FakeLocker(fail=True)
  buffers = staging.StagingBuffers(failing, make_room=lambda: False)
  buffers.take((10,), np.dtype(np.float32))
  assert buffers.locked_bytes == 0
  buffers.close()


class _LazyCopy:
  """A copy that, like a DMA, reads its host buffer only when waited for."""

  def __init__(self, host: np.ndarray):
    self._host = host
    self.value: np.ndarray | None = None

  def block_until_ready(self) -> _LazyCopy:
    if self.value is None:
      self.value = np.array(self._host, copy=True)
    return self


def _lazy_put(hosts, target):
  del target
  return [_LazyCopy(host) for host in hosts]


def _specs(sizes):
  return [
      arrays_lib.ArraySpec(key=f"a{i}", shape=(n,), dtype="float32", kind="jax")
      for i, n in enumerate(sizes)
  ]


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.lists(st.integers(0, 6000), min_size=1, max_size=40))
def test_placed_arrays_are_the_bytes_read_though_slabs_are_reused(sizes):
  """Copies that read their buffer late still see their own array: no slab
  serves again before the copies from it are waited for."""
  with pytest.MonkeyPatch.context() as patch:
    _use_small_slabs(patch)
    locker = _FakeLocker()
    patch.setattr(page_locking, "locker_for", lambda device: locker)
    specs = _specs(sizes)
    target = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with streaming.Placer(
        {spec.key: target for spec in specs}, None, staged=lambda t: True, put=_lazy_put
    ) as placer:
      for i, spec in enumerate(specs):
        host = placer.buffer_for(spec)
        assert host is not None
        host[...] = np.arange(spec.shape[0], dtype=np.float32) + 10_000 * i
        placer.take(spec, host)
      placed = placer.finish()
    for i, spec in enumerate(specs):
      expected = np.arange(spec.shape[0], dtype=np.float32) + 10_000 * i
      np.testing.assert_array_equal(placed[spec.key].value, expected)
    assert not locker.locked and locker.closed


def _copying_put(hosts, target):
  """Copies each host buffer, then places the copy (what a GPU's DMA does)."""
  return jax.device_put([np.array(host, copy=True) for host in hosts], target)


@pytest.fixture
def staged_loads(monkeypatch, small_slabs):
  return _stage_every_placement(monkeypatch)


def _tree():
  rng = np.random.default_rng(0)
  return {
      "big": jnp.asarray(rng.standard_normal((300, 40), dtype=np.float32)),  # > a slab.
      "small": [jnp.arange(n, dtype=jnp.int32) for n in range(1, 40, 7)],
      "bf16": jnp.linspace(-3, 3, 777, dtype=jnp.bfloat16),
      "empty": jnp.zeros((0, 5)),
      "numpy": np.arange(12, dtype=np.int16).reshape(3, 4),
  }


def test_a_staged_load_is_the_load(tmp_path, staged_loads):
  tree = _tree()
  pzp.save(tmp_path / "ck", tree)
  device = jax.devices()[0]
  loaded = pzp.load(tmp_path / "ck", sharding=jax.sharding.SingleDeviceSharding(device))
  assert_identical(loaded, tree)
  assert staged_loads.ever_locked > 0 and not staged_loads.locked


def test_a_damaged_staged_load_unlocks_everything(tmp_path, staged_loads):
  tree = _tree()
  pzp.save(tmp_path / "ck", tree)
  largest = max((p for p in (tmp_path / "ck").rglob("*") if p.is_file()), key=_size)
  largest.write_bytes(catalogue.flip_middle(largest.read_bytes()))  # The array's bytes.
  device = jax.devices()[0]
  with pytest.raises(errors.IntegrityError, match="do not match the checksums"):
    pzp.load(tmp_path / "ck", sharding=jax.sharding.SingleDeviceSharding(device))
  assert staged_loads.ever_locked > 0 and not staged_loads.locked and staged_loads.closed


def _size(path) -> int:
  return path.stat().st_size


@hypothesis.settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(tree=test_random_trees.trees())
def test_staged_loads_of_random_trees_are_the_saved_trees(tree, tmp_path_factory):
  path = tmp_path_factory.mktemp("staged") / "ck"
  allowed = [test_random_trees.__name__]
  pzp.save(path, tree, allow_modules=allowed)
  unstaged = pzp.load(path, allow_modules=allowed)
  with pytest.MonkeyPatch.context() as patch:
    _use_small_slabs(patch)
    locker = _stage_every_placement(patch)
    assert_identical(pzp.load(path, allow_modules=allowed), unstaged)
  assert not locker.locked


class _FakeCudaDriver:
  """The CUDA driver functions `page_locking` calls, checking what a real
  driver requires: ctypes arguments of the right types, a context pushed
  around every registration, and every registration undone."""

  def __init__(self, fail_register: bool = False):
    self.fail_register = fail_register
    self.pushed = 0
    self.registered: dict[int, int] = {}
    self.retained = 0

  def cuDeviceGet(self, device, ordinal):  # pylint: disable=invalid-name
    device._obj.value = ordinal
    return 0

  def cuDevicePrimaryCtxRetain(self, context, device):  # pylint: disable=invalid-name
    assert isinstance(device, ctypes.c_int)
    context._obj.value = 0x1234
    self.retained += 1
    return 0

  def cuDevicePrimaryCtxRelease_v2(self, device):  # pylint: disable=invalid-name
    assert isinstance(device, ctypes.c_int)
    self.retained -= 1
    return 0

  def cuCtxPushCurrent_v2(self, context):  # pylint: disable=invalid-name
    assert isinstance(context, ctypes.c_void_p) and context.value == 0x1234
    self.pushed += 1
    return 0

  def cuCtxPopCurrent_v2(self, context):  # pylint: disable=invalid-name
    self.pushed -= 1
    return 0

  def cuMemHostRegister_v2(self, pointer, nbytes, flags):  # pylint: disable=invalid-name
    assert isinstance(pointer, ctypes.c_void_p) and isinstance(nbytes, ctypes.c_size_t)
    assert isinstance(flags, ctypes.c_uint) and self.pushed == 1
    if self.fail_register:
      return 2  # CUDA_ERROR_OUT_OF_MEMORY
    assert pointer.value not in self.registered
    self.registered[pointer.value] = nbytes.value
    return 0

  def cuMemHostUnregister(self, pointer):  # pylint: disable=invalid-name
    assert isinstance(pointer, ctypes.c_void_p) and self.pushed == 1
    del self.registered[pointer.value]
    return 0


@pytest.mark.parametrize("fail_register", [False, True])
def test_the_cuda_locker_pairs_every_driver_call(small_slabs, fail_register):
  driver = _FakeCudaDriver(fail_register)
  locker = page_locking._CudaDriverLocker(driver, 0)  # pylint: disable=protected-access
  buffers = staging.StagingBuffers(locker, make_room=lambda: False)
  for n in (10, 3000, 10, 9000, 1):
    buffers.take((n,), np.dtype(np.float32))
  assert len(driver.registered) == (0 if fail_register else 3) and driver.pushed == 0
  buffers.close()
  assert not driver.registered and driver.pushed == 0 and driver.retained == 0


def test_no_locker_off_cuda_gpus():
  assert page_locking.locker_for(jax.devices("cpu")[0]) is None
