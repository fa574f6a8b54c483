"""The local disk: a checkpoint published by a locked rename.

A checkpoint directory must at every moment be either complete or absent,
even when processes are killed or several save to one path at once. So every
save writes its checkpoint completely under its own hidden sibling name (Orbax's
temporary directory is derived from the final name, ``NAME.orbax-checkpoint-tmp``,
so two saves writing the same final name would delete each other's files), and
only then moves it into place with `LocalStore.publish`: one rename, or an atomic
exchange with the checkpoint it replaces, done only if ``path`` is still what
the save saw when it started. A killed save leaves at most its own
``.NAME.pz_persist-new-*`` sibling, which no other save touches.

Only here do descriptors, ``renameat2``, ``flock``, inodes, symlinks and FIFOs
exist; `pz_persist.safety.safe_io` holds the link-safe deletes and reads.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import uuid
from collections.abc import Iterator
from typing import BinaryIO

from etils import epath

from pz_persist import errors
from pz_persist.safety import safe_io
from pz_persist.storage.stores import base

try:
  import fcntl
except ImportError:  # Windows: saves are still never mixed; see LocalStore.lock.
  fcntl = None  # type: ignore[assignment]  # Optional module: callers test for None.

ORBAX_CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
"""The file Orbax writes at the top of every checkpoint (beside its items)."""


def sibling(path: epath.Path, role: str, token: str | None = None) -> epath.Path:
  """A unique hidden name next to ``path`` (``role`` says what it is for).

  ``token`` makes it unique; processes writing one checkpoint together must
  pass the same one.
  """
  token = token or uuid.uuid4().hex[:12]
  return path.parent / f".{path.name}.pz_persist-{role}-{token}"


class LocalStore(base.Store):
  """Local paths (and ``file:///`` URLs, which name them)."""

  scheme = None
  identifies_files = True
  renames = True
  has_locks = True

  def place(self, path: epath.PathLike) -> tuple[str, ...]:
    """After ``~``, relative parts and symlinks are resolved, so ``./ck``,
    ``../run/ck`` and a link to it are one place."""
    real = os.path.realpath(os.path.expanduser(os.fspath(path)))
    return tuple(part for part in real.split(os.sep) if part)

  def normalise(self, path: epath.PathLike) -> epath.Path:
    """``path`` with ``~`` expanded, made absolute.

    Why absolute: Orbax's OCDBT layer refuses relative directories (its
    error names only the temporary directory), and a notebook's
    ``save("ckpt", ...)`` is the most natural call there is.
    """
    absolute = os.path.abspath(os.path.expanduser(os.fspath(path)))
    _check_reachable(absolute, os.fspath(path))
    return epath.Path(absolute)

  # ---- Whole files. ---------------------------------------------------------

  def read(self, path: epath.PathLike, limit: int) -> bytes:
    return safe_io.read_small_file(path, limit)

  def open(self, path: epath.PathLike) -> BinaryIO:
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    return os.fdopen(fd, "rb")

  def write_whole(self, path: epath.PathLike, data: bytes) -> None:
    """Folders are made as needed (object stores have none to make)."""
    os.makedirs(os.path.dirname(os.fspath(path)), exist_ok=True)
    safe_io.write_small_file(path, data)

  def create_if_absent(self, path: epath.PathLike, data: bytes) -> bool:
    """Written aside, then hard-linked to ``path``: a link never replaces a
    name, and the file it names is already whole."""
    path = epath.Path(path)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    self.write_whole(tmp, data)
    try:
      os.link(os.fspath(tmp), os.fspath(path))
    except FileExistsError:
      return False
    finally:
      os.unlink(os.fspath(tmp))
    return True

  def info(self, path: epath.PathLike) -> base.ObjectInfo | None:
    try:
      st = os.lstat(os.fspath(path))
    except (FileNotFoundError, NotADirectoryError):
      return None
    if stat.S_ISDIR(st.st_mode):
      return None
    return _info(st)

  def has_entry(self, path: epath.PathLike) -> bool:
    return os.path.lexists(os.fspath(path))

  def names(self, directory: epath.PathLike, prefix: str = "") -> list[str]:
    try:
      found = os.listdir(os.fspath(directory))
    except (FileNotFoundError, NotADirectoryError):
      return []
    return sorted(name for name in found if name.startswith(prefix))

  def tree(self, directory: epath.PathLike) -> dict[str, base.ObjectInfo]:
    """Links are listed as the links they are, never followed."""
    top = os.fspath(directory)
    found = {}
    for root, _, files in os.walk(top):
      for name in files:
        full = os.path.join(root, name)
        with contextlib.suppress(FileNotFoundError):
          found[os.path.relpath(full, top).replace(os.sep, "/")] = _info(os.lstat(full))
    return found

  def remove(self, path: epath.PathLike) -> None:
    safe_io.remove_tree(path)

  # ---- Locks and identities. ------------------------------------------------

  @contextlib.contextmanager
  def lock(self, path: epath.PathLike, *, shared: bool = False) -> Iterator[None]:
    """Holds an exclusive (or shared) ``flock`` on ``path``'s parent, if it can.

    Where directories cannot be locked (no ``fcntl``, some network
    filesystems) saves still never mix, thanks to the no-replace rename;
    only two overwrites of one path at the same moment could then both
    succeed, the last one winning. The lock vanishes with the process (no
    lock file).
    """
    fd = None
    if fcntl is not None:
      with contextlib.suppress(OSError):
        fd = os.open(os.fspath(epath.Path(path).parent), os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
    try:
      yield
    finally:
      if fd is not None:
        os.close(fd)  # Releases the lock.

  @contextlib.contextmanager
  def reading(self, path: epath.PathLike) -> Iterator[None]:
    """Also holds the shared lock of the checkpoint holding ``path``, when
    ``path`` is an item inside one: a save swaps that checkpoint (``path``'s
    parent) under the lock of its own parent, not of ``path``'s."""
    path = epath.Path(path)
    with self.lock(path, shared=True):
      if (path.parent / ORBAX_CHECKPOINT_METADATA).exists():
        with self.lock(path.parent, shared=True):
          yield
      else:
        yield

  def file_identity(self, path: epath.PathLike) -> tuple[int, ...] | None:
    """The file's device, inode, times and size: every save writes new files."""
    try:
      st = os.lstat(os.fspath(path))
    except OSError:
      return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)

  # ---- Publishing. ----------------------------------------------------------

  def identity(self, path: epath.Path) -> base.Identity:
    """Every save puts a new directory (a new inode, with its own timestamps)
    at the path, so inode and modification/change times tell one from the
    next."""
    try:
      st = os.stat(os.fspath(path))
    except FileNotFoundError:
      return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)

  def new_location(self, path: epath.Path, token: str) -> epath.Path:
    """A hidden sibling (`sibling`), renamed into place by `publish`."""
    return sibling(path, "new", token)

  def publish(self, path: epath.Path, new: epath.Path, seen: base.Identity) -> bool:
    """Puts the complete checkpoint ``new`` at ``path`` if ``path`` is still ``seen``.

    The check and the rename run under an exclusive `lock` of the parent
    directory, so two saves cannot both pass the check; the lock is held for
    milliseconds (no writing happens under it).

    A new ``path`` is created by a rename that never replaces anything. An
    existing one is, on Linux, atomically exchanged with ``new``, so ``path``
    always holds one whole checkpoint; elsewhere the old one is first moved
    aside, and if the process dies between the two renames it survives under
    a ``.NAME.pz_persist-old-*`` name next to ``path``. The old one is
    deleted after the lock is released.
    """
    with self.lock(path):
      if self.identity(path) != seen:
        moved, leftover = False, new
      elif seen is None:
        moved = _rename_noreplace(new, path)
        leftover = None if moved else new
      elif _renameat2(new, path, _RENAME_EXCHANGE):
        moved, leftover = True, new  # ``new`` now names the old checkpoint.
      else:
        moved, leftover = True, sibling(path, "old")
        path.rename(leftover)
        new.rename(path)
    if leftover is not None:
      safe_io.remove_tree(leftover)
    return moved


