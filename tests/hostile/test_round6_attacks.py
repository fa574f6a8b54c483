"""Holes left open by round 5 and closed in round 6, kept as tests.

Each test is a class of hole; the fix lives where the guarantee is
enforced, named in the test's docstring.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from penzai import pz

import pz_persist as pzp
from pz_persist import errors
from pz_persist import extension


def _small_model():
  return pz.nn.Linear.from_config(
      name="l", init_base_rng=jax.random.key(0),
      input_axes={"i": 2}, output_axes={"o": 2})


def test_an_option_a_load_into_cannot_use_is_refused_not_dropped(tmp_path):
  """``load_model(path, into=model, mesh=mesh)`` bound into ``model`` and
  dropped ``mesh`` without a word (the model's meshes are its own). The
  deprecated entry point now refuses ``mesh=`` before anything is read,
  saying what to do instead (`pz_persist.model.load_model`)."""
  path = tmp_path / "ck"
  pzp.save_model(path, _small_model())
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  with pytest.warns(DeprecationWarning), pytest.raises(errors.ArgumentError, match="mesh="):
    pzp.load_model(path, into=_small_model(), mesh=mesh)
  with pytest.warns(DeprecationWarning):  # Without mesh= it binds, as before.
    pzp.load_model(path, into=_small_model())


def test_an_orbax_metadata_folder_is_refused_before_orbax_reads_it(tmp_path):
  """`extension.check_orbax_folder` (the checks before a loader hands an
  Orbax folder to Orbax) passed a ``_METADATA`` that is a folder, and Orbax
  then failed inside its read with ``IsADirectoryError``; it now refuses it,
  naming the file."""
  folder = tmp_path / "download"
  (folder / "_METADATA").mkdir(parents=True)
  with pytest.raises(errors.ManifestError, match="_METADATA is a folder"):
    extension.check_orbax_folder(extension.open_path(folder))
