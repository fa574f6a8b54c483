"""Sharded models save whole: a device mesh is saved as what it means (axis
names, sizes and types, never devices) and rebuilt on load, over the devices
at hand or as the mesh passed (8 CPU devices, see conftest)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import model_zoo
import numpy as np
import manifest_json
import pytest
from penzai import pz
from penzai.toolshed import sharding_util

import pz_persist as pzp
from pz_persist import errors
from pz_persist.tools import cli

P = jax.sharding.PartitionSpec
NAMES = ("data", "model")
AUTO = (jax.sharding.AxisType.Auto,) * 2  # What with_sharding_constraint needs.


def _sharded_mlp(mesh):
  """An MLP whose activations are constrained by name over ``mesh``, and by a
  NamedSharding (Penzai's two sharding layers)."""
  return pz.nn.Sequential([
      sharding_util.ConstrainShardingByName(mesh, {"features": "model"}),
      model_zoo.mlp(),
      sharding_util.ConstrainSharding(jax.sharding.NamedSharding(mesh, P(None, "model"))),
  ])


def _manifest(path):
  return manifest_json.read(path / "penzai" / "pz_persist.json")


def _nodes(value, tag):
  if isinstance(value, dict):
    return ([value] if value.get("t") == tag else []) + [
        n for v in value.values() for n in _nodes(v, tag)]
  if isinstance(value, list):
    return [n for v in value for n in _nodes(v, tag)]
  return []


def test_a_sharded_model_saves_whole_and_loads_over_the_devices_at_hand(ckpt):
  assert jax.device_count() == 8
  mesh = jax.make_mesh((2, 4), NAMES, axis_types=AUTO)
  model = _sharded_mlp(mesh)
  pzp.save_model(ckpt, model)

  meshes = _nodes(_manifest(ckpt)["tree"], "mesh")
  assert meshes and all(
      n == {"t": "mesh", "axes": [["data", 2], ["model", 4]], "axis_types": ["Auto"] * 2}
      for n in meshes
  )  # Names, sizes and types: no devices.
  loaded = pzp.load_model(ckpt)
  assert loaded.sublayers[0].mesh == mesh  # Over the first 8 devices, as it was.
  assert loaded.sublayers[0].axis_name_to_mesh_name == {"features": "model"}
  assert loaded.sublayers[2].sharding == jax.sharding.NamedSharding(mesh, P(None, "model"))
  x = pz.nx.wrap(jnp.linspace(-1.0, 1.0, 32).reshape(4, 8), "batch", "features")
  outputs = [_run_on(mesh, m, x) for m in (loaded, model)]
  np.testing.assert_array_equal(*outputs)
  assert outputs[0].sharding.spec == P(None, "model")  # The constraint, applied.


def _run_on(mesh, model, x):
  """``model(x)`` compiled, with its parameters and input replicated on ``mesh``."""
  unbound, params = pz.unbind_params(model, freeze=True)
  replicated = jax.sharding.NamedSharding(mesh, P())
  params, x = jax.device_put((params, x), replicated)
  return jax.jit(lambda p, x: pz.bind_variables(unbound, p)(x).data_array)(params, x)


def test_the_mesh_passed_is_used_when_it_has_the_saved_axis_names(ckpt):
  pzp.save_model(ckpt, _sharded_mlp(jax.make_mesh((2, 4), NAMES)))
  mine = jax.sharding.Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), NAMES)
  loaded = pzp.load_model(ckpt, mesh=mine)
  assert loaded.sublayers[0].mesh is mine and loaded.sublayers[2].sharding.mesh is mine
  assert pzp.load(ckpt, mesh=mine).sublayers[0].mesh is mine

  with pytest.raises(errors.MeshError, match=r"tree\.sublayers\[0\]\.mesh: the saved mesh has axes"
                     r" \(data=2, model=4\); the mesh passed has \('batch', 'model'\)"):
    pzp.load_model(ckpt, mesh=jax.make_mesh((2, 4), ("batch", "model")))
  with pytest.raises(errors.ArgumentTypeError, match="mesh= takes a jax.sharding.Mesh"):
    pzp.load_model(ckpt, mesh="data")


