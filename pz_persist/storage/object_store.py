"""Object stores (``gs://``, ``s3://``) by path: the few operations pz_persist needs.

Why: on an object store there is no rename, no lock and no inode, so a
checkpoint is published by a conditionally created commit object instead
(`pz_persist.storage.object_commit`). The stores themselves are
`pz_persist.storage.stores` (`stores.gcs`, `stores.s3`, chosen by scheme in
`stores.for_path`); these functions take a path and ask its store, for the
callers that hold a path rather than a store (listings of steps, digests of
a copied checkpoint, retention).

Only local paths, ``gs://`` and ``s3://`` are accepted (`check_supported`,
called by `pz_persist.storage.commit.as_path`, which every entry point goes
through): another scheme would be a store whose atomicity nobody here has
checked.
"""

from __future__ import annotations

from typing import Any

from etils import epath

from pz_persist import errors
from pz_persist.storage import stores
from pz_persist.storage.stores import base
from pz_persist.storage.stores import objects
from pz_persist.storage.stores import urls

ObjectInfo = base.ObjectInfo
scheme = urls.scheme
file_url_path = urls.file_url_path
check_url = urls.check_url
key = urls.key


def is_object_store(path: epath.PathLike) -> bool:
  """Whether ``path`` is on an object store pz_persist supports."""
  if scheme(path) in (None, "file"):
    return False
  try:
    return isinstance(stores.for_path(path), objects.ObjectStore)
  except errors.UnsupportedStorageError:
    return False


def check_supported(path: epath.PathLike) -> None:
  """Refuses a path pz_persist cannot keep a checkpoint whole on.

  Every path reaches here (`pz_persist.storage.commit.as_path`, and the
  stores before any request), so this is the one place an object-store URL
  is held to the one spelling that names the same objects for every library
  touching it (`check_url`).

  Raises:
    UnsupportedStorageError: a scheme without a store, or a URL `check_url`
      refuses.
    MissingExtraError: the fsspec package of the scheme is not installed
      (names the ``pip install 'pz-persist[...]'`` that fixes it).
  """
  stores.normalise(path)


def _objects(path: epath.PathLike) -> objects.ObjectStore:
  found = stores.for_path(path)
  if not isinstance(found, objects.ObjectStore):
    raise ValueError(f"{path} is not on an object store")
  return found


def filesystem(path: epath.PathLike) -> Any:
  """The fsspec filesystem of ``path`` (cached by fsspec, as epath's is)."""
  found = _objects(path)
  assert isinstance(found, objects.FsspecStore)
  return found.filesystem(path)


def info(path: epath.PathLike) -> ObjectInfo | None:
  """`ObjectInfo` of the object at ``path``; None if there is none."""
  return _objects(path).info(path)


def create_if_absent(path: epath.PathLike, data: bytes) -> bool:
  """Writes ``data`` at ``path`` only if no object is there; False if one is."""
  return _objects(path).create_if_absent(path, data)


def write(path: epath.PathLike, data: bytes) -> None:
  """Writes the object ``path`` in one request (objects appear whole)."""
  _objects(path).write_whole(path, data)


def read(path: epath.PathLike, limit: int) -> bytes:
  """The bytes of the object ``path``; at most ``limit + 1`` are read.

  Raises:
    FileNotFoundError: no such object.
  """
  return _objects(path).read(path, limit)


def names(directory: epath.PathLike, prefix: str = "") -> list[str]:
  """Names directly inside ``directory`` starting with ``prefix``, never cached."""
  return _objects(directory).names(directory, prefix)


def remove(path: epath.PathLike) -> None:
  """Deletes the object or the tree of objects at ``path``; missing is fine."""
  _objects(path).remove(path)


def tree(directory: epath.PathLike) -> dict[str, ObjectInfo]:
  """Every object under ``directory``, by its name relative to it (one listing)."""
  return _objects(directory).tree(directory)
