"""Every entry point refuses a storage pz_persist cannot publish on, up front.

Only local paths, ``gs://`` and ``s3://`` have a commit protocol here. Any
other URL (fsspec's ``memory://``, ``hf://``, ``az://``, ...) must be refused
with `UnsupportedStorageError` before anything is written or read: not turned
into a relative local folder (Orbax normalises ``az://b/x`` to ``az:/b/x``),
not written through fsspec without atomicity. Enforced in one place,
`pz_persist.storage.stores.choose`; this file holds every entry point to it.
"""

from __future__ import annotations

import fsspec
import pytest

import pz_persist as pzp
from hostile.path_entry_points import TREE
from hostile.path_entry_points import entry_points
from pz_persist import errors

SCHEMES = ["memory", "hf", "az", "abfs", "http", "ftp"]


@pytest.fixture(scope="module")
def local_checkpoint(tmp_path_factory) -> str:
  path = str(tmp_path_factory.mktemp("schemes") / "ck")
  pzp.save(path, TREE)
  return path


@pytest.mark.parametrize("kind", SCHEMES)
def test_every_entry_point_refuses_an_unsupported_scheme(kind, local_checkpoint, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # A URL taken for a relative path would land here.
  memory = fsspec.filesystem("memory")
  before = set(memory.store)
  url = f"{kind}://bucket/run/ck"
  for name, call in entry_points(url, local_checkpoint):
    with pytest.raises(errors.UnsupportedStorageError, match=f"{kind}://") as raised:
      call()
    assert "gs://" in str(raised.value) and "s3://" in str(raised.value), name
    assert not list(tmp_path.iterdir()), f"{name} wrote {list(tmp_path.iterdir())}"
    assert set(memory.store) == before, f"{name} wrote into fsspec's memory store"


def test_the_cli_refuses_an_unsupported_scheme(tmp_path, monkeypatch, capsys):
  from pz_persist.tools import cli  # pylint: disable=import-outside-toplevel

  monkeypatch.chdir(tmp_path)
  for command in (["inspect", "memory://b/ck"], ["verify", "az://b/ck"], ["ls", "hf://b/run"]):
    status = cli.main(command)
    assert status != 0, command
    assert "not supported" in capsys.readouterr().err, command
  assert not list(tmp_path.iterdir())

