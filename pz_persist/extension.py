"""The extension surface: what a loader of another format needs of pz_persist.

Why this module exists: `pz_persist.pretrained` (Hugging Face folders,
safetensors files, Gemma's Orbax checkpoints) reads files someone else
published and writes folders other tools read, with the same promises as
pz_persist's own checkpoints: nothing outside the folder is read, nothing
read is a mix of two versions of a file, no cast changes values unless asked,
no allocation is larger than the limit, and nothing a user names is written
over what is read. Those promises are kept in `storage/`, `format/` and
`safety/`, which are internal and reorganised freely; a loader reaching into
them would break each time they move. So a loader uses this module, and
`tests/test_layout.py` holds `pz_persist.pretrained` to it: it imports only
this module, `pz_persist.errors` (the library's errors), `pz_persist.progress`
(progress bars and callbacks), `pz_persist.sharding` (``sharding=`` targets),
`pz_persist.nn` (the layers it builds), `pz_persist.penzai_seam` (Penzai's
private names) and its own modules.

Every name here is a deliberate contract, typed and documented with what a
loader uses it for; most delegate to the one place the library keeps the
promise, so a fix there reaches every loader. A new loader (another format
in `pz_persist.pretrained`, or a package of its own) starts from here:

* reading what others wrote: `open_path`, `check_orbax_folder` and
  `files_unchanged` (Orbax-format folders), `unreadable_orbax_metadata`,
  `special_kind`, `check_allocation`;
* casting: `cast`, `always_exact`, `refuse_lossy`;
* host memory: `aligned_empty`;
* Penzai variables as checkpoints name them: `VARIABLE_KINDS`,
  `variable_kind`, `variable_class`;
* where outputs may go, and publishing them: `checkpoint_path`,
  `local_path`, `check_output`, `writing_file`, `write_small_file`,
  `check_export_destination`, `publishing_export`;
* a whole model a pz_persist checkpoint holds, for an exporter: `load_model`.

The errors these raise are `pz_persist.errors.PzPersistError` subclasses,
named in each docstring.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import BinaryIO
from typing import Protocol

import numpy as np
from etils import epath
from penzai import pz

from pz_persist import errors
from pz_persist import model as model_lib
from pz_persist.format import casts
from pz_persist.format import variable_kinds
from pz_persist.safety import limits
from pz_persist.safety import safe_io
from pz_persist.storage import destinations
from pz_persist.storage import stores
from pz_persist.storage.integrity import containment
from pz_persist.storage.integrity import orbax_metadata_checks
from pz_persist.storage.reading import host_memory
from pz_persist.storage.reading import opening
from pz_persist.storage.stores import local

__all__ = [
    "FolderSnapshot", "PlannedArray", "VARIABLE_KINDS", "aligned_empty", "always_exact",
    "cast", "check_allocation", "check_export_destination", "check_orbax_folder",
    "check_output", "checkpoint_path", "files_unchanged", "load_model", "local_path",
    "open_path", "publishing_export", "refuse_lossy", "special_kind",
    "unreadable_orbax_metadata", "variable_class", "variable_kind", "write_small_file",
    "writing_file",
]

# ---- Reading what others wrote. ----------------------------------------------

FolderSnapshot = containment.Snapshot
"""What `check_orbax_folder` saw of a local folder's files (every entry's
identity), for `files_unchanged` to compare with after the read."""


def open_path(path: epath.PathLike) -> epath.Path:
  """The path a user gave, as the ``epath.Path`` to read (and hand to Orbax).

  A loader calls it first: a ``file://`` URL becomes the local path it
  names, a local path is made absolute, an unsupported scheme or a missing
  extra (``gs://`` without ``[gcs]``) is refused before anything is read.

  Raises:
    UnsupportedStorageError: a scheme pz_persist cannot read, or a NUL.
    MissingExtraError: the extra the path's store needs is not installed.

  Example:
    >>> from pz_persist import extension
    >>> extension.open_path("/tmp/../tmp/model").as_posix()
    '/tmp/model'
  """
  return stores.open_path(path)[1]


def check_orbax_folder(path: epath.Path) -> FolderSnapshot | None:
  """The checks `pz_persist.load` makes before Orbax reads a folder.

  For a loader handing an Orbax-format folder someone else wrote (a Gemma
  download) to Orbax: no file leads outside it or is a FIFO or device, its
  small metadata files are within their limits, Orbax's
  ``_CHECKPOINT_METADATA`` (if any) is a JSON object and ``_METADATA`` is
  at most 64 MiB (Orbax reads both whole, without a bound).

  Returns:
    The `FolderSnapshot` of a local folder's files (None for a remote one)
    for `files_unchanged` around the read.

  Raises:
    UnsafeCheckpointError: a link out, a special file.
    ManifestError: a damaged ``_CHECKPOINT_METADATA``, a ``_METADATA`` that
      is a folder, or a metadata file over the size limit every load applies
      (`pz_persist.safety.bounded_json.MAX_ORBAX_METADATA_BYTES` for
      ``_METADATA``, which holds one entry per array).

  Example:
    >>> import pathlib, tempfile
    >>> from pz_persist import extension
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> (folder / "_METADATA").write_text("{}")
    2
    >>> snapshot = extension.check_orbax_folder(extension.open_path(folder))
    >>> with extension.files_unchanged(folder, before=snapshot):
    ...   pass  # Read the arrays here.
  """
  snapshot = containment.check_contained(path)
  containment.check_checkpoint_metadata(path)
  metadata = path / "_METADATA"
  if not safe_io.is_local(metadata) or not metadata.exists():
    return snapshot
  if metadata.is_dir():  # Orbax would fail inside its own read.
    raise errors.ManifestError(
        f"{metadata} is a folder, where Orbax's array metadata is a file; the"
        " checkpoint is damaged. Save it again, or restore a copy."
    )
  return snapshot


def files_unchanged(
    path: epath.PathLike, before: FolderSnapshot | None = None
) -> contextlib.AbstractContextManager[None]:
  """A block whose reads of ``path`` are trusted only if no file of it changed.

  A loader reads an Orbax-format folder inside it: the folder's files are
  compared with ``before`` (`check_orbax_folder`'s snapshot; walked again
  if None) when the block ends, and a file swapped, rewritten or added
  meanwhile (a download finishing mid-load) refuses what was read.

  Raises:
    UnsafeCheckpointError: naming the first file that changed.
  """
  return containment.files_unchanged(path, before=before)


def unreadable_orbax_metadata(path: epath.Path, error: Exception) -> errors.IntegrityError:
  """The error to raise when Orbax cannot read a folder's array metadata.

  A loader raises it from Orbax's own failure (``raise
  extension.unreadable_orbax_metadata(path, e) from None``): it names
  ``_METADATA`` and the first line of Orbax's words, as `pz_persist.load`
  does.

  Example:
    >>> from etils import epath
    >>> from pz_persist import extension
    >>> error = extension.unreadable_orbax_metadata(epath.Path("/ckpt"), ValueError("bad"))
    >>> type(error).__name__, error.damaged
    ('IntegrityError', ('/ckpt/_METADATA: cannot be read',))
  """
  return orbax_metadata_checks.unreadable_stored_metadata(path, error)


def special_kind(mode: int) -> str:
  """What a file that is not a regular file is, in words, for a loader's
  refusal ("... is a FIFO, not a regular file").

  Args:
    mode: ``st_mode`` of an ``os.stat`` result.

  Example:
    >>> import stat
    >>> from pz_persist import extension
    >>> extension.special_kind(stat.S_IFIFO)
    'a FIFO'
  """
  return safe_io.special_kind(mode)


class PlannedArray(Protocol):
  """One array a load will allocate, as `check_allocation` reads it."""

  @property
  def key(self) -> str:
    """The name ``sizes`` counts its bytes under."""
    ...

  @property
  def dtype(self) -> np.dtype:
    """Its dtype, for the message."""
    ...

  @property
  def shape(self) -> tuple[int, ...]:
    """Its shape, for the message."""
    ...

  def describe(self) -> str:
    """How the message names it."""
    ...


def check_allocation(
    arrays: Collection[PlannedArray], sizes: Mapping[str, int], *, where: str
) -> None:
  """Refuses a load whose arrays would not fit the allocation limit, before
  any is allocated.

  A loader calls it with every array it will allocate once it knows their
  shapes (from a header or metadata, which cost a few bytes to write): the
  limit is this machine's memory, or what ``with pz_persist.limits(...)``
  sets around the load.

  Args:
    arrays: The arrays, for the message (the largest are named).
    sizes: Bytes allocated for each, by `PlannedArray.key`.
    where: The file or folder read, for the message.

  Raises:
    UnsafeCheckpointError: naming ``where``, the total and the largest arrays.
  """
  limits.check_allocation(arrays, sizes, where=where)


# ---- Casting. ----------------------------------------------------------------


def cast(array: np.ndarray, dtype: np.typing.DTypeLike, *, allow_lossy: bool,
         where: str) -> np.ndarray:
  """``array`` cast to ``dtype``, refused if values would change beyond
  rounding a float (unless ``allow_lossy``): how a loader honours ``dtype=``.

  Args:
    where: What the array is (file and tensor name), for the message.

  Raises:
    LossyCastError: naming ``where``, a changed value and ``allow_lossy``.

  Example:
    >>> import numpy as np
    >>> from pz_persist import extension
    >>> extension.cast(np.array([1.5], np.float32), np.float16, allow_lossy=False,
    ...                where="t").dtype
    dtype('float16')
    >>> extension.cast(np.array([300], np.int32), np.int8, allow_lossy=False, where="t")
    Traceback (most recent call last):
    ...
    pz_persist.errors.LossyCastError: t: casting int32 to int8 would change values...
  """
  return casts.cast(array, dtype, allow_lossy=allow_lossy, where=where)


def always_exact(source: np.typing.DTypeLike, target: np.typing.DTypeLike) -> bool:
  """Whether every value of ``source`` survives the cast to ``target``
  exactly: a loader may then let a reader cast while reading, unchecked.

  Example:
    >>> import numpy as np
    >>> from pz_persist import extension
    >>> extension.always_exact(np.float16, np.float32), extension.always_exact(
    ...     np.float32, np.float16)
    (True, False)
  """
  return casts.always_exact(np.dtype(source), np.dtype(target))


def refuse_lossy(array: np.ndarray, dtype: np.typing.DTypeLike, where: str) -> None:
  """Refuses casting ``array`` to ``dtype`` if values would change beyond
  rounding a float: a loader casting piece by piece checks each piece.

  Raises:
    LossyCastError: naming ``where`` and a changed value.
  """
  casts.refuse(array, dtype, where)


# ---- Host memory. ------------------------------------------------------------


def aligned_empty(shape: tuple[int, ...], dtype: np.typing.DTypeLike) -> np.ndarray:
  """A new array for a read to fill (contents undefined): a loader reads a
  tensor into it, and JAX's CPU backend adopts it without a copy.

  Example:
    >>> import numpy as np
    >>> from pz_persist import extension
    >>> out = extension.aligned_empty((2, 3), np.float32)
    >>> out.shape, out.ctypes.data % 64
    ((2, 3), 0)
  """
  return host_memory.aligned_empty(shape, np.dtype(dtype))


# ---- Penzai variables as checkpoints name them. -------------------------------

VARIABLE_KINDS: tuple[str, ...] = tuple(variable_kinds.KINDS)
"""The kinds of Penzai variables, as checkpoints name them (``"parameter"``,
``"state_variable"``): what a loader records beside each tensor."""


def variable_kind(variable: pz.AbstractVariable | pz.AbstractVariableValue) -> str:
  """The kind's name (one of `VARIABLE_KINDS`) of a Penzai variable or value.

  Raises:
    ArgumentTypeError: not a parameter or state variable.

  Example:
    >>> import jax.numpy as jnp
    >>> from penzai import pz
    >>> from pz_persist import extension
    >>> extension.variable_kind(pz.Parameter(value=jnp.ones(2), label="w"))
    'parameter'
  """
  return variable_kinds.kind_of(variable)


def variable_class(kind: str) -> type[pz.AbstractVariableValue]:
  """The frozen value class of the kind named ``kind`` (one of
  `VARIABLE_KINDS`): what a loader rebuilds a recorded variable as.

  Example:
    >>> from pz_persist import extension
    >>> extension.variable_class("state_variable").__name__
    'StateVariableValue'

  Raises:
    ArgumentError: ``kind`` is not one of `VARIABLE_KINDS` (a loader's
      typo, or a kind a file names), naming the kinds there are.
  """
  if not isinstance(kind, str) or kind not in variable_kinds.KINDS:
    raise errors.ArgumentError(
        f"{kind!r} is not a kind of Penzai variable; the kinds are {list(VARIABLE_KINDS)}."
    )
  return variable_kinds.KINDS[kind].value_class


# ---- Where outputs may go, and publishing them. --------------------------------


def checkpoint_path(source: object) -> epath.PathLike | None:
  """The checkpoint ``source`` names (a path, or a `pz_persist.open` handle's
  path), or None (a model in memory): what an exporter passes to
  `check_output` as what it reads."""
  return opening.checkpoint_path(source)


def local_path(path: epath.PathLike) -> epath.PathLike:
  """``path``, or the local path its ``file://`` URL names: how a loader
  looks at a folder given as a URL with ``os.path``."""
  return stores.local_path(path)


def check_output(destination: epath.PathLike, sources: Iterable[object] = (), *,
                 file: bool = False) -> epath.Path:
  """Where an output a user names may go (the destination rule): never over,
  inside or around what is read (``sources``), nor inside any checkpoint.

  An exporter calls it before its (long) read, and writes to what it returns.

  Args:
    destination: The path the user named.
    sources: What the writer reads: paths, handles, folders (anything else
      is skipped).
    file: The output is one file (a folder there is refused).

  Returns:
    ``destination`` normalised: the path to write.

  Raises:
    ArgumentError: naming the destination and what it collides with.
  """
  return destinations.check_output(destination, sources, file=file)


def writing_file(path: epath.PathLike) -> contextlib.AbstractContextManager[BinaryIO]:
  """A file to write ``path`` through, which appears whole or not at all (or
  on failure, not at all): how a loader writes a large output file.

  ``path`` is held to the destination rule without sources (`check_output`):
  never inside a checkpoint, never a folder, never a NUL, whatever the
  loader checked before.

  Raises:
    ArgumentError: as `check_output` with ``file=True``.

  Example:
    >>> import os, tempfile
    >>> from pz_persist import extension
    >>> path = os.path.join(tempfile.mkdtemp(), "out.bin")
    >>> with extension.writing_file(path) as f:
    ...   _ = f.write(b"data")
    >>> open(path, "rb").read()
    b'data'
  """
  return safe_io.writing_whole(destinations.check_output(path, file=True))


def write_small_file(path: epath.PathLike, data: bytes) -> None:
  """Writes the small file ``path`` whole or not at all (a config, an index).

  Raises:
    ArgumentError: as `writing_file`.
  """
  safe_io.write_small_file(destinations.check_output(path, file=True), data)


def check_export_destination(folder: epath.PathLike, *, overwrite: bool) -> None:
  """Refuses a folder an export may not write: not local, inside a
  checkpoint, not a folder, not empty without ``overwrite``, or holding
  anything but an earlier export's own files (only what `publishing_export`
  wrote may be replaced).

  Raises:
    ArgumentError: ``folder`` holds a NUL, is not local (serving tools read a
      local one) or lies inside a checkpoint.
    CheckpointExistsError: saying why ``folder`` may not be replaced.
  """
  path = _export_folder(folder)
  destinations.check_replaceable(stores.LOCAL, path, "hf_export")
  if os.path.isdir(path) and os.listdir(path) and not overwrite:
    raise errors.CheckpointExistsError(
        f"{folder} exists and is not empty; pass overwrite=True (CLI: --overwrite)"
        " to replace it."
    )


def _export_folder(folder: epath.PathLike) -> str:
  """``folder`` as the absolute local path an export may replace, or refused.

  Why here, and called by `publishing_export` too: a loader that publishes
  without `check_export_destination` first must still never replace a
  checkpoint, a file or someone else's folder, nor write inside a
  checkpoint, nor create a local folder named after a URL (``gs:/...``).
  """
  if not safe_io.is_local(folder):
    raise errors.ArgumentError(
        f"{os.fspath(folder)}: export_hf writes a local folder (serving tools and the Hub"
        " upload read one); export to a local path, then copy it to the store."
    )
  return os.fspath(destinations.check_output(folder))  # A NUL; inside a checkpoint.


@contextlib.contextmanager
def publishing_export(folder: epath.PathLike) -> Iterator[epath.Path]:
  """A new folder to write an export into, published at ``folder`` whole.

  The block writes its files into the folder yielded (beside ``folder``);
  when it ends, the export's marker is added (what lets a later
  `check_export_destination` with ``overwrite`` replace it) and the folder
  is moved into place the way checkpoints are (one rename, or an atomic
  exchange with the folder it replaces), so an interrupted export leaves
  ``folder`` as it was and a reader never sees a mix. If the block fails,
  what it wrote is removed.

  It refuses, before writing, what `check_export_destination` refuses
  whatever ``overwrite`` (a checkpoint, a file, a folder holding anything
  but an earlier export's files, a place inside a checkpoint): whether an
  earlier export may be replaced is the caller's ``overwrite``, checked
  there.

  Raises:
    ArgumentError, CheckpointExistsError: as `check_export_destination`.
    ConcurrentSaveError: another writer created or changed ``folder``
      meanwhile (it is left as that writer made it; nothing is replaced).

  Example:
    >>> import os, tempfile
    >>> from pz_persist import extension
    >>> folder = os.path.join(tempfile.mkdtemp(), "exported")
    >>> extension.check_export_destination(folder, overwrite=False)
    >>> with extension.publishing_export(folder) as new:
    ...   extension.write_small_file(new / "config.json", b"{}")
    >>> sorted(os.listdir(folder))
    ['config.json', 'pz_persist.export.json']
  """
  store, path = stores.choose(_export_folder(folder))
  seen = store.identity(path)  # Before the check: a change after it is caught at the move.
  destinations.check_replaceable(store, path, "hf_export")
  created = [p for p in path.parents if not p.exists()]  # Removed again if this fails.
  path.parent.mkdir(parents=True, exist_ok=True)
  # A plain mkdir, not mkdtemp: its 0o700 would be the exported folder's mode.
  new = local.sibling(path, "export")
  new.mkdir()
  try:
    yield new
    safe_io.write_small_file(new / destinations.EXPORT_MARKER, destinations.EXPORT_MARKER_DATA)
    moved = store.publish(path, new, seen)
  except BaseException:
    safe_io.remove_tree(new)  # Unpublished, or (after an exchange) the replaced export.
    for parent in created:  # Innermost first; one another writer filled stays.
      with contextlib.suppress(OSError):
        parent.rmdir()
    raise
  if not moved:
    raise errors.ConcurrentSaveError(
        f"{folder} was created or changed by another writer while this export was"
        " being written; it was left as that writer made it and this export was"
        " discarded. Export again (to another folder, or with overwrite=True)."
    )


# ---- Whole models. -------------------------------------------------------------


def load_model(path: opening.PathOrHandle) -> pz.Struct:
  """The whole model a pz_persist checkpoint holds (`pz_persist.load_model`,
  with its defaults): what an exporter given a checkpoint path writes out.

  Args:
    path: A checkpoint path or a `pz_persist.open` handle.
  """
  return model_lib.load_model(path)
