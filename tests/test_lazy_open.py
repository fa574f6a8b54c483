"""`pz_persist.open`: a checkpoint opened lazily, read only where looked at.

What it promises: opening reads the manifest only, and renders at once;
each read returns exactly what `pz_persist.load` would (bit for bit) for
what it reads; a slice reads, and verifies, only the checksum tiles it
overlaps; bad labels, axes and indexes are refused by name; and a handle
whose checkpoint was replaced never returns a mix of the two.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import jax
import numpy as np
import pytest
import treescope
from penzai import pz

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import manifest as manifest_lib
from pz_persist.storage.integrity import checksums
from pz_persist.storage.reading import reader
from pz_persist.storage.reading import slices

ROWS, COLS = 4096, 1536  # 24 MiB of float32: two checksum tiles of 16 MiB.


def _tree() -> dict:
  embed = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
  return {
      "embed": pz.ParameterValue(
          value=pz.nx.wrap(embed, "vocabulary", "embedding"), label="embedder.embeddings"
      ),
      "blocks": [
          {
              "w": pz.ParameterValue(
                  value=pz.nx.wrap(np.full((8, 4), i, np.float32), "embedding", "neurons"),
                  label=f"block_{i}/mlp.w",
              ),
              "scale": pz.ParameterValue(value=jax.numpy.ones((3,)) * i, label=f"block_{i}.scale"),
          }
          for i in range(12)
      ],
      "view": pz.ParameterValue(
          value=pz.nx.wrap(np.arange(24.0).reshape(2, 3, 4)).tag_prefix("a"),
          label="positional",
      ),
      "step": np.int32(7),
  }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> pathlib.Path:
  path = tmp_path_factory.mktemp("lazy") / "ckpt"
  pzp.save(path, _tree())
  return path


def _same(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      type(x) is type(y) and np.asarray(x).dtype == np.asarray(y).dtype
      and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
  )


@pytest.fixture
def no_array_reads(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("an array was read")
  monkeypatch.setattr(reader, "read_arrays", refuse)
  monkeypatch.setattr(slices, "read_box", refuse)


def test_open_reads_no_array_and_renders(saved, no_array_reads):
  with pzp.open(saved) as ckpt:
    assert isinstance(ckpt, pzp.OpenedCheckpoint)
    assert _same(ckpt.tree, pzp.inspect(saved)) and ckpt.abstract is ckpt.tree
    assert len(ckpt) == 26 and "block_3/mlp.w" in ckpt and "nope" not in ckpt
    assert list(ckpt)[:2] == ["embedder.embeddings", "block_0/mlp.w"]
    assert ckpt.labels == tuple(ckpt)
    assert ckpt.nbytes_of("embedder") == ROWS * COLS * 4
    text = repr(ckpt)
    assert "26 variables" in text and "MiB" in text
    sizes = ckpt.sizes()
    assert list(sizes)[0] == "embedder.embeddings" and sizes["embedder.embeddings"] == "24.0 MiB"
    assert sizes["block_3"] == "128 B" and sizes["block_3.scale"] == "12 B"
    assert sizes["(no label)"] == "4 B"
    rendered = treescope.render_to_text(ckpt)
    assert "vocabulary" in rendered and "block_11/mlp.w" in rendered
    assert "'block_3': '128 B'" in rendered
    assert "float32" in rendered
    assert "<html" not in treescope.render_to_html(ckpt)[:0]  # Renders as HTML too.


def test_a_variable_is_what_load_returns(saved):
  loaded = pzp.load(saved)
  with pzp.open(saved) as ckpt:
    assert _same(ckpt["block_5/mlp.w"], loaded["blocks"][5]["w"].value)
    assert _same(ckpt["block_5.scale"], loaded["blocks"][5]["scale"].value)
    assert _same(ckpt["embedder.embeddings"], loaded["embed"].value)


def test_load_is_load_and_only_reads_the_selection(saved, monkeypatch):
  loaded = pzp.load(saved)
  ckpt = pzp.open(saved)
  assert _same(ckpt.load(), loaded)
  asked = []
  real = reader.read_arrays
  monkeypatch.setattr(reader, "read_arrays", lambda *a, **k: asked.append(k["refs"]) or real(*a, **k))
  part = ckpt.load(only="block_1")
  # The prefix ends at a label's part: block_10 and block_11 are not selected.
  assert ckpt.select("block_1") == ["block_1/mlp.w", "block_1.scale"]
  assert len(asked[-1]) == 2
  assert _same(part["blocks"][1], loaded["blocks"][1])
  assert isinstance(part["blocks"][10]["w"].value.data_array, jax.ShapeDtypeStruct)
  assert isinstance(part["embed"].value.data_array, jax.ShapeDtypeStruct)
  several = ckpt.load(only=["block_2/mlp.w", "positional"])
  assert _same(several["view"], loaded["view"])
  assert isinstance(several["blocks"][2]["scale"].value, jax.ShapeDtypeStruct)
  chosen = ckpt.load(only=lambda label: label.endswith(".scale"))
  assert _same([b["scale"] for b in chosen["blocks"]], [b["scale"] for b in loaded["blocks"]])


@pytest.mark.parametrize("index", [
    (), 0, -1, slice(10, 20), (slice(None, None, 7), 3), (Ellipsis, slice(5, 9)),
    {"vocabulary": slice(0, 100)}, {"embedding": 5}, {"vocabulary": slice(4000, 5000, 3)},
    slice(None, None, -1), (slice(3000, 1000, -7), slice(-3, None)),
    (slice(2000, 2100), slice(None, None, 2)), slice(9000, 10000),
])
def test_read_a_slice(saved, index):
  full = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
  if isinstance(index, dict):
    parts = [index.get("vocabulary", slice(None)), index.get("embedding", slice(None))]
    expected = full[tuple(parts)]
  else:
    expected = full[index]
  with pzp.open(saved) as ckpt:
    part = ckpt.read("embedder.embeddings", index)
  assert isinstance(part, pz.nx.NamedArray)
  assert np.array_equal(np.asarray(part.data_array), expected)
  assert part.data_array.dtype == np.float32


def test_read_keeps_names_kinds_and_views(saved):
  loaded = pzp.load(saved)
  with pzp.open(saved) as ckpt:
    rows = ckpt.read("embedder.embeddings", {"vocabulary": slice(0, 100)})
    assert rows.named_shape == {"vocabulary": 100, "embedding": COLS}
    assert ckpt.read("embedder.embeddings", {"vocabulary": 3}).named_shape == {"embedding": COLS}
    scale = ckpt.read("block_4.scale", slice(1, 3))
    assert isinstance(scale, jax.Array)
    assert np.array_equal(scale, loaded["blocks"][4]["scale"].value[1:3])
    stored = np.asarray(loaded["view"].value.data_array)
    unnamed = ckpt.read("positional", (1, slice(0, 2)))  # No name left: still a view.
    assert isinstance(unnamed, pz.nx.NamedArrayView) and unnamed.named_shape == {}
    assert isinstance(unnamed.data_array, jax.Array)
    view = ckpt.read("positional", (slice(0, 1), 1))
    assert view.named_shape == {"a": 1} and view.positional_shape == (4,)
    assert np.array_equal(np.asarray(view.data_array), stored[0:1, 1])


def test_large_arrays_are_checksummed_in_tiles_along_the_leading_axis(saved):
  manifest = manifest_lib.read(saved / "penzai")
  (embed,) = [spec for spec in manifest.arrays if spec.label == "embedder.embeddings"]
  rows = checksums.tile_rows(embed.shape, 4)
  assert rows == 2048  # A power of two, at most 16 MiB of 1536 float32 columns.
  assert [c.index for c in embed.checksums] == [
      ((0, rows), (0, COLS)), ((rows, ROWS), (0, COLS))
  ]
  assert slices.box_to_read(embed, ((0, 10), (0, 5)), verify=True) == ((0, rows), (0, COLS))
  assert slices.box_to_read(embed, ((3000, 3001), (0, 5)), verify=True) == ((rows, ROWS), (0, COLS))
  assert slices.box_to_read(embed, ((0, 10), (0, 5)), verify=False) == ((0, 10), (0, 5))
  small = [spec for spec in manifest.arrays if spec.label == "block_0/mlp.w"][0]
  assert len(small.checksums) == 1


def _flip_row(ckpt: pathlib.Path, row: int) -> None:
  """Damages the stored bytes of one row of the embedding, found by value."""
  needle = np.arange(row * COLS, (row + 1) * COLS, dtype=np.float32).tobytes()[:64]
  for root, _, files in os.walk(ckpt / "penzai"):
    for name in files:
      path = os.path.join(root, name)
      data = pathlib.Path(path).read_bytes()
      at = data.find(needle)
      if at >= 0:
        damaged = bytearray(data)
        damaged[at + 8] ^= 0xFF
        pathlib.Path(path).write_bytes(bytes(damaged))
        return
  raise AssertionError("row not found in the data files")


def test_a_damaged_tile_fails_only_the_reads_that_touch_it(saved, tmp_path):
  ckpt_path = tmp_path / "damaged"
  shutil.copytree(saved, ckpt_path)
  _flip_row(ckpt_path, 3000)  # In the second tile.
  with pzp.open(ckpt_path) as ckpt:
    good = ckpt.read("embedder.embeddings", slice(0, 100))
    assert np.asarray(good.data_array)[5, 0] == 5 * COLS
    with pytest.raises(errors.IntegrityError, match=r"embedder\.embeddings.*\[2048:4096, 0:1536\]"):
      ckpt.read("embedder.embeddings", slice(2999, 3002))
    with pytest.raises(errors.IntegrityError, match=r"embedder\.embeddings"):
      ckpt["embedder.embeddings"]
    unverified = ckpt.read("embedder.embeddings", slice(2999, 3002), verify=False)
    assert unverified.named_shape["vocabulary"] == 3


def test_one_digest_per_array_reads_the_whole_array_when_verified(tmp_path, monkeypatch):
  monkeypatch.setattr(checksums, "TILE_BYTES", 2**40)  # As saved before tiles.
  path = tmp_path / "old"
  pzp.save(path, _tree())
  monkeypatch.undo()
  boxes = []
  real = slices.read_box

  def spy(directory, spec, wanted, **kwargs):
    data, box = real(directory, spec, wanted, **kwargs)
    boxes.append(box)
    return data, box

  monkeypatch.setattr(slices, "read_box", spy)
  with pzp.open(path) as ckpt:
    a = ckpt.read("embedder.embeddings", slice(7, 9))
    b = ckpt.read("embedder.embeddings", slice(7, 9), verify=False)
  assert boxes == [((0, ROWS), (0, COLS)), ((7, 9), (0, COLS))]
  assert np.array_equal(np.asarray(a.data_array), np.asarray(b.data_array))


@pytest.mark.parametrize("label, index, match", [
    ("embedder.embeddings", {"vocab": slice(0, 3)}, r"embedder\.embeddings.*no axis 'vocab'.*'vocabulary'"),
    ("embedder.embeddings", 5000, r"embedder\.embeddings.*index 5000 is out of range for axis 'vocabulary'"),
    ("embedder.embeddings", -5000, r"out of range for axis 'vocabulary'"),
    ("embedder.embeddings", (0, 0, 0), r"3 indexes given for an array of 2"),
    ("embedder.embeddings", slice(None, None, 0), r"axis 'vocabulary'.*step 0"),
    ("embedder.embeddings", slice(0.5, 3), r"axis 'vocabulary'.*must be ints"),
    ("embedder.embeddings", [1, 2], r"axis 'vocabulary'.*\[1, 2\].*int or a slice"),
    ("embedder.embeddings", (Ellipsis, Ellipsis), r"one \.\.\."),
    ("embedder.embeddings", None, r"None"),
])
def test_bad_indexes_are_refused_by_label_and_axis(saved, label, index, match):
  with pzp.open(saved) as ckpt:
    with pytest.raises(errors.ArgumentError, match=match):
      ckpt.read(label, index)


def test_unknown_labels_list_close_matches(saved):
  with pzp.open(saved) as ckpt:
    with pytest.raises(errors.UnknownLabelError, match=r"'block_3/mlp\.W'.*Close matches: 'block_3/mlp\.w'"):
      ckpt["block_3/mlp.W"]
    with pytest.raises(KeyError):
      ckpt.read("embedder.embedding", 0)
    with pytest.raises(errors.UnknownLabelError, match="block_99"):
      ckpt.load(only="block_99")


def test_closed_handles_refuse_reads(saved):
  with pzp.open(saved) as ckpt:
    pass
  with pytest.raises(errors.ArgumentError, match="closed"):
    ckpt["block_0/mlp.w"]


@pytest.mark.parametrize("read", [
    lambda ckpt: ckpt["block_0/mlp.w"],
    lambda ckpt: ckpt.read("embedder.embeddings", slice(0, 3)),
    lambda ckpt: ckpt.load(),
    lambda ckpt: ckpt.load(only="block_2"),
])
@pytest.mark.parametrize("how", ["saved again", "deleted and saved again"])
def test_a_replaced_checkpoint_is_never_mixed(tmp_path, read, how):
  path = tmp_path / "ckpt"
  pzp.save(path, _tree())
  ckpt = pzp.open(path)
  ckpt["block_1/mlp.w"]  # Reads before the replacement.
  replacement = _tree()
  replacement["blocks"][0]["w"] = pz.ParameterValue(
      value=pz.nx.wrap(np.full((8, 4), -1.0, np.float32), "embedding", "neurons"),
      label="block_0/mlp.w",
  )
  if how == "deleted and saved again":
    shutil.rmtree(path)
    pzp.save(path, replacement)
  else:
    pzp.save(path, replacement, overwrite=True)
  with pytest.raises(errors.CheckpointReplacedError, match=r"replaced since it was opened.*open it again"):
    read(ckpt)
  assert float(np.asarray(pzp.open(path)["block_0/mlp.w"].data_array)[0, 0]) == -1.0


def test_a_deleted_manager_step_is_reported_as_replaced(tmp_path):
  with pzp.CheckpointManager(tmp_path / "run", max_to_keep=1) as manager:
    manager.save(1, params=_tree())
    manager.wait_until_finished()
    ckpt = pzp.open(tmp_path / "run" / "1")
    ckpt["block_0/mlp.w"]
    manager.save(2, params=_tree())  # Retention deletes step 1.
    manager.wait_until_finished()
  assert not (tmp_path / "run" / "1").exists()
  with pytest.raises(errors.CheckpointReplacedError, match="open it again"):
    ckpt["block_0/mlp.w"]


@pytest.mark.filterwarnings("ignore:Sharding info not provided")  # Orbax's, with no template.
def test_tiles_are_chunked_to_match_and_plain_orbax_restores_them(saved):
  """The direct write chunks a tiled array so no chunk crosses a tile (a slice
  reads the chunks of its tiles only), in files plain Orbax still restores."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from etils import epath  # pylint: disable=import-outside-toplevel

  from pz_persist.storage.reading import direct_read  # pylint: disable=import-outside-toplevel

  manifest = manifest_lib.read(saved / "penzai")
  (embed,) = [spec for spec in manifest.arrays if spec.label == "embedder.embeddings"]
  chunk = direct_read.open_array(epath.Path(saved / "penzai"), embed.key).chunk_layout.read_chunk.shape
  assert checksums.tile_rows(embed.shape, 4) % chunk[0] == 0
  assert chunk[0] * chunk[1] * 4 <= 4 * 2**20  # Orbax's chunk size, within a tile.
  with ocp.PyTreeCheckpointer() as checkpointer:
    restored = checkpointer.restore(saved / "penzai")
  assert np.array_equal(
      restored[embed.key], np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
  )


def test_load_reports_progress_of_what_it_reads(saved):
  seen = []
  with pzp.open(saved) as ckpt:
    ckpt.load(only="embedder", progress=lambda done, total: seen.append((done, total)))
  assert seen and seen[-1] == (ROWS * COLS * 4, ROWS * COLS * 4)
