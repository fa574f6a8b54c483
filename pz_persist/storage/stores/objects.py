"""Object stores: checkpoints published by a commit object, files by fsspec.

`ObjectStore` is any store without rename, lock or inode but with the
conditional create: it gets the commit protocol of `commit_objects` over its own
primitives, and readers retry instead of locking. `FsspecStore` gives those
primitives through fsspec (``gcsfs``, ``s3fs``: the libraries ``etils.epath``
and Orbax already use for these paths); a kind of object store is then one
small module saying its scheme, its extra and how to read its listings
(`gcs`, `s3`). Arrays never go through here: Orbax's array handler writes
and reads them through TensorStore.
"""

from __future__ import annotations

import abc
import importlib
import os
from typing import Any
from typing import BinaryIO
from typing import ClassVar

from etils import epath

from pz_persist import errors
from pz_persist import version
from pz_persist.storage.stores import base
from pz_persist.storage.stores import commit_objects
from pz_persist.storage.stores import urls


class ObjectStore(base.Store):
  """A store publishing checkpoints by commit objects (`commit_objects`)."""

  load_attempts = 30
  """No lock makes a save's publishing wait for readers: an attempt is only
  lost when the commit it read was retired during it (an overwrite published
  *and* deleted it), so only overwrites following each other faster than one
  read could exhaust these. 10 was exhausted once in a clean CI run (a reader
  against a writer overwriting back to back on the 2-core VM, beside the
  emulator): each lost attempt costs one read, and a reader outlasting 30
  overwrites in a row is told to try again."""

  retry_jitter_seconds = 0.05
  """So that a reader and a writer that keep colliding fall out of step."""

  def normalise(self, path: epath.PathLike) -> epath.Path:
    """``path`` kept as it is, once `check` has accepted it."""
    self.check(path)
    return epath.Path(path)

  def check(self, path: epath.PathLike) -> None:
    """Refuses a URL whose objects depend on who reads it (`urls.check_url`)."""
    urls.check_url(os.fspath(path))

  # ---- Publishing: the commit protocol over this store's primitives. -------

  def identity(self, path: epath.Path) -> base.Identity:
    """``("commit", sequence, generation, folder name)``, ``("exists",)``
    for other files and no commit, or None for nothing (or only orphans)."""
    return commit_objects.identity(self, path)

  def check_publishable(self, path: epath.Path, seen: base.Identity) -> None:
    commit_objects.next_sequence(path, seen)

  def new_location(self, path: epath.Path, token: str) -> epath.Path:
    """A ``gen-<token>`` folder inside ``path``, never moved: publishing names it."""
    return commit_objects.new_generation(path, token)

  def publish(self, path: epath.Path, new: epath.Path, seen: base.Identity) -> bool:
    return commit_objects.publish(self, path, new, seen)

  def pin(self, path: epath.PathLike) -> base.Commit | None:
    return commit_objects.current(self, path)

  def orphans(self, path: epath.PathLike) -> list[epath.Path]:
    return commit_objects.orphans(self, path)


class FsspecStore(ObjectStore):
  """An object store reached through fsspec."""

  keeps_checksums = True

  package: ClassVar[str]
  """The fsspec package its scheme needs (``gcsfs``)."""

  extra: ClassVar[str]
  """The pz_persist extra installing it (``pip install 'pz-persist[gcs]'``)."""

  def check(self, path: epath.PathLike) -> None:
    """Also refuses a path whose fsspec package is not installed.

    Raises:
      MissingExtraError: naming the ``pip install 'pz-persist[...]'`` that
        fixes it.
    """
    super().check(path)
    try:
      importlib.import_module(self.package)
    except ImportError as e:
      raise errors.MissingExtraError(
          f"{os.fspath(path)}: {self.scheme}:// paths need the {self.package}"
          f" package, which is not installed ({e}). Install it with:"
          f" {version.install_command(self.extra)}"
      ) from None

  def filesystem(self, path: epath.PathLike) -> Any:
    """The fsspec filesystem of ``path`` (cached by fsspec, as epath's is)."""
    import fsspec  # pylint: disable=import-outside-toplevel

    self.check(path)
    return fsspec.filesystem(self.scheme)

  @abc.abstractmethod
  def object_info(self, raw: dict[str, Any]) -> base.ObjectInfo:
    """`base.ObjectInfo` from what fsspec's listing says of one object: each
    store names generations and checksums its own way."""

  def info(self, path: epath.PathLike) -> base.ObjectInfo | None:
    fs = self.filesystem(path)
    fs.invalidate_cache(urls.key(path))  # fsspec answers from old listings otherwise.
    try:
      raw = fs.info(urls.key(path))
    except FileNotFoundError:
      return None
    if raw.get("type") == "directory":
      return None
    return self.object_info(raw)

  def create_if_absent(self, path: epath.PathLike, data: bytes) -> bool:
    fs = self.filesystem(path)
    try:
      fs.pipe_file(urls.key(path), data, mode="create")
    except FileExistsError:
      return False
    return True

  def write_whole(self, path: epath.PathLike, data: bytes) -> None:
    """One request (``pipe_file``: a single upload; a file opened for
    writing would start a resumable upload, 2 requests, and on failure could
    commit what it had). An object appears whole when its upload completes."""
    self.filesystem(path).pipe_file(urls.key(path), data)

  def read(self, path: epath.PathLike, limit: int) -> bytes:
    fs = self.filesystem(path)
    fs.invalidate_cache(urls.key(path))  # Not an old listing's size: one ranged GET.
    return fs.cat_file(urls.key(path), start=0, end=limit + 1)

  def open(self, path: epath.PathLike) -> BinaryIO:
    return self.filesystem(path).open(urls.key(path), "rb")

  def names(self, directory: epath.PathLike, prefix: str = "") -> list[str]:
    """In one listing, never cached (another process may have written since)."""
    fs = self.filesystem(directory)
    top = urls.key(directory)
    try:
      entries = fs.ls(top, detail=False, refresh=True)
    except FileNotFoundError:
      return []
    found = []
    for entry in entries:
      name = entry.rstrip("/").rsplit("/", 1)[-1]
      if name.startswith(prefix) and entry.rstrip("/") != top:
        found.append(name)
    return sorted(found)

  def remove(self, path: epath.PathLike) -> None:
    fs = self.filesystem(path)
    try:
      fs.rm(urls.key(path), recursive=True)
    except FileNotFoundError:
      pass
    fs.invalidate_cache()

  def tree(self, directory: epath.PathLike) -> dict[str, base.ObjectInfo]:
    """One listing (paged by the store), never cached, no request per object."""
    fs = self.filesystem(directory)
    top = urls.key(directory)
    fs.invalidate_cache()  # Another process may have written since.
    try:
      found = fs.find(top, detail=True)
    except FileNotFoundError:
      return {}
    return {
        name[len(top) + 1:]: self.object_info(raw) for name, raw in found.items()
        if name.startswith(top + "/") and raw.get("type") != "directory"
    }
