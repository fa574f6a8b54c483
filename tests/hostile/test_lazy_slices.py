"""Hostile checkpoints read lazily, slice by slice (`pz_persist.open`).

A slice read trusts the checksum records to say which cells it must read and
hash; forged records must neither let damaged bytes through nor make a read
return something false. (Every case of the catalogue also runs through
``pzp.open``: `test_catalogue.py`.)
"""

from __future__ import annotations

import pathlib
import re

import manifest_json
import numpy as np
import pytest
from penzai import pz

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import manifest as manifest_lib

ROWS, COLS = 4096, 1536  # Two checksum tiles: rows [0, 2048) and [2048, 4096).
LABEL = "embedder.embeddings"


@pytest.fixture
def ckpt(tmp_path) -> pathlib.Path:
  path = tmp_path / "ckpt"
  table = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
  pzp.save(path, {
      "embed": pz.ParameterValue(value=pz.nx.wrap(table, "vocabulary", "embedding"), label=LABEL),
      "small": pz.ParameterValue(value=pz.nx.wrap(np.ones((3, 2), np.float32), "x", "y"),
                                 label="small"),
  })
  return path


def _edit_checksums(ckpt: pathlib.Path, fn) -> None:
  path = ckpt / "penzai" / manifest_lib.MANIFEST_FILENAME
  data = manifest_json.read(path)  # Written back as format 2, whose checks this exercises.
  (entry,) = [a for a in data["arrays"] if a.get("label") == LABEL]
  entry["checksums"] = fn(entry["checksums"])
  manifest_json.write(path, data)


@pytest.mark.parametrize("forge", [
    pytest.param(lambda sums: sums[:1], id="a_tile_missing"),
    pytest.param(lambda sums: sums + sums[1:], id="a_tile_repeated"),
    pytest.param(lambda sums: [{**sums[0], "index": [[0, 3000], [0, COLS]]}, sums[1]],
                 id="tiles_overlapping"),
    pytest.param(lambda sums: [{**sums[0], "index": [[0, 2000], [0, COLS]]}, sums[1]],
                 id="tiles_with_a_gap"),
    pytest.param(lambda sums: [{**sums[0], "index": [[0, 2048], [0, 1000]]}, sums[1]],
                 id="a_tile_narrower_than_the_array"),
])
def test_tile_records_that_do_not_tile_the_array_are_refused(ckpt, forge):
  _edit_checksums(ckpt, forge)
  with pytest.raises(errors.ManifestError, match=r"checksums.*grid covering each element once"):
    pzp.open(ckpt)


def test_a_lying_tile_digest_fails_only_the_reads_that_touch_it(ckpt):
  def lie(sums):
    sums[1]["xxh3_128"] = "0" * 32
    return sums

  _edit_checksums(ckpt, lie)
  with pzp.open(ckpt) as opened:
    first = opened.read(LABEL, {"vocabulary": slice(100, 104)})
    assert np.array_equal(
        np.asarray(first.data_array),
        np.arange(100 * COLS, 104 * COLS, dtype=np.float32).reshape(4, COLS),
    )
    for index in [slice(2047, 2049), 4000, {"embedding": 0}, ()]:
      with pytest.raises(errors.IntegrityError, match=rf"{LABEL}.*\[2048:4096, 0:1536\] differ"):
        opened.read(LABEL, index)
    with pytest.raises(errors.IntegrityError, match=LABEL):
      opened[LABEL]
    with pytest.raises(errors.IntegrityError, match=LABEL):
      opened.load()
    opened["small"]  # Another variable: nothing false is said of it.
    assert opened.read(LABEL, 4000, verify=False).named_shape == {"embedding": COLS}


