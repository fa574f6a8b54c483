"""Export, migrate and convert replace only what is theirs, never their source.

``pz-persist export hf project/ckpt project --overwrite`` deleted the
checkpoint being exported and every other file in ``project``. One rule now
decides for every writer (`pz_persist.storage.destinations`): a destination
is replaced only if empty or its writer's own (a pz_persist checkpoint; a
folder `export_hf` wrote, marker and files, nothing else), and is never the
source, a folder holding it, or one inside it, whatever spelling (relative,
``..``, a symlink) names either. Each case: the library call and the
command, and everything left exactly as it was.
"""

from __future__ import annotations

import os
import shutil

import jax
import pytest
from penzai.models.transformer.variants import llamalike_common

import pz_persist as pzp
from pz_persist import errors
from pz_persist.tools import cli


def _model():
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=2, query_head_multiplier=1, embedding_dim=8, projection_dim=4,
      mlp_hidden_dim=16, num_decoder_blocks=1, vocab_size=16, mlp_variant="swiglu",
      tie_embedder_and_logits=False)
  return llamalike_common.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))


@pytest.fixture(scope="module")
def model():
  return _model()


def _snapshot(root) -> dict[str, bytes | str]:
  """Every file (its bytes) and link (its target) under ``root``."""
  found: dict[str, bytes | str] = {}
  for folder, dirs, files in os.walk(root):
    for name in dirs + files:
      full = os.path.join(folder, name)
      rel = os.path.relpath(full, root)
      if os.path.islink(full):
        found[rel] = "-> " + os.readlink(full)
      elif os.path.isfile(full):
        with open(full, "rb") as f:
          found[rel] = f.read()
  return found


@pytest.fixture
def project(tmp_path, model):
  """``project/`` holding a checkpoint of ``model`` and a file of the user's."""
  root = tmp_path / "project"
  root.mkdir()
  (root / "notes.txt").write_text("mine")
  pzp.save_model(root / "ckpt", model)
  return root


def _refused_everywhere(tmp_path, calls, expected=(errors.ArgumentError,
                                                    errors.CheckpointExistsError)):
  before = _snapshot(tmp_path)
  for name, call in calls:
    with pytest.raises(expected) as e:
      call()
    assert "refusing" in str(e.value) or "destination" in str(e.value), name
    assert _snapshot(tmp_path) == before, name


def _cli_refused(tmp_path, capsys, commands):
  before = _snapshot(tmp_path)
  for command in commands:
    assert cli.main(command) == 2, command
    err = capsys.readouterr().err
    assert "refusing" in err or "the destination" in err, (command, err)
    assert _snapshot(tmp_path) == before, command


# -- export ----------------------------------------------------------------


