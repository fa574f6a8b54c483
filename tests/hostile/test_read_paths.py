"""Every path that reads a pz_persist checkpoint gives `pzp.load`'s guarantees.

The entry points besides `pzp.load`: Orbax v1's ``load_checkpointables``,
Orbax v0's ``CheckpointManager.restore`` (with `pzp.PenzaiRestore` or with no
arguments), and Orbax's ``PyTreeCheckpointer`` for models holding mutable
``pz.Parameter`` leaves (`pz_persist.orbax.variable_type_handler`, which has its own
record format). Each must refuse a changed float (checksums), symlinks leading
out of the checkpoint, FIFOs, oversized or malformed JSON, and forged shapes.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import model_zoo
import numpy as np
import orbax.checkpoint as ocp
import manifest_json
import pytest
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz
from treecompare import assert_identical

import pz_persist as pzp
from hostile import catalogue
from pz_persist import errors
from pz_persist import safety
from pz_persist.format import manifest as manifest_lib

pytestmark = [
    pytest.mark.timeout(120),  # A FIFO read by mistake would hang.
    # TensorStore's failed reads leave callbacks for Orbax's closed event loop.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

_MARKED = np.arange(4096, dtype=np.float32) + 0.5
"""An array whose stored bytes are easy to find in the data files."""


def _marked_tree() -> dict:
  return {
      "w": pz.Parameter(label="marked/w", value=pz.nx.wrap(jnp.asarray(_MARKED), "x")),
      "other": pz.Parameter(label="other/b", value=jnp.ones((3,))),
  }


def _change_one_float(directory: pathlib.Path) -> None:
  """Changes element 1001 of `_MARKED` wherever its bytes are stored (the
  checkpoints are uncompressed), as silent disk corruption would."""
  needle = _MARKED[1000:1004].tobytes()
  changed = _MARKED[1000:1004].copy()
  changed[1] += 1.0
  found = 0
  for path in directory.rglob("*"):
    if path.is_file() and not path.is_symlink():
      data = path.read_bytes()
      if needle in data:
        found += data.count(needle)
        path.write_bytes(data.replace(needle, changed.tobytes()))
  assert found, f"the marked array's bytes are not in {directory}"


def _change_checksum(item: pathlib.Path, label: str) -> None:
  path = item / manifest_lib.MANIFEST_FILENAME
  manifest = manifest_json.read(path)
  entry = next(e for e in manifest["arrays"] if e["label"] == label)
  entry["checksums"][0]["xxh3_128"] = "0" * 32
  path.write_text(json.dumps(manifest))


# A changed float, through every entry point.


def test_changed_float_is_refused_by_pzp_load(ckpt):
  pzp.save(ckpt, _marked_tree())
  assert_identical(pzp.load(ckpt), _marked_tree())
  _change_one_float(ckpt)
  with pytest.raises(errors.IntegrityError, match=r"label 'marked/w'.*slice\(s\) \[0:4096\] differ"):
    pzp.load(ckpt)


def test_changed_float_is_refused_by_orbax_v1(ckpt, tmp_path):
  pzp.save(ckpt, _marked_tree())
  ocp_v1.save_checkpointables(tmp_path / "v1", {"model": _marked_tree()})
  assert_identical(ocp_v1.load_checkpointables(ckpt)["penzai"], _marked_tree())
  assert_identical(ocp_v1.load_checkpointables(tmp_path / "v1")["model"], _marked_tree())
  _change_one_float(ckpt)
  # Orbax v1 saves compressed, so its bytes cannot be found: its recorded
  # checksum is changed instead, as if the stored bytes had changed.
  _change_checksum(tmp_path / "v1" / "model", "marked/w")
  with pytest.raises(errors.IntegrityError, match=r"(?s)penzai: 1 array\(s\).*label 'marked/w'"):
    ocp_v1.load_checkpointables(ckpt)
  with pytest.raises(errors.IntegrityError, match=r"(?s)model: 1 array\(s\).*label 'marked/w'"):
    ocp_v1.load_checkpointables(tmp_path / "v1")
  # Checking can be turned off for salvage, as with pzp.load(verify=False).
  salvaged = ocp_v1.load_checkpointables(
      ckpt, {"penzai": pzp.PenzaiRestore(verify=False)}
  )["penzai"]
  assert np.asarray(salvaged["w"].value.data_array)[1001] == _MARKED[1001] + 1


def test_orbax_v1_honors_a_sharding(ckpt):
  pzp.save(ckpt, _marked_tree())
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  rules = pzp.AxisRules(mesh, {"x": "data"})
  loaded = ocp_v1.load_checkpointables(
      ckpt, {"penzai": pzp.PenzaiRestore(sharding=rules)}
  )["penzai"]
  array = loaded["w"].value.data_array
  assert array.sharding.spec == jax.sharding.PartitionSpec("data")
  np.testing.assert_array_equal(np.asarray(array), _MARKED)


def test_changed_float_is_refused_by_checkpoint_manager(tmp_path):
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=ocp.args.Composite(params=pzp.PenzaiSave(_marked_tree())))
    manager.wait_until_finished()
  _change_one_float(tmp_path / "run")
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    with pytest.raises(errors.IntegrityError, match="label 'marked/w'"):
      manager.restore(1, args=ocp.args.Composite(params=pzp.PenzaiRestore()))
    with pytest.raises(errors.IntegrityError, match="label 'marked/w'"):
      manager.restore(1)


def test_changed_float_is_refused_by_the_type_handler(tmp_path):
  tree = _marked_tree()
  # Uncompressed, so that the float's bytes can be found and changed.
  checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
  checkpointer.save(tmp_path / "c", tree)
  assert_identical(checkpointer.restore(tmp_path / "c", item=tree), tree)
  _change_one_float(tmp_path / "c")
  with pytest.raises(errors.IntegrityError, match=r"(?s)c: 1 array\(s\).*label 'marked/w'"):
    checkpointer.restore(tmp_path / "c", item=tree)
  with pytest.raises(errors.IntegrityError, match="label 'marked/w'"):
    checkpointer.restore(tmp_path / "c")


@pytest.mark.parametrize(
    "case", [c for c in catalogue.CASES if c.name.startswith("raw_")], ids=lambda c: c.name
)
def test_damaged_raw_chunks_are_refused_by_checkpoint_manager(case, tmp_path, monkeypatch):
  """The raw-chunk read of small arrays (`pz_persist.storage.reading.raw_chunks`)
  through Orbax v0: a ``CheckpointManager`` restoring with
  `pzp.PenzaiRestore` and with no arguments (v1 and pz_persist's own loaders
  run the whole catalogue)."""
  model = model_zoo.mlp()
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=ocp.args.Composite(penzai=pzp.PenzaiSave(model)))
    manager.wait_until_finished()
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    assert_identical(manager.restore(1).penzai, model)
  case.build(tmp_path / "run" / "1", monkeypatch)
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    with pytest.raises(case.error, match=case.match):
      manager.restore(1, args=ocp.args.Composite(penzai=pzp.PenzaiRestore()))
    with pytest.raises(case.error, match=case.match):
      manager.restore(1)


# The hostile catalogue, through Orbax v1.

# Cases v1 cannot meet as pzp.load does: Orbax itself reads
# _CHECKPOINT_METADATA (and fails with its own error, a RecursionError for a
# deeply nested one) before any handler of pz_persist's runs.
_NOT_V1 = {"checkpoint_metadata_garbage", "checkpoint_metadata_deep", "manifest_missing"}


@pytest.mark.parametrize(
    "case",
    [c for c in catalogue.CASES if catalogue.LOAD in c.entry_points and c.name not in _NOT_V1],
    ids=lambda case: case.name,
)
def test_hostile_checkpoint_is_refused_by_orbax_v1(case, tmp_path, monkeypatch):
  ckpt = tmp_path / "ckpt"
  pzp.save_model(ckpt, model_zoo.mlp())
  case.build(ckpt, monkeypatch)
  with pytest.raises(case.error, match=case.match):
    ocp_v1.load_checkpointables(ckpt)


# Hostile checkpoints of the type handler (mutable Parameter leaves).


def _type_handler_checkpoint(tmp_path) -> tuple[pathlib.Path, dict]:
  model = model_zoo.mlp()
  tree = {"model": model, "again": model.sublayers[0].sublayers[0].weights}
  path = tmp_path / "c"
  ocp.PyTreeCheckpointer().save(path, tree)
  return path, tree


def _records_file(path: pathlib.Path) -> pathlib.Path:
  (found,) = path.glob("pz_persist_variables-*.json")
  return found


def _edit_records(path: pathlib.Path, fn) -> None:
  file = _records_file(path)
  records = json.loads(file.read_text())
  fn(records)
  file.write_text(json.dumps(records))


def _first_entry(records: dict) -> dict:
  return records["again"]["arrays"][0]


def _forge_shape(shape):
  def fn(records):
    entry = _first_entry(records)
    entry.pop("checksums")
    entry["shape"] = shape
    records["again"]["tree"]["value"]["axes"] = [
        [{"t": "str", "v": "features"}, shape[0]],
        [{"t": "str", "v": "features_out"}, shape[1]],
    ]
  return fn


def _records_symlink_outside(path, monkeypatch):
  file = _records_file(path)
  copy = path.parent / "outside.json"
  shutil.copy(file, copy)
  file.unlink()
  file.symlink_to(copy)


def _records_fifo(path, monkeypatch):
  file = _records_file(path)
  file.unlink()
  os.mkfifo(file)


def _records_symlink_inside(path, monkeypatch):
  file = _records_file(path)
  inside = path / "elsewhere.json"
  file.rename(inside)
  file.symlink_to(inside)


def _records_directory(path, monkeypatch):
  file = _records_file(path)
  file.unlink()
  file.mkdir()


def _data_dir_symlink_outside(path, monkeypatch):
  copy = path.parent / "outside_d"
  shutil.copytree(path / "d", copy)
  shutil.rmtree(path / "d")
  (path / "d").symlink_to(copy)


def _data_file_fifo(path, monkeypatch):
  for data in (path / "d").iterdir():
    data.unlink()
    os.mkfifo(data)


def _records_over_limit(path, monkeypatch):
  monkeypatch.setattr(manifest_lib, "MAX_MANIFEST_BYTES", 100)


def _allocation_over_limit(path, monkeypatch):
  monkeypatch.setattr(safety, "MAX_ALLOCATION_BYTES", 64)


def _raw(data: bytes):
  def build(path, monkeypatch):
    _records_file(path).write_bytes(data)
  return build


def _edit(fn):
  def build(path, monkeypatch):
    _edit_records(path, fn)
  return build


def _second_records_file(path, monkeypatch):
  file = _records_file(path)
  shutil.copy(file, path / "pz_persist_variables-second.json")


def _zarray_shape(shape):
  """Makes Orbax's own metadata of the leaf ``again`` declare ``shape``."""

  def build(path, monkeypatch):
    import tensorstore as ts  # pylint: disable=g-import-not-at-top

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    key = b"again/.zarray"
    meta = json.loads(kv.read(key).result().value)
    meta["shape"] = shape
    kv.write(key, json.dumps(meta).encode()).result()

  return build


