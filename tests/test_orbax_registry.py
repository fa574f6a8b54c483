"""`pzp.handler_registry` lets a fresh Orbax manager restore without warnings."""

from __future__ import annotations

import logging

import model_zoo
import orbax.checkpoint as ocp
import pytest
from penzai import pz
from treecompare import assert_identical

import pz_persist as pzp

WARNING = "was found in the checkpoint, but could not"


def _save_and_restore_fresh(directory, registry_factory):
  _, params = pz.unbind_params(model_zoo.mlp(), freeze=True)
  with ocp.CheckpointManager(directory, handler_registry=registry_factory()) as m:
    m.save(1, args=ocp.args.Composite(params=pzp.PenzaiSave(params)))
    m.wait_until_finished()
  with ocp.CheckpointManager(directory, handler_registry=registry_factory()) as m:
    return params, m.restore(1).params


def test_registry_restores_without_the_orbax_warning(tmp_path, caplog):
  with caplog.at_level(logging.WARNING, logger="absl"):
    params, restored = _save_and_restore_fresh(
        tmp_path / "run", lambda: pzp.handler_registry("params")
    )
  assert_identical(restored, params)
  assert WARNING not in caplog.text


def test_without_the_registry_orbax_warns(tmp_path, caplog):
  """Why the registry exists: Orbax's own default registry warns first."""
  with caplog.at_level(logging.WARNING, logger="absl"):
    params, restored = _save_and_restore_fresh(tmp_path / "run", lambda: None)
  assert_identical(restored, params)
  assert WARNING in caplog.text


def test_registry_needs_item_names():
  with pytest.raises(ValueError, match="item names"):
    pzp.handler_registry()