def test_a_grid_on_other_axes_is_verified_cell_by_cell(ckpt):
  """A grid cutting the columns too (as a sharded save records) is read as
  the box of the cells a slice overlaps, and every cell in it is checked."""
  path = ckpt / "penzai" / manifest_lib.MANIFEST_FILENAME
  table = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
  from pz_persist.storage.integrity import checksums  # pylint: disable=import-outside-toplevel

  cells = [((r0, r1), (c0, c1)) for r0, r1 in ((0, 1000), (1000, ROWS))
           for c0, c1 in ((0, 500), (500, COLS))]
  _edit_checksums(ckpt, lambda sums: [
      {"index": [list(a), list(b)], "xxh3_128": checksums.digest_of(table[a[0]:a[1], b[0]:b[1]])}
      for a, b in cells
  ])
  del path
  with pzp.open(ckpt) as opened:
    part = opened.read(LABEL, (slice(990, 1010), slice(490, 510)))
  assert np.array_equal(np.asarray(part.data_array), table[990:1010, 490:510])


def test_a_slice_is_bounded_by_its_own_box_not_the_whole_array(ckpt):
  with pzp.open(ckpt) as opened, pzp.limits(max_allocation_bytes=8 * 2**20):
    with pytest.raises(errors.UnsafeCheckpointError, match=LABEL):
      opened[LABEL]  # 24 MiB.
    with pytest.raises(errors.UnsafeCheckpointError, match=LABEL):
      opened.read(LABEL, 0)  # A verified row reads its 12 MiB tile.
    row = opened.read(LABEL, 0, verify=False)  # 6 KiB.
  assert row.named_shape == {"embedding": COLS}


@pytest.mark.parametrize("index, error, match", [
    (ROWS, errors.ArgumentError, r"index 4096 is out of range for axis 'vocabulary'"),
    ((0, -COLS - 1), errors.ArgumentError, r"out of range for axis 'embedding'"),
    (slice(10, 0, 0), errors.ArgumentError, r"step 0"),
    ({"vocab": 0}, errors.ArgumentError, r"no axis 'vocab'.*Did you mean 'vocabulary'"),
    ({"rows": 0}, errors.ArgumentError, r"no axis 'rows'.*'vocabulary', 'embedding'"),
    ((np.array([1, 2]),), errors.ArgumentError, r"use an int or a slice"),
])
def test_bad_indexes_name_the_label_and_axis(ckpt, index, error, match):
  with pzp.open(ckpt) as opened, pytest.raises(error, match=rf"{LABEL}.*{match}"):
    opened.read(LABEL, index)


def test_a_missing_label_lists_close_matches(ckpt):
  with pzp.open(ckpt) as opened:
    with pytest.raises(errors.UnknownLabelError, match=r"'embedder\.embedings'.*Close matches: 'embedder\.embeddings'"):
      opened.read("embedder.embedings", 0)
    with pytest.raises(errors.UnknownLabelError, match=r"no variable labelled 'zzz'"):
      opened["zzz"]


def test_a_damaged_tile_is_named_by_every_reader(ckpt, capsys):
  """Bytes changed in one tile: the library's load, verify, the CLI's verify and
  a lazy read all name the label and the tile; a lazy read elsewhere is exact."""
  from pz_persist.tools import cli  # pylint: disable=import-outside-toplevel

  needle = np.arange(3000 * COLS, 3001 * COLS, dtype=np.float32).tobytes()[:64]
  for path in sorted((ckpt / "penzai").rglob("*")):
    data = path.read_bytes() if path.is_file() else b""
    if needle in data:
      at = data.index(needle) + 8
      path.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])
      break
  else:
    raise AssertionError("row 3000 not found in the data files")
  tile = rf"{LABEL}.*\[2048:4096, 0:1536\]"
  with pytest.raises(errors.IntegrityError, match=tile):
    pzp.load(ckpt)
  report = pzp.verify(ckpt)
  assert any(re.search(tile, line) for line in report.damaged), report.damaged
  assert cli.main(["verify", str(ckpt)]) != 0
  assert re.search(tile, capsys.readouterr().out)
  with pzp.open(ckpt) as opened:
    with pytest.raises(errors.IntegrityError, match=tile):
      opened.read(LABEL, 3000)
    assert np.array_equal(np.asarray(opened.read(LABEL, 2047).data_array),
                          np.arange(2047 * COLS, 2048 * COLS, dtype=np.float32))
