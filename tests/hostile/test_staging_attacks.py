"""Attacks on the staging buffers of loads onto an accelerator
(`pz_persist.storage.reading.staging`, `page_locking`, `streaming.Placer`).

CI has no accelerator, so every load here stages its CPU copies (as
`tests/test_staging.py` does) with copies that, like a DMA, read their host
buffer only when waited for: a slab reused before the copies from it were
waited for hands back another array's bytes, and a slab unlocked before
them fails the fake locker. What must hold through every entry point, dtype,
size and failure: the values of the unstaged load, every lock undone, no
slab left alive after a failed load, slabs within ``LIMIT_BYTES`` but for an
array larger than it, and the unstaged path's errors.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import types
import weakref

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore
from orbax import checkpoint as ocp
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import array_specs as arrays_lib
from pz_persist.storage.integrity import checksums as checksums_lib
from pz_persist.storage.reading import direct_read
from pz_persist.storage.reading import page_locking
from pz_persist.storage.reading import raw_chunks
from pz_persist.storage.reading import staging
from pz_persist.storage.reading import streaming
from pz_persist.storage.writing import direct_write
import test_staging
from hostile import catalogue

pytestmark = pytest.mark.unit

_KIB = 1024


class _Lazy:
  """A copy that reads its host buffer only when waited for (a DMA)."""

  def __init__(self, host: np.ndarray, target: jax.sharding.Sharding, watch: _Watch):
    self.host: np.ndarray | None = host
    self.target, self.watch = target, watch
    self.value: np.ndarray | None = None

  def block_until_ready(self) -> _Lazy:
    if self.value is None:
      if self.watch.fail_always is not None:
        raise self.watch.fail_always
      if self.watch.fail_wait is not None:
        self.value = np.empty(0)  # Failed: done, reading nothing more.
        self.host = None
        raise self.watch.fail_wait
      self.value = np.array(self.host, copy=True)
    self.host = None  # Done: a DMA holds nothing once waited for.
    return self


class _LazyRead:
  """A TensorStore read that writes into its buffer only when waited for
  (slow storage): a buffer let go of before then is written after."""

  def __init__(self, store, source):
    self._store, self._source = store, source
    self._finished = False
    self._cancelled = False

  def cancel(self) -> None:
    self._cancelled = True

  def done(self) -> bool:
    return self._finished

  def result(self):
    if not self._finished:
      self._finished = True
      if self._cancelled:
        raise RuntimeError("cancelled")
      self._store.write(self._source).result()


class _Watch:
  """What a staged load did: locks, lazy copies, slabs made, their bytes."""

  def __init__(self) -> None:
    self.lockers: list[_CheckingLocker] = []
    self.copies: list[_Lazy] = []
    self.slabs: list[weakref.ref] = []
    self.peak = 0
    self.largest = 0
    self.fail_wait: BaseException | None = None
    self.fail_always: BaseException | None = None
    self.reads: list[tuple[np.ndarray, _LazyRead]] = []
    self.fail_put: BaseException | None = None
    self.puts = 0

  def put(self, hosts, target):
    self.puts += 1
    if self.fail_put is not None:
      raise self.fail_put
    copies = [_Lazy(host, target, self) for host in hosts]
    self.copies.extend(copies)
    return copies

  def read_into(self, out: np.ndarray, **kwargs):
    """TensorStore's view of ``out``, its writes (reads from storage) recorded."""
    store = tensorstore.array(out, **kwargs)
    reads = self.reads

    class _Recorded:
      def write(self, source):
        future = _LazyRead(store, source)
        reads.append((out, future))
        return future

    return _Recorded()

  def unwaited_from(self, buffer: np.ndarray) -> list[_Lazy]:
    return [c for c in self.copies if c.host is not None and np.shares_memory(c.host, buffer)]

  def locker(self) -> _CheckingLocker:
    """A new locker (one per load, as `page_locking.locker_for` makes)."""
    self.lockers.append(_CheckingLocker(self))
    return self.lockers[-1]

  @property
  def ever_locked(self) -> int:
    return sum(locker.ever_locked for locker in self.lockers)

  def alive(self) -> int:
    gc.collect()
    return sum(ref() is not None for ref in self.slabs)


