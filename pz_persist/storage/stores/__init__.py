"""The kinds of storage a checkpoint can be on, one `Store` each.

`for_path` is the one place that decides which kind a path is on, from its
spelling alone (the URL scheme; never by asking fsspec): a local path or a
``file:///`` URL is `local.LocalStore`, ``gs://`` `gcs.GcsStore`, ``s3://``
`s3.S3Store`; any other scheme is refused, since a checkpoint there could not
be published atomically by anything pz_persist has checked. Callers carry the
store they got. Adding a kind is one module implementing `base.Store` and one
`register` call (`tests/test_stores.py` runs the same contract on each).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from etils import epath

from pz_persist import errors
from pz_persist.storage.stores import base
from pz_persist.storage.stores import gcs
from pz_persist.storage.stores import local
from pz_persist.storage.stores import s3
from pz_persist.storage.stores import urls

Store = base.Store
LOCAL = local.LocalStore()

_BY_SCHEME: dict[str, base.Store] = {"gs": gcs.GcsStore(), "s3": s3.S3Store()}


def for_path(path: epath.PathLike) -> base.Store:
  """The store of ``path``, from its scheme.

  Raises:
    UnsupportedStorageError: a scheme no store is registered for, or a
      ``file://`` URL naming another host.
  """
  kind = urls.scheme(path)
  if kind is None:
    return LOCAL
  if kind == "file":
    urls.file_url_path(path)  # Local: refused only if it names another host.
    return LOCAL
  found = _BY_SCHEME.get(kind)
  if found is None:
    known = [f"{name}://" for name in sorted(_BY_SCHEME)]
    listed = " and ".join([", ".join(known[:-1]), known[-1]] if len(known) > 1 else known)
    raise errors.UnsupportedStorageError(
        f"{os.fspath(path)}: pz_persist saves and loads on local disks, {listed}"
        f" only; {kind}:// is not supported, since a checkpoint there could"
        " not be published atomically. Copy it to a local path or one of"
        " those stores."
    )
  return found


def local_path(path: epath.PathLike) -> epath.PathLike:
  """``path``, or the local path its ``file://`` URL names."""
  return urls.file_url_path(path) or path


def choose(path: epath.PathLike) -> tuple[base.Store, epath.Path]:
  """The store of ``path`` and ``path`` in the spelling it reads
  (`base.Store.normalise`): what an entry point holding a path calls once,
  to hand both down."""
  path = local_path(path)
  store = for_path(path)
  return store, store.normalise(path)


def normalise(path: epath.PathLike) -> epath.Path:
  """``path`` in the spelling its store reads (`choose`, for a caller that
  needs only the check and the spelling)."""
  return choose(path)[1]


def place(path: epath.PathLike) -> tuple[base.Store, tuple[str, ...]]:
  """The store of ``path`` and where on it ``path`` is (`base.Store.place`)."""
  path = local_path(path)
  store = for_path(path)
  return store, store.place(path)


def folders_above(store: base.Store, path: epath.Path) -> list[epath.Path]:
  """The folders holding ``path`` (on ``store``), nearest first: locally
  after ``~``, relative parts and links are resolved, up to ``/``; on an
  object store up to, not including, the bucket."""
  where = store.place(path)
  if store.scheme is None:
    return [epath.Path(os.sep + os.sep.join(where[:n])) for n in range(len(where) - 1, -1, -1)]
  return [epath.Path(f"{store.scheme}://" + "/".join(where[1:n]))
          for n in range(len(where) - 1, 2, -1)]


def open_path(path: epath.PathLike) -> tuple[base.Store, epath.Path]:
  """The store of ``path`` and ``path`` normalised, made ready for Orbax
  (`base.Store.prepare`): what an entry point handing ``path`` to Orbax calls."""
  path = local_path(path)
  store = for_path(path)
  return store, store.prepare(path)


def register(scheme: str, store: base.Store) -> Callable[[], None]:
  """Makes ``scheme://`` paths ``store``'s; returns what undoes it.

  For a store kept outside pz_persist (and the tests' own): nothing in
  pz_persist registers another one.
  """
  before = _BY_SCHEME.get(scheme)
  _BY_SCHEME[scheme] = store

  def undo() -> None:
    if before is None:
      _BY_SCHEME.pop(scheme, None)
    else:
      _BY_SCHEME[scheme] = before

  return undo
