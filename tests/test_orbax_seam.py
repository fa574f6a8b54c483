"""The contract of every private Orbax name pz_persist touches (`orbax_seam`).

Each test names the Orbax symbol it holds and says what pz_persist relies on,
so a failure after an Orbax upgrade reads as "Orbax changed X, which
pz_persist uses for Y" rather than as a failure somewhere in a save. CI runs
this file against the oldest and the newest orbax-checkpoint that
pyproject.toml allows (.ci/versions). That no other module touches a private
Orbax name is held by tests/test_layout.py.
"""

from __future__ import annotations

import json
import pathlib
import threading
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import v1 as ocp_v1

import pz_persist as pzp
from pz_persist.storage import orbax_seam

PACKAGE = pathlib.Path(pzp.__file__).parent


def _broken(symbol: str, relied_on: str) -> str:
  return (
      f"orbax-checkpoint {ocp.__version__} changed {symbol}, which pz_persist"
      f" relies on for {relied_on}: update pz_persist/storage/orbax_seam.py"
      " (and the supported range in pyproject.toml)."
  )


def test_the_seam_supports_what_pyproject_declares():
  project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
  assert f"orbax-checkpoint{orbax_seam.SUPPORTED_ORBAX}" in project["dependencies"]


# ---- Private names read. -----------------------------------------------------


def test_build_array_write_spec(tmp_path):
  """direct_write writes Orbax's files byte for byte from this spec."""
  relied_on = "writing arrays as Orbax's handler does (storage.writing.direct_write)"
  info = ocp.type_handlers.ParamInfo(
      name="_", parent_dir=tmp_path, is_ocdbt_checkpoint=True, use_zarr3=False,
      use_compression=False, ts_context=None, ocdbt_target_data_file_size=2**24,
  )
  try:
    built = orbax_seam.build_array_write_spec(
        info=info, arg=ocp.SaveArgs(chunk_byte_size=None), global_shape=(4, 3),
        local_shape=(4, 3), dtype=np.dtype("float32"), use_ocdbt=True, process_index=0,
    )
  except (AttributeError, TypeError) as e:
    pytest.fail(f"{_broken('tensorstore_utils.build_array_write_spec', relied_on)}\n{e}")
  assert isinstance(built.json, dict) and built.json.get("driver") == "zarr", _broken(
      "build_array_write_spec(...).json", relied_on
  )
  assert tuple(built.metadata.chunk_shape) == (4, 3), _broken(
      "build_array_write_spec(...).metadata.chunk_shape", relied_on
  )


def test_orbax_save_threads_are_the_threads_async_saves_start(tmp_path, monkeypatch):
  """leftovers waits for these threads when a save is abandoned."""
  relied_on = "waiting for an abandoned save's threads (storage.lifecycle.leftovers)"
  try:
    kind = orbax_seam.orbax_save_threads()
  except AttributeError as e:
    pytest.fail(f"{_broken('futures.future._SignalingThread', relied_on)}\n{e}")
  assert issubclass(kind, threading.Thread), _broken("_SignalingThread", relied_on)
  started = []
  start = threading.Thread.start

  def recording(thread):
    started.append(thread)
    start(thread)

  monkeypatch.setattr(threading.Thread, "start", recording)
  with ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler()) as checkpointer:
    checkpointer.save(tmp_path / "ck", args=ocp.args.StandardSave({"w": np.ones(3)}))
    checkpointer.wait_until_finished()
  assert any(isinstance(t, kind) for t in started), _broken(
      "the threads AsyncCheckpointer.save starts (no longer _SignalingThread)", relied_on
  )


def test_active_v1_context_is_the_callers():
  """The v1 handler reads the caller's Context where Orbax builds it."""
  relied_on = "the v1 handler's multiprocessing options (orbax.v1_handler)"
  options = ocp_v1.options.MultiprocessingOptions(primary_host=0)
  try:
    with ocp_v1.Context(multiprocessing_options=options) as context:
      inside = orbax_seam.active_v1_context()
    outside = orbax_seam.active_v1_context()
  except AttributeError as e:
    pytest.fail(f"{_broken('experimental.v1 context.get_context', relied_on)}\n{e}")
  assert inside is context, _broken("get_context() inside a Context", relied_on)
  assert isinstance(outside, ocp_v1.Context), _broken("get_context() outside", relied_on)


class _Recorder:
  def __init__(self):
    self.deleted: list[int] = []
    self.closed = False

  def delete(self, step):
    self.deleted.append(step)

  def delete_steps(self, steps):
    self.deleted.extend(steps)

  def close(self):
    self.closed = True


def test_replace_step_deleter_takes_retention_and_delete(tmp_path):
  """The manager deletes steps on object stores through its own deleter."""
  relied_on = "deleting a dropped step marker first (training.manager)"
  options = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=False)
  with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
    assert orbax_seam.has_step_deleter(manager), _broken(
        "CheckpointManager._checkpoint_deleter", relied_on
    )
    recorder = _Recorder()
    orbax_seam.replace_step_deleter(manager, recorder)
    for step in range(2):
      manager.save(step, args=ocp.args.StandardSave({"w": np.ones(2)}))
    manager.wait_until_finished()
    assert recorder.deleted == [0], _broken(
        "retention's use of CheckpointManager._checkpoint_deleter", relied_on
    )
    manager.delete(1)
    assert recorder.deleted == [0, 1], _broken(
        "CheckpointManager.delete's use of _checkpoint_deleter", relied_on
    )
  assert recorder.closed, _broken("CheckpointManager.close's deleter.close()", relied_on)


