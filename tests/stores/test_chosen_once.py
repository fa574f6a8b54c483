"""A save and a load choose their store once, and hand it down.

Why: each step of a save used to ask the path's store again from its
spelling (`stores.for_path`, twelve times in one local save, six in a
load), through by-path façades over `storage/stores/`. Now the entry point
chooses it (`stores.open_path`) and every step is handed the `Store`. These
tests count the choices (a condition, not a time): a new step that derives
the store from the path again fails here, naming where it asked.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import pz_persist as pzp
from pz_persist.storage import stores

_STORES = stores.__file__


def _counting(monkeypatch) -> list[str]:
  """Every later `stores.for_path` call, as ``module:function`` of the first
  caller outside `stores/__init__.py` (whose helpers call it themselves)."""
  asked: list[str] = []
  choose = stores.for_path

  def counting(path):
    frame = sys._getframe(1)  # pylint: disable=protected-access
    while frame.f_code.co_filename == _STORES:
      frame = frame.f_back
    asked.append(f"{frame.f_globals['__name__']}:{frame.f_code.co_name}")
    return choose(path)

  monkeypatch.setattr(stores, "for_path", counting)
  return asked


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_a_save_chooses_its_store_once(tmp_path, monkeypatch, overwrite):
  path = tmp_path / "ckpt"
  tree = {"w": np.arange(6.0).reshape(2, 3), "n": {"b": np.ones(3, np.int32)}}
  if overwrite:
    pzp.save(path, tree)
  asked = _counting(monkeypatch)
  pzp.save(path, tree, overwrite=overwrite)
  # `pz_persist.save` once; the Orbax handler asks once more for the directory
  # Orbax hands it, since Orbax's own entry points (``ocp.Checkpointer``,
  # ``CheckpointManager``) reach it without `stores.open_path`.
  assert asked == [
      "pz_persist.checkpoint:save", "pz_persist.orbax.v0_handler:async_save"
  ], asked


def test_a_load_chooses_its_store_once(tmp_path, monkeypatch):
  path = tmp_path / "ckpt"
  pzp.save(path, {"w": np.arange(4.0)})
  asked = _counting(monkeypatch)
  np.testing.assert_array_equal(pzp.load(path)["w"], np.arange(4.0))
  assert asked == ["pz_persist.storage.reading.opening:read"], asked
