"""`verify`: check a whole checkpoint against what was recorded when it was saved.

Two independent checks, because they answer different questions:

* every file against its digest (`pz_persist.storage.integrity.file_digests`): *was anything
  changed at all?* Any flipped byte in any file is caught, and the file named;
* every array, read back, against its checksums (`pz_persist.storage.integrity.checksums`):
  *which labels are damaged?* Each damaged array is named by label and path.

On an object store, where saves record no file digests, each object is
instead read back against the checksum the store itself recorded when it was
written (`file_digests.check_against_store`); the report says which file
check ran, and names the objects no check covered.

Arrays are read a batch at a time onto the host, so verifying needs memory for
one batch, not for the model. A checkpoint written before checksums existed
still verifies its files where it can and lists its arrays as unverified.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from etils import epath

from pz_persist import errors
from pz_persist import progress as progress_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.safety import terminal
from pz_persist.storage import stores
from pz_persist.storage.integrity import containment
from pz_persist.storage.integrity import file_digests
from pz_persist.storage.reading import batching
from pz_persist.storage.reading import opening
from pz_persist.storage.reading import reader

JSON_SCHEMA = "pz-persist.verify/1"
"""The ``schema`` of ``pz-persist verify --json`` (docs/reference/cli-json.md)."""


def unchecked_record(path: str, problem: str) -> dict[str, Any]:
  """The ``pz-persist verify --json`` entry of a checkpoint that could not be
  checked: verify itself failed with ``problem`` (not damage)."""
  return {
      "path": path, "ok": False, "checked": False, "error": problem,
      "arrays_checked": 0, "files_checked": None, "objects_checked": None,
      "damaged": [], "unverified": [], "objects_unchecked": [],
  }


@dataclasses.dataclass(frozen=True)
class VerifyReport:
  """What `verify` found.

  Attributes:
    path: The checkpoint item directory that was checked.
    arrays_checked: Arrays read back and compared with their checksums.
    files_checked: Files compared with their digests (None: the checkpoint
      has no digest list, e.g. written by pz_persist before version 2).
    damaged: One line per damaged file or array, naming it.
    unverified: Arrays with no recorded checksums (older checkpoints).
    objects_checked: On an object store with no digest list: objects read
      back and compared with the store's own checksums of them (None: that
      check did not run).
    objects_unchecked: Objects the store keeps no usable checksum of.
  """

  path: str
  arrays_checked: int
  files_checked: int | None
  damaged: tuple[str, ...]
  unverified: tuple[str, ...]
  objects_checked: int | None = None
  objects_unchecked: tuple[str, ...] = ()

  @property
  def ok(self) -> bool:
    """True if nothing is damaged (unverified arrays do not count)."""
    return not self.damaged

  def record(self) -> dict[str, Any]:
    """This report as JSON-ready data (``pz-persist verify --json``)."""
    return {
        "path": self.path,
        "ok": self.ok,
        "checked": True,
        "error": None,
        "arrays_checked": self.arrays_checked,
        "files_checked": self.files_checked,
        "objects_checked": self.objects_checked,
        "damaged": list(self.damaged),
        "unverified": list(self.unverified),
        "objects_unchecked": list(self.objects_unchecked),
    }

  def raise_if_damaged(self) -> None:
    """Raises `pz_persist.errors.IntegrityError` naming what is damaged."""
    if self.damaged:
      raise errors.IntegrityError(str(self), damaged=self.damaged)

  def __str__(self) -> str:
    if self.files_checked is not None:
      head = f"{self.path}: {self.arrays_checked} arrays, {self.files_checked} files checked"
    elif self.objects_checked is not None:
      head = (
          f"{self.path}: {self.arrays_checked} arrays checked, {self.objects_checked}"
          " objects against the store's checksums (no file digests on object stores)"
      )
    else:
      head = f"{self.path}: {self.arrays_checked} arrays, no file digests recorded checked"
    lines = [head + (": OK" if self.ok else f": {len(self.damaged)} DAMAGED")]
    # One line per damage, whatever names it holds (file names on disk,
    # paths from the manifest): none can forge a line of its own.
    lines += [f"  damaged: {_one_line(line)}" for line in self.damaged]
    if self.unverified:
      lines.append(
          f"  {len(self.unverified)} array(s) have no checksums (saved before"
          f" pz_persist recorded them): {_first_few(self.unverified)}"
      )
    if self.objects_unchecked:
      lines.append(
          f"  {len(self.objects_unchecked)} object(s) have no store checksum to"
          f" compare with (e.g. S3 multipart uploads): {_first_few(self.objects_unchecked)}"
      )
    return "\n".join(lines)



def _first_few(names: tuple[str, ...]) -> str:
  """The first five ``names``, each on one line of its own, then "..."."""
  return ", ".join(_one_line(name) for name in names[:5]) + (" ..." if len(names) > 5 else "")

def _one_line(text: str) -> str:
  return terminal.printable(text, newlines=False)


def verify(
    path: opening.PathOrHandle,
    *,
    read_batch_bytes: int = reader.DEFAULT_READ_BATCH_BYTES,
    progress: progress_lib.Progress = None,
) -> VerifyReport:
  """Checks every file and every array of a checkpoint; names what is damaged.

  Reads the whole checkpoint once (a batch of arrays at a time, onto the
  host), and imports nothing the checkpoint names. Damage is reported, not
  raised; call ``report.raise_if_damaged()`` to turn it into an error.

  Example::

    report = pzp.verify("/tmp/mlp_params")
    print(report)          # .../penzai: 4 arrays, 9 files checked: OK
    assert report.ok

  Args:
    path: A checkpoint directory, the item directory inside one, or a
      `pz_persist.open` handle (the checkpoint it opened is read).
    read_batch_bytes: About how many bytes of arrays to hold at once.
    progress: None (default): a bar on stderr if it is a terminal or in a
      notebook; True: always; False: never; or a function called as
      ``progress(done, total)`` with bytes of files hashed and arrays read
      (`pz_persist.progress`).

  Raises:
    NotACheckpointError: ``path`` holds no pz_persist checkpoint.
  """
  def checked(
      item: epath.Path,
      manifest: manifest_lib.Manifest | errors.ManifestError,
      snapshot: containment.Snapshot | None = None,
  ) -> VerifyReport:
    with progress_lib.tracking(progress, f"verifying {item}") as tracker:
      return _verify(item, manifest, snapshot, read_batch_bytes, tracker)

  # Opened as every read is (`opening`); a damaged manifest is reported.
  return opening.read(
      path, lambda opened: checked(opened.item, opened.manifest, opened.snapshot),
      damaged_manifest=checked,
  )


def _verify(
    item: epath.Path,
    manifest: manifest_lib.Manifest | errors.ManifestError,
    snapshot: containment.Snapshot | None,
    read_batch_bytes: int,
    tracker: progress_lib.Tracker,
) -> VerifyReport:
  """`verify` of an item directory, telling ``tracker`` each file's and each
  batch's bytes as they are checked. ``manifest`` is the error that made it
  unreadable, if it was."""
  damaged: list[str] = []
  try:
    files = file_digests.check(item, tracker)
  except errors.ManifestError as e:  # A forged or damaged digest list.
    damaged.append(str(e))
    files = (0, [])
  files_checked = files[0] if files is not None else None
  if files is not None:
    damaged += files[1]
  objects: tuple[int | None, list[str]] = (None, [])
  if files is None and stores.for_path(item).keeps_checksums:
    count, problems, unchecked = file_digests.check_against_store(item, tracker)
    objects = (count, unchecked)
    damaged += problems
  if isinstance(manifest, errors.ManifestError):
    damaged.append(str(manifest))
    return VerifyReport(str(item), 0, files_checked, tuple(damaged), (),
                        objects[0], tuple(objects[1]))
  unverified = tuple(
      spec.name for spec in manifest.arrays
      if spec.is_stored and spec.checksums is None
  )  # fmt: skip
  checked = 0
  checksummed = [
      index for index, spec in enumerate(manifest.arrays)
      if spec.is_stored and spec.checksums is not None
  ]  # fmt: skip
  nbytes = [spec.nbytes for spec in manifest.arrays]
  tracker.grow(sum(nbytes[index] for index in checksummed))
  options = reader.ReadOptions(read_batch_bytes=read_batch_bytes)
  for batch in batching.batches(checksummed, nbytes.__getitem__, read_batch_bytes):
    damaged += _check_batch(options, item, manifest, batch, snapshot)
    checked += len(batch)
    tracker.advance(sum(nbytes[index] for index in batch))
  return VerifyReport(
      str(item), checked, files_checked, tuple(damaged), unverified,
      objects[0], tuple(objects[1]),
  )


def _check_batch(
    options: reader.ReadOptions,
    item: epath.Path,
    manifest: manifest_lib.Manifest,
    batch: list[int],
    snapshot: containment.Snapshot | None,
) -> list[str]:
  """Damage lines for one batch; a batch that fails to read is split up."""
  try:
    reader.read_arrays(
        item, manifest, refs=set(batch), verify=True, to_host=True, options=options,
        snapshot=snapshot,
    )
    return []
  except errors.PzPersistError as e:
    unreadable = e.__cause__ is not None or not isinstance(e, errors.IntegrityError)
    if unreadable and len(batch) > 1:  # Find which arrays cannot be read.
      return [line for index in batch
              for line in _check_batch(options, item, manifest, [index], snapshot)]  # fmt: skip
    if isinstance(e, errors.IntegrityError) and not unreadable:
      return list(e.damaged)  # Checksum mismatches, each named.
    spec = manifest.arrays[batch[0]]
    return [f"{spec.describe()} (key {spec.key}): cannot be read: {_first_line(e.__cause__ or e)}"]


def _first_line(error: BaseException) -> str:
  lines = str(error).strip().splitlines()
  return (lines[0] if lines else type(error).__name__)[:300]

