"""Checks made before pz_persist reads anything a checkpoint points to.

Why this module exists: a checkpoint is a directory that someone else may have
written, and loading it must not be a way to attack the machine that loads it.
Validating the manifest's JSON (`pz_persist.manifest`, `pz_persist.arrays`,
`pz_persist.encoding`) is not enough, because two things outside the JSON can
still hurt:

* The files themselves. A symlink inside the checkpoint can make pz_persist
  (or TensorStore, which reads the arrays) read a file outside it, such as
  ``/etc/shadow``, or a device such as ``/dev/zero`` that never ends; a FIFO
  blocks the reader forever. `check_contained` refuses all of them before any
  file of the checkpoint is opened.
* The sizes. An array entry, or the Orbax metadata beside it, declares a shape,
  and TensorStore allocates what is declared before it reads a byte: a few
  bytes of JSON can ask for terabytes. `check_stored_metadata` compares each
  array the manifest promises with what Orbax's own metadata says is stored,
  and `check_allocation` refuses a read whose arrays could not fit in memory,
  both before anything is allocated.

Every check raises a `pz_persist.errors.ManifestError` (most often its
subclass `UnsafeCheckpointError`) naming the file or the label at fault.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import stat
import warnings
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import numpy as np
from etils import epath

from pz_persist import bounded_json
from pz_persist import directories
from pz_persist import errors
from pz_persist import file_digests
from pz_persist import manifest as manifest_lib
from pz_persist import safe_io

MAX_ALLOCATION_BYTES: int | None = None
"""Deprecated: use ``pz_persist.limits(max_allocation_bytes=...)``. Still
honoured for one release when set (with a ``DeprecationWarning``), below a
`limits` setting."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """Limits of the loads made in the current context (see `limits`).

  Attributes:
    max_allocation_bytes: Most bytes one load may allocate for arrays; None
      (the default) means the machine's physical memory. A checkpoint
      declaring more is refused before anything is allocated.
  """

  max_allocation_bytes: int | None = None


_limits: contextvars.ContextVar[Limits] = contextvars.ContextVar(
    "pz_persist_limits", default=Limits()
)
_UNSET: Any = object()


def current_limits() -> Limits:
  """The limits in force here: the innermost `limits` block's, or defaults."""
  return _limits.get()


@contextlib.contextmanager
def limits(*, max_allocation_bytes: int | None = _UNSET) -> Iterator[Limits]:
  """Sets load limits for the ``with`` block, in this thread or task only.

  Why a context and not a module setting: a limit is a decision about one
  load (a big model onto devices with more memory than the host), and a
  global changed for it would also apply to every other load of the process,
  in other threads too, until someone remembers to set it back. Like
  ``allow_modules=``, the setting is scoped: it holds inside the block (and
  in code it calls), nested blocks override the settings they name, and
  other threads and asyncio tasks keep their own (``contextvars``).

  Example::

    with pzp.limits(max_allocation_bytes=200 * 2**30):
      params = pzp.load(path, sharding=rules)

  Args:
    max_allocation_bytes: Most bytes one load may allocate for arrays; None
      means the machine's physical memory (the default). Omitted: unchanged.

  Yields:
    The `Limits` in force inside the block.

  Raises:
    ValueError: ``max_allocation_bytes`` is not a positive int or None.
  """
  changes = {}
  if max_allocation_bytes is not _UNSET:
    if max_allocation_bytes is not None and (
        isinstance(max_allocation_bytes, bool)
        or not isinstance(max_allocation_bytes, int)
        or max_allocation_bytes <= 0
    ):
      raise ValueError(
          "max_allocation_bytes must be a positive number of bytes or None"
          f" (the machine's memory), not {max_allocation_bytes!r}."
      )
    changes["max_allocation_bytes"] = max_allocation_bytes
  inside = dataclasses.replace(_limits.get(), **changes)
  token = _limits.set(inside)
  try:
    yield inside
  finally:
    _limits.reset(token)

MAX_ORBAX_METADATA_BYTES = 64 * 2**20
"""Larger Orbax ``_CHECKPOINT_METADATA`` files are refused before parsing."""