class _CheckingLocker(test_staging._FakeLocker):  # pylint: disable=protected-access
  """Also refuses to unlock a buffer a copy has not finished reading."""

  def __init__(self, watch: _Watch):
    super().__init__()
    self._watch = watch
    self.threads: set[int] = set()

  def lock(self, buffer):
    self.threads.add(threading.get_ident())
    return super().lock(buffer)

  def unlock(self, buffer):
    assert not self._watch.unwaited_from(buffer), "a slab was unlocked under a running copy"
    assert all(
        future.done() for out, future in self._watch.reads if np.shares_memory(out, buffer)
    ), "a slab was unlocked while a read still wrote into it"
    super().unlock(buffer)


@pytest.fixture
def watch(monkeypatch):
  """Every load stages through small slabs, lazily copied; returns a `_Watch`."""
  test_staging._use_small_slabs(monkeypatch)  # pylint: disable=protected-access
  # The limit's share of reads in flight, as ``LIMIT_BYTES`` counts them.
  monkeypatch.setattr(direct_read, "IN_FLIGHT_BYTES", 16 * _KIB)
  monkeypatch.setattr(raw_chunks, "IN_FLIGHT_BYTES", 16 * _KIB)
  # Arrays over 4 KiB read by TensorStore into their slab, smaller ones as raw chunks.
  monkeypatch.setattr(direct_write, "SMALL_ARRAY_BYTES", 4 * _KIB)
  seen = _Watch()
  monkeypatch.setattr(streaming, "copies_to_device", lambda target: target is not None)
  monkeypatch.setattr(streaming, "device_put", seen.put)
  monkeypatch.setattr(page_locking, "locker_for", lambda device: seen.locker())
  finish = streaming.Placer.finish

  def finishing(placer):
    placed = finish(placer)
    for key, value in placed.items():
      if isinstance(value, _Lazy):
        assert value.value is not None, f"{key}: returned before its copy was waited for"
        placed[key] = jax.device_put(value.value, value.target)
    return placed

  monkeypatch.setattr(streaming.Placer, "finish", finishing)
  monkeypatch.setattr(direct_read, "ts", _RecordingTensorStore(seen))
  make = staging.Slab.__init__

  def making(slab, capacity, locker):
    make(slab, capacity, locker)
    seen.slabs.append(weakref.ref(slab.buffer))

  monkeypatch.setattr(staging.Slab, "__init__", making)
  free_slab = staging.StagingBuffers._free_slab  # pylint: disable=protected-access

  def freeing(buffers, nbytes):
    seen.largest = max(seen.largest, nbytes)
    slab = free_slab(buffers, nbytes)
    seen.peak = max(seen.peak, buffers.nbytes)
    return slab

  monkeypatch.setattr(staging.StagingBuffers, "_free_slab", freeing)
  return seen


class _RecordingTensorStore(types.ModuleType):
  """``tensorstore`` as `direct_read` uses it, its reads into buffers recorded."""

  def __init__(self, seen: _Watch):
    super().__init__("tensorstore")
    self.array = seen.read_into

  def __getattr__(self, name):
    return getattr(tensorstore, name)


def _all_undone(seen: _Watch) -> None:
  for locker in seen.lockers:
    assert not locker.locked, "a slab is still locked after the load"
    assert locker.closed, "a locker was never closed"
  assert not [c for c in seen.copies if c.host is not None and c.host.size], "a copy not waited for"


