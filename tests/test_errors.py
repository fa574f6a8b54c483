"""Bad input fails early and clearly, and never damages what is on disk."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import orbax.checkpoint as ocp
import manifest_json
import pytest
from penzai import pz

import pz_persist as pzp
from pz_persist import errors


def _listing(directory):
  return sorted(
      os.path.relpath(os.path.join(root, name), directory)
      for root, dirs, files in os.walk(directory)
      for name in dirs + files
  )


def _param(label="layer/w", metadata=None):
  return pz.Parameter(label=label, value=pz.nx.wrap(jnp.ones(3), "x"), metadata=metadata)


@pytest.mark.parametrize(
    "tree, expected",
    [
        ({"params": [_param(metadata={"init": lambda x: x})]},
         r"tree\['params'\]\[0\].*label 'layer/w'.*metadata\['init'\].*function"),
        ({"a": object()}, r"tree\['a'\].*builtins.object"),
        ({"arr": pz.nx.wrap(jnp.ones(2), object())}, r"tree\['arr'\].*axis name"),
        ([pz.ParameterValue(label=["unhashable"], value=jnp.ones(1))],
         r"tree\[0\].*label \['unhashable'\] is not hashable"),
        ({"obj": jnp.array([1.0]).astype(object) if False else __import__("numpy").array([None])},
         r"tree\['obj'\].*dtype object"),
    ],
    ids=["lambda-in-metadata", "unsupported-leaf", "bad-axis-name", "unhashable-label",
         "object-array"],
)
def test_unsavable_values_fail_before_writing(tree, expected, tmp_path):
  ckpt = tmp_path / "ckpt"
  with pytest.raises(errors.EncodingError, match=expected):
    pzp.save(ckpt, tree)
  assert _listing(tmp_path) == []


def test_penzai_save_args_validate_on_construction():
  with pytest.raises(errors.DisallowedModuleError, match=r"tree\['f'\].*builtins.print"):
    pzp.PenzaiSave({"f": print})
  with pytest.raises(errors.EncodingError, match=r"tree\['o'\]"):
    pzp.PenzaiSave({"o": object()})


def test_existing_checkpoint_is_not_touched_without_overwrite(ckpt):
  pzp.save(ckpt, {"v": jnp.arange(3)})
  before = {p: os.path.getmtime(ckpt / p) for p in _listing(ckpt)}

  with pytest.raises(errors.CheckpointExistsError, match="overwrite=True"):
    pzp.save(ckpt, {"v": jnp.arange(4)})

  assert {p: os.path.getmtime(ckpt / p) for p in _listing(ckpt)} == before
  assert pzp.load(ckpt)["v"].shape == (3,)


def test_overwrite_replaces_whole_checkpoint(ckpt):
  pzp.save(ckpt, {"old": jnp.arange(3)})
  pzp.save(ckpt, {"new": jnp.arange(4)}, overwrite=True)
  assert list(pzp.load(ckpt)) == ["new"]
  assert sorted(os.listdir(ckpt.parent)) == ["ckpt"]  # No leftovers beside it.


def test_failed_overwrite_keeps_old_checkpoint(ckpt):
  pzp.save(ckpt, {"old": jnp.arange(3)})
  with pytest.raises(errors.EncodingError):
    pzp.save(ckpt, {"bad": object()}, overwrite=True)
  assert list(pzp.load(ckpt)) == ["old"]
  assert sorted(os.listdir(ckpt.parent)) == ["ckpt"]


def test_overwrite_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
  precious = tmp_path / "data"
  precious.mkdir()
  (precious / "notes.txt").write_text("keep me")
  with pytest.raises(errors.CheckpointExistsError, match="not a pz_persist checkpoint"):
    pzp.save(precious, {"x": jnp.ones(1)}, overwrite=True)
  assert (precious / "notes.txt").read_text() == "keep me"


def test_overwrite_of_empty_directory(tmp_path):
  target = tmp_path / "empty"
  target.mkdir()
  pzp.save(target, [1], overwrite=True)
  assert pzp.load(target) == [1]


@pytest.mark.parametrize("loader", [pzp.load, pzp.inspect])
def test_not_a_checkpoint(loader, tmp_path):
  with pytest.raises(errors.NotACheckpointError, match="does not exist"):
    loader(tmp_path / "missing")
  (tmp_path / "empty").mkdir()
  with pytest.raises(errors.NotACheckpointError, match="not a pz_persist checkpoint"):
    loader(tmp_path / "empty")
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "plain", {"x": jnp.ones(2)})
  with pytest.raises(errors.NotACheckpointError, match="written without pz_persist"):
    loader(tmp_path / "plain")


def test_several_items_must_be_chosen(tmp_path):
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    checkpointer.save(
        tmp_path / "two",
        args=ocp.args.Composite(a=pzp.PenzaiSave([1]), b=pzp.PenzaiSave([2])),
    )
  with pytest.raises(errors.NotACheckpointError, match=r"several pz_persist items \(a, b\)"):
    pzp.load(tmp_path / "two")
  assert pzp.load(tmp_path / "two" / "b") == [2]


def _edit_manifest(ckpt, edit):
  path = ckpt / "penzai" / "pz_persist.json"
  data = manifest_json.read(path)
  edit(data)
  path.write_text(json.dumps(data))


def test_newer_format_version_says_upgrade(ckpt):
  pzp.save(ckpt, {"x": jnp.ones(2)})
  _edit_manifest(ckpt, lambda m: m.update(format_version=99, writer="pz_persist 9.0"))
  with pytest.raises(errors.FormatVersionError, match=r"format 99.*pip install -U pz-persist"):
    pzp.load(ckpt)
  with pytest.raises(errors.FormatVersionError):
    pzp.inspect(ckpt)


def test_manifest_disagreeing_with_arrays_is_reported(ckpt):
  pzp.save(ckpt, {"w": pz.nx.wrap(jnp.ones((2, 3)), "a", "b")})
  # Edited consistently (checksums dropped, so the manifest declares format 1,
  # which has none), so only the stored array disagrees.
  _edit_manifest(ckpt, lambda m: (
      m["arrays"][0].update(shape=[3, 2], checksums=None), m.update(format_version=1)))
  os.remove(ckpt / "penzai" / "pz_persist.files.json")  # Not written by format 1.
  with pytest.raises(errors.ManifestError, match=r"\['w'\].*float32\[3, 2\].*float32\[2, 3\]"):
    pzp.load(ckpt)


def test_manifest_naming_a_disallowed_module_imports_nothing(ckpt):
  pzp.save(ckpt, {"x": 1})
  _edit_manifest(ckpt, lambda m: m.update(tree={
      "t": "namedtuple", "class": {"module": "antigravity", "qualname": "Fly"}, "items": []}))
  import sys
  with pytest.raises(errors.DisallowedModuleError, match="antigravity"):
    pzp.load(ckpt)
  assert "antigravity" not in sys.modules
