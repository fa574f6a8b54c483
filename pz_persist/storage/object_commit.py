"""The commit protocol on object stores, by path: a checkpoint is published by one object.

The protocol itself (its layout, why, and what it costs) is
`pz_persist.storage.stores.commits`, run by every object store
(`stores.objects.ObjectStore`) over its own primitives. These functions take
a path and run it on that path's store, for callers holding a path.

Plain Orbax restores the arrays at the folder the current commit names:
``ocp.StandardCheckpointer().restore(P + "/gen-<token>/penzai")``.
"""

from __future__ import annotations

from etils import epath

from pz_persist.storage import stores
from pz_persist.storage.stores import base
from pz_persist.storage.stores import commits

COMMIT_PREFIX = commits.COMMIT_PREFIX
MAX_SEQUENCE = commits.MAX_SEQUENCE
GENERATION_PREFIX = commits.GENERATION_PREFIX
MAX_COMMIT_BYTES = commits.MAX_COMMIT_BYTES
Commit = base.Commit
Identity = base.Identity
commit_name = commits.commit_name
new_generation = commits.new_generation
next_sequence = commits.next_sequence


def current(path: epath.PathLike, listing: list[str] | None = None) -> Commit | None:
  """The current commit of the checkpoint at ``path``; None if it has none
  (`commits.current`)."""
  return commits.current(stores.for_path(path), path, listing)


def resolve(path: epath.PathLike) -> epath.Path:
  """The folder to read the checkpoint at ``path`` from (`commits.resolve`)."""
  return commits.resolve(stores.for_path(path), path)


def identity(path: epath.PathLike) -> Identity:
  """What is at ``path`` now, in the terms `publish` needs (`commits.identity`)."""
  return commits.identity(stores.for_path(path), path)


def publish(path: epath.Path, checkpoint: epath.Path, seen: Identity) -> bool:
  """Makes the complete ``checkpoint`` current, if ``path`` is still ``seen``
  (`commits.publish`)."""
  return commits.publish(stores.for_path(path), path, checkpoint, seen)


def retire_older(
    path: epath.Path, newest: int, known: dict[int, str] | None = None,
    sequences: list[int] | None = None,
) -> None:
  """Deletes the commits below ``newest`` and the folders they name
  (`commits.retire_older`)."""
  commits.retire_older(stores.for_path(path), path, newest, known, sequences)


def orphans(path: epath.PathLike) -> list[epath.Path]:
  """The ``gen-*`` folders at ``path`` that no current commit names
  (`commits.orphans`)."""
  return commits.orphans(stores.for_path(path), path)
