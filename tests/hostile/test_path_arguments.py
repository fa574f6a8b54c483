"""What every path argument accepts and refuses, in one place each.

* A NUL, written raw or as a ``file://`` URL's ``%00`` (decoded by
  pz_persist into one), is refused by name with `ArgumentError` (a
  `PzPersistError`) by every entry point, readers and writers alike
  (`pz_persist.storage.stores.urls.check_no_nul`, asked by every entry
  point first), never a bare ``ValueError`` ("embedded null byte").
* An opened handle (``pzp.open(path)``) is accepted wherever a checkpoint
  path is read (`pz_persist.storage.reading.opening.read`, the one way in): it reads
  the checkpoint it opened, refuses once closed, and reports a checkpoint
  saved over it since rather than reading the new one.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import model_zoo
import numpy as np
import pytest
from penzai import pz

import pz_persist as pzp
from hostile.path_entry_points import entry_points
from pz_persist import errors
from pz_persist.tools import cli


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
  path = str(tmp_path_factory.mktemp("paths") / "ck")
  pzp.save_model(path, model_zoo.mlp())
  return path


def _writers(url: str, local: str):
  """Every writer of a user-named output, ``url`` as its destination."""
  return [
      ("CheckpointDiff.save_html", lambda: pzp.diff(local, local).save_html(url)),
      ("render_html", lambda: pzp.render_html(model_zoo.mlp(), url)),
      ("render_html (path)", lambda: pzp.render_html(url, os.path.join(local + "_x.html"))),
      ("export_safetensors", lambda: pzp.export_safetensors(local, url)),
      ("export_safetensors (source)", lambda: pzp.export_safetensors(url, local + ".st")),
      ("export_hf", lambda: pzp.export_hf(model_zoo.llamalike_transformer(), url)),
      ("open", lambda: pzp.open(url)),
      ("load_into", lambda: pzp.load_into(url, model_zoo.mlp())),
  ]


@pytest.mark.parametrize("url", ["{tmp}/a\0b", "file://{tmp}/a%00b", "file://localhost{tmp}/%00",
                                 "{tmp}/a\0b/../c"])
def test_every_entry_point_refuses_a_nul_by_name(url, saved, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  url = url.format(tmp=tmp_path)
  for name, call in [*entry_points(url, saved), *_writers(url, saved)]:
    if name == "render_html (path)":
      continue  # A string with a NUL is text to show, not a path: rendered, not refused.
    with pytest.raises(errors.ArgumentError) as raised:
      call()
    assert repr(url) in str(raised.value) and "NUL" in str(raised.value), name
  assert sorted(os.listdir(tmp_path)) == [], "something was written"


def test_the_command_line_refuses_a_nul_by_name(saved, tmp_path, capsys):
  for argv in (["inspect", f"file://{tmp_path}/%00"], ["verify", f"file://{tmp_path}/a%00"],
               ["ls", f"file://{tmp_path}/%00"], ["diff", saved, f"file://{tmp_path}/%00"],
               ["inspect", saved, "--html", f"file://{tmp_path}/%00.html"],
               ["export", "hf", saved, f"file://{tmp_path}/%00"]):
    assert cli.main(argv) == 2, argv
    assert "a path cannot hold a NUL character" in capsys.readouterr().err, argv


def test_every_reader_accepts_an_opened_handle(saved, tmp_path):
  expected = pzp.load_model(saved)
  with pzp.open(saved) as handle:
    for loaded in (pzp.load(handle), pzp.load_model(handle),
                   pzp.load_into(handle, model_zoo.mlp()),
                   pzp.load_into(handle, model_zoo.mlp())):
      for a, b in zip(pz.unbind_variables(loaded, freeze=True)[1],
                      pz.unbind_variables(expected, freeze=True)[1]):
        np.testing.assert_array_equal(a.value.data_array, b.value.data_array)
    assert type(pzp.inspect(handle)).__name__ == "MLP"
    assert pzp.verify(handle).ok
    assert pzp.diff(handle, saved).identical
    pzp.export_safetensors(handle, tmp_path / "m.safetensors")
    pzp.render_html(handle, tmp_path / "m.html", arrays=False)
  assert "<title>" + saved in (tmp_path / "m.html").read_text()


def test_a_handle_reads_what_it_opened_never_a_checkpoint_saved_over_it(tmp_path):
  pzp.save(tmp_path / "ck", {"w": jnp.zeros(2)})
  handle = pzp.open(tmp_path / "ck")
  pzp.save(tmp_path / "ck", {"w": jnp.ones(2)}, overwrite=True)
  for read in (pzp.load, pzp.inspect, pzp.verify):
    with pytest.raises(errors.CheckpointReplacedError, match="was replaced since it was opened"):
      read(handle)
  handle = pzp.open(tmp_path / "ck")
  handle.close()
  with pytest.raises(errors.ArgumentError, match="was closed; open it again"):
    pzp.load(handle)
