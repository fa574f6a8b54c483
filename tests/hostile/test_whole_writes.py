"""Every file pz_persist writes whole appears whole or not at all.

One writer (`safe_io.writing_whole`) serves manifests, file digests, variable
records and safetensors exports: a failure in the middle leaves the previous
file as it was and no temporary file behind.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from pz_persist.pretrained import safetensors_io
from pz_persist.safety import safe_io


class _Failure(Exception):
  pass


def test_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path):
  path = tmp_path / "record.json"
  safe_io.write_small_file(path, b"old")
  with pytest.raises(_Failure):
    with safe_io.writing_whole(path) as f:
      f.write(b"half of the new")
      raise _Failure()
  assert path.read_bytes() == b"old"
  assert os.listdir(tmp_path) == ["record.json"]


class _BrokenArray:
  """Has a shape and dtype (the header is written) but fails to be read."""

  shape = (2,)
  dtype = np.dtype(np.float32)

  def __array__(self, dtype=None, copy=None):
    raise _Failure()


def test_failed_safetensors_export_keeps_the_old_file(tmp_path):
  path = tmp_path / "model.safetensors"
  safetensors_io.write_safetensors(path, {"w": np.ones(2, np.float32)})
  before = path.read_bytes()
  with pytest.raises(_Failure):
    safetensors_io.write_safetensors(
        path, [("a", np.zeros(3, np.float32)), ("b", _BrokenArray())]
    )
  assert path.read_bytes() == before
  assert os.listdir(tmp_path) == ["model.safetensors"]
