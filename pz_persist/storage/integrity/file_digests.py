"""A digest of every file of a checkpoint item, written once it is complete.

Array checksums (`pz_persist.storage.integrity.checksums`) say *which label* is damaged, but only
catch damage that changes the bytes an array decodes to. A flipped bit in
compressed framing, in Orbax's index files or in an unused byte may not; a
digest of every file catches all of them, and says *which file*. The digests
are written by the primary process after Orbax has finalized the item (so the
multi-process OCDBT merge is included) and cost one read of the freshly written
files, from the page cache. `pz_persist.verify` checks both. (Orbax's
``commit_success.txt`` marker, a timestamp written after the item is complete
on file systems without atomic rename, is not covered: it holds no data.)

On an object store no digest list is written (a save there would pay a read
of every file it just wrote): the store records its own checksum of every
object when it is written (GCS: CRC32C and MD5; S3: the MD5 in a single-part
upload's ETag). `check_against_store` reads each object back and compares it
with that checksum: it proves the bytes read are those the store received,
but, unlike the digest list, not that they are those the save wrote (an
object written again since has a new store checksum). A checkpoint copied to
a store with its digest list is checked against the list, as on a disk.

Layout of ``pz_persist.files.json``::

  {"format": "pz_persist.files", "algorithm": "xxh3_128",
   "files": {"relative/path": [size_in_bytes, "hexdigest"], ...}}
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from typing import Any

import xxhash
from etils import epath

from pz_persist import errors
from pz_persist import progress as progress_lib
from pz_persist.format import checksum_records
from pz_persist.format import manifest as manifest_lib
from pz_persist.safety import bounded_json
from pz_persist.safety import safe_io
from pz_persist.storage import stores
from pz_persist.storage.integrity import checksums
from pz_persist.storage.integrity import hashing_threads

MAX_NODES = 2**22
"""Most JSON values a digest file may hold: 4 per file, so a million files
(a checkpoint without OCDBT has a few per array). A real list spends over
16 bytes per value (a path and a digest per file), so at most one value per
8 bytes is allowed (see `pz_persist.safety.bounded_json.node_limit`)."""

_FORMAT = "pz_persist.files"
_ORBAX_MARKER = "commit_success.txt"  # Written after the list, holds no data.
_ORBAX_METADATA = stores.local.ORBAX_CHECKPOINT_METADATA
"""Where the item is the whole checkpoint (`PenzaiCheckpointHandler` in
Orbax's ``Checkpointer`` directly, not in ``Composite``), Orbax's checkpoint
metadata lies beside the item's files and is written again after the list (its
commit time): not the item's data, never listed, and not compared where an
older list holds it."""
_NOT_LISTED = frozenset({_ORBAX_MARKER, _ORBAX_METADATA})


def _files(directory: str) -> list[str]:
  """Relative paths of the item's files (not the digest file, not temporaries)."""
  found = []
  for root, _, names in os.walk(directory):
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), directory)
      if rel in (manifest_lib.FILE_DIGESTS_FILENAME, _ORBAX_METADATA) or (
          name.startswith(".") and name.endswith(".tmp")):
        continue
      found.append(rel.replace(os.sep, "/"))
  return sorted(found)


def write(directory: epath.Path) -> None:
  """Records the size and digest of every file in ``directory`` (local only)."""
  if not safe_io.is_local(directory):
    return  # Remote stores checksum their objects themselves.
  root = os.fspath(directory)
  names = list(_files(root))
  files = dict(zip(names, hashing_threads.map_in_threads(
      lambda rel: [os.path.getsize(os.path.join(root, rel)),
                   checksums.file_digest(os.path.join(root, rel))],
      names, name="file digests",
  )))
  data = json.dumps(
      {"format": _FORMAT, "algorithm": checksum_records.ALGORITHM, "files": files},
      separators=(",", ":"),
  ).encode()
  safe_io.write_small_file(os.path.join(root, manifest_lib.FILE_DIGESTS_FILENAME), data)


