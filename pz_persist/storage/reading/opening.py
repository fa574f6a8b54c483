"""Opening a checkpoint item for reading: the one way every loader gets in.

Why one module: each thing a read must do before it trusts a byte of the
checkpoint (find the item, refuse files reaching outside it, hold the shared
lock a save's final move waits for, read the manifest once, and notice a save
replacing the checkpoint meanwhile) used to be redone, or forgotten, by each
entry point. `read` does all of it, so `pz_persist.load`, ``inspect``,
``load_model`` (both forms), ``diff``, ``verify``, the Orbax v0 handler (and
through it ``CheckpointManager.restore`` and the Orbax v1 handler) get the
same guarantees::

  tree = opening.read(path, lambda opened: decode(opened.manifest, ...))

Files are read by path, so a save replacing the checkpoint while it is read
could mix the old manifest with new arrays, or fail on files of the old one as
it is deleted. On a local disk the read holds a shared lock that a save's
final move waits for; elsewhere (or when the item directory itself was given)
such a read is detected (what is at the path changed while it was read) and
done again from the start, at most `stores.base.Store.load_attempts` times (each
store says how many). On an object store the read pins the current commit and
reads the folder it names, which never changes once published; it is read
again only if that commit was retired meanwhile
(`pz_persist.storage.stores.commit_objects`). Which of these a path gets is its
store's (`pz_persist.storage.stores`), chosen once and carried in
`OpenItem.store`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import time
from collections.abc import Callable
from typing import Any
from typing import Protocol
from typing import TypeAlias
from typing import TypeVar

from etils import epath

from pz_persist import errors
from pz_persist.format import manifest as manifest_lib
from pz_persist.safety import safe_io
from pz_persist.storage import stores
from pz_persist.storage.integrity import containment
from pz_persist.storage.lifecycle import leftovers

_T = TypeVar("_T")

"""The file Orbax writes at the top of every checkpoint (beside its items)."""


@dataclasses.dataclass(frozen=True)
class OpenItem:
  """A checkpoint item, checked and with its manifest read, ready to read.

  Attributes:
    path: The path the user (or Orbax) gave.
    item: The item directory (``path`` itself, or the one item inside it).
    manifest: The parsed, validated manifest, read once.
    digest: sha256 of exactly the manifest bytes parsed: which checkpoint
      this is, on filesystems without stable inodes.
    snapshot: What `containment.check_contained` saw of ``item`` (None remotely),
      for `containment.files_unchanged` to compare the files read against.
    identity: `_identity` of ``path`` and ``item`` before the manifest was
      read, to tell whether a save replaced them since.
    pinned: On an object store, the commit whose checkpoint is read (see
      `pz_persist.storage.stores.commit_objects`); None elsewhere.
    store: The store ``path`` is on, chosen once (`stores.for_path`).
  """

  path: epath.Path
  item: epath.Path
  manifest: manifest_lib.Manifest
  digest: bytes
  snapshot: containment.Snapshot | None
  identity: tuple[Any, ...]
  pinned: stores.base.Commit | None = None
  store: stores.Store = stores.LOCAL

  def unchanged(self) -> bool:
    """Whether ``path`` still holds the very checkpoint opened."""
    return _same(self.store, self.path, self.item, self.identity, self.digest, self.pinned)


def read(
    path: PathOrHandle,
    use: Callable[[OpenItem], _T],
    *,
    item_directory: bool = False,
    damaged_manifest: Callable[[epath.Path, errors.ManifestError], _T] | None = None,
) -> _T:
  """Opens the item at ``path`` and returns ``use(opened)``, never a mix.

  ``use`` runs under the shared lock (`stores.base.Store.reading`). If it fails or
  returns while what is at ``path`` changed (a save replaced the checkpoint),
  its result or error is discarded and everything is done again from the
  start; an error raised while nothing changed is a real one, raised at once.

  Args:
    path: A checkpoint directory or the item directory inside one.
    use: Reads what it needs from the opened item.
    item_directory: ``path`` is an item directory (as Orbax hands handlers):
      it is not searched for an item.
    damaged_manifest: For a reader that reports damage rather than raising it
      (``verify``): called as ``damaged_manifest(item, error)`` instead of
      ``use`` when the item's manifest cannot be read or is invalid.

  Raises:
    ConcurrentSaveError: other saves replaced the checkpoint during each of
      `stores.base.Store.load_attempts` attempts (the path's store says how many).
  """
  handle = opened_handle(path)
  if handle is not None:  # `pz_persist.open`'s handle: the checkpoint it opened.
    return handle.__pz_persist_read__(use)
  store, path = stores.open_path(path)
  failure = None
  attempts = store.load_attempts
  for attempt in range(attempts):
    if attempt and store.retry_jitter_seconds:
      time.sleep(random.uniform(0, store.retry_jitter_seconds))
    item, digest, pinned = None, None, None
    with store.reading(path):
      before: tuple[Any, ...] = ()
      try:
        pinned = None if item_directory else store.pin(path)
        before = _seen(store, path, item, pinned)
        item, snapshot = _find(store, path, item_directory, pinned)
        before = _seen(store, path, item, pinned)
        if not _walked(snapshot, item):  # Replaced between the walk and now.
          continue
        try:
          manifest, data = manifest_lib.read_with_bytes(item)
        except errors.ManifestError as e:
          if damaged_manifest is None:
            raise
          result = damaged_manifest(item, e)
        else:
          digest = hashlib.sha256(data).digest()
          result = use(OpenItem(path, item, manifest, digest, snapshot, before, pinned, store))
      except Exception as e:  # pylint: disable=broad-exception-caught
        if not before or _same(store, path, item, before, digest, pinned):
          raise  # Nothing was opened, or the checkpoint did not change: real.
        failure = e
        continue
      unchanged = _same(store, path, item, before, digest, pinned)
    if unchanged:
      return result
  raise errors.ConcurrentSaveError(
      f"{path} was replaced by other saves while each of {attempts}"
      " attempts to load it was reading it; try again."
  ) from failure


class OpenedHandle(Protocol):
  """What `read` accepts in place of a path: a checkpoint already opened
  (`pz_persist.open`'s `pz_persist.OpenedCheckpoint`).

  Attributes:
    path: The path it was opened from.
  """

  @property
  def path(self) -> epath.Path: ...

  def __pz_persist_read__(self, use: Callable[[OpenItem], _T]) -> _T:
    """``use`` of the item it opened, under its own checks (closed,
    replaced since, the shared lock), as its own reads are."""


PathOrHandle: TypeAlias = epath.PathLike | OpenedHandle
"""What a loader takes for its checkpoint: a path, or an opened handle."""


def opened_handle(obj: Any) -> OpenedHandle | None:
  """``obj`` if it is an opened checkpoint handle, else None.

  Why here: `read` is where every loader's path argument arrives, so a
  handle given for a path (``pzp.load(pzp.open(path))``) is accepted in
  this one place by ``load``, ``load_into``, ``load_model``, ``inspect``,
  ``verify`` and ``diff``, and reads the checkpoint the handle opened,
  never one saved over it since.
  """
  return obj if callable(getattr(obj, "__pz_persist_read__", None)) else None


def checkpoint_path(obj: Any) -> epath.PathLike | None:
  """The path ``obj`` names a checkpoint by: ``obj`` itself for a string or
  path object, a handle's `OpenedHandle.path`; None for anything else (a
  model in memory)."""
  if isinstance(obj, (str, os.PathLike)):
    return obj
  handle = opened_handle(obj)
  return None if handle is None else handle.path


def read_manifest(path: epath.PathLike) -> manifest_lib.Manifest:
  """The validated manifest of the checkpoint at ``path`` (reads no arrays)."""
  return read(path, lambda opened: opened.manifest)


def _walked(snapshot: containment.Snapshot | None, item: epath.Path) -> bool:
  """Whether ``snapshot`` is of the directory at ``item`` now.

  Why: the identity that tells a replaced checkpoint is taken after the walk
  (the item is only known then); a save landing in between would pair the
  old files' snapshot with the new checkpoint (where no lock stops it).
  """
  if snapshot is None:
    return True
  try:
    st = os.stat(snapshot[0])
  except OSError:
    return False
  same_root = os.path.realpath(os.fspath(item)) == snapshot[0]
  return same_root and (st.st_dev, st.st_ino) == snapshot[1:3]


def _seen(
    store: stores.Store, path: epath.Path, item: epath.Path | None,
    pinned: stores.base.Commit | None,
) -> tuple[Any, ...]:
  """`_identity`, or for a ``pinned`` commit the commit itself: its folder
  never changes once published, so only the commit object is watched."""
  if pinned is not None:
    return ("pinned", pinned.sequence, pinned.generation)
  return _identity(store, path, item)


def _identity(store: stores.Store, path: epath.Path, item: epath.Path | None) -> tuple[Any, ...]:
  """Which checkpoint is at ``path`` (and its ``item``, once found) now.

  A save replacing it puts new directories there, with new inodes and times,
  and a new manifest file (`stores.base.Store.file_identity`, where the store
  tells files apart).
  """
  if item is None:
    return (store.identity(path),)
  return (
      store.identity(path),
      store.identity(item),
      store.file_identity(manifest_lib.manifest_path(item)),
  )


def _same(
    store: stores.Store, path: epath.Path, item: epath.Path | None, before: tuple[Any, ...],
    digest: bytes | None, pinned: stores.base.Commit | None = None,
) -> bool:
  """Whether ``path`` still holds what was seen as ``before`` (and, remotely,
  where nothing else tells files apart, a manifest hashing to ``digest``).

  For a ``pinned`` commit: whether its commit object still exists unchanged,
  so its folder was not retired while it was read (`Commit.still_current`);
  a newer commit published meanwhile does not make the read a mix.
  """
  if pinned is not None:
    return pinned.still_current()
  if _identity(store, path, item) != before:
    return False
  if item is None or digest is None or store.identifies_files:
    return True
  return _manifest_digest(item) == digest


def _manifest_digest(item: epath.Path) -> bytes | None:
  try:  # Bounded, never following a link nor blocking, as in read.
    return hashlib.sha256(safe_io.read_small_file(
        manifest_lib.manifest_path(item), manifest_lib.MAX_MANIFEST_BYTES
    )).digest()
  except (OSError, errors.PzPersistError):
    return None


def _find(
    store: stores.Store, path: epath.Path, item_directory: bool,
    pinned: stores.base.Commit | None,
) -> tuple[epath.Path, containment.Snapshot | None]:
  """The item at ``path`` (in the folder ``pinned`` names, if any), its
  files checked, and what the check saw of it."""
  if item_directory:
    return path, check_item_contained(path)
  return _find_item(store, path if pinned is None else pinned.checkpoint)


def find_item(
    store: stores.Store, path: epath.Path
) -> tuple[epath.Path, containment.Snapshot | None]:
  """The pz_persist item directory of the checkpoint at ``path`` on ``store``
  (``path`` as `stores.choose` spells it), checked.

  Every file of the checkpoint is checked (`containment.check_contained`) once;
  returns the item and the `containment.Snapshot` of it.

  On an object store, the item is looked for in the folder the current
  commit names (`stores.base.Store.resolve`).

  Raises:
    NotACheckpointError: no item, or several (the message lists them).
    UnsafeCheckpointError: a file reaches outside the checkpoint.
  """
  return _find_item(store, store.resolve(path))


def items(path: epath.PathLike) -> list[epath.Path]:
  """The paths to pass to `read` for what ``path`` holds: ``[path]`` for a
  checkpoint or its item directory (and for anything `read` will refuse,
  so that it says why), and each item of a step directory holding several
  (``RUN/STEP`` of a ``CheckpointManager``), in name order, once the whole
  directory is checked as `read` checks a checkpoint (`containment`); `read`
  checks each item again.

  Raises:
    UnsafeCheckpointError: a file of the step reaches outside it.
  """
  store, path = stores.open_path(path)
  if store.pin(path) is not None:
    return [path]  # A checkpoint published by a commit: one item.
  if not path.is_dir() or _holds_manifest(store, path):
    return [path]
  found = sorted(
      child for child in path.iterdir()
      if child.is_dir() and _holds_manifest(store, child)
  )
  if len(found) < 2:
    return [path]
  containment.check_contained(path)  # As `read` of the whole: no link out.
  return found


def _find_item(
    store: stores.Store, path: epath.Path
) -> tuple[epath.Path, containment.Snapshot | None]:
  if not path.is_dir():
    raise errors.NotACheckpointError(
        f"{path} is not a pz_persist checkpoint: "
        + ("it is not a directory." if path.exists() else "it does not exist.")
        + leftovers.only_trace(store, path)
    )
  if _holds_manifest(store, path):
    snapshot = check_item_contained(path)
    manifest_lib.check_file(path)
    return path, snapshot
  items = sorted(
      child for child in path.iterdir()
      if child.is_dir() and _holds_manifest(store, child)
  )
  if len(items) == 1:
    # The whole checkpoint, not only the item: the item directory itself may
    # be a symlink leading out of it.
    whole = containment.check_contained(path)
    containment.check_checkpoint_metadata(path)
    manifest_lib.check_file(items[0])
    if os.path.islink(os.fspath(items[0])):  # Not walked into: its own walk.
      return items[0], containment.check_contained(items[0])
    return items[0], containment.part(whole, items[0])
  if len(items) > 1:
    names = ", ".join(item.name for item in items)
    raise errors.NotACheckpointError(
        f"{path} holds several pz_persist items ({names}); pass one of them,"
        f" e.g. {items[0]}."
    )
  hint = ""
  if (path / stores.local.ORBAX_CHECKPOINT_METADATA).exists() or (path / "_METADATA").exists():
    hint = (
        " It is an Orbax checkpoint written without pz_persist; restore it with"
        " orbax.checkpoint and a template or, if it holds a Penzai model's"
        " parameters (saved from pz.unbind_params(model, freeze=True)), load it"
        " with pz_persist.load_into(path, model) or convert it with"
        " pz_persist.migrate."
    )
  raise errors.NotACheckpointError(
      f"{path} is not a pz_persist checkpoint: no {manifest_lib.MANIFEST_FILENAME}"
      f" in it or in any directory directly inside it.{hint}"
  )


def _holds_manifest(store: stores.Store, directory: epath.Path) -> bool:
  """Whether ``directory`` has a manifest entry of any kind.

  Why not `manifest.has_manifest`: a manifest that is a symlink out of the
  checkpoint, a FIFO or a directory is not a regular file, and would make
  the directory look like no checkpoint at all; found here, it is refused by
  name instead (by `containment.check_contained` or `manifest.read`).
  """
  return store.has_entry(manifest_lib.manifest_path(directory))


def check_item_contained(directory: epath.Path) -> containment.Snapshot | None:
  """Refuses an item whose files reach outside it, or outside its checkpoint.

  Why the checkpoint too: `containment.check_contained` accepts the directory it
  is given being a symlink (a path the user chose). An item directory inside
  an Orbax checkpoint (beside ``_CHECKPOINT_METADATA``) was chosen by Orbax
  or `pz_persist.load` from the checkpoint's path, so a symlink there leading
  out of the checkpoint is refused, as `pz_persist.load` refuses it.

  Returns:
    The `containment.Snapshot` of ``directory``.
  """
  snapshot = containment.check_contained(directory)
  path = os.fspath(directory)  # Remote: never a link, so done below.
  parent = os.path.dirname(os.path.abspath(path))
  if os.path.islink(path) and os.path.exists(
      os.path.join(parent, stores.local.ORBAX_CHECKPOINT_METADATA)
  ):
    containment.check_contained(parent)
  return snapshot
