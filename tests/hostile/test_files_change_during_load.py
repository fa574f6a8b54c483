"""A file that changes during a load never yields a mix.

``load_hf`` reopened each safetensors file by path for every tensor, so a
download or rsync replacing ``model.safetensors`` mid-load returned a model
holding tensors of both versions. Now each file is opened once, every tensor
is read through that descriptor, and its identity (inode, size, times) is
checked before and after each read and once the load is done, together with
``config.json`` and the index: a change is `FileChangedError` naming the
file. `load_safetensors` reads the same way; `load_gemma` (TensorStore opens
files by path) re-checks every file of the checkpoint after reading.

The change is made deterministically, by a hook on the read of the first
tensor (no timing), in each way a writer changes a file: renamed over,
rewritten in place at the same size, rewritten at another size.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from penzai import pz

import pz_persist as pzp
from hostile.test_pretrained_hostile import CONFIG
from hostile.test_pretrained_hostile import hf_folder
from hostile.test_pretrained_hostile import llama_tensors
from pz_persist.pretrained import errors
from pz_persist.pretrained import safetensors_io
from pz_persist.tools import cli


def _renamed_over(path: str) -> None:
  """A new version written aside and renamed over (a download, rsync)."""
  with open(path, "rb") as f:
    data = bytearray(f.read())
  data[-4:] = bytes(4)  # The last tensor's bytes differ.
  with open(path + ".tmp", "wb") as f:
    f.write(data)
  os.replace(path + ".tmp", path)


def _rewritten_in_place(path: str) -> None:
  """The same inode and size, other bytes (``rsync --inplace``)."""
  with open(path, "r+b") as f:
    f.seek(-4, os.SEEK_END)
    f.write(b"\x7f\x7f\x7f\x7f")


def _truncated_and_rewritten(path: str) -> None:
  """The same inode, another size (``cp`` over it)."""
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(data + bytes(8))


CHANGES = [_renamed_over, _rewritten_in_place, _truncated_and_rewritten]


def _aged(folder) -> None:
  """Old times on every file, so a rewrite in the same clock tick as the
  write that made it still shows (the check must not rely on luck)."""
  for name in os.listdir(folder):
    os.utime(os.path.join(folder, name), ns=(10**18, 10**18))


def _after_first_read(monkeypatch, change) -> list[str]:
  """Runs ``change()`` once, right after the first tensor is read."""
  original = safetensors_io.SafetensorsFile.get
  done: list[str] = []

  def get(self, name, dtype=None, **options):
    out = original(self, name, dtype, **options)
    if not done:
      done.append(name)
      change()
    return out

  monkeypatch.setattr(safetensors_io.SafetensorsFile, "get", get)
  return done


def _sharded(folder):
  """The tiny Llama in two shards with an index."""
  tensors = llama_tensors()
  names = sorted(tensors)
  half = len(names) // 2
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps(CONFIG))
  weight_map = {}
  for i, part in enumerate((names[:half], names[half:])):
    filename = f"model-{i + 1:05d}-of-00002.safetensors"
    safetensors_io.write_safetensors(folder / filename, {n: tensors[n] for n in part})
    weight_map.update(dict.fromkeys(part, filename))
  (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return folder


@pytest.mark.parametrize("change", CHANGES)
def test_load_hf_refuses_a_weights_file_changed_mid_load(tmp_path, monkeypatch, change):
  folder = hf_folder(tmp_path / "hf")
  _aged(folder)
  target = str(folder / "model.safetensors")
  done = _after_first_read(monkeypatch, lambda: change(target))
  with pytest.raises(errors.FileChangedError, match="model.safetensors changed while"):
    pzp.pretrained.load_hf(folder)
  assert done


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("which", ["model-00001-of-00002.safetensors",
                                   "model-00002-of-00002.safetensors",
                                   "model.safetensors.index.json", "config.json"])
def test_load_hf_refuses_any_file_of_a_sharded_folder_changed_mid_load(
    tmp_path, monkeypatch, change, which):
  folder = _sharded(tmp_path / "hf")
  _aged(folder)
  _after_first_read(monkeypatch, lambda: change(str(folder / which)))
  with pytest.raises(errors.FileChangedError, match=f"{which} changed while"):
    pzp.pretrained.load_hf(folder)


def test_an_unchanged_folder_loads_and_closes_its_files(tmp_path):
  folder = _sharded(tmp_path / "hf")
  before = set(os.listdir("/proc/self/fd"))
  model = pzp.pretrained.load_hf(folder)
  assert set(os.listdir("/proc/self/fd")) <= before  # One descriptor a file, closed.
  assert model is not None


@pytest.mark.parametrize("change", CHANGES)
def test_the_cli_convert_refuses_and_writes_nothing(tmp_path, monkeypatch, change, capsys):
  folder = hf_folder(tmp_path / "hf")
  _aged(folder)
  _after_first_read(monkeypatch, lambda: change(str(folder / "model.safetensors")))
  assert cli.main(["convert", "hf", str(folder), str(tmp_path / "native"), "--quiet"]) == 2
  assert "model.safetensors changed while" in capsys.readouterr().err
  assert sorted(os.listdir(tmp_path)) == ["hf"]


@pytest.mark.parametrize("change", CHANGES)
def test_load_safetensors_refuses_a_file_changed_mid_load(tmp_path, monkeypatch, change):
  model = pz.nn.Linear.from_config(
      name="l", init_base_rng=jax.random.key(0), input_axes={"i": 4}, output_axes={"o": 4})
  model = pz.nn.Sequential([model, pz.nn.AddBias.from_config(
      name="b", init_base_rng=jax.random.key(1), biased_axes={"o": 4})])
  path = tmp_path / "m.safetensors"
  pzp.pretrained.export_safetensors(model, path)
  _aged(tmp_path)
  _after_first_read(monkeypatch, lambda: change(str(path)))
  with pytest.raises(errors.FileChangedError, match="m.safetensors changed while"):
    pzp.pretrained.load_safetensors(path)


def test_load_gemma_refuses_a_file_replaced_mid_load(tmp_path, monkeypatch):
  """TensorStore opens the array files by path: every file of the checkpoint
  must still be the one checked once all are read."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from pretrained import test_gemma  # pylint: disable=import-outside-toplevel

  params = test_gemma.official_params(test_gemma.GEMMA2, gemma2=True)
  path = test_gemma.write(tmp_path / "ckpt", params)
  original = ocp.PyTreeCheckpointer.restore
  replaced = []

  def restore(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    for parent, _, files in os.walk(path):  # A download replacing a file now.
      for name in files:
        if not replaced and "ocdbt" in parent:
          _renamed_over(os.path.join(parent, name))
          replaced.append(name)
    return out

  monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", restore)
  with pytest.raises(errors.UnsafeCheckpointError, match="changed while the checkpoint"):
    pzp.pretrained.load_gemma(path, preset={"like": "gemma2_2b"})
  assert replaced
  np.testing.assert_equal(len(replaced), 1)


def test_plain_orbax_loads_refuse_a_file_replaced_mid_load(tmp_path, monkeypatch):
  """A plain Orbax checkpoint loaded into a model (`load_model(into=)`, and
  `migrate`, which reads through it): Orbax opens files by path, so every
  file must still be the one checked once the arrays are read."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  model = pz.nn.Linear.from_config(
      name="l", init_base_rng=jax.random.key(0), input_axes={"i": 4}, output_axes={"o": 4})
  plain = str(tmp_path / "plain")
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(plain, pz.unbind_params(model, freeze=True)[1])
  original = ocp.PyTreeCheckpointHandler.restore
  replaced: list[str] = []

  def restore(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    for parent, _, files in sorted(os.walk(plain)):
      for name in sorted(files):
        if "ocdbt" in parent and not replaced:
          _renamed_over(os.path.join(parent, name))
          replaced.append(name)
    return out

  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "restore", restore)
  for name, call in (
      ("load_into", lambda: pzp.load_into(plain, model)),
      ("migrate", lambda: pzp.migrate(plain, tmp_path / "native", model)),
  ):
    replaced.clear()
    with pytest.raises(errors.UnsafeCheckpointError, match="changed while the checkpoint"):
      call()
    assert replaced, name
  assert not (tmp_path / "native").exists()
