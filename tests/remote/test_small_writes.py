"""safe_io.writing_whole on object stores: one upload to the name itself.

An object appears whole when its upload completes, so on ``gs://`` and
``s3://`` pz_persist's small files (manifest, file list, records) are
uploaded straight to their name: no temporary object, hence no copy and no
delete (a "rename" there is both). A writer allowed to create objects but not
to delete them (GCS ``roles/storage.objectCreator``, an S3 policy without
``s3:DeleteObject``) can therefore write them, and leaves nothing else behind.
"""

from __future__ import annotations

import os

import fsspec
import pytest
from etils import epath

from pz_persist.safety import safe_io
from pz_persist.storage import stores
from pz_persist.storage.stores import urls


def _objects(remote: str) -> list[str]:
  return stores.for_path(remote).names(remote)


def test_written_whole_and_nothing_else(remote):
  data = os.urandom(3 * 2**20 + 5)  # Past one upload chunk of either client.
  safe_io.write_small_file(f"{remote}/manifest.json", data)
  assert _objects(remote) == ["manifest.json"]
  assert epath.Path(f"{remote}/manifest.json").read_bytes() == data


def test_failed_block_leaves_the_previous_object(remote):
  path = f"{remote}/manifest.json"
  safe_io.write_small_file(path, b"before")
  with pytest.raises(RuntimeError, match="in the block"):
    with safe_io.writing_whole(path) as f:
      f.write(b"half of the new")
      raise RuntimeError("in the block")
  assert _objects(remote) == ["manifest.json"]
  assert epath.Path(path).read_bytes() == b"before"


def test_a_writer_that_cannot_delete_writes_and_leaves_no_temporary(remote, monkeypatch):
  """Deletes refused, as for a create-only role: the file is written, and no
  temporary object is left (before: the temporary object's move into place
  deleted it, which failed, and the write with it; measured on gs://)."""
  # On the class: fsspec shares one instance per store, and undoing a patch
  # on it would leave a bound method there, shadowing later tests' patches.
  fs_class = type(fsspec.filesystem(urls.scheme(remote)))

  def refused(*args, **kwargs):
    raise PermissionError("this writer may create objects, not delete them")

  for name in ("rm", "rm_file", "_rm", "_rm_file"):
    if hasattr(fs_class, name):
      monkeypatch.setattr(fs_class, name, refused)
  safe_io.write_small_file(f"{remote}/records.json", b"{}")
  monkeypatch.undo()
  assert _objects(remote) == ["records.json"]
  assert epath.Path(f"{remote}/records.json").read_bytes() == b"{}"
