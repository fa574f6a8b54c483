"""Indexes `read` cannot take, and shapes no array can have: the library's
own error, naming the label and the axis, never a bare TypeError or
ValueError from Python, NumPy or JAX, and never a silent choice between two
indexes of one dimension."""

from __future__ import annotations

import json

import jax.numpy as jnp
import manifest_json
import numpy as np
import pytest
from penzai import pz

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import manifest as manifest_lib


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  path = tmp_path_factory.mktemp("indexes") / "ckpt"
  view = pz.nx.NamedArrayView(
      data_shape=(2, 3, 4), data_axis_for_logical_axis=(2, 0), data_axis_for_name={"b": 1},
      data_array=np.arange(24, dtype=np.float32).reshape(2, 3, 4))
  pzp.save(path, {
      "plain": pz.ParameterValue(value=np.arange(12, dtype=np.int8).reshape(3, 4), label="plain"),
      "named": pz.ParameterValue(value=pz.nx.wrap(np.ones((5, 6), np.float32), "rows", "cols"),
                                 label="named"),
      "view": pz.ParameterValue(value=view, label="view"),
      "scalar": pz.ParameterValue(value=np.float32(1), label="scalar"),
      "python": pz.ParameterValue(value=0.5, label="python"),
  })
  return path


BAD = [
    # Slice bounds and steps that are not ints.
    ("plain", slice(0.5, 2), r"dimension 0.*slice.*ints or None"),
    ("plain", (slice(None), slice(0, 2.0)), r"dimension 1.*slice.*ints or None"),
    ("plain", slice(None, None, 1.0), r"dimension 0.*ints or None"),
    ("plain", slice(np.array([1, 2]), 3), r"dimension 0.*ints or None"),
    ("plain", slice(jnp.array([0, 1]), 3), r"dimension 0.*ints or None"),
    ("plain", slice(np.float32(1), 3), r"dimension 0.*ints or None"),
    ("plain", slice(True, 3), r"dimension 0.*ints or None"),
    ("plain", slice(0, 3, 0), r"dimension 0.*step 0"),
    ("named", {"rows": slice("a", 3)}, r"axis 'rows'.*ints or None"),
    # One dimension indexed twice.
    ("plain", {0: 1, -2: 2}, r"dimension 0 .*indexed twice"),
    ("plain", {1: 1, np.int64(-1): 2}, r"dimension 1 .*indexed twice"),
    ("view", {0: 1, -2: 2}, r"dimension 2 .*indexed twice"),
    # A name's dimension is not a position; positions count positional axes.
    ("named", {"rows": 1, 0: 2}, r"no positional axis 0.*'rows', 'cols'.*by name"),
    ("view", {2: 0}, r"no positional axis 2; it has 2 positional axes and named axes 'b'"),
    ("plain", {2: 0}, r"no positional axis 2; it has 2"),
    ("plain", {"rows": 0}, r"no axis 'rows'.*index it by position"),
    ("named", {None: 0}, r"no axis None"),
    ("named", {True: 0}, r"no axis True"),
    ("named", {(0,): 0}, r"no axis \(0,\)"),
    # Parts of other types.
    ("plain", "a", r"dimension 0.*'a'.*int or a slice"),
    ("plain", (0, "cols"), r"dimension 1.*'cols'.*int or a slice"),
    ("named", "rows", r"axis 'rows'.*'rows'.*dict by name"),
    ("plain", True, r"dimension 0.*True"),
    ("plain", np.True_, r"dimension 0.*True"),
    ("plain", (0, False), r"dimension 1.*False"),
    ("plain", None, r"dimension 0.*None"),
    ("plain", (None, 0), r"dimension 0.*None"),
    ("plain", 1.0, r"dimension 0.*1\.0"),
    ("plain", [0, 1], r"dimension 0.*\[0, 1\]"),
    ("plain", np.array([0, 1]), r"dimension 0.*array"),
    ("plain", jnp.array([0, 1]), r"dimension 0.*Array"),
    ("plain", ((0, 1),), r"dimension 0.*\(0, 1\)"),
    ("plain", {0: [0, 1]}, r"dimension 0.*\[0, 1\]"),
    ("named", {"rows": ...}, r"axis 'rows'.*is \.\.\."),
    ("plain", {0: None}, r"dimension 0.*None"),
    # Tuples of the wrong length, ints out of range.
    ("plain", (0, 0, 0), r"3 indexes given for an array of 2 dimension\(s\) \(dimension 0, dimension 1\)"),
    ("named", (0, 0, 0, ...), r"3 indexes given.*axis 'rows'.*axis 'cols'"),
    ("plain", (..., ...), r"one \.\.\."),
    ("scalar", 0, r"1 indexes given for an array of 0 dimension\(s\) \(none\)"),
    ("plain", 3, r"index 3 is out of range for dimension 0, of size 3"),
    ("plain", (0, -5), r"index -5 is out of range for dimension 1, of size 4"),
    ("plain", 2**70, r"index 1180591620717411303424 is out of range"),
    ("named", {"cols": np.int64(6)}, r"index 6 is out of range for axis 'cols'"),
    # Values that hold no array: only whole.
    ("python", 0, r"holds no array.*ckpt\[label\]"),
    ("python", {0: 1}, r"holds no array"),
]