def _bounded(seen: _Watch) -> None:
  """Within the limit, but for an array larger than it beside the reads in
  flight (which no wait can free)."""
  own = -(-seen.largest // 4096) * 4096
  in_flight = direct_read.IN_FLIGHT_BYTES + staging.SLAB_BYTES
  assert seen.peak <= max(staging.LIMIT_BYTES, own + in_flight), (seen.peak, seen.largest)


def _unstaged(load):
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(streaming, "copies_to_device", lambda target: False)
    patch.setattr(streaming, "device_put", jax.device_put)
    return load()


def _every_dtype():
  rng = np.random.default_rng(7)
  tree = {
      "bool": jnp.asarray(rng.integers(0, 2, 301).astype(bool)),
      "int4": jnp.asarray(rng.integers(-8, 8, 333), dtype=jnp.int4),
      "uint4": jnp.asarray(rng.integers(0, 16, (3, 111)), dtype=jnp.uint4),
      "bf16": jnp.asarray(rng.standard_normal(999), dtype=jnp.bfloat16),
      "c64": jnp.asarray(rng.standard_normal(77) + 1j * rng.standard_normal(77), jnp.complex64),
      "scalar": jnp.float32(3.5),
      "scalar_i": jnp.asarray(7, jnp.int8),
      "empty": jnp.zeros((0, 7), jnp.float32),
      "empty_bf": jnp.zeros((5, 0), jnp.bfloat16),
      "numpy": np.arange(13, dtype=np.uint16),
  }
  for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz", "float8_e5m2fnuz"):
    tree[name] = jnp.asarray(rng.standard_normal(123), dtype=getattr(ml_dtypes, name))
  return tree


def _sized():
  """Arrays of exactly a slab, a byte either side, and larger than the limit."""
  slab = staging.SLAB_BYTES
  rng = np.random.default_rng(3)
  sizes = {
      "slab": slab,
      "slab_less": slab - 1,
      "slab_more": slab + 1,
      "over_limit": staging.LIMIT_BYTES + 5,
      "tiny": 1,
  }
  return {
      name: jnp.asarray(rng.integers(0, 256, n, dtype=np.uint8)) for name, n in sizes.items()
  } | {f"many_{i}": jnp.full((700 + i,), i, jnp.uint8) for i in range(30)}


@pytest.mark.parametrize("make", [_every_dtype, _sized], ids=["dtypes", "sizes"])
def test_staged_loads_of_every_dtype_and_size_are_the_unstaged_load(tmp_path, watch, make):
  tree = make()
  pzp.save(tmp_path / "ck", tree)
  expected = _unstaged(lambda: pzp.load(tmp_path / "ck"))
  assert_identical(expected, tree)
  assert_identical(pzp.load(tmp_path / "ck"), tree)
  assert watch.ever_locked > 0
  _all_undone(watch)
  _bounded(watch)


def test_an_array_over_the_limit_alone_passes_it(tmp_path, watch):
  tree = {"huge": jnp.arange(staging.LIMIT_BYTES, dtype=jnp.float32)}  # 4x the limit.
  pzp.save(tmp_path / "ck", tree)
  assert_identical(pzp.load(tmp_path / "ck"), tree)
  _all_undone(watch)
  assert watch.peak <= 4 * staging.LIMIT_BYTES + staging.SLAB_BYTES


def _penzai_model():
  return pz.nn.Linear.from_config(
      name="lin", init_base_rng=jax.random.key(1), input_axes={"i": 5}, output_axes={"o": 3}
  )


def test_penzai_models_and_views_load_staged(tmp_path, watch):
  model = _penzai_model()
  pzp.save_model(tmp_path / "m", model)
  assert_identical(pzp.load_model(tmp_path / "m"), model)
  assert_identical(pzp.load_into(tmp_path / "m", model), model)
  _all_undone(watch)


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))


def test_sharded_staged_loads_over_eight_devices(tmp_path, watch):
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  mesh = _mesh()
  rng = np.random.default_rng(5)
  tree = {
      "w": pz.nx.wrap(jnp.asarray(rng.standard_normal((64, 40)), jnp.float32)).tag("a", "b"),
      "v": pz.nx.wrap(jnp.asarray(rng.standard_normal((8,)), jnp.bfloat16)).tag("a"),
      "big": pz.nx.wrap(jnp.asarray(rng.integers(0, 9, (16, 3000)), jnp.int8)).tag("a", "b"),
  }
  pzp.save(tmp_path / "ck", tree)
  rules = pzp.AxisRules(mesh, {"a": "a", "b": "b"})
  expected = _unstaged(lambda: pzp.load(tmp_path / "ck", sharding=rules))
  loaded = pzp.load(tmp_path / "ck", sharding=rules)
  assert_identical(loaded, expected)
  assert loaded["w"].data_array.sharding == expected["w"].data_array.sharding
  assert len(loaded["w"].data_array.sharding.device_set) == 8
  _all_undone(watch)


