"""Restoring straight onto a device mesh by axis names (8 CPU devices)."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import model_zoo
import numpy as np
import pytest
from penzai import pz
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist import errors

P = jax.sharding.PartitionSpec


def _mesh(shape=(2, 4), names=("data", "model")):
  return jax.sharding.Mesh(np.array(jax.devices()[: np.prod(shape)]).reshape(shape), names)


RULES = {"embedding": "data", "neurons": "model", "vocabulary": "model", "projection": "model"}


def _expected_spec(named: pz.nx.NamedArrayBase, rules) -> P:
  view = named.as_namedarrayview()
  spec = [None] * view.data_array.ndim
  for name, index in view.data_axis_for_name.items():
    spec[index] = rules.get(name)
  return P(*spec)


def _gather(tree):
  return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree)


def test_model_restores_onto_a_mesh_by_axis_names(ckpt):
  assert jax.device_count() == 8
  model = model_zoo.gemma_style_transformer()
  pzp.save_model(ckpt, model)
  mesh = _mesh()

  sharded = pzp.load_model(ckpt, sharding=pzp.AxisRules(mesh, RULES))

  for param in pz.unbind_params(sharded, freeze=True)[1]:
    sharding = param.value.data_array.sharding
    assert sharding == jax.sharding.NamedSharding(mesh, _expected_spec(param.value, RULES)), param.label
  embeddings = next(p for p in pz.unbind_params(sharded)[1] if p.label.endswith("embeddings"))
  assert embeddings.value.data_array.sharding.spec == P("model", "data")  # (vocabulary, embedding)
  tokens = model_zoo.tokens()
  expected = model(tokens).data_array
  np.testing.assert_allclose(sharded(tokens).data_array, expected, rtol=2e-5, atol=2e-5)
  assert_identical(_gather(pz.unbind_params(sharded, freeze=True)[1]),
                   _gather(pz.unbind_params(model, freeze=True)[1]))


def test_positional_prefix_axes_are_replicated(ckpt):
  """Penzai's name_to_name_sharding would shard dimension 0 here."""
  named = pz.nx.NamedArray(
      named_axes=collections.OrderedDict(embedding=8), data_array=jnp.arange(24.0).reshape(3, 8)
  )
  pzp.save(ckpt, {"w": named, "plain": jnp.ones(4)})
  mesh = _mesh((8,), ("data",))
  loaded = pzp.load(ckpt, sharding=pzp.AxisRules(mesh, {"embedding": "data"}))
  assert loaded["w"].data_array.sharding.spec == P(None, "data")
  assert loaded["plain"].sharding.is_fully_replicated  # Outside NamedArrays.
  np.testing.assert_array_equal(loaded["w"].data_array, named.data_array)


def test_indivisible_axis_is_a_clear_error(ckpt):
  pzp.save(ckpt, [pz.ParameterValue(label="layer/w", value=pz.nx.wrap(jnp.ones((6, 4)), "rows", "cols"))])
  with pytest.raises(errors.PzPersistError, match=r"label 'layer/w'.*axis 'rows' has size 6.*\('model',\) \(4 devices\)"):
    pzp.load(ckpt, sharding=pzp.AxisRules(_mesh(), {"rows": "model"}))


def test_one_mesh_axis_twice_is_a_clear_error(ckpt):
  pzp.save(ckpt, [pz.ParameterValue(label="w", value=pz.nx.wrap(jnp.ones((4, 4)), "rows", "cols"))])
  with pytest.raises(errors.PzPersistError, match="'rows' and 'cols' are both mapped to mesh axis 'model'"):
    pzp.load(ckpt, sharding=pzp.AxisRules(_mesh(), {"rows": "model", "cols": "model"}))
  with pytest.raises(ValueError, match="names mesh axis 'nope'"):
    pzp.AxisRules(_mesh(), {"rows": "nope"})


