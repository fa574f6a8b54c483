"""A model `save_model` accepts is one `load_model` rebuilds.

`load_model` binds variables back by label, so two distinct mutable
variables with one label (two loaded models in one container, both with
``transformer/...`` labels) cannot both come back: the save refuses them,
naming both places, before anything is written, for every kind of mutable
variable; frozen values with one label, and one variable used twice, save
and load.
"""

from __future__ import annotations

import numpy as np
import pytest
from penzai import pz

import pz_persist as pzp
from pz_persist import errors


def _two_linears(first, second) -> pz.nn.Sequential:
  return pz.nn.Sequential([
      pz.nn.Linear(weights=w, in_axis_names=("i",), out_axis_names=("o",))
      for w in (first, second)
  ])


def _value(fill: float) -> pz.nx.NamedArray:
  return pz.nx.wrap(np.full((3, 3), fill, np.float32), "i", "o")


@pytest.mark.parametrize("kind", [pz.Parameter, pz.StateVariable])
def test_two_mutable_variables_with_one_label_are_refused_before_writing(tmp_path, kind):
  model = _two_linears(kind(label="w", value=_value(1.0)), kind(label="w", value=_value(0.0)))
  with pytest.raises(errors.EncodingError, match=r"save_model cannot save.*sublayers\[1\]"):
    pzp.save_model(tmp_path / "m", model)
  assert list(tmp_path.iterdir()) == []  # Nothing written, nothing hidden left.


def test_frozen_values_with_one_label_and_one_shared_variable_load(tmp_path):
  frozen = _two_linears(pz.ParameterValue(label="w", value=_value(1.0)),
                        pz.ParameterValue(label="w", value=_value(0.0)))
  pzp.save_model(tmp_path / "frozen", frozen)
  loaded = pzp.load_model(tmp_path / "frozen")
  np.testing.assert_array_equal(loaded.sublayers[1].weights.value.unwrap("i", "o"), 0.0)
  shared = pz.Parameter(label="w", value=_value(2.0))
  pzp.save_model(tmp_path / "shared", _two_linears(shared, shared))
  loaded = pzp.load_model(tmp_path / "shared")
  assert loaded.sublayers[0].weights is loaded.sublayers[1].weights