def check(
    directory: epath.Path, tracker: progress_lib.Tracker | None = None
) -> tuple[int, list[str]] | None:
  """Compares the item's files with the recorded list, each with its digest.

  The recorded files must be exactly those on disk: a file missing, added,
  resized, changed or no longer a regular file is a problem. Each file is
  hashed at most once (the list names each by one canonical path).

  Args:
    directory: The checkpoint item directory.
    tracker: Told the recorded bytes, then each file's once it is checked.

  Returns:
    ``(files checked, problems)``, one problem line per missing, added,
    resized or changed file; None if the item has no digest file (written by
    an older pz_persist, or on a remote store).
  """
  path = os.fspath(epath.Path(directory) / manifest_lib.FILE_DIGESTS_FILENAME)
  try:  # Never following a link, never blocking on a FIFO, bounded.
    raw = safe_io.read_small_file(path, manifest_lib.MAX_FILE_DIGESTS_BYTES, what="file digest list")
  except FileNotFoundError:
    return None
  recorded = _parse(raw, where=path)
  if safe_io.is_local(directory):
    root = os.fspath(directory)
    return _compare(
        recorded, lambda rel, size, digest: _file_problem(
            os.path.join(root, rel), size, digest),
        present=_files(root), where=lambda rel: os.path.join(root, rel), tracker=tracker,
        threads=hashing_threads.thread_count(),
    )
  store = stores.for_path(directory)
  listed = store.tree(directory)  # A list copied to a store with its files.
  return _compare(
      recorded, lambda rel, size, digest: _object_problem(
          store, directory, rel, listed.get(rel), size, digest),
      present=[rel for rel in sorted(listed) if rel != manifest_lib.FILE_DIGESTS_FILENAME],
      where=lambda rel: f"{directory / rel}", tracker=tracker, threads=1,
  )


def _compare(
    recorded: dict[str, tuple[int, str]],
    problem: Callable[[str, int, str], str | None],
    *, present: list[str], where: Callable[[str], str],
    tracker: progress_lib.Tracker | None, threads: int,
) -> tuple[int, list[str]]:
  """`check`'s comparison, on a disk or a store: each recorded file's
  ``problem(rel, size, digest)`` (local files hashed on ``threads`` threads;
  a store's objects one at a time), then the ``present`` files not recorded
  (Orbax's marker aside), each named by ``where(rel)``."""
  if tracker is not None:
    tracker.grow(sum(size for size, _ in recorded.values()))
  problems = []
  recorded = {rel: entry for rel, entry in recorded.items() if rel != _ORBAX_METADATA}
  entries = list(recorded.items())
  with hashing_threads.ordered_results(
      lambda entry: problem(entry[0], *entry[1]), entries, name="file checks", threads=threads
  ) as found_all:
    for (rel, (size, _)), found in zip(entries, found_all):
      if found:
        problems.append(f"{where(rel)}: {found}")
      if tracker is not None:
        tracker.advance(size)
  problems += [
      f"{where(rel)}: not recorded when the checkpoint was saved"
      for rel in present if rel not in recorded and rel not in _NOT_LISTED
  ]  # fmt: skip
  return len(recorded), problems


def _file_problem(full: str, size: int, digest: str) -> str | None:
  """What is wrong with one recorded file, or None if it is intact.

  Never opens anything but a regular file: a FIFO would block, a device
  never end, and a symlink could lead anywhere (pz_persist writes neither).
  """
  try:
    info = os.lstat(full)
  except OSError:
    return "missing"
  if not stat.S_ISREG(info.st_mode):
    return "missing" if stat.S_ISDIR(info.st_mode) else "not a regular file"
  if info.st_size != size:
    return f"{info.st_size} bytes, {size} when saved"
  try:
    changed = checksums.file_digest(full) != digest
  except OSError:  # Swapped for a link, FIFO or device since the lstat.
    return "not a regular file"
  if changed:
    return "contents changed since it was saved"
  return None


def _canonical(rel: object) -> bool:
  """Whether ``rel`` is how `_files` names a file: relative, with no empty,
  ``.`` or ``..`` parts, so no two names reach one file."""
  return isinstance(rel, str) and "\0" not in rel and all(
      part not in ("", ".", "..") for part in rel.split("/")
  )