def _entry_points(path):
  """Every public load that reads through the direct read, by name."""
  model_tree = {"w": pz.nx.wrap(jnp.arange(3000.0)).tag("x"), "b": jnp.ones(5)}

  def manager():
    with ocp.CheckpointManager(path / "run") as m:
      m.save(1, args=ocp.args.Composite(params=pzp.PenzaiSave(model_tree)))
      m.wait_until_finished()
    with ocp.CheckpointManager(path / "run") as m:
      return m.restore(1).params

  def pz_manager():
    with pzp.CheckpointManager(path / "pzrun") as m:
      m.save(1, params=model_tree)
      m.wait_until_finished()
      return m.restore(1)["params"]

  def v0():
    with ocp.Checkpointer(pzp.PenzaiCheckpointHandler()) as c:
      c.save(path / "v0", args=pzp.PenzaiSave(model_tree))
      return c.restore(path / "v0", args=pzp.PenzaiRestore())

  def v1():
    ocp_v1.save_checkpointables(path / "v1", {"model": model_tree})
    return ocp_v1.load_checkpointables(path / "v1")["model"]

  def lazy():
    pzp.save(path / "lazy", model_tree)
    with pzp.open(path / "lazy") as opened:
      return opened.load()

  return model_tree, [
      ("ocp.CheckpointManager", manager),
      ("pzp.CheckpointManager", pz_manager),
      ("v0 handler", v0),
      ("v1 handler", v1),
      ("lazy open", lazy),
  ]


@pytest.mark.parametrize("index", range(5))
def test_every_entry_point_stages_and_undoes_every_lock(tmp_path, watch, index):
  tree, points = _entry_points(tmp_path)
  name, call = points[index]
  before = watch.ever_locked
  assert_identical(call(), tree), name
  assert watch.ever_locked > before, f"{name} did not stage"
  _all_undone(watch)


# --- failures at every stage -------------------------------------------------


def _saved(tmp_path):
  tree = {f"a{i}": jnp.full((300 + 97 * i,), i, jnp.float32) for i in range(24)}
  tree |= {f"big{i}": jnp.arange(3000 + 1000 * i, dtype=jnp.float32) for i in range(6)}
  pzp.save(tmp_path / "ck", tree)
  return tmp_path / "ck", tree


def _failed(seen: _Watch, raised) -> None:
  """Every lock undone, and no slab held, even by the error still held."""
  _all_undone(seen)
  assert seen.alive() == 0, f"a slab outlives the failed load ({raised.value!r} holds it)"


def _fails_the_same(path, kind, **load):
  with pytest.raises(kind) as unstaged:
    _unstaged(lambda: pzp.load(path, **load))
  return str(unstaged.value)


