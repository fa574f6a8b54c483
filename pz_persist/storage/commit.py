"""Publishing a checkpoint whole: local directory moves, or an object store's commit.

On an object store (``gs://``, ``s3://``) there is no rename; there the
functions below hand over to `pz_persist.storage.object_commit`, whose
checkpoints are published by one conditionally created commit object. Callers
(`pz_persist.save`, `pz_persist.storage.opening`) use the same four calls
(`identity`, `new_location`, `move_into_place`, `reading`) for both.

Locally:

A checkpoint directory must at every moment be either complete or absent,
even when processes are killed or several save to one path at once. So every
save writes its checkpoint completely under its own hidden sibling name (Orbax's
temporary directory is derived from the final name, ``NAME.orbax-checkpoint-tmp``,
so two saves writing the same final name would delete each other's files), and
only then moves it into place with `move_into_place`: one rename, or an atomic
exchange with the checkpoint it replaces, done only if ``path`` is still what
the save saw when it started. A killed save leaves at most its own
``.NAME.pz_persist-new-*`` sibling, which no other save touches.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import uuid

from etils import epath

from pz_persist.safety import safe_io
from pz_persist.storage import object_commit
from pz_persist.storage import object_store
from pz_persist.storage import s3_kvstore

try:
  import fcntl
except ImportError:  # Windows: saves are still never mixed; see _parent_locked.
  fcntl = None  # type: ignore[assignment]  # Optional module: callers test for None.


def remove_unfinished(target: epath.Path) -> None:
  """Deletes what a failed save to the unique ``target`` left, and only that.

  Raises:
    UnsafeCheckpointError: one of these names (all the save's own
      directories) is a symlink or not a directory; it is left untouched.
  """
  for leftover in target.parent.glob(f"{target.name}.orbax-checkpoint-tmp*"):
    safe_io.remove_tree(leftover, strict=True)
  safe_io.remove_tree(target, strict=True)


def rmtree(path: epath.Path) -> None:
  """Deletes a tree, local or remote (a missing one is fine), never following
  a symlink: a link, at ``path`` or inside, is deleted as a link."""
  safe_io.remove_tree(path)


def sibling(path: epath.Path, role: str, token: str | None = None) -> epath.Path:
  """A unique hidden name next to ``path`` (``role`` says what it is for).

  ``token`` makes it unique; processes writing one checkpoint together must
  pass the same one.
  """
  token = token or uuid.uuid4().hex[:12]
  return path.parent / f".{path.name}.pz_persist-{role}-{token}"


Identity = tuple | None
"""What a path held when looked at: None if nothing, else a value that changes
whenever another directory is put there (see `identity`)."""


def identity(path: epath.Path) -> Identity:
  """What is at ``path`` now, to tell later whether another save replaced it.

  Every save puts a new directory (a new inode, with its own timestamps) at
  the path, so inode and modification/change times tell one from the next.
  On an object store, every save creates a new commit object, so its
  sequence and generation do (`object_commit.identity`).
  """
  if object_store.is_object_store(path):
    return object_commit.identity(path)
  if not is_local(path):
    return ("exists",) if path.exists() else None
  try:
    st = os.stat(os.fspath(path))
  except FileNotFoundError:
    return None
  return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def check_publishable(path: epath.Path, seen: Identity) -> None:
  """Refuses, before anything is written, a save `move_into_place` could not
  publish over ``seen``: on an object store, a commit already at the last
  sequence (`object_commit.next_sequence`). Locally every save can be.

  Raises:
    ManifestError: naming the commit object and what to do instead.
  """
  if object_store.is_object_store(path):
    object_commit.next_sequence(path, seen)


def new_location(path: epath.Path, token: str) -> epath.Path:
  """Where a save of ``path`` writes its checkpoint before `move_into_place`.

  Locally a hidden sibling (`sibling`), renamed into place; on an object
  store a ``gen-<token>`` folder inside ``path``, never moved: publishing
  names it (`object_commit`). ``token`` is shared by all writing processes.
  """
  if object_store.is_object_store(path):
    return object_commit.new_generation(path, token)
  return sibling(path, "new", token)


def move_into_place(path: epath.Path, new: epath.Path, seen: Identity) -> bool:
  """Puts the complete checkpoint ``new`` at ``path`` if ``path`` is still ``seen``.

  ``seen`` is `identity` of ``path`` when the save started. If another save
  has put a checkpoint there since, ``new`` is deleted and False returned:
  the other save won, and its checkpoint stays whole. The check and the
  rename run under an exclusive ``flock`` of the parent directory, so two
  saves cannot both pass the check; the lock is held for milliseconds (no
  writing happens under it) and vanishes with the process (no lock file).

  A new ``path`` is created by a rename that never replaces anything. An
  existing one is, on Linux, atomically exchanged with ``new``, so ``path``
  always holds one whole checkpoint; elsewhere the old one is first moved
  aside, and if the process dies between the two renames it survives under a
  ``.NAME.pz_persist-old-*`` name next to ``path``. The old one is deleted
  after the lock is released.

  On an object store, ``new`` (from `new_location`) is published instead
  (`object_commit.publish`), with the same outcome: True, or False with
  ``new`` deleted when another save published first.
  """
  if object_store.is_object_store(path):
    return object_commit.publish(path, new, seen)
  with _parent_locked(path):
    if identity(path) != seen:
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
    rmtree(leftover)
  return moved


@contextlib.contextmanager
def reading(path: epath.Path):
  """Holds a shared ``flock`` on ``path``'s parent while a checkpoint is read.

  Why: a save moves its checkpoint into place under the exclusive lock, so
  while any reader holds this one, ``path`` cannot be swapped under it; the
  save's move waits (its writing does not) until the read is done. Readers
  never wait for each other. Where locking is unavailable, `load` detects a
  swap after the fact and reads again.
  """
  with _parent_locked(path, shared=True):
    yield


@contextlib.contextmanager
def _parent_locked(path: epath.Path, *, shared: bool = False):
  """Holds an exclusive (or shared) ``flock`` on ``path``'s parent, if it can.

  Where directories cannot be locked (remote paths, no ``fcntl``, some
  network filesystems) saves still never mix, thanks to the no-replace
  rename; only two overwrites of one path at the same moment could then
  both succeed, the last one winning.
  """
  fd = None
  if is_local(path) and fcntl is not None:
    with contextlib.suppress(OSError):
      fd = os.open(os.fspath(path.parent), os.O_RDONLY | os.O_DIRECTORY)
      fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
  try:
    yield
  finally:
    if fd is not None:
      os.close(fd)  # Releases the lock.


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


def as_path(path: epath.PathLike) -> epath.Path:
  """``path`` as an ``epath.Path``; a local one with ``~`` expanded, made absolute.

  Why absolute: Orbax's OCDBT layer refuses relative directories (its error
  names only the temporary directory), and a notebook's ``save("ckpt", ...)``
  is the most natural call there is. Remote paths (``gs://...``) are kept,
  once `object_store.check_supported` has accepted them: every entry point
  passes its path through here, so an unsupported scheme or a missing extra
  is refused before anything is read or written, and a ``file://`` URL is
  the local path it names.
  """
  path = object_store.file_url_path(path) or path  # file:///a is the local /a.
  if not is_local(path):
    object_store.check_supported(path)
    s3_kvstore.enable_for(path)  # Orbax's arrays on s3:// (the user's opt-in).
    return epath.Path(path)
  return epath.Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


is_local = safe_io.is_local  # Where the commit protocol's callers ask it.


_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2(a: epath.Path, b: epath.Path, flags: int) -> bool:
  """Linux ``renameat2(a, b, flags)``; False where unsupported.

  Raises:
    OSError: for a failure other than "unsupported" (e.g. `FileExistsError`
      with ``RENAME_NOREPLACE``).
  """
  if not (is_local(a) and is_local(b)):
    return False
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
