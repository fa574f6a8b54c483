"""The walk that keeps every read inside the checkpoint it was given.

Why this module exists: a checkpoint is a directory that someone else may have
written, and validating its JSON is not enough. A symlink inside it can make
pz_persist (or TensorStore, which reads the arrays) read a file outside it,
such as ``/etc/shadow``, or a device such as ``/dev/zero`` that never ends; a
FIFO blocks the reader forever. `check_contained` refuses all of them before
any file of the checkpoint is opened, and `files_unchanged` checks again after
a read, so that nothing swapped in meanwhile is returned. `storage.reading.opening`
walks once per item; the reader re-checks after reading.

Every check raises a `pz_persist.errors.ManifestError` (most often its
subclass `UnsafeCheckpointError`) naming the file at fault.
"""


from __future__ import annotations

import contextlib
import os
import stat

from etils import epath

from pz_persist import errors
from pz_persist.format import manifest as manifest_lib
from pz_persist.safety import bounded_json
from pz_persist.safety import safe_io

MAX_CHECKPOINT_METADATA_BYTES = 64 * 2**20
"""Larger Orbax ``_CHECKPOINT_METADATA`` (and ``metrics``) files are refused
before parsing: they hold a step's few fields, not one entry per array (that
is ``_METADATA``, bounded by `pz_persist.safety.bounded_json.
MAX_ORBAX_METADATA_BYTES`)."""



def small_file(name: str) -> tuple[str, int] | None:
  """``(what it is, most bytes)`` of a file named ``name`` that pz_persist or
  Orbax reads whole; None for other files (array data, read by ranges)."""
  if name in ("_CHECKPOINT_METADATA", "metrics"):
    return "Orbax's metadata", MAX_CHECKPOINT_METADATA_BYTES
  if name in ("_METADATA", "_sharding"):
    return "Orbax's metadata", bounded_json.MAX_ORBAX_METADATA_BYTES  # One entry per array.
  if name == manifest_lib.MANIFEST_FILENAME:
    return "manifest", manifest_lib.MAX_MANIFEST_BYTES
  if name == manifest_lib.FILE_DIGESTS_FILENAME:
    return "file digest list", manifest_lib.MAX_FILE_DIGESTS_BYTES
  return None

MAX_ORBAX_METADATA_NODES = 2**20
"""Most JSON values of ``_CHECKPOINT_METADATA`` (Orbax writes a few tens,
plus the user's metrics and custom metadata)."""


def _within(path: str, root: str) -> bool:
  return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _special(mode: int) -> str | None:
  """What a file that is neither a regular file nor a directory is."""
  if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
    return None
  return safe_io.special_kind(mode)


Snapshot = tuple
"""What `check_contained` saw: the root and every entry's identity (device,
inode, type, ctime), to tell later whether anything was swapped."""


def check_contained(directory: epath.PathLike) -> Snapshot | None:
  """Refuses a checkpoint whose files reach outside it or are not files.

  Why: loading opens the manifest and TensorStore opens every array file by
  path; a symlink leading out of the checkpoint would make either read a file
  the checkpoint's author chose anywhere on this machine, and a FIFO or device
  would block or never end. Symlinks that stay inside the checkpoint are
  fine, and so is ``directory`` itself being a symlink (the user chose it).
  The small JSON files read whole (`small_file`) must also be small,
  since Orbax reads them without a bound.

  Returns:
    A `Snapshot` of what was checked (None for a remote directory), for
    `files_unchanged`.

  Raises:
    UnsafeCheckpointError: naming the offending file and where it leads.
    ManifestError: a small JSON file is over its size limit.
  """
  if not safe_io.is_local(directory):
    return None
  root = os.path.realpath(os.fspath(directory))
  try:
    top = os.stat(root)
  except OSError:
    return None  # Missing: the caller says so in its own words.
  seen = {}
  for parent, dirs, files in os.walk(root, followlinks=False):
    for name in dirs + files:
      path = os.path.join(parent, name)
      try:
        info = os.lstat(path)
      except FileNotFoundError:
        continue  # Removed while we looked (a concurrent save's temporary).
      seen[path] = (info.st_dev, info.st_ino, info.st_mode, info.st_ctime_ns)
      if stat.S_ISLNK(info.st_mode):
        target = os.path.realpath(path)
        if not _within(target, root):
          raise errors.UnsafeCheckpointError(
              f"{path} is a symlink to {target}, outside the checkpoint"
              f" {root}; refusing to read it."
          )
        try:
          info = os.stat(path)
        except OSError:
          continue  # A dangling link inside: reading it fails cleanly later.
      kind = _special(info.st_mode)
      if kind is not None:
        raise errors.UnsafeCheckpointError(
            f"{path} is {kind}, not a regular file; refusing to read it."
        )
      small = small_file(name)
      if small is not None and stat.S_ISREG(info.st_mode) and info.st_size > small[1]:
        raise safe_io.too_large(path, small[0], info.st_size, small[1])
  return (root, top.st_dev, top.st_ino, seen)


