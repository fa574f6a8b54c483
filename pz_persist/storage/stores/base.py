"""The `Store` protocol: what pz_persist asks of the storage a checkpoint is on.

Why one protocol: a local disk, ``gs://`` and ``s3://`` keep a checkpoint
whole by different means (a locked rename there, a conditionally created
commit object here), list and delete differently, and only a disk has
links, locks and inodes. Asked by each caller ("is this local?"), that
difference was decided again in every module that touched a file; now
`pz_persist.storage.stores.for_path` decides it once, from the path's
scheme, and the caller carries the `Store` it got (`opening.OpenItem.store`,
a save's ``store``). A kind of storage is one module implementing this class;
`tests/test_stores.py` holds every implementation to the same contract.

The operations are the few the commit protocol, the readers and the cleaners
need: normalise a path (`normalise`, `prepare`); files (`read`, `open`,
`write_whole`, `create_if_absent`, `info`, `has_entry`); listings (`names`, `tree`);
`remove`; the reader's lock (`lock`); and publishing a checkpoint whole
(`identity`, `check_publishable`, `new_location`, `publish`, `pin`,
`resolve`).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import BinaryIO
from typing import ClassVar

from etils import epath

from pz_persist.storage.stores import urls

Identity = tuple | None
"""What a path held when looked at: None if nothing, else a value that changes
whenever a save puts another checkpoint there (see `Store.identity`)."""


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
  """What the store says of one object (one file).

  Attributes:
    size: Bytes.
    generation: Changes whenever the object is written again (GCS's
      generation; S3's ETag plus version id; a local file's inode and times).
    checksums: The store's own checksums of the content, by name:
      ``crc32c`` / ``md5`` (GCS, raw bytes) or ``md5`` (an S3 ETag of a
      single-part upload). Empty where the store keeps none usable.
  """

  size: int
  generation: str
  checksums: dict[str, bytes]


COMMIT_PREFIX = "pz_persist.commit."
"""Name prefix of commit objects; the rest is the sequence, 20 digits."""


def commit_name(sequence: int) -> str:
  """The name of the commit object of ``sequence``."""
  return f"{COMMIT_PREFIX}{sequence:020d}"


@dataclasses.dataclass(frozen=True)
class Commit:
  """The commit object that makes a checkpoint current (object stores).

  Attributes:
    path: The checkpoint path (``gs://bucket/ckpt``).
    sequence: Its sequence number (1 for a first save).
    generation: The store's generation / ETag of the commit object, which
      changes if it is ever deleted and written again.
    checkpoint: The ``gen-*`` folder it names: the Orbax checkpoint.
    store: The store it is on (asked by `still_current`).
  """

  path: epath.Path
  sequence: int
  generation: str
  checkpoint: epath.Path
  store: Store = dataclasses.field(compare=False, repr=False)

  @property
  def object(self) -> epath.Path:
    return self.path / commit_name(self.sequence)

  def still_current(self) -> bool:
    """Whether this commit object still exists, unchanged: then its folder
    has not started being retired (`pz_persist.storage.stores.commit_objects`)."""
    found = self.store.info(self.object)
    return found is not None and found.generation == self.generation


class Store(abc.ABC):
  """One kind of storage. Instances hold no state of a checkpoint: one per
  kind serves every path of that kind (`stores.for_path`)."""

  scheme: ClassVar[str | None] = None
  """The URL scheme of its paths (``"gs"``); None for local paths."""

  load_attempts: ClassVar[int] = 3
  """How many times a reader reads a checkpoint that saves keep replacing."""

  retry_jitter_seconds: ClassVar[float] = 0.0
  """Most a reader waits, at random, before reading again (0: no wait)."""

  identifies_files: ClassVar[bool] = False
  """Whether `file_identity` tells every rewrite of a file (inodes and
  times). Where not, a reader compares the manifest's bytes instead."""

  renames: ClassVar[bool] = False
  """Whether a folder is renamed in one step. Where it is, a checkpoint or an
  Orbax step is written under a temporary name and renamed into place, and a
  dropped step is moved into a trash; where not, both are written in place
  and published by a marker (a commit object; Orbax's
  ``commit_success.txt``), and deleted marker first."""

  has_locks: ClassVar[bool] = False
  """Whether files can be locked, so that a save's marker and a run's lock
  prove a writer alive or dead (`pz_persist.storage.lifecycle.leftovers`). Where not,
  nothing proves a writer gone: leftovers are the commit protocol's
  `orphans`, removed only when the user vouches for them."""

  keeps_checksums: ClassVar[bool] = False
  """Whether the store records checksums of what it was sent (`ObjectInfo`),
  which ``verify`` compares an item's files against where pz_persist
  recorded no digests of its own."""

  # ---- Paths. ---------------------------------------------------------------

  @abc.abstractmethod
  def normalise(self, path: epath.PathLike) -> epath.Path:
    """``path`` as the one spelling every library reads alike; refuses one
    that has none (`errors.UnsupportedStorageError`) or whose extra is not
    installed (`errors.MissingExtraError`). Changes nothing process-wide."""

  def place(self, path: epath.PathLike) -> tuple[str, ...]:
    """Where ``path`` is, as segments: two paths naming one place have equal
    places, and a place inside another starts with its segments."""
    return (str(self.scheme), *urls.key(path).split("/"))

  def prepare(self, path: epath.PathLike) -> epath.Path:
    """`normalise`, and this store made ready for Orbax to write and read
    ``path`` (installs what Orbax needs, where it needs anything: `s3`)."""
    return self.normalise(path)

  # ---- Whole objects. -------------------------------------------------------

  @abc.abstractmethod
  def read(self, path: epath.PathLike, limit: int) -> bytes:
    """The bytes of the small file ``path``; never more than ``limit + 1``
    are read (a larger file is refused or returned cut: the caller, seeing
    more than ``limit``, refuses it).

    Raises:
      FileNotFoundError: no such file.
    """

  @abc.abstractmethod
  def open(self, path: epath.PathLike) -> BinaryIO:
    """The file ``path`` opened for reading in pieces (to hash a large one);
    locally never through a link.

    Raises:
      FileNotFoundError: no such file.
    """

  @abc.abstractmethod
  def write_whole(self, path: epath.PathLike, data: bytes) -> None:
    """Writes ``path``, which readers see whole or not at all."""

  @abc.abstractmethod
  def create_if_absent(self, path: epath.PathLike, data: bytes) -> bool:
    """Writes ``path`` whole only if nothing is there; False if something is.

    Decided atomically: of any number of concurrent calls for one name,
    exactly one returns True.
    """

  @abc.abstractmethod
  def info(self, path: epath.PathLike) -> ObjectInfo | None:
    """`ObjectInfo` of the file at ``path``; None if there is none (or a folder)."""

  def has_entry(self, path: epath.PathLike) -> bool:
    """Whether anything is at ``path`` that a reader must look at: a file
    (locally also a link, a FIFO or a folder, never followed, so that it is
    refused by name rather than taken for nothing)."""
    return self.info(path) is not None

  @abc.abstractmethod
  def names(self, directory: epath.PathLike, prefix: str = "") -> list[str]:
    """Names directly inside ``directory`` starting with ``prefix`` (files and
    folders), sorted, never from a cache; [] if there is no ``directory``."""

  @abc.abstractmethod
  def tree(self, directory: epath.PathLike) -> dict[str, ObjectInfo]:
    """Every file under ``directory``, by its ``/``-separated name relative
    to it; {} if there is none."""

  @abc.abstractmethod
  def remove(self, path: epath.PathLike) -> None:
    """Deletes the file or the tree at ``path`` (never what a link leads to);
    missing is fine."""

  # ---- Locks and identities. ------------------------------------------------

  def lock(
      self, path: epath.PathLike, *, shared: bool = False
  ) -> contextlib.AbstractContextManager[None]:
    """A context holding the lock a save's publishing of ``path`` takes
    (exclusive) and a reader of it holds (shared); a no-op where the store
    has no locks (the commit protocol keeps readers safe there)."""
    del path, shared
    return contextlib.nullcontext()

  def reading(self, path: epath.PathLike) -> contextlib.AbstractContextManager[None]:
    """What a reader of ``path`` holds while it reads: `lock` (shared) of
    ``path`` and, where ``path`` is an item inside a checkpoint, of that
    checkpoint too."""
    return self.lock(path, shared=True)

  def file_identity(self, path: epath.PathLike) -> tuple[int, ...] | None:
    """Which file is at ``path`` (see `identifies_files`); None where the
    store cannot tell, or there is none."""
    del path
    return None

  # ---- Publishing a checkpoint whole. ---------------------------------------

  @abc.abstractmethod
  def identity(self, path: epath.Path) -> Identity:
    """What is at ``path`` now, to tell later whether a save replaced it."""

  def check_publishable(self, path: epath.Path, seen: Identity) -> None:
    """Refuses, before anything is written, a save `publish` could not
    publish over ``seen`` (a `errors.PzPersistError` naming why)."""
    del path, seen

  @abc.abstractmethod
  def new_location(self, path: epath.Path, token: str) -> epath.Path:
    """Where a save of ``path`` writes its checkpoint before `publish`.
    ``token`` is shared by all processes writing it."""

  @abc.abstractmethod
  def publish(self, path: epath.Path, new: epath.Path, seen: Identity) -> bool:
    """Publishes the complete checkpoint ``new`` (from `new_location`) at
    ``path`` if ``path`` is still ``seen``; else deletes ``new`` and returns
    False (another save won, and its checkpoint stays whole)."""

  def pin(self, path: epath.PathLike) -> Commit | None:
    """The commit a reader of ``path`` pins (its folder never changes once
    published); None where checkpoints are not published by commit objects,
    or ``path`` has none."""
    del path
    return None

  def resolve(self, path: epath.PathLike) -> epath.Path:
    """The folder to read the checkpoint at ``path`` from: the one its
    `pin` names, or ``path`` itself."""
    pinned = self.pin(path)
    return epath.Path(path) if pinned is None else pinned.checkpoint

  def orphans(self, path: epath.PathLike) -> list[epath.Path]:
    """What saves of ``path`` left that nothing publishes and nothing proves
    dead (object stores: the ``gen-*`` folders no commit names). [] where
    leftovers are told by their writers' markers (`storage.lifecycle.leftovers`)."""
    del path
    return []