def test_a_checksum_mismatch_names_the_array_and_holds_nothing(tmp_path, watch):
  path, _ = _saved(tmp_path)
  largest = max((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  largest.write_bytes(catalogue.flip_middle(largest.read_bytes()))
  message = _fails_the_same(path, errors.IntegrityError)
  with pytest.raises(errors.IntegrityError) as raised:
    pzp.load(path)
  assert str(raised.value) == message
  _failed(watch, raised)


def test_a_tensorstore_read_error_names_the_array_and_holds_nothing(tmp_path, watch, monkeypatch):
  path, _ = _saved(tmp_path)
  calls = {"n": 0}
  result = direct_read._result  # pylint: disable=protected-access

  def failing(key, future):
    value = result(key, future)
    if value is None:  # A copy into a staging buffer, not an open.
      calls["n"] += 1
      if calls["n"] == 3:
        raise errors.ArrayReadError(key, OSError("disk gone"))
    return value

  monkeypatch.setattr(direct_read, "_result", failing)
  message = _fails_the_same(path, errors.IntegrityError)
  calls["n"] = 0
  with pytest.raises(errors.IntegrityError) as raised:
    pzp.load(path)
  assert str(raised.value) == message and "disk gone" in message
  _failed(watch, raised)


@pytest.mark.parametrize("interrupt", [RuntimeError("put broke"), KeyboardInterrupt()])
def test_a_put_that_raises_undoes_every_lock(tmp_path, watch, interrupt):
  path, _ = _saved(tmp_path)
  watch.fail_put = interrupt
  with pytest.raises(type(interrupt)) as raised:
    pzp.load(path)
  watch.fail_put = None
  _failed(watch, raised)


@pytest.mark.parametrize("interrupt", [RuntimeError("copy broke"), KeyboardInterrupt()])
def test_a_copy_that_fails_when_waited_for_undoes_every_lock(tmp_path, watch, interrupt):
  path, _ = _saved(tmp_path)
  watch.fail_wait = interrupt
  with pytest.raises(type(interrupt)) as raised:
    pzp.load(path)
  watch.fail_wait = None
  for copy in watch.copies:
    copy.block_until_ready()  # What a real DMA would have done by now.
  _failed(watch, raised)


def test_a_wait_interrupted_every_time_does_not_hang_the_load(tmp_path, watch):
  path, _ = _saved(tmp_path)
  watch.fail_always = KeyboardInterrupt()
  with pytest.raises(KeyboardInterrupt):
    pzp.load(path)  # Returns: the copies it gave up on are the user's second Ctrl-C.


@pytest.mark.parametrize("interrupt", [RuntimeError("check broke"), KeyboardInterrupt()])
def test_a_check_that_raises_undoes_every_lock(tmp_path, watch, monkeypatch, interrupt):
  path, _ = _saved(tmp_path)
  check = checksums_lib.check
  calls = {"n": 0}

  def failing(array, recorded):
    calls["n"] += 1
    if calls["n"] == 5:
      raise interrupt
    return check(array, recorded)

  monkeypatch.setattr(checksums_lib, "check", failing)
  with pytest.raises(type(interrupt)) as raised:
    pzp.load(path)
  _failed(watch, raised)


@pytest.mark.parametrize("interrupt", [MemoryError("no slab"), KeyboardInterrupt()])
def test_buffer_for_that_raises_undoes_every_lock(tmp_path, watch, monkeypatch, interrupt):
  path, _ = _saved(tmp_path)
  take = staging.StagingBuffers.take
  calls = {"n": 0}

  def failing(buffers, shape, dtype):
    calls["n"] += 1
    if calls["n"] == 12:
      raise interrupt
    return take(buffers, shape, dtype)

  monkeypatch.setattr(staging.StagingBuffers, "take", failing)
  with pytest.raises(type(interrupt)) as raised:
    pzp.load(path)
  _failed(watch, raised)


@pytest.mark.parametrize("interrupt", [RuntimeError("progress broke"), KeyboardInterrupt()])
def test_a_progress_callback_that_raises_undoes_every_lock(tmp_path, watch, interrupt):
  path, _ = _saved(tmp_path)
  calls = {"n": 0}

  def progress(*args, **kwargs):
    calls["n"] += 1
    if calls["n"] == 8:
      raise interrupt

  with pytest.raises(type(interrupt)) as raised:
    pzp.load(path, progress=progress)
  _failed(watch, raised)


class _RaisingLocker(test_staging._FakeLocker):  # pylint: disable=protected-access
  """A driver call that raises (not returns False) in lock or unlock."""

  def __init__(self, where: str):
    super().__init__()
    self.where = where

  def lock(self, buffer):
    if self.where == "lock" and self.ever_locked == 2:
      raise OSError("cuCtxPushCurrent_v2 failed")
    return super().lock(buffer)

  def unlock(self, buffer):
    super().unlock(buffer)
    if self.where == "unlock":  # Unregistered, then the context's pop failed.
      self.where = ""
      raise OSError("cuCtxPopCurrent_v2 failed")


@pytest.mark.parametrize("where", ["lock", "unlock"])
def test_a_locker_that_raises_neither_fails_the_load_nor_leaves_locks(tmp_path, watch, monkeypatch, where):
  """Page-locking is not needed for correctness: a driver call that fails
  (CUDA error from a push or pop of the context) leaves the load as it is."""
  path, tree = _saved(tmp_path)
  locker = _RaisingLocker(where)
  monkeypatch.setattr(page_locking, "locker_for", lambda device: locker)
  assert_identical(pzp.load(path), tree)
  assert not locker.locked and locker.closed


def test_a_failed_cuda_context_push_leaves_slabs_pageable(small_slabs):
  driver = test_staging._FakeCudaDriver()  # pylint: disable=protected-access
  locker = page_locking._CudaDriverLocker(driver, 0)  # pylint: disable=protected-access
  driver.cuCtxPushCurrent_v2 = lambda context: 201  # CUDA_ERROR_INVALID_CONTEXT
  buffers = staging.StagingBuffers(locker, make_room=lambda: False)
  buffers.take((10,), np.dtype(np.float32))
  assert buffers.locked_bytes == 0
  buffers.close()
  assert driver.retained == 0 and not driver.registered


@pytest.fixture
def small_slabs(monkeypatch):
  test_staging._use_small_slabs(monkeypatch)  # pylint: disable=protected-access


# --- concurrency and reuse -----------------------------------------------------


def test_two_staged_loads_at_once_on_two_threads(tmp_path, watch):
  path, tree = _saved(tmp_path)
  results: dict[int, object] = {}

  def load(i):
    results[i] = pzp.load(path)

  threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert set(results) == {0, 1}
  for value in results.values():
    assert_identical(value, tree)
  _all_undone(watch)


def test_a_load_inside_a_loads_progress_callback(tmp_path, watch):
  path, tree = _saved(tmp_path)
  inner: list[object] = []

  def progress(*args, **kwargs):
    if not inner:
      inner.append(pzp.load(path))

  assert_identical(pzp.load(path, progress=progress), tree)
  assert_identical(inner[0], tree)
  _all_undone(watch)


def test_consecutive_loads_start_clean(tmp_path, watch):
  path, tree = _saved(tmp_path)
  for _ in range(3):
    assert_identical(pzp.load(path), tree)
    _all_undone(watch)
  assert watch.alive() == 0


def test_raw_chunks_and_tensorstore_reads_share_slabs_correctly(tmp_path, watch, monkeypatch):
  """Small raw-chunk arrays and ts.open arrays interleaved through one
  placer, with slabs reused between them, keep their own bytes."""
  monkeypatch.setattr(raw_chunks, "IN_FLIGHT_BYTES", 2 * _KIB)
  monkeypatch.setattr(direct_read, "IN_FLIGHT_BYTES", 2 * _KIB)
  rng = np.random.default_rng(11)
  tree = {f"r{i}": jnp.asarray(rng.standard_normal(50 + 313 * i), jnp.float32) for i in range(20)}
  pzp.save(tmp_path / "ck", tree)
  assert_identical(pzp.load(tmp_path / "ck"), tree)
  _all_undone(watch)
  _bounded(watch)


def test_ctypes_signatures_of_the_driver_calls():
  """Each argument `page_locking` passes has the C type of the driver's
  signature (CUresult f(...)): pointers as c_void_p, sizes as size_t."""
  driver = test_staging._FakeCudaDriver()  # pylint: disable=protected-access
  locker = page_locking._CudaDriverLocker(driver, 3)  # pylint: disable=protected-access
  assert locker._device.value == 3  # pylint: disable=protected-access
  buffer = np.zeros(2 * 4096 + 1, np.uint8)
  assert locker.lock(buffer)
  assert driver.registered == {buffer.ctypes.data: buffer.nbytes}
  locker.unlock(buffer)
  locker.close()
  assert not driver.registered and driver.retained == 0
  assert ctypes.sizeof(ctypes.c_size_t) == 8


class _FakeGpu:
  platform = "gpu"
  client = type("Client", (), {"platform_version": "cuda 12.8"})()

  def __init__(self, ordinal):
    self.local_hardware_id = ordinal


@pytest.mark.parametrize("ordinal", [None, -1])
def test_a_gpu_without_a_cuda_ordinal_gets_no_locker(monkeypatch, ordinal):
  """PJRT's local_hardware_id is the CUDA ordinal, or -1 where undefined:
  then no other GPU's primary context is retained in its place."""
  driver = test_staging._FakeCudaDriver()  # pylint: disable=protected-access
  monkeypatch.setattr(page_locking, "_cuda_driver", lambda: driver)
  assert page_locking.locker_for(_FakeGpu(ordinal)) is None
  assert driver.retained == 0
  locker = page_locking.locker_for(_FakeGpu(2))
  assert locker is not None and driver.retained == 1
  locker.close()


@pytest.mark.parametrize("value", ["0", "off", "False", " no "])
def test_the_environment_turns_page_locking_off(monkeypatch, value):
  """``PZ_PERSIST_PAGE_LOCKING=0``: the user's way out where a driver
  misbehaves; no context is retained, nothing is locked."""
  driver = test_staging._FakeCudaDriver()  # pylint: disable=protected-access
  monkeypatch.setattr(page_locking, "_cuda_driver", lambda: driver)
  monkeypatch.setenv(page_locking.SWITCH, value)
  assert page_locking.locker_for(_FakeGpu(0)) is None
  assert driver.retained == 0
  monkeypatch.setenv(page_locking.SWITCH, "1")
  locker = page_locking.locker_for(_FakeGpu(0))
  assert locker is not None and driver.retained == 1
  locker.close()


@pytest.mark.parametrize("value", ["2", "disable", "0x0"])
def test_a_page_locking_switch_neither_on_nor_off_is_refused(monkeypatch, tmp_path, value):
  """A value that is neither on nor off is named, not guessed at, by the
  load that would have locked memory, and the load leaves nothing behind."""
  monkeypatch.setenv(page_locking.SWITCH, value)
  with pytest.raises(errors.ArgumentError, match=f"{page_locking.SWITCH}={value!r}"):
    page_locking.locker_for(_FakeGpu(0))
  path = tmp_path / "ckpt"
  pzp.save(path, {"x": jnp.arange(10.0)})
  # Every load checks it before reading, on any device: a typo made on a CPU
  # machine is named there, not first on the GPU job it was meant for.
  for load in (
      lambda: pzp.load(path),
      lambda: pzp.load(path, verify=False),
      lambda: pzp.open(path).load(),
  ):
    with pytest.raises(errors.ArgumentError, match=f"{page_locking.SWITCH}={value!r}"):
      load()
  monkeypatch.setattr(streaming, "copies_to_device", lambda target: target is not None)
  monkeypatch.setattr(streaming, "device_put", test_staging._copying_put)  # pylint: disable=protected-access
  with pytest.raises(errors.ArgumentError, match="0 \\(page-lock no read buffers\\)"):
    pzp.load(path)
  monkeypatch.setenv(page_locking.SWITCH, "0")
  assert np.array_equal(pzp.load(path)["x"], np.arange(10.0))


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(
    st.lists(
        st.sampled_from([0, 1, 63, 64, 65, 4095, 8191, 8192, 8193, 20_000, 32_768, 40_000]),
        min_size=1,
        max_size=30,
    )
)
def test_slabs_stay_within_the_limit_but_for_an_array_larger(sizes):
  """Read one at a time (nothing in flight), the slabs never pass
  ``LIMIT_BYTES`` but to hold one array larger than it, and every array
  placed is its own bytes though slabs are reused."""
  with pytest.MonkeyPatch.context() as patch:
    test_staging._use_small_slabs(patch)  # pylint: disable=protected-access
    seen = _Watch()
    patch.setattr(page_locking, "locker_for", lambda device: seen.locker())
    specs = [
        arrays_lib.ArraySpec(key=f"a{i}", shape=(n,), dtype="uint8", kind="jax")
        for i, n in enumerate(sizes)
    ]
    target = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with streaming.Placer(
        {spec.key: target for spec in specs}, None, staged=lambda t: True, put=seen.put
    ) as placer:
      for i, spec in enumerate(specs):
        host = placer.buffer_for(spec)
        assert host is not None
        host[...] = (np.arange(spec.shape[0]) + i) % 251
        placer.take(spec, host)
        own = -(-spec.shape[0] // 4096) * 4096
        slabs = placer._staging.nbytes if placer._staging else 0  # pylint: disable=protected-access
        assert slabs <= max(staging.LIMIT_BYTES, own + staging.SLAB_BYTES)
      placed = placer.finish()
    for i, spec in enumerate(specs):
      expected = (np.arange(spec.shape[0]) + i) % 251
      np.testing.assert_array_equal(placed[spec.key].value, expected.astype(np.uint8))
    _all_undone(seen)