MAX_ORBAX_TREE_METADATA_BYTES = bounded_json.MAX_ORBAX_METADATA_BYTES
"""Larger Orbax ``_METADATA`` / ``_sharding`` files (one entry per array, so
larger than ``_CHECKPOINT_METADATA``, like the manifest) are refused."""


def small_file(name: str) -> tuple[str, int] | None:
  """``(what it is, most bytes)`` of a file named ``name`` that pz_persist or
  Orbax reads whole; None for other files (array data, read by ranges)."""
  if name in ("_CHECKPOINT_METADATA", "metrics"):
    return "Orbax's metadata", MAX_ORBAX_METADATA_BYTES
  if name in ("_METADATA", "_sharding"):
    return "Orbax's metadata", MAX_ORBAX_TREE_METADATA_BYTES
  if name == manifest_lib.MANIFEST_FILENAME:
    return "manifest", manifest_lib.MAX_MANIFEST_BYTES
  if name == file_digests.FILENAME:
    return "file digest list", file_digests.MAX_BYTES
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
  if not directories.is_local(directory):
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
  (`pz_persist.opening` takes one), saves walking it again first.

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
        path, MAX_ORBAX_METADATA_BYTES, what="Orbax's checkpoint metadata"
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


def allocation_limit() -> int:
  """The ``max_allocation_bytes`` of `limits`, or the machine's physical
  memory by default.

  Why: no load can succeed that needs more memory than the machine has, so a
  checkpoint declaring more is either damaged or an attempt to exhaust memory.
  """
  scoped = _limits.get().max_allocation_bytes
  if scoped is not None:
    return scoped
  if MAX_ALLOCATION_BYTES is not None:
    warnings.warn(
        "pz_persist.safety.MAX_ALLOCATION_BYTES is deprecated and will be"
        " ignored in the next release; use"
        " `with pz_persist.limits(max_allocation_bytes=...):` around the load.",
        DeprecationWarning, stacklevel=2,
    )
    return MAX_ALLOCATION_BYTES
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (AttributeError, ValueError, OSError):
    return 2**50  # Unknown platform: only absurd sizes are refused.


def check_allocation(
    specs: Collection[Any], sizes: Mapping[str, int], *, where: str,
    limit: int | None = None,
) -> None:
  """Refuses to read arrays whose bytes would exceed the allocation limit.

  Why: shapes come from the checkpoint, and reading allocates them in full
  before a byte is read; ``[2**31, 2**31]`` costs a few bytes of JSON.

  Args:
    specs: The manifest's `ArraySpec` entries of the arrays to read.
    sizes: Bytes this process allocates for each, by storage key.
    where: The item directory, for messages.
    limit: Defaults to `allocation_limit`.

  Raises:
    UnsafeCheckpointError: naming the largest arrays and the total.
  """
  limit = allocation_limit() if limit is None else limit
  total = sum(sizes.values())
  if total <= limit:
    return
  largest = sorted(specs, key=lambda s: sizes.get(s.key, 0), reverse=True)[:3]
  named = "; ".join(
      f"{s.describe()}: {s.dtype}{list(s.shape)}, {sizes.get(s.key, 0)} bytes"
      for s in largest
  )
  raise errors.UnsafeCheckpointError(
      f"{where}: reading these arrays would allocate {total} bytes, more than"
      f" the {limit}-byte limit (this machine's memory unless raised with"
      " `with pz_persist.limits(max_allocation_bytes=...):` around the"
      f" load). Largest: {named}."
  )


def read_stored_metadata(handler: Any, directory: epath.Path) -> dict[str, Any]:
  """What Orbax says it stored: ``{key: metadata with .shape and .dtype}``.

  Why: Orbax's metadata (``_METADATA`` and TensorStore's per-array metadata)
  is what TensorStore will trust when it allocates; reading it costs no array
  data, so it can be checked against the manifest first.

  Args:
    handler: The ``ocp.PyTreeCheckpointHandler`` that wrote the arrays.
    directory: The item directory.

  Raises:
    IntegrityError: the metadata is missing or unreadable; the message names
      ``_METADATA`` and TensorStore's own words, which name the file it
      failed on (the files are damaged or incomplete, as for array data).
    ManifestError: the metadata is not what pz_persist writes.
  """
  try:
    tree = handler.metadata(directory).tree
  except (KeyboardInterrupt, MemoryError):
    raise
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise unreadable_stored_metadata(directory, e) from None
  if not isinstance(tree, Mapping):
    raise errors.ManifestError(
        f"{directory / '_METADATA'}: Orbax's metadata is not a flat dict of"
        " arrays, as pz_persist writes it."
    )
  return dict(tree)