LEAF = r"leaf 'again'"
RECORDS = r"c/pz_persist_variables-\w+\.json"

TYPE_HANDLER_CASES = [
    ("records_symlink_outside", _records_symlink_outside, errors.UnsafeCheckpointError,
     RECORDS + r" is a symlink to .*outside\.json, outside the checkpoint"),
    ("records_fifo", _records_fifo, errors.UnsafeCheckpointError,
     RECORDS + " is a FIFO, not a regular file"),
    ("records_symlink_inside", _records_symlink_inside, errors.UnsafeCheckpointError,
     RECORDS + " is a symbolic link; pz_persist and Orbax never write one"),
    ("records_directory", _records_directory, errors.ManifestError,
     RECORDS + " is a directory, not a pz_persist variable record file"),
    ("data_dir_symlink_outside", _data_dir_symlink_outside, errors.UnsafeCheckpointError,
     r"c/d is a symlink to .*outside_d, outside the checkpoint"),
    ("data_file_fifo", _data_file_fifo, errors.UnsafeCheckpointError,
     r"c/d/\w+ is a FIFO, not a regular file"),
    ("records_over_size_limit", _records_over_limit, errors.ManifestError,
     # The records or the manifest of the variables beside them: both are bounded.
     r"(" + RECORDS + r": pz_persist variable record|c/pz_persist\.json: manifest) is \d+"
     r" bytes, over the 100-byte limit"),
    ("records_not_json", _raw(b"\x89PNG\r\n"), errors.ManifestError,
     RECORDS + ": not valid JSON"),
    ("records_nan", _raw(b'{"again": NaN}'), errors.ManifestError,
     RECORDS + ": not valid JSON.*NaN"),
    ("records_deep_json", _raw(b"[" * 100_000 + b"]" * 100_000), errors.ManifestError,
     RECORDS + r": JSON nested 100000 levels deep, over the limit"),
    ("records_a_list", _raw(b"[]"), errors.ManifestError,
     RECORDS + ": not a pz_persist variable record file"),
    ("record_extra_field", _edit(lambda r: r["again"].update(code="import os")),
     errors.ManifestError, RECORDS + ": " + LEAF + ": malformed record"),
    ("record_unknown_kind", _edit(lambda r: r["again"].update(kind="os.system")),
     errors.ManifestError, RECORDS + ": " + LEAF + ": malformed record"),
    ("record_same_as_chain",
     _edit(lambda r: r.update(again={"same_as": "model.sublayers.0.sublayers.0.weights"})),
     errors.ManifestError, RECORDS + r": leaf '(again|model\S+)' is recorded as the same"),
    ("record_missing", _edit(lambda r: r.pop("again")), errors.ManifestError,
     r"c: no pz_persist record for leaf 'again'"),
    ("two_records_of_one_leaf", _second_records_file, errors.ManifestError,
     r"leaf '\S+' also has a record in"),
    ("array_key_dotdot", _edit(lambda r: _first_entry(r).update(key="../../etc/passwd")),
     errors.ManifestError, RECORDS + ": " + LEAF + r": arrays\[0\].*invalid array key"),
    ("shape_disagrees_with_stored_array", _edit(_forge_shape([16, 8])), errors.ManifestError,
     r"c: label 'mlp/Affine_0/Linear\.weights' at leaf 'again'\S* \(key again\) should be"
     r" float32\[16, 8\] by the manifest, but the stored array is float32\[8, 16\]"),
    ("huge_shape_over_memory", _edit(_forge_shape([2**30, 2**30])),
     errors.UnsafeCheckpointError, r"c: reading these arrays would allocate \d+ bytes"),
    ("huge_shape_in_orbax_metadata", _zarray_shape([2**31, 2**31]), errors.ManifestError,
     r"should be float32\[8, 16\] by the manifest, but the stored array is"
     r" float32\[2147483648, 2147483648\]"),
    ("allocation_over_limit", _allocation_over_limit, errors.UnsafeCheckpointError,
     r"c: reading these arrays would allocate \d+ bytes, more than the 64-byte limit"),
    ("checksum_changed",
     _edit(lambda r: _first_entry(r)["checksums"][0].update(xxh3_128="0" * 32)),
     errors.IntegrityError, r"(?s)c: 1 array\(s\).*label 'mlp/Affine_0/Linear\.weights'"),
]