def _parse(raw: bytes, *, where: str) -> dict[str, tuple[int, str]]:
  """Parses and validates a digest file; any flaw is a `ManifestError`."""
  if len(raw) > manifest_lib.MAX_FILE_DIGESTS_BYTES:
    raise errors.ManifestError(f"{where}: over the {manifest_lib.MAX_FILE_DIGESTS_BYTES}-byte limit.")
  most = bounded_json.node_limit(len(raw), most=MAX_NODES, bytes_per_node=8)
  data = bounded_json.loads(raw, where=where, max_nodes=most, max_depth=4)
  if (
      not isinstance(data, dict)
      or set(data) != {"format", "algorithm", "files"}
      or data["format"] != _FORMAT
      or data["algorithm"] != checksum_records.ALGORITHM
      or not isinstance(data["files"], dict)
  ):
    raise errors.ManifestError(f"{where}: not a pz_persist file digest list.")
  files = {}
  for rel, entry in data["files"].items():
    if (
        not _canonical(rel) or rel == manifest_lib.FILE_DIGESTS_FILENAME
        or not isinstance(entry, list) or len(entry) != 2
        or type(entry[0]) is not int or entry[0] < 0
        or not isinstance(entry[1], str)
    ):  # fmt: skip
      raise errors.ManifestError(f"{where}: invalid entry for {rel!r:.200}.")
    files[rel] = (entry[0], entry[1])
  return files


# ---- Object stores. ---------------------------------------------------------


def _hash_object(store: stores.Store, directory: epath.Path, rel: str, hasher: Any) -> Any:
  """Feeds the object ``rel`` of ``directory`` on ``store`` to ``hasher``, in chunks."""
  with store.open(directory / rel) as f:
    while chunk := f.read(2**22):
      hasher.update(chunk)
  return hasher


def _object_problem(
    store: stores.Store, directory: epath.Path, rel: str, info: stores.base.ObjectInfo | None,
    size: int, digest: str,
) -> str | None:
  """What is wrong with the object ``rel`` (listed as ``info``) against its
  recorded size and digest; None if nothing."""
  if info is None:
    return "missing"
  if info.size != size:
    return f"{info.size} bytes, {size} when saved"
  if _hash_object(store, directory, rel, xxhash.xxh3_128()).hexdigest() != digest:
    return "contents changed since it was saved"
  return None


def _crc32c_hasher() -> Callable[[], Any] | None:
  """CRC32C hashers if ``google-crc32c`` (which gcsfs installs) is there."""
  try:
    import google_crc32c  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return google_crc32c.Checksum


def check_against_store(
    directory: epath.Path, tracker: progress_lib.Tracker | None = None
) -> tuple[int, list[str], list[str]]:
  """Reads every object of the remote item ``directory`` back and compares it
  with the checksum the store recorded when it was written (MD5, else CRC32C).

  Returns:
    ``(objects checked, problems, unchecked)``: one problem line per object
    whose bytes differ from the store's checksum, and the objects the store
    keeps no usable checksum of (an S3 multipart upload's ETag is no MD5),
    each named.
  """
  store = stores.for_path(directory)
  listed = store.tree(directory)
  crc32c = _crc32c_hasher()
  if tracker is not None:
    tracker.grow(sum(info.size for info in listed.values()))
  checked, problems, unchecked = 0, [], []
  for rel, info in sorted(listed.items()):
    stored = info.checksums
    if "md5" in stored:
      name, hasher = "MD5", hashlib.md5(usedforsecurity=False)
    elif "crc32c" in stored and crc32c is not None:
      name, hasher = "CRC32C", crc32c()
    else:
      unchecked.append(f"{directory / rel}")
      continue
    expected = stored["md5" if name == "MD5" else "crc32c"]
    if _hash_object(store, directory, rel, hasher).digest() != expected:
      problems.append(
          f"{directory / rel}: its bytes do not match the store's {name} of it"
      )
    checked += 1
    if tracker is not None:
      tracker.advance(info.size)
  return checked, problems, unchecked
