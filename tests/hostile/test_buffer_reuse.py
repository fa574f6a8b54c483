"""Read buffers are reused across loads, never while anything uses them.

`pz_persist.storage.reading.host_memory.aligned_empty` hands the memory of a dead
array's buffer to the next load of the same size (a notebook reloading a
model maps nothing new). The hole this closes for good: a load writing into
memory that an array the user still holds (the previous result, a NumPy view
of it, a ``jax.Array`` that adopted it) still uses. Every test here loads two
checkpoints of the same shapes and different values, so that reused memory
would show as changed values.
"""

from __future__ import annotations

import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python

import pz_persist as pzp
from pz_persist.storage.reading import host_memory

_SHAPES = {"w": (64, 256), "v": (3, 1000), "n": (32, 128), "big": (640, 512)}
""""n" stays NumPy. The small arrays are read as raw chunks, each into heap
memory of its own (`pz_persist.storage.reading.raw_chunks`: the C heap reuses it by
itself), "big" (over 1 MiB) by TensorStore into a mapping of its own: so a
load makes `_PER_LOAD` mappings, which the pool reuses; the values of every
array are checked either way."""
_PER_LOAD = 1
_MAPPED = ("big",)


def _tree(seed: int) -> dict:
  rng = np.random.default_rng(seed)
  tree = {key: rng.standard_normal(shape, dtype=np.float32) for key, shape in _SHAPES.items()}
  return {key: value if key == "n" else jnp.asarray(value) for key, value in tree.items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """Two checkpoints of the same shapes: ``(path, values)`` each."""
  directory = tmp_path_factory.mktemp("reuse")
  out = []
  for seed in (1, 2):
    path = directory / f"ckpt{seed}"
    tree = _tree(seed)
    pzp.save(path, tree)
    out.append((path, {key: np.array(value) for key, value in tree.items()}))
  return out


@pytest.fixture
def new_mappings(monkeypatch):
  """The sizes of the mappings made anew during the test (the pool starts
  and ends empty)."""
  _collect()
  host_memory.release_buffers()
  made = []
  real = host_memory._new_mapping  # pylint: disable=protected-access

  def recording(size):
    made.append(size)
    return real(size)

  monkeypatch.setattr(host_memory, "_new_mapping", recording)
  yield made
  _collect()
  host_memory.release_buffers()


def _addresses(tree: dict, only: tuple[str, ...] | None = None) -> set[int]:
  return {
      value.unsafe_buffer_pointer() if isinstance(value, jax.Array) else value.ctypes.data
      for key, value in tree.items() if only is None or key in only
  }


def _assert_values(tree: dict, expected: dict) -> None:
  for key, value in expected.items():
    np.testing.assert_array_equal(np.asarray(tree[key]), value, err_msg=key)


def _collect():
  """Lets go of what is dead: cycles, and the host buffers of deleted
  ``jax.Array`` values, which JAX hands back at its next call."""
  gc.collect()
  jax.device_put(np.zeros(1, np.float32)).block_until_ready()
  gc.collect()


def test_the_memory_of_a_dead_result_serves_the_next_load(checkpoints, new_mappings):
  (first_path, _), (second_path, second_values) = checkpoints
  first = pzp.load(first_path)
  assert len(new_mappings) == _PER_LOAD
  addresses = _addresses(first, _MAPPED)
  del first
  _collect()
  second = pzp.load(second_path)
  assert len(new_mappings) == _PER_LOAD, "the dead result's memory was not reused"
  assert _addresses(second, _MAPPED) == addresses
  _assert_values(second, second_values)


def test_a_result_still_held_is_not_overwritten_by_the_next_load(checkpoints, new_mappings):
  """The notebook case: ``model = load(...)`` again holds the old model
  until the new one is returned."""
  (first_path, first_values), (second_path, second_values) = checkpoints
  first = pzp.load(first_path)
  second = pzp.load(second_path)
  assert len(new_mappings) == 2 * _PER_LOAD
  assert not _addresses(first) & _addresses(second)
  second["n"][...] = 0.0  # The NumPy array is writable: no write may reach the first.
  _collect()
  third = pzp.load(second_path)  # Nothing has died: all new memory again.
  assert len(new_mappings) == 3 * _PER_LOAD
  _assert_values(first, first_values)
  _assert_values(third, second_values)
  del second
  _collect()
  fourth = pzp.load(first_path)  # Now the second result's memory serves.
  assert len(new_mappings) == 3 * _PER_LOAD
  _assert_values(first, first_values)
  _assert_values(third, second_values)
  _assert_values(fourth, first_values)


def test_memory_a_view_still_uses_is_not_reused(checkpoints, new_mappings):
  """Dropping the loaded tree is not enough: NumPy views of its NumPy
  arrays and of its ``jax.Array`` values (zero-copy on CPU) keep the memory."""
  (first_path, first_values), (second_path, second_values) = checkpoints
  first = pzp.load(first_path)
  views = {"w": np.asarray(first["w"]), "n": first["n"][1:]}
  assert views["w"].ctypes.data == first["w"].unsafe_buffer_pointer()  # A view indeed.
  adopted = {"v": first["v"], "big": first["big"]}  # The jax.Arrays alone, without the tree.
  del first
  _collect()
  second = pzp.load(second_path)
  assert len(new_mappings) == 2 * _PER_LOAD
  np.testing.assert_array_equal(views["w"], first_values["w"])
  np.testing.assert_array_equal(views["n"], first_values["n"][1:])
  _assert_values(adopted, {"v": first_values["v"], "big": first_values["big"]})
  _assert_values(second, second_values)


def test_release_buffers_gives_the_memory_back(checkpoints, new_mappings):
  (path, values) = checkpoints[0]
  first = pzp.load(path)
  del first
  _collect()
  host_memory.release_buffers()
  second = pzp.load(path)
  assert len(new_mappings) == 2 * _PER_LOAD, "released memory was reused"
  _assert_values(second, values)


def test_memory_is_kept_for_a_bounded_time(checkpoints, new_mappings, monkeypatch):
  """The pool's thread unmaps what no load took within `POOL_SECONDS`."""
  monkeypatch.setattr(host_memory, "POOL_SECONDS", 3.0)  # Load to drop takes less.
  (path, values) = checkpoints[0]
  first = pzp.load(path)
  del first
  _collect()
  pool = host_memory._POOL  # pylint: disable=protected-access
  assert pool._free_bytes > 0  # pylint: disable=protected-access
  pool._wake.set()  # pylint: disable=protected-access  # Its thread may sleep 60 s.
  for _ in range(600):  # Due 3 s after the drop; wait up to 60 s.
    if not pool._free_bytes:  # pylint: disable=protected-access
      break
    time.sleep(0.1)
  assert pool._free_bytes == 0  # pylint: disable=protected-access
  second = pzp.load(path)
  assert len(new_mappings) == 2 * _PER_LOAD
  _assert_values(second, values)


def test_results_dropped_by_other_threads_never_alias():
  """Loads and drops on several threads at once (finalizers then run on
  any thread, inside another's pool operation): every result keeps its
  values while held, and nothing deadlocks (a subprocess with a timeout)."""
  out = run_python(
      """
import tempfile, threading
import jax.numpy as jnp
import numpy as np
import pz_persist as pzp

directory = tempfile.mkdtemp()
values = []
for seed in range(3):
  rng = np.random.default_rng(seed)
  tree = {"w": jnp.asarray(rng.standard_normal((64, 128), dtype=np.float32)),
          "n": rng.standard_normal((16, 256)).astype(np.float32)}
  pzp.save(f"{directory}/c{seed}", tree)
  values.append({k: np.array(v) for k, v in tree.items()})

failures = []

def worker(seed):
  held = []
  for step in range(40):
    which = (seed + step) % 3
    held.append((which, pzp.load(f"{directory}/c{which}")))
    held[-1][1]["n"][0, 0] += 0.0  # Written to, as a user may.
    if len(held) > 2:
      held.pop(0)
    for which, tree in held:
      for key in values[which]:
        if not np.array_equal(np.asarray(tree[key]), values[which][key]):
          failures.append((seed, step, key))

threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(3)]
for thread in threads:
  thread.start()
for thread in threads:
  thread.join()
print("failures", len(failures))
""",
      timeout=300,
  )
  assert out.strip().splitlines()[-1] == "failures 0"


def test_memory_of_arrays_loaded_long_ago_is_not_kept(checkpoints, new_mappings, monkeypatch):
  """What is kept never exceeds the bytes handed out in the last
  `POOL_SECONDS`: a model dropped long after its load gives its memory back."""
  monkeypatch.setattr(host_memory, "POOL_SECONDS", 1.0)
  (path, _) = checkpoints[0]
  first = pzp.load(path)
  time.sleep(1.5)  # The load is now older than POOL_SECONDS.
  del first
  _collect()
  assert host_memory._POOL._free_bytes == 0  # pylint: disable=protected-access
