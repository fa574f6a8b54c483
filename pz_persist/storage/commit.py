"""Publishing a checkpoint whole, on whichever store its path is on.

The protocols are the stores' (`pz_persist.storage.stores`): on a local disk
a save writes its checkpoint under a hidden sibling name and renames it into
place under a lock (`stores.local`); on ``gs://`` / ``s3://`` it writes a
``gen-*`` folder in place and publishes it by one conditionally created
commit object (`stores.commit_objects`). Callers (`pz_persist.save`, the exporters,
``migrate``) use the same calls (`identity`, `check_publishable`,
`new_location`, `move_into_place`, `reading`) for every store; each asks the
path's store (`stores.for_path`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from etils import epath

from pz_persist.safety import safe_io
from pz_persist.storage import stores
from pz_persist.storage.stores import local

Identity = stores.base.Identity
"""What a path held when looked at: None if nothing, else a value that changes
whenever another directory is put there (see `identity`)."""

sibling = local.sibling


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
  stores.for_path(path).remove(path)


def identity(path: epath.Path) -> Identity:
  """What is at ``path`` now, to tell later whether another save replaced it
  (`stores.base.Store.identity`)."""
  return stores.for_path(path).identity(path)


def check_publishable(path: epath.Path, seen: Identity) -> None:
  """Refuses, before anything is written, a save `move_into_place` could not
  publish over ``seen``: on an object store, a commit already at the last
  sequence (`stores.commit_objects.next_sequence`). Locally every save can be.

  Raises:
    ManifestError: naming the commit object and what to do instead.
  """
  stores.for_path(path).check_publishable(path, seen)


def new_location(path: epath.Path, token: str) -> epath.Path:
  """Where a save of ``path`` writes its checkpoint before `move_into_place`.

  Locally a hidden sibling (`sibling`), renamed into place; on an object
  store a ``gen-<token>`` folder inside ``path``, never moved: publishing
  names it. ``token`` is shared by all writing processes.
  """
  return stores.for_path(path).new_location(path, token)


def move_into_place(path: epath.Path, new: epath.Path, seen: Identity) -> bool:
  """Puts the complete checkpoint ``new`` at ``path`` if ``path`` is still ``seen``.

  ``seen`` is `identity` of ``path`` when the save started. If another save
  has put a checkpoint there since, ``new`` is deleted and False returned:
  the other save won, and its checkpoint stays whole
  (`stores.base.Store.commit`).
  """
  return stores.for_path(path).commit(path, new, seen)


@contextlib.contextmanager
def reading(path: epath.Path) -> Iterator[None]:
  """Holds the shared lock of ``path`` while a checkpoint is read.

  Why: a save moves its checkpoint into place under the exclusive lock, so
  while any reader holds this one, ``path`` cannot be swapped under it; the
  save's move waits (its writing does not) until the read is done. Readers
  never wait for each other. Where locking is unavailable, `load` detects a
  swap after the fact and reads again.
  """
  with stores.for_path(path).lock(path, shared=True):
    yield


def as_path(path: epath.PathLike) -> epath.Path:
  """``path`` as an ``epath.Path``; a local one with ``~`` expanded, made absolute.

  Why absolute: Orbax's OCDBT layer refuses relative directories (its error
  names only the temporary directory), and a notebook's ``save("ckpt", ...)``
  is the most natural call there is. Remote paths (``gs://...``) are kept,
  once their store has accepted them: every entry point passes its path
  through here or `open_path`, so an unsupported scheme or a missing extra
  is refused before anything is read or written, and a ``file://`` URL is
  the local path it names. Changes nothing process-wide.
  """
  return stores.normalise(path)


def open_path(path: epath.PathLike) -> epath.Path:
  """`as_path`, and the path's store made ready for Orbax to write and read
  it (`stores.base.Store.prepare`): on ``s3://`` that teaches Orbax S3
  (`pz_persist.enable_orbax_s3`), explicitly, the first time an entry point
  that hands the path to Orbax is given one."""
  return stores.open_path(path)[1]


is_local = safe_io.is_local  # For callers holding a path and not its store.
