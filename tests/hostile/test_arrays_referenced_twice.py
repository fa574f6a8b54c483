"""One stored array referenced from two places of a forged manifest.

A save writes every array it meets as an entry of its own (the same array at
two places too), and a variable shared by two places as one variable entry
whose array is referenced once: no saved manifest refers to an array entry
twice. Loaded, such a manifest would give one writable array at two places
(an optimizer state updated in place at one corrupting the other), so every
way in refuses it, naming both places (`pz_persist.format.decode`, where
each array is placed), and ``verify`` reports it as damage. What a save can
produce keeps its meaning: arrays equal or identical when saved load as
independent arrays, and a shared variable loads shared.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import manifest_json
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import manifest as manifest_lib

MATCH = r"refers to arrays\[\d+\].*refers to already.*refers to each array once"


def _tree():
  return {
      "a": np.arange(4, dtype=np.float32),
      "b": np.arange(4, dtype=np.float32) + 10,
      "p": pz.Parameter(value=np.zeros(3, np.float32), label="p"),
      "q": pz.Parameter(value=np.ones(3, np.float32), label="q"),
      "w": pz.Parameter(value=(np.ones(2, np.int8), np.zeros(2, np.int8)), label="w"),
  }


def _edit(path, forge) -> None:
  file = path / "penzai" / manifest_lib.MANIFEST_FILENAME
  data = manifest_json.read(file)  # Written back as format 2.
  forge(data)
  manifest_json.write(file, data)


def _item(data, key):
  return next(value for name, value in data["tree"]["items"] if name["v"] == key)


def _tree_twice(data):  # tree['b'] refers to tree['a']'s array.
  _item(data, "b")["ref"] = _item(data, "a")["ref"]


def _variable(data, label):
  return next(v for v in data["variables"] if v["label"]["v"] == label)


def _variables_twice(data):  # Variable q's value refers to variable p's array.
  _variable(data, "q")["value"]["ref"] = _variable(data, "p")["value"]["ref"]


def _tree_and_variable(data):  # tree['a'] refers to variable p's array.
  _item(data, "a")["ref"] = _variable(data, "p")["value"]["ref"]


def _within_one_value(data):  # Variable w holds (x, x).
  first, second = _variable(data, "w")["value"]["items"]
  second["ref"] = first["ref"]


FORGERIES = {
    "tree_twice": _tree_twice,
    "variables_twice": _variables_twice,
    "tree_and_variable": _tree_and_variable,
    "within_one_value": _within_one_value,
}


@pytest.fixture(params=sorted(FORGERIES))
def forged(request, tmp_path):
  path = tmp_path / "ckpt"
  pzp.save(path, _tree())
  _edit(path, FORGERIES[request.param])
  return request.param, path


def _ways_in(path):
  """Every way a user gets values out of a checkpoint path."""
  yield "load", lambda: pzp.load(path)
  yield "inspect", lambda: pzp.inspect(path)
  yield "open().load()", lambda: pzp.open(path).load()
  yield "open()[label]", lambda: [pzp.open(path)[label] for label in ("p", "q", "w")]
  yield "load_model(into=)", lambda: pzp.load_model(path, into=_tree())
  yield "orbax v0", lambda: ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(path)
  yield "orbax v1", lambda: ocp_v1.load_checkpointables(path)


# Where the array's label names another holder, the arrays table's labels
# refuse it first: a ManifestError too, naming the array and both holders.
EITHER = MATCH + r"|labelled '.*' in the arrays table, but is held by"
# `open` decodes the whole (abstract) tree, as `inspect` does: it refuses too.
WHOLE = ("load", "inspect", "open().load()", "open()[label]", "orbax v0", "orbax v1")
EXPECTED = {  # None: the values returned hold the array once (binding reads variables only).
    "tree_twice": {"load_model(into=)": None},
    "variables_twice": {"load_model(into=)": MATCH},
    "tree_and_variable": {"load_model(into=)": None},
    "within_one_value": {"load_model(into=)": MATCH},
}
WHOLE_EXPECTED = {"tree_twice": MATCH, "variables_twice": EITHER,
                  "tree_and_variable": EITHER, "within_one_value": MATCH}


def test_every_way_in_refuses_an_array_referenced_twice(forged):
  name, path = forged
  for way, call in _ways_in(path):
    expected = WHOLE_EXPECTED[name] if way in WHOLE else EXPECTED[name][way]
    if expected is None:
      values = jax.tree_util.tree_leaves(call())
      arrays = [v for v in values if isinstance(v, np.ndarray)]
      for i, x in enumerate(arrays):
        assert not any(np.shares_memory(x, y) for y in arrays[i + 1:]), (name, way)
      continue
    with pytest.raises(errors.ManifestError, match=expected):
      call()
  report = pzp.verify(path)
  assert not report.ok and any("refers to already" in line for line in report.damaged)


def test_the_cli_verify_reports_it(forged):
  _, path = forged
  done = subprocess.run([sys.executable, "-m", "pz_persist.tools.cli", "verify", str(path)],
                        capture_output=True, text=True, check=False)
  assert done.returncode != 0 and "refers to already" in done.stdout + done.stderr


def test_a_checkpoint_manager_step_refuses_it(tmp_path):
  with pzp.CheckpointManager(tmp_path / "run", async_save=False) as manager:
    manager.save(1, params=_tree())
  step = next(p for p in (tmp_path / "run").iterdir() if p.name.startswith("1"))
  file = next(step.rglob(manifest_lib.MANIFEST_FILENAME))
  data = manifest_json.read(file)
  _tree_twice(data)
  manifest_json.write(file, data)
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    with pytest.raises(errors.ManifestError, match=MATCH):
      manager.restore(1)


def test_what_a_save_writes_keeps_its_sharing(tmp_path):
  """The same array at two places: two entries, two independent arrays. The
  same variable at two places: one variable, shared, as saved."""
  x = np.arange(3, dtype=np.float32)
  shared = pz.Parameter(value=np.zeros(2, np.float32), label="shared")
  pzp.save(tmp_path / "c", {"x1": x, "x2": x, "s1": shared, "s2": shared})
  manifest = json.dumps(manifest_json.read(tmp_path / "c" / "penzai" / "pz_persist.json"))
  assert manifest.count('"t": "variable"') == 2
  assert pzp.verify(tmp_path / "c").ok
  loaded = pzp.load(tmp_path / "c")
  loaded["x1"][0] = 99  # Writable, and its own.
  assert loaded["x2"][0] == 0 and not np.shares_memory(loaded["x1"], loaded["x2"])
  assert loaded["s1"] is loaded["s2"]  # Shared as saved: one variable.
  into = pzp.load_model(tmp_path / "c", into={"x1": x, "x2": x, "s1": shared, "s2": shared})
  assert into["s1"] is into["s2"]
