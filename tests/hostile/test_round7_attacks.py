"""Holes closed in round 7 (the streaming load), kept as tests.

Each test is a class of hole; the fix lives where the guarantee is
enforced, named in the test's docstring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from penzai import pz

import pz_persist as pzp
from pz_persist import errors


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs several devices")
def test_a_sharding_that_cannot_hold_an_array_is_refused_naming_it(tmp_path):
  """One ``sharding=`` for a whole tree that does not divide one of its
  arrays raised JAX's ``IndivisibleError``, naming neither the checkpoint nor
  the array. The read's plan (`pz_persist.storage.reading.reader.plan`, which
  every load goes through before anything is allocated) refuses it with an
  `ArgumentError` naming both and the way out, for each entry point."""
  path = tmp_path / "ck"
  pzp.save(path, {"w": pz.nx.wrap(jnp.arange(6.0)).tag("rows"), "ok": jnp.ones((8, 2))})
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
  spread = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  with pytest.raises(errors.ArgumentError, match=r"tree\['w'\].*shape \[6\].*AxisRules"):
    pzp.load(path, sharding=spread)
  with pytest.raises(errors.ArgumentError, match=r"tree\['w'\]"):
    with ocp.Checkpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
      checkpointer.restore(path / "penzai", args=pzp.PenzaiRestore(sharding=spread))
  with pytest.raises(errors.ArgumentError, match=r"tree\['w'\]"):
    pzp.open(path).load(sharding=spread)


def _damage_one_value(item, spec) -> None:
  """Changes one stored value of ``spec``'s array behind pz_persist's back."""
  import tensorstore as ts

  from pz_persist.storage.reading import direct_read

  store = direct_read.open_array(item, spec.key)
  writable = ts.open(store.spec().to_json(), read=True, write=True).result()
  writable[(0,) * len(spec.shape)] = -1


def _tracked_reads(monkeypatch) -> list:
  """Weak references to every host buffer a load reads and every array it
  places (a CPU ``jax.Array`` adopts its host buffer)."""
  import weakref

  from pz_persist.storage.reading import streaming

  refs: list = []
  take, device_put = streaming.Placer.take, streaming.jax.device_put

  def tracking_take(self, spec, host):
    refs.append(weakref.ref(host))
    return take(self, spec, host)

  def tracking_device_put(hosts, target):
    placed = device_put(hosts, target)
    refs.extend(weakref.ref(array) for array in placed)
    return placed

  monkeypatch.setattr(streaming.Placer, "take", tracking_take)
  monkeypatch.setattr(streaming.jax, "device_put", tracking_device_put)
  return refs


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs several devices")
def test_a_failed_load_keeps_nothing_it_read_while_its_error_is_held(tmp_path, monkeypatch):
  """A load refused after its arrays were read and placed (damaged bytes, a
  file changed during the read) kept every array alive for as long as its
  exception was: the traceback held the reader's frames, whose locals held
  the placed arrays (on an accelerator the whole model, in device memory,
  for as long as a notebook keeps its last error). Fixed where every direct
  load goes: `streaming.Placer` drops what it placed when left on an error,
  `reader._read_directly` refuses damage before handing anything out, and
  `reader.read_arrays` drops what it read when the load fails after it."""
  import gc

  from pz_persist.format import manifest as manifest_lib
  from pz_persist.storage.integrity import containment

  path = tmp_path / "ck"
  pzp.save(path, {f"w{i}": pz.nx.wrap(jnp.full((8, 4), float(i))).tag("r", "c") for i in range(6)})
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  spread = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("b"))
  refs = _tracked_reads(monkeypatch)
  assert pzp.load(path, sharding=spread)  # Reads are tracked.
  assert refs

  def alive() -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)

  # A file found changed once everything was read and checked.
  refs.clear()
  real = containment.files_unchanged

  def changed_after(directory, before=None):
    import contextlib

    @contextlib.contextmanager
    def check():
      with real(directory, before=before):
        yield
      raise errors.UnsafeCheckpointError(f"{directory}: a file changed while it was read")
    return check()

  monkeypatch.setattr(containment, "files_unchanged", changed_after)
  with pytest.raises(errors.UnsafeCheckpointError) as refused:
    pzp.load(path, sharding=spread)
  assert refs and alive() == 0, refused
  monkeypatch.setattr(containment, "files_unchanged", real)

  # Damaged bytes, found by the checks.
  item = path / "penzai"
  _damage_one_value(item, manifest_lib.read(item).arrays[2])
  for sharding in (spread, None):
    refs.clear()
    with pytest.raises(errors.IntegrityError) as damaged:
      pzp.load(path, sharding=sharding)
    assert refs and alive() == 0, damaged


def test_damaged_arrays_are_named_in_the_checkpoints_order_whatever_thread_checked_first(
    tmp_path, monkeypatch):
  """Checks now run on a pool of threads, and the damaged arrays were listed
  (in the message and in ``IntegrityError.damaged``) in the order their
  checks happened to finish: the same damaged checkpoint gave a different
  report from one load to the next. Fixed in `reader._Verifier` (which every
  load's checks go through): damage is reported in the manifest's order."""
  import threading

  from pz_persist.format import manifest as manifest_lib
  from pz_persist.storage.integrity import hashing_threads
  from pz_persist.storage.reading import reader
  from pz_persist.storage.reading import streaming

  path = tmp_path / "ck"
  pzp.save(path, {f"w{i}": pz.nx.wrap(jnp.full((16,), float(i))).tag("r") for i in range(4)})
  item = path / "penzai"
  specs = manifest_lib.read(item).arrays
  for spec in specs:
    _damage_one_value(item, spec)
  monkeypatch.setattr(streaming, "BATCH_BYTES", 1)  # A check task per array.
  monkeypatch.setattr(hashing_threads, "thread_count", lambda: 4)
  last_checked = threading.Event()
  check = reader.checksums_lib.check

  def first_array_checked_last(array, recorded):
    if recorded == specs[0].checksums:
      assert last_checked.wait(timeout=120)
    found = check(array, recorded)
    if recorded == specs[-1].checksums:
      last_checked.set()
    return found

  monkeypatch.setattr(reader.checksums_lib, "check", first_array_checked_last)
  with pytest.raises(errors.IntegrityError) as caught:
    pzp.load(path, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  assert [line.split(" (key")[0] for line in caught.value.damaged] == [
      spec.describe() for spec in specs]


def test_ctrl_c_during_verify_stops_the_file_checks_not_yet_started(tmp_path, monkeypatch):
  """``pz-persist verify`` hashes the checkpoint's files on a pool of
  threads; on Ctrl-C (or any error) the pool was left by waiting for every
  file still queued to be hashed, so a large checkpoint went on being read
  for minutes after the user asked it to stop. Fixed in
  `hashing_threads.ordered_results` (through which every threaded hashing
  goes: saves, loads' file checks, verify): leaving it cancels what has not
  started."""
  import concurrent.futures
  import threading

  from pz_persist.storage.integrity import checksums
  from pz_persist.storage.integrity import hashing_threads

  path = tmp_path / "ck"
  pzp.save(path, {f"w{i}": jnp.full((4,), float(i)) for i in range(8)})
  monkeypatch.setattr(hashing_threads, "thread_count", lambda: 2)
  calls: list[str] = []
  queue_settled = threading.Event()
  digest = checksums.file_digest

  # The first file verify waits for is interrupted (the one whose result the
  # caller asks for first: interrupting another would leave the caller
  # waiting on a check that waits for the pool to settle).
  import json
  import os

  from pz_persist.format import manifest as manifest_lib
  from pz_persist.storage.integrity import file_digests

  with open(os.path.join(path, "penzai", manifest_lib.FILE_DIGESTS_FILENAME)) as f:
    recorded = [rel for rel in json.load(f)["files"] if rel != file_digests._ORBAX_METADATA]  # pylint: disable=protected-access
  first = os.path.join(path, "penzai", recorded[0])

  def interrupted_first(full):
    calls.append(full)
    if os.fspath(full) == os.fspath(first):
      raise KeyboardInterrupt
    assert queue_settled.wait(timeout=120)  # Until the pool cancels or runs the rest.
    return digest(full)

  shutdown = concurrent.futures.ThreadPoolExecutor.shutdown

  def settling_shutdown(self, wait=True, *, cancel_futures=False):
    shutdown(self, wait=False, cancel_futures=cancel_futures)
    queue_settled.set()
    shutdown(self, wait=wait)

  monkeypatch.setattr(checksums, "file_digest", interrupted_first)
  monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "shutdown", settling_shutdown)
  before = set(threading.enumerate())
  with pytest.raises(KeyboardInterrupt):
    pzp.verify(path, progress=False)
  assert len(calls) <= 3, calls  # The interrupted one and one more per thread.
  assert set(threading.enumerate()) <= before


def test_arrays_bound_for_many_places_are_not_all_held_back_until_the_end(monkeypatch):
  """`streaming.Placer` gathered arrays into one batch per target and sent a
  batch only once it held `BATCH_BYTES`: a tree placed in many different
  ways (``load_into`` a model sharded across meshes, per-array placements,
  AxisRules over arrays of many ranks) kept up to ``BATCH_BYTES`` per
  distinct placement in host memory, unchecked and uncopied, outside the
  window (here, everything until the end). Fixed in `streaming.Placer.take`:
  the bytes batched for every target together stay under `BATCH_BYTES`."""
  from pz_persist.format import array_specs as arrays_lib
  from pz_persist.storage.reading import streaming

  held = {"taken": 0, "sent": 0, "most": 0}

  def device_put(hosts, target):
    del target
    held["sent"] += sum(host.nbytes for host in hosts)
    return [jnp.asarray(host) for host in hosts]

  monkeypatch.setattr(streaming.jax, "device_put", device_put)
  monkeypatch.setattr(streaming, "BATCH_BYTES", 1024)
  monkeypatch.setattr(streaming, "WINDOW_BYTES", 4096)
  specs = [arrays_lib.ArraySpec(key=f"a{i}", shape=(128,), dtype="float32", kind="jax",
                                path=f"a{i}") for i in range(64)]
  targets = {spec.key: f"place {i}" for i, spec in enumerate(specs)}  # 64 distinct.
  with streaming.Placer(targets, None) as placer:  # type: ignore[arg-type]
    for i, spec in enumerate(specs):
      placer.take(spec, np.full(spec.shape, i, np.float32))
      held["taken"] += 512
      held["most"] = max(held["most"], held["taken"] - held["sent"])
    placed = placer.finish()
  assert held["most"] <= 1024 + 512, held  # The batch bytes, plus the array that crossed them.
  for i, spec in enumerate(specs):
    np.testing.assert_array_equal(placed[spec.key], np.full(spec.shape, i, np.float32))


# Attacks that found nothing, kept as guards of the surface.


def _every_dtype_tree() -> dict:
  """Leaves of every kind a sharded direct load must place unchanged; each
  jax.Array's leading axis divides by 8."""
  rng = np.random.default_rng(7)
  return {
      "f32": jnp.asarray(rng.standard_normal((8, 6)), jnp.float32),
      "bf16": jnp.asarray(rng.standard_normal((16, 3)), jnp.bfloat16),
      "int4": jnp.asarray(rng.integers(-8, 8, (8, 4)), jnp.int4),
      "bool": jnp.asarray(rng.integers(0, 2, (8,)).astype(bool)),
      "c64": jnp.asarray(rng.standard_normal((8, 2)) + 1j, jnp.complex64),
      "empty": jnp.zeros((0, 8), jnp.float32),
      "keys": jax.random.split(jax.random.key(4), 8),
      "u8": jnp.arange(64, dtype=jnp.uint8).reshape(8, 8),
      "numpy": rng.standard_normal((3, 5)),
      "numpy_scalar": np.float32(2.5),
  }


def _assert_every_shard_is_saved(loaded, saved, sharding) -> None:
  for name, want in saved.items():
    got = loaded[name]
    if not isinstance(want, jax.Array):
      assert type(got) is type(want), name
      np.testing.assert_array_equal(got, want)
      continue
    assert got.sharding.is_equivalent_to(sharding, got.ndim), (name, got.sharding)
    if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
      assert got.dtype == want.dtype, name
      got, want = jax.random.key_data(got), jax.random.key_data(want)
    assert (got.dtype, got.shape) == (want.dtype, want.shape), name
    full = np.asarray(want)
    for shard in got.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index], err_msg=name)


