"""The one rule for replacing a destination: only what pz_persist wrote, never the source.

Why one module: ``save``, ``migrate``, ``export_hf`` and the commands that
wrap them each replace a folder when asked to (``overwrite=True``,
``--overwrite``), and each used to decide on its own what it may delete.
``pz-persist export hf project/ckpt project --overwrite`` deleted the
checkpoint being exported and every other file of ``project``. Here, for all
of them:

* a destination is replaced only if it is empty, or is what the same kind of
  writer produced: a pz_persist checkpoint for a save (`check_replaceable`
  with ``"checkpoint"``), a folder `export_hf` wrote and nothing else for an
  export (``"hf_export"``: its marker file `EXPORT_MARKER`, and only the
  files an export writes);
* a destination is never the source, an ancestor of it, or inside it
  (`check_apart`), compared after symlinks and relative paths are resolved:
  replacing the one deletes the other, and writing into the source changes
  what is being read.

Every file or folder a user names for pz_persist to write (the HTML of
``diff`` and ``inspect``, `pz_persist.render_html`, ``export_safetensors``,
``export_hf``, ``migrate``, the command's ``convert``/``export``/``migrate``
destinations and ``--html``, the demo's ``--out``) goes through
`check_output` (files: `write_output`), the destination rule: never over,
inside or around a checkpoint being read, nor inside any checkpoint at all,
however the path is spelled (links, relative parts, ``..``, ``file://``
URLs, trailing slashes) and never through a hard link to a file of the
source. A refused write has written nothing.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable
from typing import Any
from typing import Literal

from etils import epath

from pz_persist import errors
from pz_persist.format import manifest as manifest_lib
from pz_persist.safety import safe_io
from pz_persist.storage import stores
from pz_persist.storage.reading import opening

EXPORT_MARKER = "pz_persist.export.json"
"""The small file `export_hf` writes into every folder it exports, so that a
later ``overwrite=True`` can tell its own folder from anyone else's."""

EXPORT_MARKER_DATA = b'{"pz_persist_export": 1}\n'

_EXPORT_FILE = re.compile(
    r"config\.json|model\.safetensors\.index\.json|model-\d{5}-of-\d{5}\.safetensors"
)

Kind = Literal["checkpoint", "hf_export"]


def check_replaceable(store: stores.Store, path: epath.PathLike, kind: Kind) -> None:
  """Refuses to replace ``path`` (on ``store``) unless it is absent, empty,
  or ``kind``'s own.

  Raises:
    CheckpointExistsError: ``path`` is a file (or, for an export, a link), or
      a folder holding something other than what ``kind``'s writer writes
      (the message says what, and that the user must remove it).
  """
  if kind == "checkpoint":
    _check_checkpoint(store, epath.Path(path))
  else:
    _check_export(os.fspath(path))


def _check_checkpoint(store: stores.Store, path: epath.Path) -> None:
  if not path.is_dir():
    raise errors.CheckpointExistsError(
        f"{path} exists and is not a directory; refusing to replace it."
    )
  if not any(path.iterdir()):
    return
  try:
    opening.find_item(store, path)
  except errors.NotACheckpointError:
    raise errors.CheckpointExistsError(
        f"{path} exists and is not a pz_persist checkpoint; refusing to"
        " replace it even with overwrite=True. Remove it yourself if you mean to."
    ) from None


def is_export_folder(folder: str) -> tuple[bool, str]:
  """Whether ``folder`` is a folder `export_hf` wrote, untouched since but
  for its own files; and if not, why (for the message)."""
  try:
    marker = safe_io.read_small_file(os.path.join(folder, EXPORT_MARKER), 4096)
  except FileNotFoundError:
    return False, f"it has no {EXPORT_MARKER}, the file export_hf writes into its folders"
  except errors.PzPersistError as e:
    return False, str(e)
  try:
    parsed = json.loads(marker)
  except ValueError:
    parsed = None
  if not isinstance(parsed, dict) or parsed.get("pz_persist_export") != 1:
    return False, f"its {EXPORT_MARKER} is not one export_hf wrote"
  others = []
  for name in sorted(os.listdir(folder)):
    mode = os.lstat(os.path.join(folder, name)).st_mode
    if not stat.S_ISREG(mode) or not (name == EXPORT_MARKER or _EXPORT_FILE.fullmatch(name)):
      others.append(name)
  if others:
    return False, f"it also holds {', '.join(others[:5])}, which export_hf did not write"
  return True, ""


