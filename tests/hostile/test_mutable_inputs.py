"""What a save writes is the tree as it was when the save was called.

NumPy arrays are mutable, and a save writes and hashes in the background
(async saves after they return). Issue 26, item 1: ``m.save(1, params={"w":
w}); w[:] = 7; m.wait_until_finished()`` restored 7s. Every save path now
takes its NumPy values' bytes when it encodes the tree, before it returns
(`pz_persist.format.encode`): the library calls, ``save_model``, both
managers, `PenzaiSave` in Orbax's own async checkpointer, Orbax v1, and the
mutable-variable type handler.

Deterministic: the first time a save's background work is about to write or
hash an array, the test changes every array the caller passed (as a training
loop would after `save` returned), and lets the save go on. What is loaded
must be the values as they were, and their checksums must match them.
"""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz

import pz_persist as pzp
from pz_persist.storage.integrity import checksums
from pz_persist.storage.writing import direct_write

pytestmark = pytest.mark.timeout(300)


def _arrays() -> dict[str, np.ndarray]:
  big = np.arange(64 * 1024, dtype=np.float32).reshape(256, 256)
  return {
      "f32": big,  # Written straight from its memory by TensorStore.
      "strided": np.arange(40, dtype=np.int16)[::3],  # A view.
      "f8": np.linspace(-2, 2, 16).astype(ml_dtypes.float8_e4m3),  # Stored as a uint8 view.
      "u4": np.arange(16, dtype=np.uint8).astype(ml_dtypes.uint4),  # Widened: a fresh copy.
  }


class _Mutator:
  """Changes the caller's arrays once, as the save's background work starts."""

  def __init__(self, arrays: dict[str, np.ndarray]):
    self.arrays = arrays
    self.fired = False
    self._lock = threading.Lock()

  def fire(self) -> None:
    with self._lock:
      if self.fired:
        return
      self.fired = True
      for name, value in self.arrays.items():
        base = value.base if name == "strided" else value
        base[...] = np.asarray(7, base.dtype)


@pytest.fixture
def mutate_in_background(monkeypatch):
  """Returns a `_Mutator` fired just before any array is written or hashed."""
  holder: list[_Mutator] = []
  real_start, real_digest = direct_write.start, checksums.digest_of

  def start(*args, **kwargs):
    holder[0].fire()
    return real_start(*args, **kwargs)

  def digest_of(data):
    holder[0].fire()
    return real_digest(data)

  monkeypatch.setattr(direct_write, "start", start)
  monkeypatch.setattr(checksums, "digest_of", digest_of)

  def make(arrays):
    holder.append(_Mutator(arrays))
    return holder[0]

  return make


def _tree(arrays):
  return {
      "params": pz.ParameterValue(label="w", value=pz.nx.wrap(arrays["f32"], "a", "b")),
      "raw": {k: v for k, v in arrays.items() if k != "f32"},
  }


def _unwrap(tree) -> dict[str, np.ndarray]:
  return {"f32": np.asarray(tree["params"].value.unwrap("a", "b")),
          **{k: np.asarray(v) for k, v in tree["raw"].items()}}


def _assert_original(loaded: dict[str, np.ndarray]) -> None:
  for name, expected in _arrays().items():
    np.testing.assert_array_equal(
        np.asarray(loaded[name]).astype(np.float32), expected.astype(np.float32),
        err_msg=f"{name}: the save wrote values changed after it was called",
    )


def _save_pzp(tmp_path, tree):
  pzp.save(tmp_path / "c", tree)
  return lambda: _unwrap(pzp.load(tmp_path / "c"))


def _save_manager(tmp_path, tree):
  manager = pzp.CheckpointManager(tmp_path / "run")
  manager.save(1, params=tree)
  manager.wait_until_finished()
  loaded = manager.restore(1)
  manager.close()
  return lambda: _unwrap(loaded["params"])


def _save_orbax_manager(tmp_path, tree):
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=ocp.args.Composite(params=pzp.PenzaiSave(tree)))
    manager.wait_until_finished()
  return lambda: _unwrap(pzp.load(tmp_path / "run" / "1" / "params"))


