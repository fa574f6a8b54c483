"""Hostile plain Orbax checkpoints (no pz_persist manifest) loaded into a model.

``load_into(path, model)`` reads checkpoints written without pz_persist
too; they are as untrusted as native ones, so the same classes of attack are
refused the same way, before any array is read, and the model passed in is
never changed.
"""

from __future__ import annotations

import json
import os

import jax
import model_zoo
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import run_python
from penzai import pz
from penzai.models import simple_mlp

import pz_persist as pzp
from pz_persist import errors
from pz_persist import safety


def _fresh():
  return simple_mlp.MLP.from_config(
      name="mlp", init_base_rng=jax.random.key(7), feature_sizes=[8, 16, 8]
  )


def _values(model):
  return [np.asarray(x) for x in jax.tree.leaves(pz.unbind_params(model, freeze=True)[1])]


@pytest.fixture
def plain(tmp_path):
  path = tmp_path / "plain"
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, pz.unbind_params(model_zoo.mlp(), freeze=True)[1])
  return path


def _refused(path, error, match):
  model = _fresh()
  before = _values(model)
  with pytest.raises(error, match=match):
    pzp.load_into(path, model)
  assert all(np.array_equal(a, b) for a, b in zip(_values(model), before))


def _data_files(path):
  return [
      os.path.join(parent, name)
      for parent, _, names in os.walk(path)
      for name in names
      if os.sep + "d" + os.sep in os.path.join(parent, name) + os.sep
  ]


def test_the_valid_one_loads(plain):
  """The undamaged copy (the cases below damage it) loads every saved value
  into the model, in both spellings, and leaves the model passed in as it was."""
  model = _fresh()
  before = _values(model)
  saved = _values(model_zoo.mlp())
  assert not all(np.array_equal(a, b) for a, b in zip(before, saved))  # Else nothing shows.
  for loaded in (pzp.load_into(plain, model), pzp.load_into(plain, model, pzp.BindOptions())):
    values = _values(loaded)
    assert len(values) == len(saved)
    for got, want in zip(values, saved):
      np.testing.assert_array_equal(got, want)
  assert all(np.array_equal(a, b) for a, b in zip(_values(model), before))


def test_symlink_out_of_the_checkpoint(plain, tmp_path):
  secret = tmp_path / "secret"
  secret.write_bytes(b"not for reading")
  target = _data_files(plain)[0]
  os.remove(target)
  os.symlink(secret, target)
  _refused(plain, errors.UnsafeCheckpointError, r"is a symlink to .*secret, outside")


def test_symlinked_orbax_metadata(plain, tmp_path):
  outside = tmp_path / "outside.json"
  os.rename(plain / "_METADATA", outside)
  os.symlink(outside, plain / "_METADATA")
  _refused(plain, errors.UnsafeCheckpointError, r"_METADATA is a symlink to .*outside")


def test_fifo_in_the_checkpoint(plain):
  """Would block a reader forever: refused before anything opens it."""
  target = _data_files(plain)[0]
  output = run_python(f"""
      import os, sys
      sys.path.insert(0, "tests")
      import resource
      resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, 8 * 2**30))
      os.remove({target!r})
      os.mkfifo({target!r})
      import jax
      import pz_persist as pzp
      from penzai.models import simple_mlp
      from pz_persist import errors
      model = simple_mlp.MLP.from_config(
          name="mlp", init_base_rng=jax.random.key(7), feature_sizes=[8, 16, 8])
      try:
        pzp.load_into({str(plain)!r}, model)
      except errors.UnsafeCheckpointError as e:
        print("refused:", e)
  """, timeout=240)
  assert "refused:" in output and "is a FIFO" in output


def test_garbled_orbax_metadata(plain):
  (plain / "_METADATA").write_bytes(b"\x89PNG\x00\xff not json")
  _refused(plain, errors.IntegrityError, r"_METADATA.*cannot be read")


def test_garbled_checkpoint_metadata(plain):
  (plain / "_CHECKPOINT_METADATA").write_text("[1, 2")
  _refused(plain, errors.ManifestError, r"_CHECKPOINT_METADATA: .*not a JSON object")


def test_deeply_nested_orbax_metadata(plain):
  """Orbax rebuilds the tree recursively: too deep is an error, not a crash."""
  metadata = json.loads((plain / "_METADATA").read_text())
  keys = [{"key": "k", "key_type": 2}] * 100_000
  metadata["tree_metadata"] = {"('k',)": {"key_metadata": keys, "value_metadata": {
      "value_type": "jax.Array", "skip_deserialize": False, "write_shape": [2]}}}
  (plain / "_METADATA").write_text(json.dumps(metadata))
  _refused(plain, errors.IntegrityError, r"_METADATA.*cannot be read")


def test_damaged_array_files(plain):
  for name in _data_files(plain):
    with open(name, "r+b") as f:
      size = f.seek(0, 2)
      f.seek(0)
      f.write(b"\xff" * size)
  _refused(plain, errors.IntegrityError, r"damaged or incomplete")


def test_allocation_beyond_the_limit_is_refused_before_reading(plain, monkeypatch):
  monkeypatch.setattr(safety, "MAX_ALLOCATION_BYTES", 256)
  _refused(
      plain, errors.UnsafeCheckpointError,
      r"would allocate 1120 bytes, more than the 256-byte limit.*mlp/Affine_0",
  )
