"""The extension surface (`pz_persist.extension`): every name a documented
contract, every example in its docstrings run.

Why: `pz_persist.pretrained` uses only this surface of the library's
internals (`tests/test_layout.py`), so what it says is what loaders rely on;
an example that stopped running, or a name exported without saying what a
loader uses it for, would leave the next loader guessing.
"""

from __future__ import annotations

import doctest
import inspect
import os

import numpy as np
import pytest

from pz_persist import errors
from pz_persist import extension
from pz_persist.safety import bounded_json


def test_every_docstring_example_runs():
  results = doctest.testmod(extension, optionflags=doctest.ELLIPSIS, raise_on_error=False)
  assert results.attempted >= 30
  assert results.failed == 0


def test_every_exported_name_is_documented_and_typed():
  assert sorted(extension.__all__) == sorted(set(extension.__all__))
  for name in extension.__all__:
    value = getattr(extension, name)
    if callable(value) and not isinstance(value, type):
      assert value.__module__ == "pz_persist.extension", name  # A deliberate contract.
      assert (value.__doc__ or "").strip(), name
      signature = inspect.signature(value)
      assert signature.return_annotation is not inspect.Signature.empty, name
      assert all(p.annotation is not inspect.Parameter.empty
                 for p in signature.parameters.values()), name
  public = {name for name, value in vars(extension).items()
            if not name.startswith("_") and getattr(value, "__module__", None)
            == "pz_persist.extension"}
  assert public <= set(extension.__all__), public - set(extension.__all__)


def test_an_export_that_fails_leaves_the_folder_as_it_was(tmp_path):
  folder = tmp_path / "out"
  with pytest.raises(RuntimeError, match="stop"):
    with extension.publishing_export(os.fspath(folder)) as new:
      extension.write_small_file(new / "config.json", b"{}")
      raise RuntimeError("stop")
  assert os.listdir(tmp_path) == []  # Nothing published, nothing left beside it.


def test_an_export_replaces_only_an_earlier_export(tmp_path):
  folder = os.fspath(tmp_path / "out")
  with extension.publishing_export(folder) as new:
    extension.write_small_file(new / "config.json", b"{}")
  with pytest.raises(errors.CheckpointExistsError, match="not empty"):
    extension.check_export_destination(folder, overwrite=False)
  extension.check_export_destination(folder, overwrite=True)  # Its own: replaceable.
  with open(os.path.join(folder, "notes.txt"), "w") as f:
    f.write("mine")
  with pytest.raises(errors.CheckpointExistsError, match="notes.txt"):
    extension.check_export_destination(folder, overwrite=True)
  with pytest.raises(errors.ArgumentError, match="local folder"):
    extension.check_export_destination("gs://bucket/out", overwrite=True)


def test_an_export_changed_meanwhile_is_not_replaced(tmp_path):
  folder = tmp_path / "out"
  with pytest.raises(errors.ConcurrentSaveError, match="another writer"):
    with extension.publishing_export(os.fspath(folder)) as new:
      extension.write_small_file(new / "config.json", b"{}")
      folder.mkdir()
      (folder / "theirs").write_text("x")
  assert os.listdir(folder) == ["theirs"]


def test_an_orbax_folder_with_a_link_out_or_large_metadata_is_refused(tmp_path):
  folder = tmp_path / "ckpt"
  folder.mkdir()
  (folder / "x").symlink_to("/etc/hostname")
  with pytest.raises(errors.UnsafeCheckpointError, match="outside the checkpoint"):
    extension.check_orbax_folder(extension.open_path(folder))
  (folder / "x").unlink()
  with open(folder / "_METADATA", "wb") as f:  # A large tree's is legitimate...
    f.truncate(64 * 2**20 + 1)
  extension.check_orbax_folder(extension.open_path(folder))
  with open(folder / "_METADATA", "wb") as f:  # ...up to the limit every load applies
    f.truncate(bounded_json.MAX_ORBAX_METADATA_BYTES + 1)  # (containment's walk, as for loads).
  with pytest.raises(errors.ManifestError, match="_METADATA: Orbax's metadata is .* over the"):
    extension.check_orbax_folder(extension.open_path(folder))


def test_a_file_added_during_the_read_refuses_it(tmp_path):
  snapshot = extension.check_orbax_folder(extension.open_path(tmp_path))
  with pytest.raises(errors.UnsafeCheckpointError, match="changed while"):
    with extension.files_unchanged(tmp_path, before=snapshot):
      (tmp_path / "new").write_text("x")


def test_allocation_over_the_limit_is_refused_before_reading(tmp_path):
  class Planned:
    key, dtype, shape = "t", np.dtype(np.float32), (4,)

    def describe(self) -> str:
      return "tensor 't'"

  import pz_persist as pzp  # pylint: disable=import-outside-toplevel

  with pzp.limits(max_allocation_bytes=15):
    with pytest.raises(errors.UnsafeCheckpointError, match=r"x\.bin.*16 bytes.*tensor 't'"):
      extension.check_allocation([Planned()], {"t": 16}, where="x.bin")
  with pzp.limits(max_allocation_bytes=16):
    extension.check_allocation([Planned()], {"t": 16}, where="x.bin")
