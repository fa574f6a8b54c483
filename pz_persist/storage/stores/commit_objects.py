"""The commit protocol on object stores: a checkpoint is published by one object.

Every function takes the `base.Store` whose primitives it uses
(`base.Store.create_if_absent`, `info`, `read`, `names`, `remove`), so any
object store (`objects.ObjectStore`) gets the same protocol.

Why not the local protocol: it writes a checkpoint under a hidden name and
renames it into place, but an object store has no rename: gcsfs and s3fs
"rename" a folder by copying and deleting each object, so two saves mix,
nest, and cost twice the requests, and a reader sees a checkpoint appear file
by file. What stores do have is the conditional create (GCS
``ifGenerationMatch=0``, S3 ``If-None-Match: *``): of several writers
creating one name, exactly one succeeds. So a checkpoint at ``P`` is::

  P/gen-<token>/                        a whole Orbax checkpoint, written in
                                        place (never moved): _CHECKPOINT_METADATA,
                                        the penzai/ item, its arrays
  P/pz_persist.commit.<sequence>        tiny JSON naming the gen-* folder
                                        that is the checkpoint; the highest
                                        sequence is the current one

A save writes its own ``gen-<token>`` folder completely, then *publishes* it
by creating the commit object one above the sequence it saw when it started
(1 for a first save), only if that name is still free. Two racing saves of
one sequence: one creates it and wins; the other gets `False`
(``ConcurrentSaveError``) and deletes its folder. The winner lists the
commits once more: a name is free again once its commit was retired, so a
save whose view was stale (others saved and overwrote since) can create one
below the current commit; finding a higher one, it undoes its commit and
loses too. Otherwise it retires what it replaced: first the old commit
object, then the old folder, so a folder is only ever deleted once no commit
names it.

A reader lists the commit objects (one request), reads the highest and reads
the folder it names, then checks that this commit object still exists with
the same generation (GCS) / ETag (S3). If it does, the folder was not
retired during the read (retiring starts by deleting the commit object), and
since a gen-* folder never changes once published, what was read is that one
checkpoint, whole. If not, the read is done again on the new current commit
(`pz_persist.storage.reading.opening` does that for every reader).

Plain Orbax restores the arrays at the folder the current commit names:
``ocp.StandardCheckpointer().restore(P + "/gen-<token>/penzai")``.

What it costs over plain Orbax's save of the same tree: two listings and one
small create, and on overwrite a read of the current commit and the deletes
of the replaced checkpoint.
"""

from __future__ import annotations

import json
import re

from etils import epath

from pz_persist import errors
from pz_persist.safety import bounded_json
from pz_persist.storage.stores import base

MAX_SEQUENCE = 10**20 - 1
"""The highest sequence a commit object's name holds (20 digits). Reached
only by a commit object written by hand: a save a second for three
trillion years would not get there. A save that would need the next one is
refused (`next_sequence`): a longer name is one no reader recognises."""

GENERATION_PREFIX = "gen-"
"""Name prefix of the folders that hold one checkpoint each."""

MAX_COMMIT_BYTES = 4096
"""Larger commit objects are refused before parsing (pz_persist writes ~70 B)."""

_COMMIT_NAME = re.compile(re.escape(base.COMMIT_PREFIX) + r"(\d{20})")
_GENERATION_NAME = re.compile(re.escape(GENERATION_PREFIX) + r"[0-9a-f]{16}")
_FORMAT = 1


def new_generation(path: epath.Path, token: str) -> epath.Path:
  """Where a save writes its checkpoint before publishing it.

  ``token`` (16 hex digits) is shared by all processes writing it.
  """
  return path / f"{GENERATION_PREFIX}{token}"


