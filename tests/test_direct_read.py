"""The load fast path (`pz_persist.storage.reading.direct_read`) and the storage defaults.

Loads into one process onto host memory or one device read each array
straight into its final, 64-byte aligned buffer; everything else goes through
Orbax's restore. Both must give bit-identical trees, and the fast path must
keep every check of the Orbax path.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from etils import epath
from penzai import pz
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.storage.reading import direct_read
from pz_persist.storage.reading import host_memory


def _tree():
  """Every storage kind: NamedArrays and views, substituted dtypes, NumPy
  arrays and scalars, weak types, empty arrays, a multi-chunk array."""
  rng = np.random.default_rng(0)
  big = rng.standard_normal((1100, 1024), dtype=np.float32)  # > one 4 MiB chunk.
  return {
      "params": (
          pz.ParameterValue(
              label="big",
              value=pz.nx.NamedArray(
                  named_axes=collections.OrderedDict(rows=1100, cols=1024),
                  data_array=jnp.asarray(big),
              ),
          ),
          pz.ParameterValue(
              label="view",
              value=pz.nx.wrap(jnp.arange(24.0).reshape(2, 3, 4)).tag("a", "b", "c").untag("b"),
          ),
      ),
      "bf16": jnp.linspace(-3, 3, 77, dtype=jnp.bfloat16),
      "f8": jnp.asarray(np.arange(16).astype(ml_dtypes.float8_e4m3fn)),
      "int4": jnp.asarray(np.arange(-8, 8).astype(ml_dtypes.int4)),
      "bool": jnp.asarray([True, False, True]),
      "complex": jnp.asarray([1 + 2j, 3 - 4j], jnp.complex64),
      "key": jax.random.key(3),
      "weak": jnp.asarray(2.5),
      "empty": jnp.zeros((0, 5)),
      "numpy": np.arange(12, dtype=np.int16).reshape(3, 4),
      "numpy_scalar": np.float32(1.5),
  }


def _orbax_path_load(path):
  handler = pzp.PenzaiCheckpointHandler(direct_reads=False)
  with ocp.Checkpointer(handler) as checkpointer:
    return checkpointer.restore(path / "penzai", args=pzp.PenzaiRestore())


def _spy(monkeypatch):
  calls = []
  real = direct_read.read

  def spy(*args, **kwargs):
    calls.append(args[1])
    return real(*args, **kwargs)

  monkeypatch.setattr(direct_read, "read", spy)
  return calls


def test_direct_and_orbax_paths_give_identical_trees(ckpt, monkeypatch):
  tree = _tree()
  pzp.save(ckpt, tree)
  calls = _spy(monkeypatch)
  direct = pzp.load(ckpt)
  assert len(calls) == 1, "the default load must take the direct path"
  assert_identical(direct, tree)
  assert_identical(_orbax_path_load(ckpt), tree)
  assert len(calls) == 1, "direct_reads=False must not take it"



@pytest.mark.parametrize("direct_writes", [True, False], ids=["direct_write", "orbax_write"])
def test_small_arrays_are_read_as_raw_chunks(ckpt, tensorstore_opens, direct_writes):
  # Every dtype and rank of the tree, whether pz_persist's direct write or
  # Orbax's own TensorStore write stored them: only the large multi-chunk
  # array is opened by TensorStore; the rest load bit for bit without it.
  tree = _tree()
  handler = pzp.PenzaiCheckpointHandler(direct_writes=direct_writes)
  with ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(ckpt, args=pzp.PenzaiSave(tree))
  assert_identical(pzp.load(ckpt), tree)
  assert tensorstore_opens == ["big"]


def test_compressed_small_arrays_are_opened_by_tensorstore(ckpt, tensorstore_opens):
  tree = {"a": jnp.arange(64.0), "b": np.arange(8, dtype=np.int8)}
  handler = pzp.PenzaiCheckpointHandler(use_compression=True)
  with ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(ckpt, args=pzp.PenzaiSave(tree))
  assert_identical(pzp.load(ckpt), tree)
  assert sorted(tensorstore_opens) == ["tree['a']", "tree['b']"]


def test_arrays_are_adopted_without_a_copy_on_cpu(ckpt, monkeypatch):
  # Small arrays (read as raw chunks, each into heap memory of its own) and a
  # large one (read by TensorStore into its own mapping).
  pzp.save(ckpt, {"a": jnp.arange(4096.0), "b": jnp.ones((64, 64), jnp.bfloat16),
                  "c": jnp.arange(300_000.0)})
  buffers = []

  def recording(real):
    def allocate(*args):
      out = real(*args)
      buffers.append((out.ctypes.data, out.nbytes))
      return out
    return allocate

  monkeypatch.setattr(host_memory, "aligned_empty", recording(host_memory.aligned_empty))
  monkeypatch.setattr(host_memory, "aligned_heap", recording(host_memory.aligned_heap))
  loaded = pzp.load(ckpt)
  assert all(address % host_memory.ALIGNMENT == 0 for address, _ in buffers)
  # The jax.Arrays are in the very buffers the reads filled, aligned.
  for name, value in loaded.items():
    pointer = value.unsafe_buffer_pointer()
    assert pointer % host_memory.ALIGNMENT == 0, name
    assert any(start <= pointer and pointer + value.nbytes <= start + size
               for start, size in buffers), name
  assert len(buffers) == 3  # One of its own for each array.


def test_only_the_selected_arrays_are_read(ckpt, monkeypatch):
  model_values = _tree()["params"]
  pzp.save(ckpt, model_values)
  model = tuple(p.unfreeze_as_copy() for p in model_values)
  calls = _spy(monkeypatch)
  loaded = pzp.load_into(ckpt, model, only="view")
  assert [[spec.label for spec in specs] for specs in calls] == [["view"]]
  assert_identical(pz.unbind_params(loaded, freeze=True)[1], model_values)


def test_which_loads_take_the_direct_path():
  devices = jax.devices()
  assert direct_read.applies({"a": None, "b": jax.sharding.SingleDeviceSharding(devices[1])})
  assert direct_read.applies({})
  if len(devices) > 1:
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("x",))
    spread = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    assert direct_read.applies({"a": None, "b": spread})  # One host's mesh.
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    assert direct_read.applies({"b": replicated})


def test_single_device_target_other_than_the_default(ckpt, monkeypatch):
  tree = _tree()
  pzp.save(ckpt, tree)
  calls = _spy(monkeypatch)
  device = jax.devices()[-1]
  loaded = pzp.load(ckpt, sharding=jax.sharding.SingleDeviceSharding(device))
  assert len(calls) == 1
  assert_identical(loaded, tree)
  assert loaded["bf16"].devices() == {device}


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs several devices")
def test_one_hosts_mesh_loads_go_direct_each_device_holding_its_shard(ckpt, monkeypatch):
  """A mesh of this process's devices (one host's GPUs): each array is read
  whole once and each device gets its own shard, as Orbax's path gives."""
  data = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
  tree = {"w": pz.nx.wrap(jnp.asarray(data)).tag("rows", "cols"),
          "kept_whole": pz.nx.wrap(jnp.arange(5.0)).tag("other")}
  pzp.save(ckpt, tree)
  calls = _spy(monkeypatch)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
  rules = pzp.AxisRules(mesh, {"rows": "data", "cols": "model"})
  loaded = pzp.load(ckpt, sharding=rules)
  assert len(calls) == 1
  assert_identical(loaded, tree)
  w = loaded["w"].data_array
  assert w.sharding.is_equivalent_to(
      jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model")), 2)
  for shard in w.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), data[shard.index])
  replicated = loaded["kept_whole"].data_array
  assert len(replicated.sharding.device_set) == 4
  assert all(np.array_equal(np.asarray(s.data), np.arange(5.0)) for s in replicated.addressable_shards)