@pytest.mark.parametrize(
    "build, error, match",
    [case[1:] for case in TYPE_HANDLER_CASES],
    ids=[case[0] for case in TYPE_HANDLER_CASES],
)
def test_hostile_type_handler_checkpoint_is_refused(build, error, match, tmp_path, monkeypatch):
  path, tree = _type_handler_checkpoint(tmp_path)
  build(path, monkeypatch)
  checkpointer = ocp.PyTreeCheckpointer()
  with pytest.raises(error, match=match):
    checkpointer.restore(path, item=tree)
  with pytest.raises(error, match=match):
    checkpointer.restore(path)


def test_type_handler_records_are_written_whole(tmp_path):
  """No temporary is left, and the one records file is complete JSON."""
  path, _ = _type_handler_checkpoint(tmp_path)
  assert not list(path.glob(".*tmp"))
  records = json.loads(_records_file(path).read_text())
  assert records["model.sublayers.0.sublayers.0.weights"] == {"same_as": "again"}
  assert all("checksums" in entry for entry in records["again"]["arrays"])


def test_changed_float_is_refused_by_diff(tmp_path):
  """pzp.diff reads arrays through the same engine: checked by default."""
  pzp.save(tmp_path / "a", _marked_tree())
  pzp.save(tmp_path / "b", _marked_tree())
  assert not pzp.diff(tmp_path / "a", tmp_path / "b").arrays[0].max_abs
  _change_one_float(tmp_path / "b")
  with pytest.raises(errors.IntegrityError, match="label 'marked/w'"):
    pzp.diff(tmp_path / "a", tmp_path / "b")


