"""Every store the conformance tests run on: local disk, gs:// and s3:// (the
emulators of `tests/remote`), and `folder_store.FolderStore`, a third object
store kept in tests only, registered for ``az://`` while a test runs."""

from __future__ import annotations

import uuid

import pytest
from remote.conftest import _emulator

from pz_persist.storage import stores
from stores import folder_store


@pytest.fixture
def az_root(tmp_path):
  """``az://`` (Azure Blob's spelling, which etils reads) registered for this
  test, backed by a fresh folder."""
  undo = stores.register("az", folder_store.FolderStore(tmp_path / "az"))
  yield "az://container"
  undo()


@pytest.fixture(params=["local", "gs", "s3", "az"])
def root(request, tmp_path) -> str:
  """A fresh, empty folder on each kind of store, as a path string."""
  if request.param == "local":
    return str(tmp_path / "local")
  if request.param == "az":
    return f"{request.getfixturevalue('az_root')}/{uuid.uuid4().hex[:12]}"
  return f"{_emulator(request.param).root()}/{uuid.uuid4().hex[:12]}"