def _sequences(
    store: base.Store, path: epath.Path, listing: list[str] | None = None
) -> list[int]:
  """The sequences of the commit objects at ``path``, in one listing (or
  from ``listing``, the names at ``path``, when the caller has it).

  Raises:
    ManifestError: a name starts as a commit object's does but is not one
      (another number of digits: what an earlier pz_persist wrote past
      `MAX_SEQUENCE`). Passed over, it would hide the current checkpoint
      behind an older commit or none, and a save would retire it.
  """
  found = []
  if listing is None:
    listing = store.names(path, base.COMMIT_PREFIX)
  for name in listing:
    if not name.startswith(base.COMMIT_PREFIX):
      continue
    match = _COMMIT_NAME.fullmatch(name)
    if match is None:
      raise errors.ManifestError(
          f"{path / name}: not a commit object name pz_persist reads"
          f" ({base.COMMIT_PREFIX} and 20 digits), so which checkpoint at {path} is"
          " current cannot be told; the checkpoint is damaged. Its gen-* folders"
          " still hold Orbax checkpoints: load one by its path, or delete"
          f" {path} and save again."
      )
    found.append(int(match.group(1)))
  return sorted(found)


def next_sequence(path: epath.PathLike, seen: base.Identity) -> int:
  """The sequence a save publishing over ``seen`` (`identity`) creates.

  Raises:
    ManifestError: it would be past `MAX_SEQUENCE` (its commit object would
      have a name no reader recognises); nothing has been written.
  """
  sequence = seen[1] + 1 if seen is not None and seen[0] == "commit" else 1
  if sequence > MAX_SEQUENCE:
    raise errors.ManifestError(
        f"{epath.Path(path) / base.commit_name(sequence - 1)}: the current commit"
        f" has sequence {sequence - 1}, the highest a commit object's name holds,"
        " so no save can replace it (pz_persist never counts this high: the"
        " object was written by hand). Save to another path, or delete"
        f" {path} and save again."
    )
  return sequence


def current(
    store: base.Store, path: epath.PathLike, listing: list[str] | None = None
) -> base.Commit | None:
  """The current commit of the checkpoint at ``path``; None if it has none.

  ``listing``: the names at ``path``, if the caller has just listed them.

  Raises:
    ManifestError: the current commit object is not one pz_persist wrote
      (too large, not JSON, or naming something other than a ``gen-*``
      folder directly inside ``path``).
  """
  path = epath.Path(path)
  for _ in range(8):  # A commit retired between the listing and its read.
    sequences, listing = _sequences(store, path, listing), None
    if not sequences:
      return None
    sequence = sequences[-1]
    found = _read_commit(store, path, sequence)
    if found is not None:
      return found
  raise errors.ConcurrentSaveError(
      f"{path}: its commit objects kept being replaced while being read; try again."
  )


def _read_commit(store: base.Store, path: epath.Path, sequence: int) -> base.Commit | None:
  """The commit object of ``sequence``; None if it vanished meanwhile."""
  where = path / base.commit_name(sequence)
  found = store.info(where)
  if found is None:
    return None
  try:
    data = store.read(where, MAX_COMMIT_BYTES)
  except FileNotFoundError:
    return None
  if len(data) > MAX_COMMIT_BYTES:
    raise errors.ManifestError(
        f"{where}: a commit object of over {MAX_COMMIT_BYTES} bytes is not one"
        " pz_persist wrote; the checkpoint is damaged."
    )
  parsed = bounded_json.loads(data, where=str(where), max_nodes=16, max_depth=2)
  name = parsed.get("checkpoint") if isinstance(parsed, dict) else None
  if (
      not isinstance(parsed, dict)
      or parsed.get("pz_persist_commit") != _FORMAT
      or not isinstance(name, str)
      or not _GENERATION_NAME.fullmatch(name)
  ):
    raise errors.ManifestError(
        f"{where}: not a pz_persist commit object (expected"
        f' {{"pz_persist_commit": {_FORMAT}, "checkpoint": "gen-<16 hex digits>"}});'
        " the checkpoint is damaged. Its gen-* folders still hold Orbax"
        " checkpoints; load one by its path."
    )
  return base.Commit(path, sequence, found.generation, path / name, store)


def resolve(store: base.Store, path: epath.PathLike) -> epath.Path:
  """The folder to read the checkpoint at ``path`` from: the one its current
  commit names, or ``path`` itself if it has no commit (a step of a
  ``CheckpointManager``, an item directory, or a checkpoint written before
  this protocol)."""
  found = current(store, path)
  return epath.Path(path) if found is None else found.checkpoint