def test_item_symlinked_out_of_a_manager_step_is_refused(tmp_path):
  """The item directory is Orbax's choice, not the user's: a symlink there
  leading out of the checkpoint is refused, by every loader."""
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=ocp.args.Composite(params=pzp.PenzaiSave(_marked_tree())))
    manager.wait_until_finished()
  item = tmp_path / "run" / "1" / "params"
  shutil.copytree(item, tmp_path / "outside")
  shutil.rmtree(item)
  item.symlink_to(tmp_path / "outside")
  match = r"run/1/params is a symlink to .*outside, outside the checkpoint"
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    with pytest.raises(errors.UnsafeCheckpointError, match=match):
      manager.restore(1)
  with pytest.raises(errors.UnsafeCheckpointError, match=match):
    pzp.load(tmp_path / "run" / "1")
  with pytest.raises(errors.UnsafeCheckpointError, match=match):
    pzp.load(item)
  with pytest.raises(errors.UnsafeCheckpointError, match=match):
    ocp_v1.load_checkpointables(tmp_path / "run" / "1")


def test_orbax_v1_takes_its_own_metadata_as_abstract_state(ckpt):
  """The v1 idiom (metadata, then load) reaches the same read path."""
  pzp.save(ckpt, _marked_tree())
  metadata = ocp_v1.checkpointables_metadata(ckpt)
  assert_identical(ocp_v1.load_checkpointables(ckpt, metadata)["penzai"], _marked_tree())
  device = jax.sharding.SingleDeviceSharding(jax.devices()[3])
  placed = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
      metadata.metadata["penzai"],
  )
  loaded = ocp_v1.load_checkpointables(ckpt, {"penzai": placed})["penzai"]
  assert loaded["w"].value.data_array.sharding == device
  _change_one_float(ckpt)
  with pytest.raises(errors.IntegrityError, match="label 'marked/w'"):
    ocp_v1.load_checkpointables(ckpt, metadata)


def test_orbax_v1_refuses_an_abstract_tree_with_several_shardings(ckpt):
  pzp.save(ckpt, _marked_tree())
  metadata = ocp_v1.checkpointables_metadata(ckpt).metadata["penzai"]
  devices = iter(jax.devices())
  placed = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(next(devices))
      ),
      metadata,
  )
  with pytest.raises(errors.PzPersistError, match="penzai: the abstract checkpointable places arrays on 2 different shardings.*AxisRules"):
    ocp_v1.load_checkpointables(ckpt, {"penzai": placed})


def test_orbax_v1_loads_in_the_callers_x64_context(tmp_path):
  """The read runs in a worker thread; JAX's x64 switch is thread-local."""
  if jax.config.jax_enable_x64:
    pytest.skip("x64 is on globally: nothing to carry over")
  with jax.enable_x64(True):
    tree = {"x": pz.Parameter(label="x", value=jnp.arange(3, dtype=jnp.float64))}
    ocp_v1.save_checkpointables(tmp_path / "c", {"model": tree})
    loaded = ocp_v1.load_checkpointables(tmp_path / "c")["model"]
    assert loaded["x"].value.dtype == jnp.float64