def _mesh_shardings() -> dict:
  devices = np.array(jax.devices()[:8])
  line = jax.sharding.Mesh(devices, ("x",))
  grid = jax.sharding.Mesh(devices.reshape(2, 4), ("a", "b"))
  part = jax.sharding.Mesh(devices[2:6], ("x",))
  named = jax.sharding.NamedSharding
  spec = jax.sharding.PartitionSpec
  return {
      "rows over 8": named(line, spec("x")),
      "partially replicated": named(grid, spec("b")),
      "two axes on one dim": named(grid, spec(("a", "b"))),
      "replicated": named(grid, spec()),
      "a subset of the devices": named(part, spec("x")),
      "pinned host memory": named(grid, spec("a"), memory_kind="pinned_host"),
      "one device, not the first": jax.sharding.SingleDeviceSharding(
          jax.devices()[5], memory_kind="unpinned_host"),
  }


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
@pytest.mark.parametrize("kind", list(_mesh_shardings()))
def test_guard_sharded_direct_loads_place_every_shard_of_every_dtype(tmp_path, kind, monkeypatch):
  """Guard: one host's meshes (split, partially replicated, over a subset of
  the devices, with a memory kind) take the direct read, through several
  windows; every shard of every dtype is the saved one, through pzp.load,
  pzp.open(...).load and the Orbax handler, and no thread is left."""
  import threading

  import orbax.checkpoint as ocp

  from pz_persist.storage.reading import direct_read
  from pz_persist.storage.reading import streaming

  monkeypatch.setattr(streaming, "BATCH_BYTES", 64)
  monkeypatch.setattr(streaming, "WINDOW_BYTES", 256)
  sharding = _mesh_shardings()[kind]
  assert direct_read.applies({"any": sharding})
  tree = _every_dtype_tree()
  pzp.save(tmp_path / "ck", tree)
  before = set(threading.enumerate())
  _assert_every_shard_is_saved(pzp.load(tmp_path / "ck", sharding=sharding), tree, sharding)
  _assert_every_shard_is_saved(pzp.open(tmp_path / "ck").load(sharding=sharding), tree, sharding)
  with ocp.Checkpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
    restored = checkpointer.restore(tmp_path / "ck" / "penzai",
                                    args=pzp.PenzaiRestore(sharding=sharding))
  _assert_every_shard_is_saved(restored, tree, sharding)
  assert {t for t in threading.enumerate() if t.name.startswith("pz_persist checks")} <= before


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
@pytest.mark.parametrize("where", ["check", "read"])
def test_guard_ctrl_c_in_a_check_or_a_read_of_a_sharded_load_leaves_no_thread(
    tmp_path, monkeypatch, where):
  """Guard: a KeyboardInterrupt raised in one array's check (on a pool
  thread) or as an array is handed over from the read reaches the caller as
  itself, and no thread the load started is left running."""
  import threading

  from pz_persist.storage.reading import reader
  from pz_persist.storage.reading import streaming

  monkeypatch.setattr(streaming, "BATCH_BYTES", 64)
  pzp.save(tmp_path / "ck", {f"w{i}": jnp.full((8, 4), float(i)) for i in range(12)})
  calls = []
  if where == "check":
    check = reader.checksums_lib.check

    def interrupted(array, recorded):
      calls.append(1)
      if len(calls) == 5:
        raise KeyboardInterrupt
      return check(array, recorded)

    monkeypatch.setattr(reader.checksums_lib, "check", interrupted)
  else:
    take = streaming.Placer.take

    def interrupted_take(self, spec, host):
      calls.append(1)
      if len(calls) == 5:
        raise KeyboardInterrupt
      return take(self, spec, host)

    monkeypatch.setattr(streaming.Placer, "take", interrupted_take)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
  before = set(threading.enumerate())
  with pytest.raises(KeyboardInterrupt):
    pzp.load(tmp_path / "ck", sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("b")))
  assert set(threading.enumerate()) <= before


