"""export_hf never writes through, or deletes, what its destination points to.

The destination of an export may be a link (to a folder of someone else's
files), a file, or a non-empty folder: each is refused (the folder unless
``overwrite``) and left exactly as it was; the sentinel outside is untouched.
"""

from __future__ import annotations

import os
import shutil

import pytest
from penzai.models.transformer.variants import llamalike_common

import pz_persist as pzp
from pz_persist import errors


@pytest.fixture(scope="module")
def model():
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=2, query_head_multiplier=1, embedding_dim=8, projection_dim=4,
      mlp_hidden_dim=16, num_decoder_blocks=1, vocab_size=16, mlp_variant="swiglu",
      tie_embedder_and_logits=False)
  import jax  # pylint: disable=import-outside-toplevel

  return llamalike_common.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))


def _sentinel(tmp_path):
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "precious.txt").write_text("keep")
  return outside


@pytest.mark.parametrize("overwrite", [False, True])
def test_link_destination_is_refused_and_its_target_kept(tmp_path, model, overwrite):
  outside = _sentinel(tmp_path)
  link = tmp_path / "dst"
  link.symlink_to(outside, target_is_directory=True)
  with pytest.raises(errors.CheckpointExistsError, match="not a folder"):
    pzp.export_hf(model, link, overwrite=overwrite)
  assert os.path.islink(link) and os.listdir(outside) == ["precious.txt"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_file_destination_is_refused(tmp_path, model, overwrite):
  dst = tmp_path / "dst"
  dst.write_text("mine")
  with pytest.raises(errors.CheckpointExistsError):
    pzp.export_hf(model, dst, overwrite=overwrite)
  assert dst.read_text() == "mine"


def test_overwrite_replaces_only_the_folder(tmp_path, model):
  """A folder holding a link is not one export wrote: refused, the link and
  its target kept. An earlier export is replaced, and only it."""
  outside = _sentinel(tmp_path)
  dst = tmp_path / "dst"
  dst.mkdir()
  (dst / "link").symlink_to(outside, target_is_directory=True)
  with pytest.raises(errors.CheckpointExistsError, match="not a folder export_hf wrote"):
    pzp.export_hf(model, dst, overwrite=True)
  assert os.listdir(dst) == ["link"] and os.listdir(outside) == ["precious.txt"]
  os.remove(dst / "link")
  pzp.export_hf(model, dst, overwrite=True)  # Empty: fine.
  pzp.export_hf(model, dst, overwrite=True)  # Its own: replaced.
  assert "config.json" in os.listdir(dst)
  assert os.listdir(outside) == ["precious.txt"]
  assert sorted(os.listdir(tmp_path)) == ["dst", "outside"]


def test_exported_folder_follows_the_umask(tmp_path, model):
  """Written aside then renamed: the folder must not keep a private
  temporary mode (another user serves it)."""
  mask = os.umask(0o022)
  try:
    pzp.export_hf(model, tmp_path / "dst")
  finally:
    os.umask(mask)
  assert os.stat(tmp_path / "dst").st_mode & 0o777 == 0o755


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_another_writer_puts_there_meanwhile_is_kept(tmp_path, model, monkeypatch,
                                                              overwrite):
  """Another writer's folder, created or replaced while the export is being
  written, is never replaced (even with ``overwrite``, which was about what
  was there when the export started): the export is discarded with
  `ConcurrentSaveError`, as a racing checkpoint save is."""
  from pz_persist.pretrained import safetensors_io  # pylint: disable=import-outside-toplevel

  dst = tmp_path / "dst"
  if overwrite:
    pzp.export_hf(model, dst)  # An earlier export: the one kind replaced.
  original = safetensors_io.write_safetensors

  def other_writer_meanwhile(path, tensors, **kwargs):
    if dst.exists():
      shutil.rmtree(dst)
    dst.mkdir()
    (dst / "theirs.txt").write_text("theirs")
    return original(path, tensors, **kwargs)

  monkeypatch.setattr(safetensors_io, "write_safetensors", other_writer_meanwhile)
  with pytest.raises(errors.ConcurrentSaveError, match="another writer"):
    pzp.export_hf(model, dst, overwrite=overwrite)
  assert os.listdir(dst) == ["theirs.txt"]
  assert sorted(os.listdir(tmp_path)) == ["dst"]
