"""What a user keeps of a load costs about its own bytes.

Small arrays were read into 16 MiB buffers shared by the arrays of a load,
freed only once every array in them died: keeping one 16 KiB array from each
of 40 loads held 640 MiB. Measured here by buffer-base accounting: the bytes
of the buffers (the NumPy base at the end of each kept array's ``.base``
chain) that the kept arrays hold alive, against the arrays' own bytes.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from penzai import pz

import pz_persist as pzp
from pz_persist.storage.writing import direct_write

LOADS = 40
SMALL = 1100  # 16 KiB each: 17 MiB of small arrays per load, over one old buffer.


def _buffer(array: np.ndarray) -> np.ndarray:
  """The array whose memory ``array`` views (what keeps it alive)."""
  while isinstance(array.base, np.ndarray):
    array = array.base
  return array


def _held(kept: list[np.ndarray]) -> int:
  buffers = {id(b): b for b in map(_buffer, kept)}
  return sum(b.nbytes for b in buffers.values())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  path = tmp_path_factory.mktemp("held") / "ckpt"
  tree = {f"small_{i}": np.full(4096, i, np.float32) for i in range(SMALL)}
  large = np.ones(direct_write.SMALL_ARRAY_BYTES // 2 + 4096, np.float32)  # 2 MiB.
  tree["large"] = pz.ParameterValue(value=large, label="large")
  pzp.save(path, tree)
  return path


@pytest.mark.parametrize("name", ["small_5", "large"])
def test_an_array_kept_from_each_load_holds_its_own_bytes(ckpt, name):
  kept = []
  for _ in range(LOADS):
    loaded = pzp.load(ckpt)
    kept.append(loaded[name].value if name == "large" else loaded[name])
    del loaded
  gc.collect()
  own = sum(x.nbytes for x in kept)
  # Own bytes, plus alignment (64 bytes) or a page's rounding per array.
  assert _held(kept) <= own + LOADS * 4096, (_held(kept), own)
  assert all(np.array_equal(x, kept[0]) for x in kept)


def test_a_lazy_slice_holds_its_own_bytes_not_the_tile_read(ckpt):
  with pzp.open(ckpt) as opened:
    rows = [opened.read("large", slice(i, i + 4)) for i in range(LOADS)]  # 16 bytes each.
  assert _held(rows) <= sum(r.nbytes for r in rows) + LOADS * 64
