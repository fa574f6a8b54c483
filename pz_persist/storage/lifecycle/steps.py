"""The steps of an Orbax checkpoint directory, as ``pz-persist ls`` lists them.

An Orbax ``CheckpointManager`` directory holds one subdirectory per step
(``100``, or ``step_100`` with a prefix), each with one directory per item and
a ``_CHECKPOINT_METADATA`` file recording when it was committed. A step still
being written has a temporary name (``100.orbax-checkpoint-tmp-...``) and is
listed as uncommitted. Names are read with Orbax's own step-path utilities
(``ocp.path.step``), so they mean here what they mean to Orbax.

On an object store (``gs://``, ``s3://``) there is no rename: a step is
written under its final name and committed by a last, empty
``commit_success.txt`` object in it (Orbax's `CommitFileTemporaryPath`, its
default on GCS; `temporary_path_class` gives it for S3 too). A step is
committed there exactly when that marker is present, so pz_persist and
Orbax's ``CheckpointManager`` agree on which steps exist, and a step whose
marker was deleted first (retention, `pz_persist.training.manager`) is gone
for both at once, whatever is left of its files.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from pz_persist import errors
from pz_persist.format import manifest as manifest_lib
from pz_persist.safety import bounded_json
from pz_persist.safety import safe_io
from pz_persist.storage import stores
from pz_persist.storage.integrity import containment

_step_paths = ocp.path.step
_atomicity = ocp.path.atomicity  # Public: Orbax exports it as orbax.checkpoint.path.atomicity.

COMMIT_MARKER = _atomicity.COMMIT_SUCCESS_FILE
"""The object Orbax writes last into a step on an object store: the step is
committed exactly while it exists."""



def temporary_path_class(store: stores.Store, directory: epath.PathLike) -> type[Any]:
  """How Orbax must write and recognize the steps of ``directory`` on ``store``.

  Orbax's own default, except on S3, where Orbax would write a step under a
  temporary name and "rename" it object by object (a copy and a delete each:
  a step killed half-way through would look committed under its final
  name); there, as on GCS, a step is written in place and committed by its
  `COMMIT_MARKER`.
  """
  if not store.renames:
    return _atomicity.CommitFileTemporaryPath
  return ocp.path.atomicity_defaults.get_default_temporary_path_class(epath.Path(directory))


def committed_by_marker(store: stores.Store, directory: epath.PathLike) -> bool:
  """Whether a step of ``directory`` on ``store`` is committed by its
  `COMMIT_MARKER` (object stores) rather than by its name (a local rename)."""
  return issubclass(temporary_path_class(store, directory), _atomicity.CommitFileTemporaryPath)


def parse_step_name(name: str) -> tuple[int, bool] | None:
  """``(step, committed)`` for an Orbax step directory's name, else None.

  Orbax's parser (`step_from_checkpoint_name`) reads the step of a final
  name (``100``, ``step_100``); a temporary name is its final name plus
  Orbax's ``TMP_DIR_SUFFIX`` and more, and is not committed. pz_persist's
  own rules on top: hidden names (pz_persist's save families,
  ``.NAME.pz_persist-new-...``) are never steps, and a name Orbax's looser
  checks would let through to a failing ``int()`` (``"²"`` is a digit to
  `str.isdigit`) is not a step rather than an error.
  """
  final, suffix, _ = name.partition(_step_paths.TMP_DIR_SUFFIX)
  if name.startswith("."):
    return None
  try:
    return _step_paths.step_from_checkpoint_name(final), not suffix
  except ValueError:
    return None


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """One step of a checkpoint directory.

  Attributes:
    step: The step number.
    path: Its directory.
    committed: Whether Orbax finished writing it.
    items: Its items, e.g. ``("params", "opt_state")``.
    penzai_items: The items pz_persist wrote (they hold a manifest).
    nbytes: Bytes on disk.
    commit_time_ns: When it was committed (ns since the epoch), if recorded.
  """

  step: int
  path: epath.Path
  committed: bool
  items: tuple[str, ...]
  penzai_items: tuple[str, ...]
  nbytes: int
  commit_time_ns: int | None


def disk_bytes(path: epath.PathLike) -> int:
  """Bytes of the regular files at or under the local ``path`` (links are
  not followed and count nothing); 0 if it is gone.

  A run is listed while it is written (`pz-persist ls` beside training, a
  test waiting for a save to start, ``pz-persist clean`` sizing leftovers):
  a file a concurrent save removes or renames between the listing and its
  size counts as gone, not as an error.
  """
  name = os.fspath(path)
  try:
    info = os.lstat(name)
  except OSError:
    return 0
  if not stat.S_ISDIR(info.st_mode):
    return info.st_size if stat.S_ISREG(info.st_mode) else 0
  total = 0
  for root, _, files in os.walk(name):
    for file in files:
      try:
        info = os.lstat(os.path.join(root, file))
      except OSError:
        continue  # Removed or renamed by a concurrent save.
      total += info.st_size if stat.S_ISREG(info.st_mode) else 0
  return total


def _item_names(step_dir: epath.Path) -> tuple[str, ...] | None:
  """The items of a step, or None when the step directory went away while
  the run was listed (a save renaming its temporary, a cleanup removing it)."""
  try:
    return tuple(sorted(p.name for p in step_dir.iterdir() if p.is_dir()))
  except FileNotFoundError:
    return None


def _commit_time(path: epath.Path) -> int | None:
  try:
    data = safe_io.read_small_file(
        path / stores.local.ORBAX_CHECKPOINT_METADATA, containment.MAX_CHECKPOINT_METADATA_BYTES,
        what="Orbax's checkpoint metadata",
    )
    metadata: Any = bounded_json.loads(
        data, where=str(path / stores.local.ORBAX_CHECKPOINT_METADATA),
        max_nodes=bounded_json.node_limit(len(data), most=containment.MAX_ORBAX_METADATA_NODES),
        max_depth=64,
    )
  except (OSError, errors.PzPersistError):
    return None
  value = metadata.get("commit_timestamp_nsecs") if isinstance(metadata, dict) else None
  return value if isinstance(value, int) else None


def list_steps(directory: epath.PathLike, *, commit_times: bool = True) -> list[StepInfo]:
  """The steps in ``directory``, oldest first.

  Args:
    directory: The run directory.
    commit_times: Read each step's commit time from its metadata (one small
      read per step; False leaves `StepInfo.commit_time_ns` None).

  Raises:
    UnsafeCheckpointError: a file under ``directory`` is a link leading out
      of it, a FIFO or a device (see `containment.check_run_directory`).
    ManifestError: an Orbax metadata file is over its size limit.
    UnsupportedStorageError: ``directory`` is on a storage other than a
      local disk, ``gs://`` or ``s3://``.
  """
  store, _ = stores.choose(directory)  # Refused before anything is listed.
  directory = epath.Path(stores.local_path(directory))
  if not store.renames:  # Committed by marker: all told by one listing.
    return _remote_steps(store, directory, commit_times)
  containment.check_run_directory(directory)  # Before anything is read.
  steps = []
  for child in directory.iterdir():
    parsed = parse_step_name(child.name)
    if parsed is None or not child.is_dir():
      continue
    step, committed = parsed
    items = _item_names(child)
    if items is None:
      continue  # Gone while listed: a later listing shows where it went.
    steps.append(
        StepInfo(
            step=step,
            path=child,
            committed=committed,
            items=items,
            penzai_items=tuple(
                name for name in items if manifest_lib.has_manifest(child / name)
            ),
            nbytes=disk_bytes(child),
            commit_time_ns=_commit_time(child) if commit_times else None,
        )
    )
  return sorted(steps, key=lambda s: (s.step, not s.committed))


@dataclasses.dataclass
class _Listed:
  """What one listing of a run says of one step directory."""

  nbytes: int = 0
  files: set[str] = dataclasses.field(default_factory=set)
  items: set[str] = dataclasses.field(default_factory=set)
  penzai_items: set[str] = dataclasses.field(default_factory=set)


def _remote_steps(
    store: stores.Store, directory: epath.Path, commit_times: bool
) -> list[StepInfo]:
  """`list_steps` of a run on an object store, from one listing of it."""
  listed: dict[str, _Listed] = {}
  for rel, info in store.tree(directory).items():
    top, _, rest = rel.partition("/")
    if not rest:
      continue  # An object beside the steps.
    step = listed.setdefault(top, _Listed())
    step.nbytes += info.size
    item, _, inside = rest.partition("/")
    if not inside:
      step.files.add(item)
      continue
    step.items.add(item)
    if inside == manifest_lib.MANIFEST_FILENAME:
      step.penzai_items.add(item)
  by_marker = committed_by_marker(store, directory)
  steps = []
  for name, step in listed.items():
    parsed = parse_step_name(name)
    if parsed is None:
      continue
    number, committed = parsed
    if by_marker:
      committed = committed and COMMIT_MARKER in step.files
    timed = commit_times and stores.local.ORBAX_CHECKPOINT_METADATA in step.files
    steps.append(StepInfo(
        step=number, path=directory / name, committed=committed,
        items=tuple(sorted(step.items)), penzai_items=tuple(sorted(step.penzai_items)),
        nbytes=step.nbytes, commit_time_ns=_commit_time(directory / name) if timed else None,
    ))
  return sorted(steps, key=lambda s: (s.step, not s.committed))


def remove_step(store: stores.Store, step_dir: epath.Path) -> None:
  """Deletes the step directory ``step_dir`` on the object store ``store``,
  whole or gone.

  Why the marker first: deleting a step's objects takes one request per
  object, and a process killed half-way would leave a step that still looks
  complete to Orbax and to `list_steps` (its `COMMIT_MARKER` intact) but
  does not restore. With the marker deleted first, one request, the step is
  uncommitted for every reader from then on; what a killed deletion leaves
  is an uncommitted step, which Orbax's ``CheckpointManager`` deletes when
  it next opens the run (``cleanup_tmp_directories``) and ``pz-persist
  clean --force`` removes.
  """
  store.remove(step_dir / COMMIT_MARKER)
  store.remove(step_dir)