def test_checkpoints_written_compressed_still_load(ckpt, monkeypatch):
  """The default was zstd before; such checkpoints (and ones written with
  use_compression=True) load through the direct path."""
  tree = _tree()
  handler = pzp.PenzaiCheckpointHandler(use_compression=True)
  with ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(ckpt, args=pzp.PenzaiSave(tree))
  assert _compressor(ckpt) is not None
  calls = _spy(monkeypatch)
  assert_identical(pzp.load(ckpt), tree)
  assert len(calls) == 1


def test_arrays_are_stored_uncompressed_by_default(ckpt):
  pzp.save(ckpt, {"a": jnp.zeros((256, 256))})
  assert _compressor(ckpt / "penzai") is None


def _compressor(item):
  """The zarr compressor TensorStore finds for the item's first array."""
  key = next(spec.key for spec in manifest_lib.read(item).arrays if spec.is_stored)
  context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
  info = ocp.type_handlers.ParamInfo(
      name=key, parent_dir=item, use_zarr3=False, ts_context=context
  )
  spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True)
  store = ts.open(spec, context=context).result()
  return store.spec().to_json()["metadata"]["compressor"]


def test_stored_shape_that_differs_from_the_manifest_is_refused_before_reading(ckpt, monkeypatch):
  pzp.save(ckpt, {"w": jnp.zeros((4, 4))})
  item = ckpt / "penzai"
  manifest = manifest_lib.read(item)
  (spec,) = manifest.arrays
  allocated = []
  monkeypatch.setattr(host_memory, "aligned_empty", lambda *a: allocated.append(a))
  lying = arrays_lib.ArraySpec(
      key=spec.key, shape=(4, 5), dtype=spec.dtype, kind=spec.kind, path=spec.path
  )
  with pytest.raises(errors.ManifestError, match=r"should be float32\[4, 5\].*stored array is float32\[4, 4\]"):
    direct_read.read(item, [lying], where=str(item), on_read=lambda spec, array: None)
  assert allocated == []