def test_export_over_the_folder_holding_its_source_is_refused(
    tmp_path, project, model, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  os.symlink(project, tmp_path / "link", target_is_directory=True)
  _refused_everywhere(tmp_path, [
      ("export_hf", lambda: pzp.export_hf(model, project, overwrite=True)),
      ("export_hf relative", lambda: pzp.export_hf(model, "project", overwrite=True)),
      ("export_hf dotdot", lambda: pzp.export_hf(model, "project/ckpt/..", overwrite=True)),
  ])
  _cli_refused(tmp_path, capsys, [
      ["export", "hf", "project/ckpt", "project", "--overwrite", "--quiet"],
      ["export", "hf", str(project / "ckpt"), str(project), "--overwrite", "--quiet"],
      ["export", "hf", "link/ckpt", "project", "--overwrite", "--quiet"],
      ["export", "hf", "project/ckpt", "./project/ckpt/../", "--overwrite", "--quiet"],
      ["export", "hf", "project/ckpt", "project/ckpt", "--overwrite", "--quiet"],
      ["export", "hf", "project/ckpt", "project/ckpt/hf", "--quiet"],  # Inside it.
      ["export", "hf", "link/ckpt", "project/ckpt/hf", "--quiet"],
  ])


def test_export_replaces_only_a_folder_it_wrote(tmp_path, model, capsys):
  dst = tmp_path / "hf"
  pzp.export_hf(model, dst)
  assert "pz_persist.export.json" in os.listdir(dst)
  pzp.export_hf(model, dst, overwrite=True)  # Its own folder: replaced.
  assert cli.main(["export", "hf", str(_saved(tmp_path, model)), str(dst), "--overwrite",
                   "--quiet"]) == 0
  capsys.readouterr()
  (dst / "tokenizer.json").write_text("{}")  # Now it holds the user's file too.
  os.remove(dst / "pz_persist.export.json")
  other = tmp_path / "other"
  other.mkdir()
  (other / "config.json").write_text("{}")  # Looks like an export, no marker.
  forged = tmp_path / "forged"
  shutil.copytree(tmp_path / "hf", forged)
  (forged / "pz_persist.export.json").write_bytes(b'{"pz_persist_export": 1}\n')
  (forged / "sub").mkdir()  # Marker, but something export never writes.
  linked = tmp_path / "linked"
  linked.mkdir()
  (linked / "pz_persist.export.json").symlink_to(tmp_path / "hf" / "config.json")
  for folder in (dst, other, forged, linked):
    with pytest.raises(errors.CheckpointExistsError, match="not a folder export_hf wrote"):
      pzp.export_hf(model, folder, overwrite=True)
  _cli_refused(tmp_path, capsys, [
      ["export", "hf", str(tmp_path / "saved"), str(folder), "--overwrite", "--quiet"]
      for folder in (dst, other, forged, linked)
  ])


def _saved(tmp_path, model):
  path = tmp_path / "saved"
  if not path.exists():
    pzp.save_model(path, model)
  return path


# -- migrate and convert -----------------------------------------------------


def test_migrate_never_replaces_or_writes_into_its_source(
    tmp_path, project, model, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  os.symlink(project, tmp_path / "link", target_is_directory=True)
  fresh = _model()
  _refused_everywhere(tmp_path, [
      ("same", lambda: pzp.migrate(project / "ckpt", project / "ckpt", fresh, overwrite=True)),
      ("same relative", lambda: pzp.migrate("project/ckpt", "./project/ckpt", fresh,
                                            overwrite=True)),
      ("same via link", lambda: pzp.migrate("link/ckpt", "project/ckpt", fresh, overwrite=True)),
      ("same dotdot", lambda: pzp.migrate("project/ckpt", "project/x/../ckpt", fresh,
                                          overwrite=True)),
      ("holds it", lambda: pzp.migrate("project/ckpt", "project", fresh, overwrite=True)),
      ("inside it", lambda: pzp.migrate("project/ckpt", "link/ckpt/native", fresh)),
  ])
  (tmp_path / "build.py").write_text(
      "import jax\nfrom penzai.models.transformer.variants import llamalike_common\n"
      "def build():\n"
      "  config = llamalike_common.LlamalikeTransformerConfig(num_kv_heads=2,"
      " query_head_multiplier=1, embedding_dim=8, projection_dim=4, mlp_hidden_dim=16,"
      " num_decoder_blocks=1, vocab_size=16, mlp_variant='swiglu',"
      " tie_embedder_and_logits=False)\n"
      "  return llamalike_common.build_llamalike_transformer(config,"
      " init_base_rng=jax.random.key(0))\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  _cli_refused(tmp_path, capsys, [
      ["migrate", "project/ckpt", "project/ckpt", "--model", "build:build", "--overwrite"],
      ["migrate", "link/ckpt", "project/ckpt", "--model", "build:build", "--overwrite"],
      ["migrate", "project/ckpt", "project", "--model", "build:build", "--overwrite"],
      ["migrate", "project/ckpt", "project/ckpt/native", "--model", "build:build"],
  ])
  assert pzp.migrate("link/ckpt", "elsewhere", fresh) is not None  # Apart: fine.


def test_convert_never_replaces_or_writes_into_its_source(tmp_path, model, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  pzp.export_hf(model, tmp_path / "hf")
  os.symlink(tmp_path / "hf", tmp_path / "link", target_is_directory=True)
  _cli_refused(tmp_path, capsys, [
      ["convert", "hf", "hf", "hf", "--overwrite", "--quiet"],
      ["convert", "hf", "link", "hf", "--overwrite", "--quiet"],
      ["convert", "hf", "hf", "hf/native", "--quiet"],
      ["convert", "hf", "hf/", ".", "--overwrite", "--quiet"],
  ])