def _check_export(folder: str) -> None:
  if os.path.islink(folder) or (os.path.exists(folder) and not os.path.isdir(folder)):
    raise errors.CheckpointExistsError(
        f"{folder} exists and is not a folder; choose another destination.")
  if not os.path.exists(folder) or not os.listdir(folder):
    return
  ours, why = is_export_folder(folder)
  if not ours:
    raise errors.CheckpointExistsError(
        f"{folder} exists and is not a folder export_hf wrote ({why}); refusing"
        " to replace it even with overwrite=True, since everything in it would be"
        " deleted. Export to a new or empty folder, or remove it yourself."
    )


def check_apart(destination: epath.PathLike, sources: Iterable[epath.PathLike]) -> None:
  """Refuses a ``destination`` that is a source, holds one, or lies inside one.

  Local paths are compared after ``~``, relative parts and symlinks are
  resolved (``os.path.realpath``), so ``./ck``, ``../run/ck`` and a link to
  it are the same folder; object-store paths as written (`stores.choose`
  has refused every ambiguous spelling): `stores.base.Store.place`.

  Raises:
    ArgumentError: naming both paths and how they are related.
  """
  dst = stores.place(destination)
  for source in sources:
    src = stores.place(source)
    if dst[0] is not src[0]:
      continue  # On two stores: never related.
    relation = None
    if dst[1] == src[1]:
      relation = "is the source itself"
    elif _inside(src[1], dst[1]):
      relation = "contains the source"
    elif _inside(dst[1], src[1]):
      relation = "lies inside the source"
    if relation is not None:
      raise errors.ArgumentError(
          f"{os.fspath(destination)}: the destination {relation}"
          f" ({os.fspath(source)}); replacing or writing it would delete or"
          " change what is being read. Choose a destination outside the source"
          " (and the source outside the destination)."
      )


def _inside(path: tuple[str, ...], folder: tuple[str, ...]) -> bool:
  return len(path) > len(folder) and path[:len(folder)] == folder


def check_output(
    destination: epath.PathLike, sources: Iterable[Any] = (), *, file: bool = False
) -> epath.Path:
  """The destination rule for a file or folder a user names: where it may go.

  Args:
    destination: What the user named (a path, ``file://`` URL, ``gs://``...).
    sources: What the writer reads: checkpoint paths, `pz_persist.open`
      handles, other folders read (a ``like=`` folder); anything else (a
      model in memory) is no source and is skipped.

  Returns:
    ``destination`` normalised (``~`` expanded, made absolute, a ``file://``
    URL as its local path): the path to write.

  Raises:
    ArgumentError: ``destination`` holds a NUL, is a source, holds one, lies
      inside one, lies inside any pz_persist or Orbax checkpoint, is a hard
      link to a file of a source, or (``file``) is a folder; the message
      names the file and what to do.
  """
  return _checked_output(destination, sources, file=file)[1]


def _checked_output(
    destination: epath.PathLike, sources: Iterable[Any], *, file: bool
) -> tuple[stores.Store, epath.Path]:
  """`check_output`, and the store it chose for ``destination``."""
  store, path = stores.choose(destination)  # Refuses a NUL, a bad scheme, a remote host.
  roots = [root for root in (opening.checkpoint_path(s) for s in sources) if root is not None]
  check_apart(destination, roots)
  check_outside_checkpoints(store, destination, path)
  if store.identifies_files:  # Where files have inodes: hard links.
    _check_no_hard_link(destination, os.fspath(path), roots)
  if file and path.is_dir():
    raise errors.ArgumentError(
        f"{os.fspath(destination)}: the destination is a folder; name a file to"
        " write (e.g. a name ending in .html or .safetensors inside it)."
    )
  return store, path


