"""The lists of digests ``verify`` trusts cannot make it work more, or less.

* The file digest list names each file once, canonically, and exactly the
  files on disk: ``./x``, ``././x`` and ``.//x`` are not three files (which
  would have ``verify`` hash one large file a million times), and a file
  added to the checkpoint is reported.
* A manifest of a format that records checksums must have them for every
  stored array, over slices that cut it into a grid: deleting them, or all
  but one slice, or repeating a slice (more hashing again) is refused, so
  modified arrays cannot load verified or verify OK once the checksums are
  gone (a downgrade).
"""

from __future__ import annotations

import json
import os

import model_zoo
import manifest_json
import pytest

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import checksum_records
from pz_persist.storage.integrity import checksums

LARGEST = "manifest.ocdbt"  # Any recorded file will do.


@pytest.fixture
def ckpt(ckpt):
  """A saved checkpoint (of the MLP of `model_zoo`)."""
  pzp.save_model(ckpt, model_zoo.mlp())
  return ckpt


def _digests_path(ckpt) -> str:
  return os.path.join(ckpt, "penzai", "pz_persist.files.json")


def _edit_digests(ckpt, fn) -> None:
  path = _digests_path(ckpt)
  with open(path) as f:
    data = json.load(f)
  fn(data["files"])
  with open(path, "w") as f:
    json.dump(data, f)


@pytest.mark.parametrize("alias", ["./{}", "././{}", ".//{}", "{}/", "{}/.", "x/../{}", ".",
                                   "/{}", "penzai/../../{}"])
def test_non_canonical_paths_are_refused(ckpt, alias):
  # Each alias names a real file, with its true size and digest.
  _edit_digests(ckpt, lambda files: files.update({alias.format(LARGEST): files[LARGEST]}))
  report = pzp.verify(ckpt)
  assert not report.ok
  assert any(
      "pz_persist.files.json: invalid entry for" in line for line in report.damaged
  ), report


def test_each_file_is_hashed_once(ckpt, monkeypatch):
  aliases = {"./" * n + LARGEST for n in range(1, 1000)}
  _edit_digests(ckpt, lambda files: files.update(dict.fromkeys(aliases, files[LARGEST])))
  hashed = []
  real = checksums.file_digest
  monkeypatch.setattr(checksums, "file_digest", lambda path, **kw: (
      hashed.append(path), real(path, **kw))[1])
  report = pzp.verify(ckpt)
  assert not report.ok
  assert len(hashed) == len(set(hashed)), "a file was hashed twice"


def test_duplicate_keys_in_the_digest_list_are_refused(ckpt):
  path = _digests_path(ckpt)
  with open(path, "rb") as f:
    data = f.read()
  entry = json.dumps({LARGEST: json.loads(data)["files"][LARGEST]})[1:-1].encode()
  with open(path, "wb") as f:
    f.write(data.replace(b'"files":{', b'"files":{' + entry + b",", 1))
  report = pzp.verify(ckpt)
  assert any("duplicate object key" in line for line in report.damaged), report


def test_a_file_added_to_the_checkpoint_is_reported(ckpt):
  added = os.path.join(ckpt, "penzai", "d", "extra")
  with open(added, "wb") as f:
    f.write(b"not saved by pz_persist")
  report = pzp.verify(ckpt)
  assert report.damaged == (f"{added}: not recorded when the checkpoint was saved",)


def test_a_recorded_file_replaced_by_a_symlink_is_reported(ckpt):
  # (A symlink leading out of the checkpoint is refused before anything.)
  victim = os.path.join(ckpt, "penzai", LARGEST)
  copy = os.path.join(ckpt, "penzai", "copy")
  os.rename(victim, copy)
  os.symlink(copy, victim)
  report = pzp.verify(ckpt)
  assert f"{victim}: not a regular file" in report.damaged, report


def _manifest(ckpt) -> str:
  return os.path.join(ckpt, "penzai", "pz_persist.json")


