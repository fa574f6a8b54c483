"""The commit protocol on object stores, by path: a checkpoint is published by one object.

The protocol itself (its layout, why, and what it costs) is
`pz_persist.storage.stores.commit_objects`, run by every object store
(`stores.objects.ObjectStore`) over its own primitives. These functions take
a path and run it on that path's store, for callers holding a path.

Plain Orbax restores the arrays at the folder the current commit names:
``ocp.StandardCheckpointer().restore(P + "/gen-<token>/penzai")``.
"""

from __future__ import annotations

from etils import epath

from pz_persist.storage import stores
from pz_persist.storage.stores import base
from pz_persist.storage.stores import commit_objects

COMMIT_PREFIX = commit_objects.COMMIT_PREFIX
MAX_SEQUENCE = commit_objects.MAX_SEQUENCE
GENERATION_PREFIX = commit_objects.GENERATION_PREFIX
MAX_COMMIT_BYTES = commit_objects.MAX_COMMIT_BYTES
Commit = base.Commit
Identity = base.Identity
commit_name = commit_objects.commit_name
new_generation = commit_objects.new_generation
next_sequence = commit_objects.next_sequence


def current(path: epath.PathLike, listing: list[str] | None = None) -> Commit | None:
  """The current commit of the checkpoint at ``path``; None if it has none
  (`commit_objects.current`)."""
  return commit_objects.current(stores.for_path(path), path, listing)


def resolve(path: epath.PathLike) -> epath.Path:
  """The folder to read the checkpoint at ``path`` from (`commit_objects.resolve`)."""
  return commit_objects.resolve(stores.for_path(path), path)


def identity(path: epath.PathLike) -> Identity:
  """What is at ``path`` now, in the terms `publish` needs (`commit_objects.identity`)."""
  return commit_objects.identity(stores.for_path(path), path)


def publish(path: epath.Path, checkpoint: epath.Path, seen: Identity) -> bool:
  """Makes the complete ``checkpoint`` current, if ``path`` is still ``seen``
  (`commit_objects.publish`)."""
  return commit_objects.publish(stores.for_path(path), path, checkpoint, seen)


def retire_older(
    path: epath.Path, newest: int, known: dict[int, str] | None = None,
    sequences: list[int] | None = None,
) -> None:
  """Deletes the commits below ``newest`` and the folders they name
  (`commit_objects.retire_older`)."""
  commit_objects.retire_older(stores.for_path(path), path, newest, known, sequences)


def orphans(path: epath.PathLike) -> list[epath.Path]:
  """The ``gen-*`` folders at ``path`` that no current commit names
  (`commit_objects.orphans`)."""
  return commit_objects.orphans(stores.for_path(path), path)