def identity(store: base.Store, path: epath.PathLike) -> base.Identity:
  """What is at ``path`` now, in the terms `publish` needs (one listing,
  plus one read when there is a commit)."""
  path = epath.Path(path)
  listing = store.names(path)
  found = current(store, path, listing)
  if found is not None:
    return ("commit", found.sequence, found.generation, found.checkpoint.name)
  return ("exists",) if _others(listing) else None


def _others(listing: list[str]) -> list[str]:
  return [
      name for name in listing
      if not (_COMMIT_NAME.fullmatch(name) or _GENERATION_NAME.fullmatch(name))
  ]


def publish(
    store: base.Store, path: epath.Path, checkpoint: epath.Path, seen: base.Identity
) -> bool:
  """Makes the complete ``checkpoint`` current, if ``path`` is still ``seen``.

  ``seen`` is `identity` of ``path`` when the save started. Creates the
  commit object one above it (the first one if it had none), only if no
  object has that name: if another save published since, it has taken that
  name, and False is returned (``checkpoint`` is then deleted: the other
  save won, and its checkpoint is untouched). On success what ``seen`` and
  older commits named is retired, and so is a checkpoint ``seen`` found
  written there before this protocol (``("exists",)``), which only
  ``overwrite=True`` lets a save replace.

  Raises:
    ManifestError: ``seen``'s commit is the last sequence (`next_sequence`);
      ``checkpoint`` is deleted and ``path`` left as it is.
  """
  replaced = seen if seen is not None and seen[0] == "commit" else None
  try:
    sequence = next_sequence(path, seen)
  except errors.PzPersistError:
    store.remove(checkpoint)
    raise
  record = json.dumps({"pz_persist_commit": _FORMAT, "checkpoint": checkpoint.name})
  if not store.create_if_absent(path / base.commit_name(sequence), record.encode()):
    store.remove(checkpoint)
    return False
  # A name is free again once its commit was retired: with ``seen`` stale
  # (others saved and overwrote since), the create above succeeds below the
  # current commit. A higher commit means this save was overtaken: undone as
  # a retirement is (commit object, then folder), and lost.
  sequences = _sequences(store, path)
  if sequences and sequences[-1] > sequence:
    store.remove(path / base.commit_name(sequence))
    store.remove(checkpoint)
    return False
  retire_older(store, path, sequence, known={replaced[1]: replaced[3]} if replaced else {},
               sequences=sequences)
  if seen == ("exists",):
    for name in _others(store.names(path)):
      store.remove(path / name)
  return True


def retire_older(
    store: base.Store, path: epath.Path, newest: int, known: dict[int, str] | None = None,
    sequences: list[int] | None = None,
) -> None:
  """Deletes the commits below ``newest`` and the folders they name.

  Each commit object goes before its folder, so a reader holding it learns
  that its folder may be incomplete (`base.Commit.still_current`). Another save
  retiring the same ones at once is harmless: deleting is idempotent.
  ``known`` maps sequences to the folder names their commits were read to
  name (by the save's `identity`), which are then not read again;
  ``sequences``, the commits just listed, saves listing them again.
  """
  known = known or {}
  for sequence in _sequences(store, path) if sequences is None else sequences:
    if sequence >= newest:
      break
    name = known.get(sequence)
    if name is None:
      try:
        old = _read_commit(store, path, sequence)
      except errors.PzPersistError:
        old = None  # Damaged: its commit object still goes.
      name = None if old is None else old.checkpoint.name
    store.remove(path / base.commit_name(sequence))
    if name is not None:
      store.remove(path / name)


def orphans(store: base.Store, path: epath.PathLike) -> list[epath.Path]:
  """The ``gen-*`` folders at ``path`` that no current commit names.

  They are what saves killed before publishing (or still writing!) left.
  Nothing proves their writer is gone (no locks or pids on an object store),
  so only ``pz-persist clean --force`` deletes them.
  """
  path = epath.Path(path)
  found = current(store, path)
  keep = None if found is None else found.checkpoint.name
  return [
      path / name
      for name in store.names(path, GENERATION_PREFIX)
      if _GENERATION_NAME.fullmatch(name) and name != keep
  ]