def unreadable_stored_metadata(
    directory: epath.Path, error: Exception
) -> errors.IntegrityError:
  """The error for Orbax metadata that cannot be read, naming ``_METADATA``
  and the first line of the reader's own words."""
  detail = (str(error).strip().splitlines() or [""])[0][:400]
  return errors.IntegrityError(
      f"{directory}: Orbax's metadata of the stored arrays (_METADATA, and"
      " TensorStore's per-array metadata in the array files) cannot be"
      f" read; the checkpoint's files are damaged or incomplete"
      f" ({type(error).__name__}: {detail})",
      damaged=(f"{directory / '_METADATA'}: cannot be read",),
  )


def check_stored_metadata(
    specs: Collection[Any], stored: Mapping[str, Any], *, where: str
) -> None:
  """Refuses arrays whose stored shape or dtype differs from the manifest's.

  Why: TensorStore reads (and allocates) what Orbax's metadata declares, not
  what the manifest says; if the two disagree the checkpoint is damaged or
  forged, for instance a tiny file declaring a huge shape. Checking before the
  read means no such array is ever allocated.

  Raises:
    ManifestError: naming the label, tree path and both shapes and dtypes.
  """
  for spec in specs:
    if spec.key not in stored:
      raise errors.ManifestError(
          f"{where}: the array of {spec.describe()} (key {spec.key}) is"
          " missing from Orbax's metadata."
      )
    meta = stored[spec.key]
    shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
    try:
      found = (tuple(int(d) for d in shape), _dtype(dtype))
    except (TypeError, ValueError):
      found = None
    if found is None or found != (spec.shape, spec.storage_dtype):
      stored_text = f"{found[1]}{list(found[0])}" if found else f"{meta!r:.80}"
      raise errors.ManifestError(
          f"{where}: {spec.describe()} (key {spec.key}) should be"
          f" {spec.storage_dtype}{list(spec.shape)} by the manifest, but the"
          f" stored array is {stored_text}."
      )
    _check_chunk_shape(spec, meta, where=where)


def _check_chunk_shape(spec: Any, meta: Any, *, where: str) -> None:
  """Refuses a stored chunk larger than its array.

  Why: TensorStore decodes a chunk whole, allocating the chunk shape Orbax's
  metadata declares, whatever the array's shape: a ``[4, 2]`` array whose
  ``.zarray`` declares chunks of ``[2**20, 2**20]`` aborts the interpreter.
  Orbax and pz_persist never write a chunk beyond the array (a dimension of
  size 0 is stored in chunks of 1), so anything larger is forged or damaged.
  """
  storage = getattr(meta, "storage", None)
  chunks = getattr(storage, "chunk_shape", None)
  if chunks is None:
    return
  try:
    chunk_shape = tuple(int(d) for d in chunks)
  except (TypeError, ValueError):
    chunk_shape = None
  fits = chunk_shape is not None and len(chunk_shape) == len(spec.shape) and all(
      0 < c <= max(d, 1) for c, d in zip(chunk_shape, spec.shape)
  )
  if not fits:
    raise errors.UnsafeCheckpointError(
        f"{where}: {spec.describe()} (key {spec.key}) is stored in chunks of"
        f" {list(chunks)!r:.80}, which do not fit its shape {list(spec.shape)};"
        " reading it would allocate the whole chunk. The checkpoint is"
        " damaged or forged."
    )


def _dtype(dtype: Any) -> np.dtype:
  if dtype is None:
    raise ValueError("no dtype")
  return np.dtype(dtype)
