"""Reading the files of a pretrained checkpoint: only regular files, only
inside the folder, only so many bytes, only so deep.

Why this module exists: the pretrained loaders read folders that someone else
published (a Hugging Face snapshot, a safetensors file, a Gemma download).
`pz_persist.safety` guards pz_persist's own checkpoints; this is the same
promise for the files the pretrained loaders open themselves:

* A FIFO or a device named ``config.json`` would block the reader forever or
  never end, so a file is opened without blocking and read only if the open
  file descriptor is a regular file (no window between the check and the
  read).
* A symlink in a Hugging Face folder may only lead to a regular file inside
  the folder, or, when the folder is a ``huggingface_hub`` snapshot
  (``.../models--org--name/snapshots/<revision>``), inside that cache entry
  (``.../models--org--name``, whose ``blobs/`` hold the files the snapshot
  links to). Anything else (``/etc/passwd``, another user's model) is refused.
* JSON is read with a byte limit and a nesting limit, so a small file can
  neither exhaust memory nor the interpreter's stack.
* Every tensor a load will allocate is added up and compared with
  `pz_persist.safety.limits.allocation_limit` before the first one is read.

Why a local module rather than `pz_persist.safety`: the rules differ from a
native checkpoint's (symlinks into the hub cache are normal there), and the
pretrained loaders are the only readers of these formats.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import stat
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

import numpy as np

from pz_persist import extension
from pz_persist.pretrained import errors

MAX_JSON_DEPTH = 64
"""Deepest nesting of JSON arrays and objects accepted in any file read here;
real configs, indexes and headers are a few levels deep."""

MAX_CONFIG_BYTES = 4 * 2**20
"""Largest ``config.json`` read (real ones are a few KiB)."""

MAX_INDEX_BYTES = 64 * 2**20
"""Largest ``model.safetensors.index.json`` read (real ones are under 1 MiB)."""


ErrorFactory = Callable[[str], Exception]


def _not_regular(path: str, mode: int) -> errors.UnsafeCheckpointError:
  return errors.UnsafeCheckpointError(
      f"{path} is {extension.special_kind(mode)}, not a regular file; refusing to read it."
  )


def open_regular(path: str) -> io.BufferedReader:
  """Opens ``path`` for reading if, once open, it is a regular file.

  The open never blocks (``O_NONBLOCK``: a FIFO without a writer opens at
  once) and the type is checked on the open descriptor, so the file read is
  the file checked. The returned file blocks as usual.

  Raises:
    UnsafeCheckpointError: a FIFO, device, socket or directory, naming the
      path.
    OSError: the file cannot be opened.
  """
  info = os.stat(path)  # Refuse devices before opening them at all.
  if not stat.S_ISREG(info.st_mode):
    raise _not_regular(path, info.st_mode)
  fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
  try:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
      raise _not_regular(path, info.st_mode)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")
  except BaseException:
    os.close(fd)
    raise


Identity = tuple[int, int, int, int, int]
"""What `identity` says of a file: device, inode, size, modification and
change times (ns). A file replaced (renamed over) has another inode; one
rewritten in place, another size or times."""


def identity(info: os.stat_result) -> Identity:
  """The `Identity` in ``info`` (an ``os.stat`` / ``os.fstat`` result)."""
  return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def check_unchanged(path: str, seen: Identity, fd: int | None = None) -> None:
  """Refuses a load during which ``path`` changed since it was ``seen``.

  Both the open descriptor ``fd`` (if given: rewritten in place) and the
  name ``path`` (replaced by another file, as a download or ``rsync`` does
  when it finishes) must still be the very file first read.

  Raises:
    FileChangedError: naming ``path``.
  """
  try:
    now = [identity(os.stat(path))] + ([identity(os.fstat(fd))] if fd is not None else [])
  except OSError:
    now = []
  if not now or any(found != seen for found in now):
    raise errors.FileChangedError(
        f"{path} changed while it was being loaded (it was replaced or rewritten:"
        " a download or sync still writing it?); what was read is discarded, since"
        " it could mix both versions. Load again once nothing writes to the folder."
    )


def parse_json(raw: bytes, error: ErrorFactory,
               object_hook: Callable[[dict[str, Any]], Any] | None = None) -> Any:
  """Parses JSON bytes, refusing invalid UTF-8 or JSON and deep nesting.

  ``object_hook`` (as `json.loads`'s) may turn objects into something
  else as they are parsed; what it makes that is not a dict or list is not
  looked into by the depth check (so it must hold no nested JSON).

  Raises:
    What ``error`` makes, saying what is wrong.
  """
  try:
    value = json.loads(raw.decode("utf-8"), object_hook=object_hook)
  except RecursionError:
    raise error(f"nests JSON deeper than {MAX_JSON_DEPTH} levels") from None
  except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError.
    raise error(f"is not valid JSON ({str(e)[:200]})") from None
  if _deeper_than(value, MAX_JSON_DEPTH):
    raise error(f"nests JSON deeper than {MAX_JSON_DEPTH} levels")
  return value


def _deeper_than(value: object, limit: int) -> bool:
  """Whether ``value`` nests lists and objects more than ``limit`` deep.

  Only containers are pushed (a safetensors header of 20,000 tensors holds
  some 200,000 leaves, which are only looked at)."""
  if not isinstance(value, (dict, list)):
    return False
  stack = [(value, 1)]
  while stack:
    node, depth = stack.pop()
    if depth > limit:
      return True
    for child in (node.values() if type(node) is dict else node):
      if type(child) is dict or type(child) is list:  # What json.loads makes.
        stack.append((child, depth + 1))
  return False


def read_json(path: str, max_bytes: int, error: ErrorFactory,
              seen: list[tuple[str, Identity]] | None = None) -> Any:
  """Reads a JSON file of at most ``max_bytes`` (a regular file, see
  `open_regular`) and parses it with `parse_json`.

  ``seen``, if given, gets ``(path, identity)`` of the file read, for the
  caller to `check_unchanged` once its whole load is done.

  Raises:
    UnsafeCheckpointError: not a regular file.
    What ``error`` makes: unreadable, too large, not JSON, too deep.
  """
  try:
    with open_regular(path) as f:
      before = identity(os.fstat(f.fileno()))
      raw = f.read(max_bytes + 1)
      check_unchanged(path, before, f.fileno())
  except OSError as e:
    raise error(f"cannot be read ({e})") from None
  if len(raw) > max_bytes:
    raise error(f"is over the {max_bytes}-byte limit for this file")
  if seen is not None:
    seen.append((path, before))
  return parse_json(raw, error)


def _within(path: str, root: str) -> bool:
  return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def hub_cache_entry(folder: str) -> str | None:
  """The ``huggingface_hub`` cache entry a snapshot folder belongs to.

  ``.../models--org--name/snapshots/<revision>`` (or a subfolder of it, as
  for repositories with several models) links its files to
  ``.../models--org--name/blobs/<hash>``; the entry ``.../models--org--name``
  is returned so those links are accepted. None for any other folder.
  """
  revision = os.path.realpath(folder)
  while os.path.dirname(revision) != revision:
    snapshots = os.path.dirname(revision)
    entry = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(entry).startswith("models--"):
      return entry
    revision = snapshots
  return None


def plain_file_name(name: object) -> bool:
  """Whether ``name`` names a file directly in a folder: a non-empty string
  with no path separator (either OS's), no NUL, and not ``.`` or ``..``.

  Why: an index file (``model.safetensors.index.json``) names the files
  holding the tensors; ``..``, ``''`` or ``/etc/x`` there would have the
  loader open the folder itself, its parent or any file, and fail far from
  the index with a message that does not name it.
  """
  return (isinstance(name, str) and name not in ("", ".", "..")
          and not any(c in name for c in ("/", "\\", "\0", os.sep))
          and (os.altsep is None or os.altsep not in name))


def check_folder_file(folder: str, name: str) -> str | None:
  """The path of ``name`` in ``folder`` if it is a file pz_persist may read,
  None if it does not exist.

  A symlink must resolve inside ``folder`` or inside its hub cache entry
  (`hub_cache_entry`), to a regular file.

  Raises:
    UnsafeCheckpointError: a symlink leading elsewhere, or not a regular file.
  """
  path = os.path.join(folder, name)
  try:
    info = os.lstat(path)
  except FileNotFoundError:
    return None
  if stat.S_ISLNK(info.st_mode):
    target = os.path.realpath(path)
    roots = [os.path.realpath(folder)] + [r for r in [hub_cache_entry(folder)] if r]
    if not any(_within(target, root) for root in roots):
      raise errors.UnsafeCheckpointError(
          f"{path} is a symlink to {target}, outside the checkpoint folder"
          f" {roots[0]}{' and its Hugging Face cache entry ' + roots[1] if len(roots) > 1 else ''};"
          " refusing to read it (copy the file into the folder if it is meant"
          " to be there)."
      )
    try:
      info = os.stat(path)
    except FileNotFoundError:
      return None  # Dangling: reported as missing.
  if not stat.S_ISREG(info.st_mode):
    raise _not_regular(path, info.st_mode)
  return path


@dataclasses.dataclass(frozen=True)
class PlannedArray:
  """One array a load will allocate (`pz_persist.extension.PlannedArray`)."""

  key: str
  dtype: np.dtype
  shape: tuple[int, ...]

  def describe(self) -> str:
    return repr(self.key)

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


def check_planned_allocation(arrays: Iterable[PlannedArray], where: str) -> None:
  """Refuses a load whose arrays would not fit the allocation limit, before
  any is allocated (`pz_persist.extension.check_allocation`).

  Raises:
    UnsafeCheckpointError: naming ``where``, the total and the largest arrays.
  """
  arrays = list(arrays)
  sizes: dict[str, int] = {}
  for array in arrays:
    sizes[array.key] = sizes.get(array.key, 0) + array.nbytes
  extension.check_allocation(arrays, sizes, where=where)
