"""The pz-persist command line: inspect, diff, ls; exit codes and help."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys

import jax.numpy as jnp
import model_zoo
import orbax.checkpoint as ocp
import pytest
from penzai import pz

import pz_persist as pzp
from pz_persist.storage.reading import reader
from pz_persist.tools import cli
from pz_persist.tools import diffing


def _run(capsys, *argv):
  code = cli.main(list(argv))
  captured = capsys.readouterr()
  return code, captured.out, captured.err


@pytest.fixture
def model_ckpt(tmp_path):
  path = tmp_path / "model"
  pzp.save_model(path, model_zoo.mlp())
  return path


def test_inspect_table(model_ckpt, capsys):
  code, out, _ = _run(capsys, "inspect", str(model_ckpt))
  assert code == 0
  assert "model penzai.models.simple_mlp.MLP" in out
  lines = [line.split() for line in out.splitlines()]
  assert ["label", "axes", "shape", "dtype", "bytes"] in lines
  assert ["mlp/Affine_0/Linear.weights", "(features,", "features_out)", "8x16", "float32", "512", "B"] in lines
  assert "4 parameters, 0 state variables (mutable): 1.1 KiB in 4 arrays" in out


def test_inspect_of_a_parameter_tree_counts_parameters(tmp_path, capsys):
  _, params = pz.unbind_params(model_zoo.mlp(), freeze=True)
  pzp.save(tmp_path / "params", params)
  code, out, _ = _run(capsys, "inspect", str(tmp_path / "params"))
  assert code == 0
  assert "  tree\n  4 parameters, 0 state variables: 1.1 KiB in 4 arrays" in out


def test_inspect_fits_the_terminal_and_groups_constants(tmp_path, capsys, monkeypatch):
  pzp.save_model(tmp_path / "lm", model_zoo.llamalike_transformer())
  monkeypatch.setenv("COLUMNS", "200")
  wide = _run(capsys, "inspect", str(tmp_path / "lm"))[1]
  assert "tree.body.sublayers" not in wide  # Constants by field name, not by path.
  assert re.search(r"\d+ constants held by layers", wide)
  assert re.search(r"^epsilon +\(\) +float32 +\d+ ", wide, re.M)
  assert "transformer/block_0/attention/query.weights" in wide
  monkeypatch.setenv("COLUMNS", "80")
  narrow = _run(capsys, "inspect", str(tmp_path / "lm"))[1]
  table = narrow.split("\n\n", 1)[1]
  assert max(map(len, table.splitlines())) <= 80
  assert "…" not in narrow  # Long labels continue on the next line, never cut.


def test_version(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--version"])
  assert exit_info.value.code == 0
  assert re.match(r"pz-persist \d+\.\d+\.\d+ \(orbax-checkpoint", capsys.readouterr().out)


def test_inspect_html(model_ckpt, tmp_path, capsys):
  code, out, _ = _run(capsys, "inspect", str(model_ckpt), "--html", str(tmp_path / "v.html"))
  assert code == 0 and "wrote" in out
  html = (tmp_path / "v.html").read_text()
  assert "treescope" in html and "mlp/Affine_0/Linear.weights" in html


def _changed_copy(tmp_path, source, change):
  model = pzp.load_model(source)
  unbound, params = pz.unbind_params(model, freeze=True)
  model = pz.bind_variables(unbound, [change(p) for p in params], unfreeze_as_copy=True)
  path = tmp_path / "changed"
  pzp.save_model(path, model)
  return path


def test_diff_identical(model_ckpt, tmp_path, capsys):
  shutil.copytree(model_ckpt, tmp_path / "copy")
  code, out, _ = _run(capsys, "diff", str(model_ckpt), str(tmp_path / "copy"))
  assert code == 0 and "identical: 4 array(s) compared" in out


def test_diff_values(model_ckpt, tmp_path, capsys):
  def nudge(p):
    if p.label == "mlp/Affine_1/AddBias.bias":
      return dataclasses.replace(p, value=p.value + 0.25)
    return p

  changed = _changed_copy(tmp_path, model_ckpt, nudge)
  code, out, _ = _run(capsys, "diff", str(model_ckpt), str(changed))
  assert code == 1
  row = next(line.split() for line in out.splitlines() if "AddBias" in line)
  assert row[0] == "changed" and row[-3:] == ["0.25", "1", "100%"]  # max, |A-B|/|B|, fraction
  assert "1 of 4 compared array(s) differ" in out


def test_diff_structure_and_labels(tmp_path, capsys):
  pzp.save_model(tmp_path / "a", model_zoo.llamalike_transformer())
  pzp.save_model(tmp_path / "b", model_zoo.llamalike_transformer(layer_stack=True))
  code, out, _ = _run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"))
  assert code == 1
  rows = [line.split()[:3] for line in out.splitlines()]
  assert ["changed", "tree.body.sublayers", "list"] in rows  # 5 items -> 4
  assert ["removed", "tree.body.sublayers[1]", "TransformerBlock"] in rows
  assert ["removed", "tree.body.sublayers[2]", "TransformerBlock"] in rows
  assert ["added", "tree.body.sublayers[1]", "LayerStack"] in rows


def test_diff_reads_bounded_batches(tmp_path, monkeypatch):
  a = [pz.ParameterValue(label=f"w{i}", value=jnp.full((256, 256), float(i))) for i in range(6)]
  pzp.save(tmp_path / "a", a)
  pzp.save(tmp_path / "b", a)
  batches = []
  original = reader.read_arrays

  def spy(directory, manifest, **kwargs):
    batches.append(sum(manifest.arrays[i].nbytes for i in kwargs["refs"]))
    return original(directory, manifest, **kwargs)

  monkeypatch.setattr(reader, "read_arrays", spy)
  result = diffing.diff(tmp_path / "a", tmp_path / "b", batch_bytes=2 * 256 * 256 * 4)
  assert result.identical and len(result.arrays) == 6
  assert max(batches) <= 2 * 256 * 256 * 4 and len(batches) == 6  # 3 batches x 2 sides.


def test_ls_steps(tmp_path, capsys):
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    for step in (10, 20):
      manager.save(step, args=ocp.args.Composite(
          params=pzp.PenzaiSave([jnp.ones(3)]), meta=ocp.args.JsonSave({"step": step})))
    manager.wait_until_finished()
  (tmp_path / "run" / "30.orbax-checkpoint-tmp-123").mkdir()
  code, out, _ = _run(capsys, "ls", str(tmp_path / "run"))
  assert code == 0
  rows = [line.split() for line in out.splitlines()[1:4]]
  assert [row[:3] for row in rows] == [["10", "yes", "meta,"], ["20", "yes", "meta,"], ["30", "no", "(partial)"]]
  assert "params*" in out


def test_errors_exit_2_with_a_message(tmp_path, capsys):
  code, _, err = _run(capsys, "inspect", str(tmp_path / "missing"))
  assert code == 2 and "pz-persist: error:" in err and "does not exist" in err
  (tmp_path / "empty").mkdir()
  code, _, err = _run(capsys, "diff", str(tmp_path / "empty"), str(tmp_path / "empty"))
  assert code == 2 and "not a pz_persist checkpoint" in err


@pytest.mark.parametrize("command", [[], ["inspect"], ["diff"], ["ls"]])
def test_help_for_each_command(command):
  script = shutil.which("pz-persist")
  argv = [script] if script else [sys.executable, "-m", "pz_persist.tools.cli"]
  result = subprocess.run([*argv, *command, "--help"], capture_output=True, text=True, timeout=120)
  assert result.returncode == 0 and "usage: pz-persist" in result.stdout


def test_usage_error_exits_2():
  result = subprocess.run(
      [sys.executable, "-m", "pz_persist.tools.cli", "inspect"], capture_output=True, text=True,
      timeout=120,
  )
  assert result.returncode == 2 and "required" in result.stderr
