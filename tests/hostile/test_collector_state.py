"""Loading and saving never touch Python's garbage collector, even briefly.

`gc.disable` / `gc.enable` are process-wide: a parse that paused the
collector while it ran turned it back on for a thread that had just turned it
off (issue 26, item 12), and let every other thread see it off meanwhile. So
no read or save path may call them (nor change the collector's thresholds
or freeze it): these tests record every such call made through each entry
point, and reproduce the reported race deterministically.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import threading

import jax.numpy as jnp
import model_zoo
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz

import pz_persist as pzp
from pz_persist.tools import cli

pytestmark = pytest.mark.timeout(300)

_CHANGES = ("disable", "enable", "set_threshold", "freeze", "unfreeze")


def _tree() -> dict:
  return {
      "w": pz.ParameterValue(label="w", value=pz.nx.wrap(jnp.arange(6.0).reshape(2, 3), "a", "b")),
      "n": np.arange(4, dtype=np.int32),
  }


@pytest.fixture
def collector_calls(monkeypatch):
  """Every call that would change the collector's state, as (name, args)."""
  calls: list[tuple[str, tuple]] = []
  for name in _CHANGES:
    real = getattr(gc, name)

    def recording(*args, _name=name, _real=real):
      calls.append((_name, args))
      return _real(*args)

    monkeypatch.setattr(gc, name, recording)
  return calls


def _cli(*argv: str) -> None:
  with contextlib.redirect_stdout(io.StringIO()):
    assert cli.main(list(argv)) == 0


def _read_every_way(tmp_path) -> None:
  """Every read entry point, on checkpoints written by every save path."""
  model = model_zoo.mlp()
  path, model_path = tmp_path / "ck", tmp_path / "model"
  pzp.save(path, _tree())
  pzp.save_model(model_path, model)
  pzp.load(path)
  pzp.inspect(path)
  pzp.load_model(model_path)
  pzp.load_into(model_path, model_zoo.mlp())
  pzp.diff(path, path)
  pzp.verify(path)
  _cli("inspect", str(path))
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, params=_tree())
    manager.wait_until_finished()
    manager.restore(1)
  with ocp.CheckpointManager(tmp_path / "orbax_run") as manager:
    manager.save(1, args=ocp.args.Composite(params=pzp.PenzaiSave(_tree())))
    manager.wait_until_finished()
  with ocp.CheckpointManager(tmp_path / "orbax_run") as manager:
    manager.restore(1)
  ocp_v1.save_checkpointables(tmp_path / "v1", {"model": _tree()})
  ocp_v1.load_checkpointables(tmp_path / "v1")
  ocp_v1.load_checkpointables(path)
  checkpointer = ocp.PyTreeCheckpointer()
  checkpointer.save(tmp_path / "variables", {"model": model_zoo.mlp()})
  checkpointer.restore(tmp_path / "variables")


@pytest.mark.parametrize("enabled", [True, False], ids=["collector_on", "collector_off"])
def test_no_entry_point_changes_the_collector(tmp_path, collector_calls, enabled):
  was = gc.isenabled()
  if not enabled:
    gc.disable()
  collector_calls.clear()
  try:
    _read_every_way(tmp_path)
    assert collector_calls == []
    assert gc.isenabled() is enabled
  finally:
    (gc.enable if was else gc.disable)()


def test_a_thread_turning_the_collector_off_mid_load_keeps_it_off(tmp_path, monkeypatch):
  """As reported: one thread loads while another calls ``gc.disable()``.

  Deterministic: the other thread turns the collector off while the loader is
  inside the manifest's parse (the first ``json.loads`` it makes), and the
  parse goes on only once it did. The collector must stay off, and the parse
  must see it as the user set it each time.
  """
  pzp.save(tmp_path / "ck", _tree())
  real_loads = json.loads
  in_parse, turned_off = threading.Event(), threading.Event()
  seen: list[bool] = []

  def loads(*args, **kwargs):
    seen.append(gc.isenabled())
    if threading.current_thread().name == "loader" and not in_parse.is_set():
      in_parse.set()
      assert turned_off.wait(60)
      seen.append(gc.isenabled())
    return real_loads(*args, **kwargs)

  monkeypatch.setattr(json, "loads", loads)
  was = gc.isenabled()
  gc.enable()
  failures: list[BaseException] = []

  def load() -> None:
    try:
      pzp.load(tmp_path / "ck")
    except BaseException as e:  # pylint: disable=broad-exception-caught
      failures.append(e)

  loader = threading.Thread(target=load, name="loader")
  try:
    loader.start()
    assert in_parse.wait(60)
    gc.disable()  # The other thread's wish.
    turned_off.set()
    loader.join(120)
    assert not loader.is_alive() and failures == []
    assert not gc.isenabled(), "the load turned the collector back on"
    assert seen[:2] == [True, False], seen  # Never paused by the load itself.
  finally:
    turned_off.set()
    loader.join(120)
    (gc.enable if was else gc.disable)()
