"""A third object store, for tests only: ``az://CONTAINER/...`` kept in a folder.

Why: adding a kind of storage must be one module implementing
`pz_persist.storage.stores.base.Store` (here through
`stores.objects.ObjectStore`, which brings the commit protocol) and one
`stores.register` call; this one is that module, written the way an Azure
Blob store would be, and `test_conformance.py` holds it to the same contract
as local disk, gs:// and s3://. It behaves as an object store does: no
rename is used for publishing, objects appear whole, "folders" exist only as
name prefixes, and the conditional create is decided atomically (a hard
link, which never replaces a name).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import uuid
from typing import BinaryIO

from etils import epath

from pz_persist.storage.stores import base
from pz_persist.storage.stores import objects
from pz_persist.storage.stores import urls


class FolderStore(objects.ObjectStore):
  """Objects as files under ``top``; the name ``az://c/k`` is ``top/c/k``."""

  scheme = "az"

  def __init__(self, top: pathlib.Path):
    self.top = top
    self.spare = top.parent / f"{top.name}-uploads"  # Never listed.
    self.top.mkdir(parents=True, exist_ok=True)
    self.spare.mkdir(parents=True, exist_ok=True)

  def _file(self, path: epath.PathLike) -> pathlib.Path:
    return self.top / urls.key(path)

  def _staged(self, data: bytes) -> pathlib.Path:
    staged = self.spare / uuid.uuid4().hex
    staged.write_bytes(data)
    return staged

  def info(self, path: epath.PathLike) -> base.ObjectInfo | None:
    try:
      st = os.stat(self._file(path))
    except (FileNotFoundError, NotADirectoryError):
      return None
    if os.path.isdir(self._file(path)):
      return None
    return base.ObjectInfo(st.st_size, f"{st.st_ino}:{st.st_mtime_ns}", {})

  def create_if_absent(self, path: epath.PathLike, data: bytes) -> bool:
    target = self._file(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = self._staged(data)
    try:
      os.link(staged, target)
    except FileExistsError:
      return False
    finally:
      staged.unlink()
    return True

  def open(self, path: epath.PathLike) -> BinaryIO:
    return open(self._file(path), "rb")  # pylint: disable=consider-using-with

  def write_whole(self, path: epath.PathLike, data: bytes) -> None:
    target = self._file(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(self._staged(data), target)

  def read(self, path: epath.PathLike, limit: int) -> bytes:
    with open(self._file(path), "rb") as f:
      return f.read(limit + 1)

  def names(self, directory: epath.PathLike, prefix: str = "") -> list[str]:
    try:
      return sorted(n for n in os.listdir(self._file(directory)) if n.startswith(prefix))
    except (FileNotFoundError, NotADirectoryError):
      return []

  def tree(self, directory: epath.PathLike) -> dict[str, base.ObjectInfo]:
    top = self._file(directory)
    found = {}
    for folder, _, files in os.walk(top):
      for name in files:
        rel = (pathlib.Path(folder) / name).relative_to(top).as_posix()
        info = self.info(f"{os.fspath(directory).rstrip('/')}/{rel}")
        if info is not None:
          found[rel] = info
    return found

  def remove(self, path: epath.PathLike) -> None:
    target = self._file(path)
    if target.is_dir():
      shutil.rmtree(target, ignore_errors=True)
    else:
      target.unlink(missing_ok=True)
