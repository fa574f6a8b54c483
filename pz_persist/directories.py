"""Directory moves that keep a checkpoint whole: replace, swap, clean up.

A checkpoint directory must at every moment be either complete or absent.
Orbax gives that for a new directory (it writes to a temporary name and renames
it). Replacing an existing checkpoint needs one more step, done here: the new
checkpoint is written completely under a sibling name, then exchanged with the
old one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import uuid

from etils import epath


def remove_unfinished(target: epath.Path) -> None:
  """Deletes what a failed save left: Orbax's temporary directory for it."""
  for leftover in target.parent.glob(f"{target.name}.orbax-checkpoint-tmp*"):
    rmtree(leftover)


def rmtree(path: epath.Path) -> None:
  """Deletes a directory tree, local or remote (a missing one is fine)."""
  if _is_local(path):
    shutil.rmtree(os.fspath(path), ignore_errors=True)
  else:
    path.rmtree()


def sibling(path: epath.Path, role: str, token: str | None = None) -> epath.Path:
  """A unique hidden name next to ``path`` (``role`` says what it is for).

  ``token`` makes it unique; processes writing one checkpoint together must
  pass the same one.
  """
  token = token or uuid.uuid4().hex[:12]
  return path.parent / f".{path.name}.pz_persist-{role}-{token}"


def replace(path: epath.Path, new: epath.Path) -> None:
  """Puts the complete checkpoint ``new`` at ``path``, then deletes the old one.

  On Linux the two directories are exchanged atomically, so ``path`` always
  holds one whole checkpoint. Elsewhere the old one is first moved aside; if
  the process dies between the two renames, the old checkpoint survives under
  a ``.NAME.pz_persist-old-*`` name next to ``path``.
  """
  if _exchange(os.fspath(new), os.fspath(path)):
    old = new
  else:
    old = sibling(path, "old")
    path.rename(old)
    new.rename(path)
  rmtree(old)


def _is_local(path: epath.Path) -> bool:
  return "://" not in os.fspath(path)  # Not gs://, s3://, ...


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
  """Atomically swaps two paths with Linux ``renameat2``; False if unsupported."""
  if "://" in a or "://" in b:
    return False
  with contextlib.suppress(AttributeError, OSError):
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = libc.renameat2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
      return True
  return False