def part(snapshot: Snapshot | None, directory: epath.PathLike) -> Snapshot | None:
  """What ``check_contained(directory)`` would return, taken from the
  ``snapshot`` of a directory holding it (not through a link): no second walk."""
  if snapshot is None:
    return None
  root = os.path.realpath(os.fspath(directory))
  top = snapshot[3].get(root)
  if top is None:
    return None
  inside = root.rstrip(os.sep) + os.sep
  seen = {path: info for path, info in snapshot[3].items() if path.startswith(inside)}
  return (root, top[0], top[1], seen)


@contextlib.contextmanager
def files_unchanged(directory: epath.PathLike, before: Snapshot | None = None):
  """Checks ``directory`` with `check_contained` before and after the block.

  Why after as well: TensorStore (directly, or inside Orbax's restore) opens
  the array files by path, so a file swapped for a symlink between the check
  and its open would be read from wherever the link leads. Opening each file
  with ``O_NOFOLLOW`` ourselves just before would not help, since TensorStore
  opens it again, by path. So the block's result is only trusted if every
  entry is still the very one checked (same device, inode, type and change
  time: a swap, even a rename away and back, changes one of them); otherwise
  nothing read is returned, and the error names the first changed entry.
  The read itself may have touched a swapped-in file, but what it read is
  discarded. Cheap: one ``lstat`` per file, no file is opened.

  ``before``, a `check_contained` snapshot of ``directory`` taken earlier
  (`pz_persist.storage.reading.opening` takes one), saves walking it again first.

  Raises:
    UnsafeCheckpointError: something was swapped or added while reading.
  """
  if before is None:
    before = check_contained(directory)
  yield
  after = check_contained(directory)
  if after == before:
    return
  changed = "the directory itself"
  if before is not None and after is not None and before[:3] == after[:3]:
    changed = next(
        (path for path in sorted(set(before[3]) | set(after[3]))
         if before[3].get(path) != after[3].get(path)),
        changed,
    )
  raise errors.UnsafeCheckpointError(
      f"{directory}: {changed} changed while the checkpoint was being read;"
      " refusing what was read, since a file swapped for a link may have been"
      " read from outside the checkpoint. Load it again once nothing else"
      " writes to it."
  )


def check_run_directory(directory: epath.PathLike) -> None:
  """Refuses a run directory Orbax must not read in (see `check_contained`).

  Why: an Orbax ``CheckpointManager`` reads every step's
  ``_CHECKPOINT_METADATA`` and metrics on its own, without bounds, when it
  opens a run directory and restores from it; this checks every file under
  the run first. A missing directory is fine (it is created empty).
  """
  check_contained(directory)


def check_checkpoint_metadata(checkpoint_dir: epath.PathLike) -> None:
  """Refuses a damaged Orbax ``_CHECKPOINT_METADATA`` beside the item.

  Why: pz_persist's own load does not need the file, but Orbax (a
  ``CheckpointManager``, ``ocp.Checkpointer``) reads it to find the item's
  handler, so a garbled one means the checkpoint was damaged; saying so here
  names the file instead of failing later, elsewhere, with Orbax's error.
  """
  path = epath.Path(checkpoint_dir) / "_CHECKPOINT_METADATA"
  if not path.exists():
    return
  try:
    data = safe_io.read_small_file(
        path, MAX_CHECKPOINT_METADATA_BYTES, what="Orbax's checkpoint metadata"
    )
  except OSError as e:
    raise errors.ManifestError(f"{path}: cannot be read: {e}") from None
  try:
    most = bounded_json.node_limit(len(data), most=MAX_ORBAX_METADATA_NODES)
    parsed = bounded_json.loads(data, where=str(path), max_nodes=most, max_depth=64)
  except errors.ManifestError:
    parsed = None
  if not isinstance(parsed, dict):
    raise errors.ManifestError(
        f"{path}: Orbax's checkpoint metadata is not a JSON object; the"
        " checkpoint is damaged."
    )