def test_several_mesh_axes_for_one_name(ckpt):
  pzp.save(ckpt, {"w": pz.nx.wrap(jnp.arange(32.0).reshape(16, 2), "rows", "cols")})
  loaded = pzp.load(ckpt, sharding=pzp.AxisRules(_mesh(), {"rows": ("data", "model")}))
  assert loaded["w"].data_array.sharding.spec == P(("data", "model"), None)
  assert len(loaded["w"].data_array.addressable_shards) == 8


def test_resharding_from_one_mesh_to_another(ckpt):
  data = jnp.arange(64.0 * 8).reshape(64, 8)
  on_first = jax.device_put(data, jax.sharding.NamedSharding(_mesh((4, 2)), P("data", "model")))
  pzp.save(ckpt, {"w": pz.nx.wrap(on_first, "rows", "cols")})
  loaded = pzp.load(ckpt, sharding=pzp.AxisRules(_mesh((2, 4)), {"rows": "model", "cols": "data"}))
  assert loaded["w"].data_array.sharding.spec == P("model", "data")
  np.testing.assert_array_equal(loaded["w"].data_array, data)
  single = pzp.load(ckpt)  # And back onto one device.
  assert single["w"].data_array.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])


def test_manager_and_binding_take_axis_rules(tmp_path):
  model = model_zoo.llamalike_transformer()
  rules = pzp.AxisRules(_mesh(), RULES)
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, params=pz.unbind_params(model, freeze=True)[1])
    manager.wait_until_finished()
    params = manager.restore(sharding=rules)["params"]
  assert all(
      p.value.data_array.sharding.spec == _expected_spec(p.value, RULES) for p in params
  )
  pzp.save(tmp_path / "params", pz.unbind_params(model, freeze=True)[1])
  bound = pzp.load_into(tmp_path / "params", model, sharding=rules)
  for p in pz.unbind_params(bound, freeze=True)[1]:
    assert p.value.data_array.sharding.spec == _expected_spec(p.value, RULES)


def test_shard_bytes(ckpt):
  pzp.save(ckpt, {"w": pz.nx.wrap(jnp.ones((8, 16)), "rows", "cols")})
  manifest = pzp.checkpoint.read_manifest(ckpt)
  rules = pzp.AxisRules(_mesh(), {"rows": "data", "cols": "model"})
  # 8 devices, 1/8 each.
  assert pzp.storage.reading.placements.shard_bytes(manifest, rules) == 8 * 16 * 4
  assert pzp.storage.reading.placements.shard_bytes(manifest, None) == 8 * 16 * 4


def test_arrays_are_read_in_bounded_batches(ckpt, monkeypatch):
  tree = {f"w{i}": pz.nx.wrap(jnp.full((64, 64), float(i)), "rows", "cols") for i in range(6)}
  pzp.save(ckpt, tree)
  calls = []
  # Orbax's path (the direct one reads all), in batches of two arrays.
  handler = pzp.PenzaiCheckpointHandler(read_batch_bytes=2 * 64 * 64 * 4, direct_reads=False)
  import orbax.checkpoint as ocp
  restore = ocp.PyTreeCheckpointHandler.restore
  monkeypatch.setattr(
      ocp.PyTreeCheckpointHandler, "restore",
      lambda self, directory, args: calls.append(len(args.restore_args)) or restore(self, directory, args=args),
  )
  item = ckpt / "penzai"
  loaded = handler.restore(item, pzp.PenzaiRestore())
  assert calls == [2, 2, 2]
  assert_identical(loaded, tree)
  # With axis rules a batch counts the bytes of every local device's shard:
  # here rows split in 2, replicated 4 times, so one array per batch.
  calls.clear()
  sharded = handler.restore(
      item, pzp.PenzaiRestore(sharding=pzp.AxisRules(_mesh(), {"rows": "data"}))
  )
  handler.close()
  assert calls == [1] * 6
  assert_identical(_gather(sharded), _gather(tree))