# ---- Orbax functions wrapped (enable_orbax_s3). --------------------------------


def _recording(calls):
  def teach(original):
    def recorded(*args, **kwargs):
      calls.append(args[0] if args else kwargs)
      return original(*args, **kwargs)
    return recorded
  return teach


@pytest.fixture
def wrapped():
  """Wraps Orbax functions for one test; every wrap is undone after it, back
  to the function Orbax called before (which an earlier test's
  `enable_orbax_s3` may have wrapped already: wraps stack)."""
  before = {}

  def wrap(name, teach):
    before.setdefault(name, orbax_seam.orbax_function(name))
    orbax_seam.wrap(name, teach)

  yield wrap
  for name, function in before.items():
    orbax_seam.unwrap(name)
    assert orbax_seam.orbax_function(name) is function


def test_build_kvstore_tspec_is_what_orbax_writes_arrays_with(tmp_path, wrapped):
  relied_on = "s3:// arrays (storage.stores.s3_kvstore, enable_orbax_s3)"
  spec = orbax_seam.orbax_function("build_kvstore_tspec")("gs://bucket/ck", use_ocdbt=False)
  assert isinstance(spec, dict) and spec.get("driver") in ("gcs", "gcs_grpc"), _broken(
      "build_kvstore_tspec('gs://...', use_ocdbt=False)", relied_on
  )
  calls = []
  wrapped("build_kvstore_tspec", _recording(calls))
  assert orbax_seam.is_wrapped("build_kvstore_tspec")
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ck", {"w": jnp.ones(3)})
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ck")
  np.testing.assert_array_equal(restored["w"], np.ones(3))
  assert calls, _broken(
      "the callers of build_kvstore_tspec (no longer through its module attribute)", relied_on
  )


@pytest.mark.parametrize("name", [
    "get_default_temporary_path_class", "get_item_default_temporary_path_class",
])
def test_default_temporary_path_classes_are_what_orbax_publishes_by(tmp_path, wrapped, name):
  relied_on = "publishing s3:// checkpoints by commit file (storage.stores.s3_kvstore)"
  atomicity = ocp.path.atomicity
  function = orbax_seam.orbax_function(name)
  from etils import epath  # pylint: disable=import-outside-toplevel

  assert function(epath.Path("gs://bucket/ck")) is atomicity.CommitFileTemporaryPath, _broken(
      f"{name}('gs://...')", relied_on
  )
  assert function(tmp_path / "ck") is atomicity.AtomicRenameTemporaryPath, _broken(
      f"{name}(local path)", relied_on
  )
  calls = []
  wrapped(name, _recording(calls))
  handler = ocp.CompositeCheckpointHandler(item=ocp.StandardCheckpointHandler())
  with ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(
        tmp_path / "ck", args=ocp.args.Composite(item=ocp.args.StandardSave({"w": np.ones(2)}))
    )
  assert calls, _broken(f"the callers of {name} (no longer through its module attribute)",
                        relied_on)


# ---- Public names pz_persist relies on in the same places. ---------------------


def test_commit_marker_and_classes_stay_public():
  atomicity = ocp.path.atomicity
  assert atomicity.COMMIT_SUCCESS_FILE == "commit_success.txt", _broken(
      "ocp.path.atomicity.COMMIT_SUCCESS_FILE (its name is in every object-store step)",
      "telling committed steps (storage.lifecycle.steps)",
  )
  assert issubclass(atomicity.CommitFileTemporaryPath, ocp.path.atomicity_types.TemporaryPath)


def test_sharding_metadata_is_what_orbax_records(tmp_path):
  """direct_write describes shardings with Orbax's public metadata classes;
  Orbax's own handler must write the same in ``_sharding``."""
  from pz_persist.storage.writing import direct_write  # pylint: disable=import-outside-toplevel

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  shardings = {
      "named": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")),
      "single": jax.sharding.SingleDeviceSharding(jax.devices()[0]),
  }
  tree = {name: jax.device_put(jnp.arange(4.0), s) for name, s in shardings.items()}
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ck", tree)
    checkpointer.wait_until_finished()
  recorded = set(json.loads((tmp_path / "ck" / "_sharding").read_text()).values())
  for sharding in shardings.values():
    described = direct_write._sharding_metadata(sharding)  # pylint: disable=protected-access
    assert described.to_serialized_string() in recorded, _broken(
        "what Orbax's handler writes in _sharding (ocp.metadata's ShardingMetadata)",
        "the _sharding file (storage.writing.direct_write)",
    )


def test_orbax_save_threads_pass_on_a_keyboard_interrupt(tmp_path, monkeypatch):
  """A save whose background work is interrupted must fail, not look done:
  Orbax's save threads pass on a BaseException raised in them (since 0.12.5,
  the lower bound in pyproject.toml; before, the thread dropped it)."""
  from pz_persist.format import manifest as manifest_lib  # pylint: disable=import-outside-toplevel

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt("injected in the save's background work")

  monkeypatch.setattr(manifest_lib, "write", interrupted)
  try:
    pzp.save(tmp_path / "ck", {"w": jnp.ones(3)})
  except KeyboardInterrupt:
    pass
  else:
    pytest.fail(_broken(
        "how Orbax's save threads (_SignalingThread) pass on a BaseException raised in them",
        "failing an interrupted save (checkpoint.save, storage.lifecycle.leftovers)",
    ))
  assert not (tmp_path / "ck").exists()