@pytest.mark.parametrize("hashing", ["digest_of", "file_digest"])
def test_guard_a_save_interrupted_while_hashing_leaves_nothing_that_looks_complete(
    tmp_path, monkeypatch, hashing):
  """Guard: Ctrl-C while a save hashes its arrays or its files (now on a pool
  of threads) leaves no checkpoint at the path, and no thread."""
  import threading

  from pz_persist.storage.integrity import checksums

  hash_ = getattr(checksums, hashing)
  calls = []

  def interrupted(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
      raise KeyboardInterrupt
    return hash_(*args, **kwargs)

  monkeypatch.setattr(checksums, hashing, interrupted)
  before = set(threading.enumerate())
  with pytest.raises(KeyboardInterrupt):
    pzp.save(tmp_path / "ck", {f"w{i}": jnp.full((8, 4), float(i)) for i in range(6)})
  assert not (tmp_path / "ck").exists()
  with pytest.raises(errors.PzPersistError):
    pzp.load(tmp_path / "ck")
  assert {t for t in threading.enumerate() if t.name.startswith("pz_persist")} <= before


def test_a_subclass_of_a_stateful_layer_is_sampled_as_its_nearest_listed_class():
  """Two branches added sampling forms at once: one matched stateful layers
  by exact class (so `KimiDeltaAttention`, a `GatedDeltaNet`, got its own
  form once), which left `FalconH1Mamba2`, a `Mamba2` subclass listed
  nowhere, unconverted: Falcon-H1's KV-cache sampling refused to run. Each
  layer now takes the form of the listed class nearest in its ancestry
  (`pz_persist.pretrained.sampling._stateful_kind`)."""
  from pz_persist.nn.gated_delta_net import GatedDeltaNet
  from pz_persist.nn.kimi_delta_attention import KimiDeltaAttention
  from pz_persist.nn.mamba2 import FalconH1Mamba2
  from pz_persist.nn.mamba2 import Mamba2
  from pz_persist.pretrained import sampling

  def kind_of(cls):
    return sampling._stateful_kind(object.__new__(cls))  # pylint: disable=protected-access

  assert kind_of(FalconH1Mamba2) is Mamba2
  assert kind_of(KimiDeltaAttention) is KimiDeltaAttention
  assert kind_of(GatedDeltaNet) is GatedDeltaNet
  assert sampling._stateful_kind(pz.nn.Identity()) is None  # pylint: disable=protected-access