def _save_async_checkpointer(tmp_path, tree):
  with ocp.AsyncCheckpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
    checkpointer.save(tmp_path / "c", args=pzp.PenzaiSave(tree))
    checkpointer.wait_until_finished()
  return lambda: _unwrap(pzp.load(tmp_path / "c"))


def _save_async_orbax_path(tmp_path, tree):
  """Orbax's own array writer (compressed: not the direct path)."""
  handler = pzp.PenzaiCheckpointHandler(use_compression=True)
  with ocp.AsyncCheckpointer(handler) as checkpointer:
    checkpointer.save(tmp_path / "c", args=pzp.PenzaiSave(tree))
    checkpointer.wait_until_finished()
  return lambda: _unwrap(pzp.load(tmp_path / "c"))


def _save_v1(tmp_path, tree):
  response = ocp_v1.save_checkpointables_async(tmp_path / "v1", {"model": tree})
  response.result()
  return lambda: _unwrap(ocp_v1.load_checkpointables(tmp_path / "v1")["model"])


SAVES = {
    "pzp.save": _save_pzp,
    "pzp.CheckpointManager": _save_manager,
    "ocp.CheckpointManager+PenzaiSave": _save_orbax_manager,
    "ocp.AsyncCheckpointer+PenzaiSave": _save_async_checkpointer,
    "ocp.AsyncCheckpointer, Orbax's writer": _save_async_orbax_path,
    "orbax v1": _save_v1,
}


@pytest.mark.parametrize("save", sorted(SAVES))
def test_a_change_after_the_call_is_not_saved(tmp_path, mutate_in_background, save):
  arrays = _arrays()
  mutator = mutate_in_background(arrays)
  load = SAVES[save](tmp_path, _tree(arrays))
  assert mutator.fired, "the save wrote nothing in the background; nothing was tested"
  assert float(arrays["f32"][0, 0]) == 7.0
  _assert_original(load())  # Loading verifies the checksums: they match too.


def test_save_model_keeps_the_values_it_was_called_with(tmp_path, mutate_in_background):
  from penzai.nn import linear_and_affine  # pylint: disable=import-outside-toplevel

  weights = np.arange(12, dtype=np.float32).reshape(3, 4)
  model = linear_and_affine.Linear(
      weights=pz.Parameter(label="w", value=pz.nx.wrap(weights, "in", "out")),
      in_axis_names=("in",), out_axis_names=("out",),
  )
  mutator = mutate_in_background({"f32": weights})
  pzp.save_model(tmp_path / "m", model)
  assert mutator.fired and float(weights[0, 0]) == 7.0
  loaded = pzp.load_model(tmp_path / "m")
  np.testing.assert_array_equal(
      np.asarray(loaded.weights.value.unwrap("in", "out")),
      np.arange(12, dtype=np.float32).reshape(3, 4),
  )


def test_the_type_handler_keeps_the_values_it_was_called_with(tmp_path, mutate_in_background):
  """Mutable ``pz.Parameter`` leaves saved by Orbax's own PyTree checkpointer."""
  weights = np.arange(8, dtype=np.float32)
  tree = {"w": pz.Parameter(label="w", value=pz.nx.wrap(weights, "x"))}
  mutator = mutate_in_background({"f32": weights})
  with ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
    checkpointer.save(tmp_path / "c", args=ocp.args.PyTreeSave(tree))
    checkpointer.wait_until_finished()
  assert mutator.fired and float(weights[0]) == 7.0
  restored = ocp.PyTreeCheckpointer().restore(tmp_path / "c")
  np.testing.assert_array_equal(
      np.asarray(restored["w"].value.unwrap("x")), np.arange(8, dtype=np.float32)
  )


def test_the_reported_sequence(tmp_path):
  """``save``; ``w[:] = 7``; ``wait_until_finished``; ``restore``: 1s, not 7s."""
  w = np.ones((512, 512), np.float32)
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, params={"w": w})
    w[:] = 7
    manager.wait_until_finished()
    np.testing.assert_array_equal(manager.restore(1)["params"]["w"], 1.0)
