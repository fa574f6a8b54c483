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

import os
import stat
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
from etils import epath

from pz_persist import bounded_json
from pz_persist import directories
from pz_persist import errors

MAX_ALLOCATION_BYTES: int | None = None
"""Most bytes one load may allocate for arrays in this process; None (the
default) means the machine's physical memory. A checkpoint declaring more is
refused before anything is allocated. Raise it (or set it very high) to load
straight onto devices with more memory than the host."""

MAX_ORBAX_METADATA_BYTES = 64 * 2**20
"""Larger Orbax ``_CHECKPOINT_METADATA`` files are refused before parsing."""

MAX_ORBAX_METADATA_NODES = 2**20
"""Most JSON values of ``_CHECKPOINT_METADATA`` (Orbax writes a few tens,
plus the user's metrics and custom metadata)."""

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _within(path: str, root: str) -> bool:
  return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _special(mode: int) -> str | None:
  """What a file that is neither a regular file nor a directory is."""
  if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
    return None
  return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def check_contained(directory: epath.PathLike) -> None:
  """Refuses a checkpoint whose files reach outside it or are not files.

  Why: loading opens the manifest and TensorStore opens every array file by
  path; a symlink leading out of the checkpoint would make either read a file
  the checkpoint's author chose anywhere on this machine, and a FIFO or device
  would block or never end. Symlinks that stay inside the checkpoint are
  fine, and so is ``directory`` itself being a symlink (the user chose it).

  Raises:
    UnsafeCheckpointError: naming the offending file and where it leads.
  """
  if not directories.is_local(directory):
    return
  root = os.path.realpath(os.fspath(directory))
  for parent, dirs, files in os.walk(root, followlinks=False):
    for name in dirs + files:
      path = os.path.join(parent, name)
      try:
        info = os.lstat(path)
      except FileNotFoundError:
        continue  # Removed while we looked (a concurrent save's temporary).
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
    with path.open("rb") as f:
      data = bounded_json.read_limited(f, MAX_ORBAX_METADATA_BYTES)
  except OSError as e:
    raise errors.ManifestError(f"{path}: cannot be read: {e}") from None
  if len(data) > MAX_ORBAX_METADATA_BYTES:
    raise errors.ManifestError(
        f"{path}: over the {MAX_ORBAX_METADATA_BYTES}-byte limit."
    )
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
  """`MAX_ALLOCATION_BYTES`, or the machine's physical memory by default.

  Why: no load can succeed that needs more memory than the machine has, so a
  checkpoint declaring more is either damaged or an attempt to exhaust memory.
  """
  if MAX_ALLOCATION_BYTES is not None:
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
      f" the {limit}-byte limit (this machine's memory unless"
      f" pz_persist.safety.MAX_ALLOCATION_BYTES is set). Largest: {named}."
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


def _dtype(dtype: Any) -> np.dtype:
  if dtype is None:
    raise ValueError("no dtype")
  return np.dtype(dtype)