def write_output(
    destination: epath.PathLike, data: bytes | str, sources: Iterable[Any] = ()
) -> epath.Path:
  """Writes the file ``destination`` (a ``str`` as UTF-8) under `check_output`.

  Written whole or not at all (`safe_io.writing_whole`: aside, then renamed
  over ``destination``), so a link or hard link at ``destination`` is
  replaced, never written through. Its parent folders are created.

  Returns:
    The path written.

  Raises:
    ArgumentError: as `check_output`, or ``destination`` is a folder.
  """
  store, path = _checked_output(destination, sources, file=True)
  if isinstance(data, str):
    data = data.encode("utf-8")
  store.write_whole(path, data)  # Folders made as needed.
  return path


_CHECKPOINT_FILES = (manifest_lib.MANIFEST_FILENAME, stores.local.ORBAX_CHECKPOINT_METADATA)
"""A folder holding one of these is a checkpoint (a pz_persist item, or an
Orbax checkpoint or step): nothing a user names is written inside it."""


def check_outside_checkpoints(
    store: stores.Store, destination: epath.PathLike, path: epath.Path
) -> None:
  """Refuses a ``path`` (on ``store``) lying inside a checkpoint, read or not: a file added
  there is one `pz_persist.verify` reports as damage, and one over its files
  breaks it. Locally after links are resolved; on an object store each
  folder above is asked for a manifest, Orbax's metadata or a commit object
  (a few requests: outputs are written there rarely). `pz_persist.save`
  asks it too: a checkpoint saved inside another (over its item folder,
  or beside it) damages the outer one."""
  for folder in stores.folders_above(store, path):
    found = next((name for name in _CHECKPOINT_FILES if store.has_entry(folder / name)), None)
    if found is None and store.pin(folder) is not None:
      found = "a commit object"
    if found is not None:
      raise errors.ArgumentError(
          f"{os.fspath(destination)}: the destination lies inside the checkpoint"
          f" {folder} (it holds {found}); writing there would change or damage"
          " it. Choose a destination outside every checkpoint."
      )


def _check_no_hard_link(
    destination: epath.PathLike, path: str, roots: list[epath.PathLike]
) -> None:
  """Refuses an existing ``path`` that is a hard link to a file of a local
  source: the same file under another name (links are looked for only when
  the file has several names, so this costs nothing otherwise)."""
  try:
    st = os.stat(path)
  except OSError:
    return
  if st.st_nlink < 2 or not stat.S_ISREG(st.st_mode):
    return
  for root in roots:
    for file in _files_of(root):
      try:
        other = os.stat(file, follow_symlinks=False)
      except OSError:
        continue
      if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
        raise errors.ArgumentError(
            f"{os.fspath(destination)}: the destination is a hard link to"
            f" {file}, a file of the source ({os.fspath(root)}); writing it"
            " would change what is being read. Choose another destination,"
            " or remove that link first."
        )


def _files_of(root: epath.PathLike) -> Iterable[str]:
  """The files of the local source ``root``: itself if a file, else every
  file under it, or under its checkpoint when it is an item directory (the
  folder above holds Orbax's metadata)."""
  local = stores.local_path(root)
  if not stores.for_path(local).identifies_files:  # No hard links there.
    return
  top = os.path.realpath(os.fspath(local))
  if os.path.isfile(top):
    yield top
    return
  parent = os.path.dirname(top)
  if os.path.lexists(os.path.join(parent, stores.local.ORBAX_CHECKPOINT_METADATA)):
    top = parent
  for folder, _, files in os.walk(top):
    for name in files:
      yield os.path.join(folder, name)
