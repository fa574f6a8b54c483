"""Arrays placed as they are read (`pz_persist.storage.reading.streaming`).

On an accelerator the point is that host memory holds a bounded window of
copies, not the whole model; CI has no accelerator, so the window is checked
with a recording ``device_put`` standing in for a device's asynchronous copy,
and the real path is checked end to end on CPU devices with windows and
batches small enough that every load goes through many of them.
"""

from __future__ import annotations

import threading

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from penzai import pz
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import array_specs as arrays_lib
from pz_persist.storage.reading import streaming


def _spec(key: str, nbytes: int) -> arrays_lib.ArraySpec:
  return arrays_lib.ArraySpec(key=key, shape=(nbytes // 4,), dtype="float32", kind="jax", path=key)


class _AsyncCopies:
  """A ``device_put`` whose copies finish only when waited for, recording
  the host bytes not yet copied (what a GPU client holds on to)."""

  def __init__(self):
    self.unfinished = 0
    self.most_unfinished = 0
    self.calls = 0

  def device_put(self, hosts, target):
    del target
    self.calls += 1
    self.unfinished += sum(h.nbytes for h in hosts)
    self.most_unfinished = max(self.most_unfinished, self.unfinished)
    return [_Copy(self, h) for h in hosts]


class _Copy:
  def __init__(self, copies: _AsyncCopies, host: np.ndarray):
    self._copies, self.value, self._done = copies, host.copy(), False

  def block_until_ready(self):
    if not self._done:
      self._done = True
      self._copies.unfinished -= self.value.nbytes
    return self


def test_copies_on_the_way_stay_within_the_window(monkeypatch):
  copies = _AsyncCopies()
  monkeypatch.setattr(streaming.jax, "device_put", copies.device_put)
  monkeypatch.setattr(streaming, "WINDOW_BYTES", 1000)
  monkeypatch.setattr(streaming, "BATCH_BYTES", 300)
  sizes = [40, 80, 400, 16, 16, 16, 1200, 200, 200, 200, 8, 600, 44]
  specs = [_spec(f"a{i}", n) for i, n in enumerate(sizes)]
  target = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  with streaming.Placer({s.key: target for s in specs}, None) as placer:
    for i, spec in enumerate(specs):
      placer.take(spec, np.full(spec.shape, i, np.float32))
    placed = placer.finish()
  assert copies.unfinished == 0
  # At most the window, plus the batch that crossed it (here the largest array).
  assert copies.most_unfinished <= 1000 + 1200
  assert copies.calls < len(specs), "small arrays must be copied in batches"
  for i, spec in enumerate(specs):
    np.testing.assert_array_equal(placed[spec.key].value, np.full(spec.shape, i, np.float32))


def test_checks_run_on_other_threads_and_all_finish_before_finish_returns():
  threads, checked = set(), []
  release = threading.Event()

  def check(spec, host):
    threads.add(threading.current_thread().name)
    release.wait()
    checked.append(spec.key)

  specs = [_spec(f"a{i}", 64) for i in range(6)]
  with streaming.Placer(dict.fromkeys([s.key for s in specs]), check) as placer:
    for spec in specs:
      placer.take(spec, np.zeros(spec.shape, np.float32))
    assert len(checked) < len(specs)  # Taking never waits for a check...
    release.set()
    placer.finish()
  assert sorted(checked) == sorted(s.key for s in specs)  # ...finishing waits for all.
  assert threading.current_thread().name not in threads


def test_an_exception_in_a_check_surfaces_from_finish():
  def check(spec, host):
    raise RuntimeError(f"cannot check {spec.key}")

  spec = _spec("a", 64)
  with streaming.Placer({"a": None}, check) as placer:
    placer.take(spec, np.zeros(spec.shape, np.float32))
    with pytest.raises(RuntimeError, match="cannot check a"):
      placer.finish()


@pytest.fixture
def small_windows(monkeypatch):
  """Every load goes through many windows and batches."""
  monkeypatch.setattr(streaming, "WINDOW_BYTES", 2048)
  monkeypatch.setattr(streaming, "BATCH_BYTES", 512)


_shapes = st.lists(
    st.tuples(st.integers(0, 40), st.integers(1, 30), st.sampled_from(["float32", "int8", "bfloat16"])),
    min_size=1, max_size=12,
)


@hypothesis.settings(max_examples=25, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(shapes=_shapes, device=st.integers(0, 3), numpy_every=st.integers(2, 5))
def test_load_through_small_windows_is_the_saved_tree(tmp_path_factory, small_windows, shapes,
                                                       device, numpy_every):
  rng = np.random.default_rng(len(shapes))
  tree = {}
  for i, (rows, cols, dtype) in enumerate(shapes):
    data = rng.standard_normal((rows, cols)).astype(jnp.dtype(dtype))
    tree[f"p{i}"] = data if i % numpy_every == 0 else pz.ParameterValue(
        label=f"p{i}", value=pz.nx.wrap(jnp.asarray(data)).tag("rows", "cols"))
  path = tmp_path_factory.mktemp("ckpt") / "c"
  pzp.save(path, tree)
  target = jax.devices()[device]
  loaded = pzp.load(path, sharding=jax.sharding.SingleDeviceSharding(target))
  assert_identical(loaded, tree)
  for leaf in jax.tree.leaves(loaded):
    if isinstance(leaf, jax.Array):
      assert leaf.devices() == {target}


def test_damage_is_reported_through_small_windows(tmp_path, small_windows):
  tree = {f"w{i}": pzp_param(f"w{i}", np.full((300,), i, np.float32)) for i in range(8)}
  pzp.save(tmp_path / "c", tree)
  damaged = _damage_one_chunk(tmp_path / "c")
  with pytest.raises(errors.IntegrityError, match="do not match the checksums") as caught:
    pzp.load(tmp_path / "c")
  assert damaged in str(caught.value)


def pzp_param(label, data):
  return pz.ParameterValue(label=label, value=pz.nx.wrap(jnp.asarray(data)).tag("x"))


def _damage_one_chunk(path) -> str:
  """Changes one stored value of one array behind pz_persist's back; returns its label."""
  import tensorstore as ts

  from pz_persist.format import manifest as manifest_lib
  from pz_persist.storage.reading import direct_read

  item = path / "penzai"
  spec = manifest_lib.read(item).arrays[3]
  store = direct_read.open_array(item, spec.key)
  context = store.spec().to_json()
  writable = ts.open(context, read=True, write=True).result()
  writable[0] = -1.0
  return spec.label