def test_unreadable_array_names_its_label(ckpt):
  pzp.save(ckpt, {"w": pzp_param("weights.w", np.arange(1024.0, dtype=np.float32))})
  item = ckpt / "penzai"
  for data_file in (item / "d").iterdir():
    data_file.write_bytes(b"")  # Truncated: the chunk cannot be read.
  for data_file in item.glob("ocdbt.process_*/d/*"):
    data_file.write_bytes(b"")
  with pytest.raises(errors.IntegrityError, match="weights.w"):
    pzp.load(ckpt, verify=False)


def pzp_param(label, data):
  return pz.ParameterValue(label=label, value=pz.nx.wrap(jnp.asarray(data)).tag("n"))


@pytest.mark.parametrize("use_ocdbt", [True, False])
@pytest.mark.parametrize("use_zarr3", [True, False])
def test_read_specs_are_orbaxs_own_for_every_key(tmp_path, use_ocdbt, use_zarr3):
  # Orbax builds two specs; the others are the first re-keyed. Each must be
  # exactly the spec Orbax builds for its key, including keys that end or
  # start like another key, or like the directory's name.
  directory = epath.Path(tmp_path) / "00000_w"
  directory.mkdir()
  keys = ["00000_w", "00001_w", "00002_w_00000_w", "10_w", "00003_00000_w", "x"]
  context = ocp.type_handlers.get_ts_context(use_ocdbt=use_ocdbt)
  specs = direct_read._read_specs(directory, keys, use_zarr3, use_ocdbt, context)
  assert specs == [
      direct_read._read_spec(directory, key, use_zarr3, use_ocdbt, context) for key in keys
  ]


def test_read_specs_are_built_by_orbax_when_rekeying_would_not_reproduce_them(
    tmp_path, monkeypatch
):
  # A spec that depends on its key beyond the key itself (here, its length):
  # re-keying the first spec does not give the second, so Orbax builds all.
  real = direct_read._read_spec

  def key_dependent(directory, key, *args):
    return dict(real(directory, key, *args), extra=len(key))

  monkeypatch.setattr(direct_read, "_read_spec", key_dependent)
  context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
  keys = ["a", "bb", "ccc", "dddd"]
  specs = direct_read._read_specs(epath.Path(tmp_path), keys, False, True, context)
  assert [spec["extra"] for spec in specs] == [1, 2, 3, 4]
