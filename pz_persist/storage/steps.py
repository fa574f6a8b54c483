"""The steps of an Orbax checkpoint directory, as ``pz-persist ls`` lists them.

An Orbax ``CheckpointManager`` directory holds one subdirectory per step
(``100``, or ``step_100`` with a prefix), each with one directory per item and
a ``_CHECKPOINT_METADATA`` file recording when it was committed. A step still
being written has a temporary name (``100.orbax-checkpoint-tmp-...``) and is
listed as uncommitted. Names are read with Orbax's own step-path utilities
(``ocp.path.step``), so they mean here what they mean to Orbax.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from pz_persist import errors
from pz_persist.format import manifest as manifest_lib
from pz_persist.safety import bounded_json
from pz_persist.safety import safe_io
from pz_persist.storage import containment
from pz_persist.storage import object_store

_step_paths = ocp.path.step


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


def _disk_bytes(path: epath.Path) -> int:
  """Bytes of the files under ``path``; a link counts as itself, not followed."""
  local = os.fspath(path)
  if not safe_io.is_local(local):
    return sum(p.stat().length for p in path.rglob("*") if p.is_file())
  return sum(
      os.lstat(os.path.join(root, name)).st_size
      for root, _, files in os.walk(local)
      for name in files
  )


def _commit_time(path: epath.Path) -> int | None:
  try:
    data = safe_io.read_small_file(
        path / "_CHECKPOINT_METADATA", containment.MAX_ORBAX_METADATA_BYTES,
        what="Orbax's checkpoint metadata",
    )
    metadata: Any = bounded_json.loads(
        data, where=str(path / "_CHECKPOINT_METADATA"),
        max_nodes=bounded_json.node_limit(len(data), most=containment.MAX_ORBAX_METADATA_NODES),
        max_depth=64,
    )
  except (OSError, errors.PzPersistError):
    return None
  value = metadata.get("commit_timestamp_nsecs") if isinstance(metadata, dict) else None
  return value if isinstance(value, int) else None


def list_steps(directory: epath.PathLike) -> list[StepInfo]:
  """The steps in ``directory``, oldest first.

  Raises:
    UnsafeCheckpointError: a file under ``directory`` is a link leading out
      of it, a FIFO or a device (see `containment.check_run_directory`).
    ManifestError: an Orbax metadata file is over its size limit.
    UnsupportedStorageError: ``directory`` is on a storage other than a
      local disk, ``gs://`` or ``s3://``.
  """
  object_store.check_supported(directory)  # Not listed through fsspec first.
  directory = epath.Path(directory)
  containment.check_run_directory(directory)  # Before anything is read.
  steps = []
  for child in directory.iterdir():
    parsed = parse_step_name(child.name)
    if parsed is None or not child.is_dir():
      continue
    step, committed = parsed
    items = tuple(sorted(p.name for p in child.iterdir() if p.is_dir()))
    steps.append(
        StepInfo(
            step=step,
            path=child,
            committed=committed,
            items=items,
            penzai_items=tuple(
                name for name in items if manifest_lib.has_manifest(child / name)
            ),
            nbytes=_disk_bytes(child),
            commit_time_ns=_commit_time(child),
        )
    )
  return sorted(steps, key=lambda s: (s.step, not s.committed))