@pytest.mark.parametrize("label, index, match", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_indexes_raise_the_librarys_error_naming_label_and_axis(ckpt, label, index, match):
  with pzp.open(ckpt) as opened:
    with pytest.raises(errors.ArgumentError, match=rf"'{label}'.*({match})") as info:
      opened.read(label, index)
  assert isinstance(info.value, errors.PzPersistError)


@pytest.mark.parametrize("index, expected", [
    (np.int64(1), (1,)),
    ((np.uint8(2), slice(np.int32(1), np.int64(3))), (2, slice(1, 3))),
    (slice(np.array(1), None), slice(1, None)),        # A 0-d int array is an int, as in NumPy.
    (slice(-2**70, 2**70, 2), slice(None, None, 2)),  # Bounds clipped, as NumPy clips them.
    ((slice(3, None, -2), slice(None, None, -1)), (slice(3, None, -2), slice(None, None, -1))),
    ({0: slice(2, 0, -1)}, slice(2, 0, -1)),
    ({np.int64(-1): 0}, (slice(None), 0)),
    ((slice(5, 1), 0), (slice(5, 1), 0)),              # Empty.
])
def test_numpy_ints_and_any_slice_read_as_numpy_would(ckpt, index, expected):
  full = np.arange(12, dtype=np.int8).reshape(3, 4)
  with pzp.open(ckpt) as opened:
    got = opened.read("plain", index)
  want = full[expected if isinstance(expected, tuple) else (expected,)]
  assert type(got) is type(want) and got.dtype == want.dtype
  assert np.array_equal(got, want) and np.shape(got) == np.shape(want)


@pytest.mark.parametrize("compact", [False, True], ids=["format_2", "format_4"])
@pytest.mark.parametrize("shape", [[0, 2**70], [2**70, 0], [0, 2**40, 2**40], [0, 2**62], [0, 2**61]])
def test_shapes_no_array_can_have_are_refused_by_label(tmp_path, shape, compact):
  """A zero-size array still has to be made: a shape whose non-zero
  dimensions overflow is refused on every way in, naming the label."""
  path = tmp_path / "ckpt"
  pzp.save(path, {"empty": pz.ParameterValue(value=np.zeros((0, 3), np.float32), label="empty")})
  file = path / "penzai" / manifest_lib.MANIFEST_FILENAME
  if compact:  # As saved (format 4): its columnar arrays table.
    data = json.loads(file.read_text())
    table = data["arrays"]
    table["shapes"][table["shape"][table["label"].index("empty")]] = shape
  else:
    data = manifest_json.read(file)
    (entry,) = [a for a in data["arrays"] if a.get("label") == "empty"]
    entry["shape"] = shape
  manifest_json.write(file, data)
  for way in (lambda: pzp.load(path), lambda: pzp.inspect(path), lambda: pzp.open(path),
              lambda: pzp.load_model(path)):
    with pytest.raises(errors.UnsafeCheckpointError,
                       match=r"'empty'.*more than any array can (have|hold)"):
      way()
  report = pzp.verify(path)
  assert not report.ok and "more than any array can" in str(report)