def test_a_mesh_larger_than_the_devices_at_hand_is_refused_clearly(ckpt):
  big = jax.sharding.AbstractMesh((4, 4), NAMES)  # 16 devices; this process has 8.
  pzp.save_model(ckpt, _sharded_mlp(big))
  with pytest.raises(errors.MeshError) as caught:
    pzp.load_model(ckpt)
  assert str(caught.value).startswith(
      f"{ckpt / 'penzai'}: tree.sublayers[0].mesh: the saved mesh (data=4, model=4) needs 16"
      " devices; this process has 8 (cpu). Pass mesh= a jax.sharding.Mesh with the same"
      " axis names"
  )
  loaded = pzp.load_model(ckpt, mesh=jax.make_mesh((2, 4), NAMES))  # As it says.
  assert loaded.sublayers[0].mesh.shape == {"data": 2, "model": 4}
  abstract = pzp.inspect(ckpt)  # Needs no devices: an AbstractMesh.
  assert abstract.sublayers[0].mesh == big


def test_shardings_that_name_devices_are_refused(ckpt):
  single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  with pytest.raises(errors.EncodingError, match=r"tree\.sublayers\[2\]\.sharding: a"
                     r" SingleDeviceSharding names devices, which are never saved"):
    pzp.save_model(ckpt, pz.nn.Sequential([
        model_zoo.mlp(), model_zoo.mlp(), sharding_util.ConstrainSharding(single)]))
  with pytest.raises(errors.EncodingError, match="only None, mesh axis names"):
    pzp.save(ckpt, {"spec": P(P.UNCONSTRAINED)})
  assert not ckpt.exists()


@pytest.mark.parametrize("axes, types, problem", [
    ([["data", 0]], ["Explicit"], "malformed mesh"),
    ([["data", 2], ["data", 4]], ["Explicit", "Explicit"], "malformed mesh"),
    ([["data", 2]], ["Explicit", "Auto"], "malformed mesh"),
    ([["data", 2.5]], ["Explicit"], "malformed mesh"),
    ([[{"t": "str"}, 2]], ["Explicit"], "malformed mesh"),
    ([["data", 2]], ["Sideways"], "axis types"),
    ([["data", 10**15]], ["Explicit"], "needs 1000000000000000 devices"),
])
def test_malformed_meshes_are_refused(ckpt, axes, types, problem):
  pzp.save(ckpt, {"mesh": jax.make_mesh((2,), ("data",)), "x": jnp.ones(2)})
  manifest_path = ckpt / "penzai" / "pz_persist.json"
  manifest = manifest_json.read(manifest_path)
  node = _nodes(manifest["tree"], "mesh")[0]
  node["axes"], node["axis_types"] = axes, types
  manifest_path.write_text(json.dumps(manifest))
  with pytest.raises(errors.PzPersistError, match=problem):
    pzp.load(ckpt, verify=False)


def test_the_cli_shows_and_compares_meshes(tmp_path, capsys):
  pzp.save_model(tmp_path / "a", _sharded_mlp(jax.make_mesh((2, 4), NAMES)))
  pzp.save_model(tmp_path / "b", _sharded_mlp(jax.make_mesh((4, 2), NAMES)))
  assert cli.main(["inspect", str(tmp_path / "a")]) == 0
  assert "mlp/Affine_0/Linear.weights" in capsys.readouterr().out
  assert cli.main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
  out = capsys.readouterr().out
  lines = out.splitlines()
  at = next(i for i, line in enumerate(lines) if "tree.sublayers[0].mesh" in line)
  row = " ".join(lines[at:at + 2])  # A row is one line, or two at 80 columns.
  assert row.startswith("changed") and "mesh(data=2, model=4) -> mesh(data=4, model=2)" in row


def test_a_training_run_restores_the_mesh_passed(tmp_path):
  """``CheckpointManager.restore(mesh=)``: the mesh reaches Orbax's restore."""
  mesh = jax.make_mesh((2, 4), NAMES, axis_types=AUTO)
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, model=_sharded_mlp(mesh))
    mine = jax.sharding.Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), NAMES)
    assert manager.restore(1, mesh=mine)["model"].sublayers[0].mesh is mine
    assert manager.restore(1)["model"].sublayers[0].mesh == mesh