def _info(st: os.stat_result) -> base.ObjectInfo:
  return base.ObjectInfo(st.st_size, f"{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}", {})


def _rename_noreplace(src: epath.Path, dst: epath.Path) -> bool:
  """Renames ``src`` to ``dst`` unless ``dst`` exists; False if it does."""
  try:
    if _renameat2(src, dst, _RENAME_NOREPLACE):
      return True
  except FileExistsError:
    return False
  if dst.exists():  # No renameat2: checked under the lock instead.
    return False
  src.rename(dst)
  return True


_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2(a: epath.Path, b: epath.Path, flags: int) -> bool:
  """Linux ``renameat2(a, b, flags)``; False where unsupported.

  Raises:
    OSError: for a failure other than "unsupported" (e.g. `FileExistsError`
      with ``RENAME_NOREPLACE``).
  """
  try:
    renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
  except (AttributeError, OSError):
    return False
  renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
  if renameat2(_AT_FDCWD, os.fsencode(os.fspath(a)), _AT_FDCWD, os.fsencode(os.fspath(b)), flags) == 0:
    return True
  code = ctypes.get_errno()
  if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
    return False  # Old kernel, or a filesystem without these flags.
  raise OSError(code, os.strerror(code), os.fspath(a), None, os.fspath(b))


_UNREACHABLE = {
    errno.ELOOP: "it is a symbolic link that leads back to itself (or through too many links)",
    errno.ENOTDIR: "a part of it above the last is a file, not a folder",
}


def _check_reachable(absolute: str, given: str) -> None:
  """Refuses a local path the system can never reach: a link loop, or a
  path through a file. Why here, where every local path is normalised
  (`stores.open_path`, the destination rule): each raised a bare OSError
  from whichever call first met it (``Too many levels of symbolic links``,
  ``Not a directory``), which the command reported as a failed check.

  Raises:
    ArgumentError: naming the path as given and what is wrong with it.
  """
  try:
    os.stat(absolute)
  except OSError as e:
    why = _UNREACHABLE.get(e.errno or 0)
    if why is not None:
      raise errors.ArgumentError(
          f"{given}: no file or folder can be reached at this path: {why}."
          " Check the path."
      ) from None
