"""The one way pz_persist deletes a directory and reads a small file.

Why this module exists: checkpoint and run directories may have been written
by someone else, and may keep changing while pz_persist works in them. A
symlink where a directory was expected must never make a delete leave the
directory (``shutil.rmtree`` of ``trash/step`` follows ``trash`` if it is a
link), and a FIFO or a device where a small JSON file was expected must never
block a reader or feed it without end. So every delete goes through
`remove_tree` / `empty_directory`, which work relative to open directory
descriptors and never follow a link (a link is deleted as a link), and every
small file is read by `read_small_file`, which opens without following a link
and without blocking, checks through the descriptor that it really opened a
regular file of bounded size, and reads at most that many bytes.

Remote paths (``gs://...``) have no links, FIFOs or devices; they are deleted
and read through ``epath`` as before.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from typing import BinaryIO

from etils import epath

from pz_persist import errors

_DIR_FLAGS = (
    os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)
_FILE_FLAGS = (
    os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
)
_NOT_FOLLOWED = (errno.ELOOP, errno.ENOTDIR, getattr(errno, "EMLINK", errno.ELOOP))
"""What ``open`` with ``O_NOFOLLOW`` (and ``O_DIRECTORY``) says of a link
(FreeBSD says EMLINK) or a non-directory."""


_FD_RELATIVE = (
    {os.open, os.stat, os.unlink, os.rmdir} <= os.supports_dir_fd
    and os.listdir in os.supports_fd
)
"""Whether deletes can work relative to directory descriptors (POSIX). Where
not (Windows), `remove_tree` falls back to ``shutil.rmtree``, which there
deletes links and junctions as links too."""


def is_local(path: epath.PathLike) -> bool:
  """Whether ``path`` is on the local file system (not gs://, s3://, ...).

  Only there do descriptors, renameat2, flock, symlinks and FIFOs exist.
  """
  return "://" not in os.fspath(path)


def lexists(path: epath.PathLike) -> bool:
  """Whether anything is at ``path``; locally a link, FIFO or folder too,
  never followed (remotely: an object or a prefix)."""
  if not is_local(path):
    return epath.Path(path).exists()
  return os.path.lexists(os.fspath(path))


def local_mode(path: epath.PathLike) -> int | None:
  """``path``'s ``st_mode`` (what a link leads to); None if there is nothing,
  it cannot be looked at, or it is remote (where FIFOs, devices and folders
  standing for files do not exist)."""
  if not is_local(path):
    return None
  try:
    return os.stat(os.fspath(path)).st_mode
  except OSError:
    return None


def remove_tree(path: epath.PathLike, *, strict: bool = False) -> None:
  """Deletes ``path`` and everything under it, and nothing a link leads to.

  A link anywhere in the tree, ``path`` included, is deleted as a link; its
  target is never touched. Every step works relative to a descriptor of the
  directory being emptied, opened with ``O_NOFOLLOW``, so a directory swapped
  for a link meanwhile is not entered either. The directories above ``path``
  are the caller's choice and may be links. A missing ``path`` is fine;
  entries that cannot be deleted (permissions) are left, as before.

  Args:
    path: What to delete.
    strict: ``path`` must be a real directory (a name pz_persist or Orbax
      created for its own temporary use, like a trash or a temporary
      checkpoint): anything else there is refused and left untouched.

  Raises:
    UnsafeCheckpointError: with ``strict``, ``path`` is a link or not a
      directory.
  """
  if not is_local(path):
    path = epath.Path(path)
    if path.exists():
      path.rmtree()
    return
  if not _FD_RELATIVE:
    if strict:
      check_own_directory(path)
    if os.path.islink(path) or os.path.isfile(path):
      os.unlink(path)
    else:
      shutil.rmtree(os.fspath(path), ignore_errors=True)
    return
  parent, name = os.path.split(os.path.abspath(os.fspath(path)))
  try:
    parent_fd = os.open(parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
  except (FileNotFoundError, NotADirectoryError):
    return
  try:
    if strict:
      _require_directory(parent_fd, name, os.fspath(path))
    _remove_entry(parent_fd, name)
  finally:
    os.close(parent_fd)


def empty_directory(path: epath.PathLike) -> None:
  """Deletes everything inside the real directory ``path`` (kept, empty).

  Why a descriptor: the directory is opened once, refusing a link, and its
  entries are deleted relative to that descriptor, so swapping ``path`` for a
  link after the check changes nothing. A missing ``path`` is fine.

  Raises:
    UnsafeCheckpointError: ``path`` is a link or not a directory.
  """
  if not is_local(path):
    path = epath.Path(path)
    if path.exists():
      for child in path.iterdir():
        remove_tree(child)
    return
  local = os.fspath(path)
  if not _FD_RELATIVE:
    check_own_directory(path)
    for name in os.listdir(local) if os.path.isdir(local) else ():
      remove_tree(os.path.join(local, name))
    return
  try:
    fd = os.open(local, _DIR_FLAGS)
  except FileNotFoundError:
    return
  except OSError as e:
    if e.errno in _NOT_FOLLOWED:
      raise _not_a_directory(local) from None
    raise
  try:
    _remove_contents(fd)
  finally:
    os.close(fd)


def check_own_directory(path: epath.PathLike) -> None:
  """Refuses ``path`` unless it is missing or a real directory, not a link.

  Why: for names pz_persist or Orbax create for their own use (a trash, a
  temporary checkpoint), anything else there was put by someone else, and
  moving into or deleting through it would act wherever it leads.

  Raises:
    UnsafeCheckpointError: naming ``path``.
  """
  if not is_local(path):
    return
  try:
    info = os.lstat(os.fspath(path))
  except FileNotFoundError:
    return
  if not stat.S_ISDIR(info.st_mode):
    raise _not_a_directory(os.fspath(path))


def _require_directory(parent_fd: int, name: str, shown: str) -> None:
  try:
    info = os.lstat(name, dir_fd=parent_fd)
  except FileNotFoundError:
    return
  if not stat.S_ISDIR(info.st_mode):
    raise _not_a_directory(shown)


def _not_a_directory(path: str) -> errors.UnsafeCheckpointError:
  what = "a symbolic link" if os.path.islink(path) else "not a directory"
  return errors.UnsafeCheckpointError(
      f"{path} is {what}, where pz_persist keeps a directory of its own;"
      " refusing to delete anything through it. Remove it yourself if it is"
      " not needed."
  )


def _remove_entry(dir_fd: int, name: str) -> None:
  """Deletes ``name`` in the directory open as ``dir_fd``, never following."""
  try:
    info = os.lstat(name, dir_fd=dir_fd)
  except FileNotFoundError:
    return
  if not stat.S_ISDIR(info.st_mode):
    _quietly(os.unlink, name, dir_fd=dir_fd)  # A link goes as a link.
    return
  try:
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
  except FileNotFoundError:
    return
  except OSError as e:
    if e.errno in _NOT_FOLLOWED:  # Swapped for a link or file since lstat.
      _quietly(os.unlink, name, dir_fd=dir_fd)
    return
  try:
    _remove_contents(fd)
  finally:
    os.close(fd)
  _quietly(os.rmdir, name, dir_fd=dir_fd)


def _remove_contents(fd: int) -> None:
  try:
    names = os.listdir(fd)
  except OSError:
    return
  for name in names:
    _remove_entry(fd, name)


def _quietly(remove, name: str, *, dir_fd: int) -> None:
  """Best effort, like ``rmtree(ignore_errors=True)``: what cannot go stays."""
  try:
    remove(name, dir_fd=dir_fd)
  except OSError:
    pass


@contextlib.contextmanager
def writing_whole(path: epath.PathLike) -> Iterator[BinaryIO]:
  """A file to write ``path`` through, which appears whole or not at all.

  Why: a reader (or a crash) must never meet half a manifest, file list,
  record or exported file. The data goes to a temporary name aside, which
  starts with a dot and ends in ``.tmp`` so that it matches none of the names
  readers look for; on a local disk it is flushed to the device, then renamed
  to ``path`` when the block ends. If the block fails, the temporary file is
  removed and ``path`` is untouched.

  On an object store (``gs://``, ``s3://``) an object appears whole when its
  upload completes, and a "rename" there is a copy plus a delete: the bytes
  are kept in memory and uploaded to ``path`` itself in one request when the
  block ends (nothing is written if it fails). That saves the temporary
  object's upload, its move (S3: copy and delete) and the existence checks
  around them: 1 request instead of 10 to 17. Remote callers write small
  files (manifests, records, configs).
  """
  if not is_local(path):
    buffer = io.BytesIO()
    yield buffer
    _upload(path, buffer.getvalue())
    return
  path = epath.Path(path)
  tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
  try:
    with open(os.fspath(tmp), "wb") as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(os.fspath(tmp), os.fspath(path))
  except BaseException:
    with contextlib.suppress(Exception):  # Best effort: the failure matters.
      tmp.unlink(missing_ok=True)
    raise


def _upload(path: epath.PathLike, data: bytes) -> None:
  """Writes the object ``path`` in one request (fsspec's ``pipe_file``: a
  single upload; a file opened for writing would start a resumable upload,
  2 requests, and on failure could commit what it had)."""
  import fsspec  # pylint: disable=import-outside-toplevel

  scheme, name = os.fspath(path).split("://", 1)
  fsspec.filesystem(scheme).pipe_file(name.rstrip("/"), data)


def write_small_file(path: epath.PathLike, data: bytes) -> None:
  """Writes the small file ``path`` whole or not at all (`writing_whole`)."""
  with writing_whole(path) as f:
    f.write(data)


def read_small_file(path: epath.PathLike, limit: int, *, what: str = "file") -> bytes:
  """The bytes of the small regular file ``path``, at most ``limit`` of them.

  Why each step: the file is opened with ``O_NOFOLLOW`` (a link, even one
  staying inside the checkpoint, is never what pz_persist or Orbax wrote) and
  ``O_NONBLOCK`` (opening a FIFO would otherwise wait for a writer forever);
  ``fstat`` of the very descriptor then says whether it is a regular file and
  how large, so a file swapped after any earlier check is judged as what was
  actually opened; and the read stops after ``limit + 1`` bytes whatever the
  file claims.

  Args:
    path: The file.
    limit: The most bytes accepted.
    what: What the file is, for messages (e.g. ``"manifest"``).

  Raises:
    FileNotFoundError: ``path`` does not exist (callers decide what that means).
    UnsafeCheckpointError: a link, FIFO, device or socket.
    ManifestError: a directory, or larger than ``limit``.
    OSError: it cannot be read for another reason.
  """
  shown = os.fspath(path)
  if not is_local(path):
    with epath.Path(path).open("rb") as f:
      return _bounded(f.read(limit + 1), limit, shown, what)
  try:
    fd = os.open(shown, _FILE_FLAGS)
  except OSError as e:
    if e.errno in (errno.ELOOP, getattr(errno, "EMLINK", errno.ELOOP)):
      raise errors.UnsafeCheckpointError(
          f"{shown} is a symbolic link; pz_persist and Orbax never write one"
          " there, so it is not followed."
      ) from None
    raise
  try:
    info = os.fstat(fd)
    if stat.S_ISDIR(info.st_mode):
      raise errors.ManifestError(f"{shown} is a directory, not a {what} file.")
    if not stat.S_ISREG(info.st_mode):
      raise errors.UnsafeCheckpointError(
          f"{shown} is {special_kind(info.st_mode)}, not a regular file;"
          " refusing to read it."
      )
    if info.st_size > limit:
      raise too_large(shown, what, info.st_size, limit)
    chunks, size = [], 0
    while size <= limit:  # Bounded even if the file grows meanwhile.
      chunk = os.read(fd, min(limit + 1 - size, 2**24))
      if not chunk:
        break
      chunks.append(chunk)
      size += len(chunk)
  finally:
    os.close(fd)
  return _bounded(b"".join(chunks), limit, shown, what)


def _bounded(data: bytes, limit: int, shown: str, what: str) -> bytes:
  if len(data) > limit:
    raise too_large(shown, what, len(data), limit)
  return data


def too_large(shown: str, what: str, size: int, limit: int) -> errors.ManifestError:
  """The error for the file ``shown`` (a ``what``) of ``size`` bytes."""
  return errors.ManifestError(
      f"{shown}: {what} is {size} bytes, over the {limit}-byte limit."
  )


_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFDIR: "a directory",
}


def special_kind(mode: int) -> str:
  """What a file that is not a regular file is, in words."""
  return _KINDS.get(stat.S_IFMT(mode), "not a regular file")
