"""Relative paths work everywhere a path is taken, as users write them in
notebooks (Orbax's OCDBT layer refuses relative directories by itself)."""

from __future__ import annotations

import jax
from penzai import pz
from penzai.models import simple_mlp
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist.tools import cli


def _model():
  return simple_mlp.MLP.from_config(
      name="mlp", init_base_rng=jax.random.key(0), feature_sizes=[4, 8, 4]
  )


def test_save_load_inspect_verify_diff(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  _, params = pz.unbind_params(_model(), freeze=True)
  pzp.save("params", params)
  assert (tmp_path / "params").is_dir()
  assert_identical(pzp.load("params"), params)
  assert pzp.inspect("./params") is not None
  assert pzp.verify("params").ok
  pzp.save("sub/../params_copy", params)
  assert pzp.diff("params", "params_copy").identical


def test_models_and_manager(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  model = _model()
  pzp.save_model("model", model)
  assert_identical(pzp.load_model("model"), model)
  with pzp.CheckpointManager("run") as manager:
    manager.save(3, params=pz.unbind_params(model, freeze=True)[1])
    manager.wait_until_finished()
    assert manager.latest_step() == 3
    assert "params" in manager.restore()
  assert (tmp_path / "run").is_dir()


def test_cli_and_safetensors_export(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  pzp.save_model("model", _model())
  pzp.export_safetensors("model", "model.safetensors")
  assert cli.main(["inspect", "model"]) == 0
  _, saved = pz.unbind_params(pzp.load_model("model"))
  loaded = pzp.pretrained.load_safetensors("model.safetensors")
  assert {v.label for v in loaded} == {v.label for v in saved}
  assert "mlp" in capsys.readouterr().out