def _edit_manifest(ckpt, fn, *, drop_file_digests: bool = True) -> None:
  """Edits the manifest; by default also deletes the file digest list, as
  whoever edits the manifest (whose digest it records) would."""
  with open(_manifest(ckpt)) as f:
    data = manifest_json.expanded(f.read().encode())
  fn(data)
  with open(_manifest(ckpt), "w") as f:
    json.dump(data, f)
  if drop_file_digests:
    os.remove(_digests_path(ckpt))


def _drop_checksums(manifest: dict) -> None:
  for entry in manifest["arrays"]:
    entry.pop("checksums", None)


def _empty_checksums(manifest: dict) -> None:
  for entry in manifest["arrays"]:
    entry["checksums"] = entry["checksums"][:0]


def _repeat_slices(manifest: dict) -> None:
  for entry in manifest["arrays"]:
    entry["checksums"] = entry["checksums"] * 1000


def _half_slice(manifest: dict) -> None:
  entry = manifest["arrays"][0]
  index = entry["checksums"][0]["index"]
  index[0][1] //= 2  # Rows [0, 4) of [0, 8): the rest goes unchecked.


@pytest.mark.parametrize("forge", [_drop_checksums, _empty_checksums, _repeat_slices,
                                   _half_slice])
def test_checksums_cannot_be_removed_from_a_format_2_manifest(ckpt, forge):
  _edit_manifest(ckpt, forge)
  for load in (pzp.load, pzp.load_model):
    with pytest.raises(errors.ManifestError, match=r"penzai/pz_persist\.json: arrays\[0\]"):
      load(ckpt, verify=True)
  report = pzp.verify(ckpt)
  assert not report.ok
  assert "pz_persist.json: arrays[0]" in report.damaged[0], report


def test_format_1_manifests_without_checksums_still_load(ckpt):
  # What a checkpoint saved before checksums existed looks like.
  _edit_manifest(ckpt, lambda m: (_drop_checksums(m), m.update(format_version=1)))
  pzp.load(ckpt, verify=True)
  report = pzp.verify(ckpt)
  assert report.ok and len(report.unverified) == 4, report


@pytest.mark.parametrize("shape, indices, tiled", [
    ((8, 16), [((0, 8), (0, 16))], True),
    ((8, 16), [((0, 4), (0, 16)), ((4, 8), (0, 16))], True),
    ((8, 16), [((0, 4), (0, 8)), ((4, 8), (0, 8)), ((0, 4), (8, 16)), ((4, 8), (8, 16))],
     True),
    ((), [()], True),
    ((8, 16), [], False),
    ((8, 16), [((0, 4), (0, 16))], False),
    ((8, 16), [((0, 8), (0, 16))] * 2, False),
    ((8, 16), [((0, 4), (0, 16)), ((2, 8), (0, 16))], False),
    ((8, 16), [((0, 4), (0, 8)), ((4, 8), (8, 16))], False),  # Half the grid.
    ((8,), [((0, 4),), ((4, 4),), ((4, 8),)], False),  # An empty slice.
    ((), [(), ()], False),
])
def test_tiles(shape, indices, tiled):
  assert checksum_records.tiles(indices, shape) == tiled


def test_file_digest_reads_only_the_regular_file_it_opened(tmp_path):
  """A file swapped after verify's lstat (for a FIFO, a link out) is refused
  by the open itself: never blocks on the FIFO, never hashes the target."""
  from pz_persist.storage.integrity import checksums

  fifo = tmp_path / "fifo"
  os.mkfifo(fifo)
  link = tmp_path / "link"
  link.symlink_to("/etc/passwd")
  for path in (fifo, link):
    with pytest.raises(OSError):
      checksums.file_digest(str(path))
  regular = tmp_path / "regular"
  regular.write_bytes(b"x" * 10)
  assert len(checksums.file_digest(str(regular))) == 32
