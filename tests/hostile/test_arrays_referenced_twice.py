"""One stored array referenced from two places of a forged manifest.

A save writes every array it meets as an entry of its own (the same array at
two places too), and a variable shared by two places as one variable entry
whose array is referenced once: no saved manifest refers to an array entry
twice. Loaded, such a manifest would give one writable array at two places
(an optimizer state updated in place at one corrupting the other), so it is
refused where the manifest is parsed (`Manifest.loads`, through
`pz_persist.format.nodes.arrays_referenced_once`), naming both places: every
reader goes through it (loads, ``inspect``, ``open``, ``diff``, ``verify``,
the CLI, Orbax v0/v1, the manager), and a save checks what it publishes with
it. What a save can produce keeps its meaning: arrays equal or identical when
saved load as independent arrays, and a shared variable loads shared.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

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


def _ways_in(path, good):
  """Every way a user reads a checkpoint path."""
  yield "load", lambda: pzp.load(path)
  yield "inspect", lambda: pzp.inspect(path)
  yield "open", lambda: pzp.open(path)
  yield "load_into", lambda: pzp.load_into(path, _tree())
  yield "diff(path, path)", lambda: pzp.diff(path, path)
  yield "diff(handle, path)", lambda: pzp.diff(pzp.open(good), path)
  yield "diff(path, handle)", lambda: pzp.diff(path, pzp.open(good))
  yield "orbax v0", lambda: ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(path)
  yield "orbax v1", lambda: ocp_v1.load_checkpointables(path)


def _refused_by_every_way_in(path, good):
  for way, call in _ways_in(path, good):
    with pytest.raises(errors.ManifestError, match=MATCH):
      call()
      pytest.fail(f"{way} did not refuse it")
  report = pzp.verify(path)
  assert not report.ok and any("refers to already" in line for line in report.damaged)
  for command in (["inspect", str(path)], ["diff", str(path), str(path)],
                  ["diff", str(good), str(path)], ["verify", str(path)]):
    done = _cli(*command)
    assert done.returncode != 0, (command, done.stdout)
    assert "refers to already" in done.stdout + done.stderr, command


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "pz_persist.tools.cli", *args],
                        capture_output=True, text=True, check=False)


def test_every_way_in_refuses_an_array_referenced_twice(forged, tmp_path):
  name, path = forged
  pzp.save(tmp_path / "good", _tree())
  _refused_by_every_way_in(path, tmp_path / "good")
  with pytest.raises(errors.ManifestError, match=MATCH) as caught:
    pzp.inspect(path)
  assert str(caught.value).count("refers to") >= 2  # Both places named.


def _compact_twice(file):
  """Format 4, edited as written: the second ``array`` node of the tree
  refers to the first one's array."""
  raw = json.loads(file.read_text())
  assert raw["format_version"] >= manifest_lib.FIRST_COMPACT_FORMAT
  array = raw["types"].index("array")
  found = []
  stack = [raw["tree"]] + [entry[3] for entry in raw["variables"]]
  while stack:
    node = stack.pop()
    if isinstance(node, list) and node and node[0] == array and len(node) == 2:
      found.append(node)
    elif isinstance(node, list):
      stack.extend(reversed(node[1:]))
  found[1][1] = found[0][1]
  file.write_text(json.dumps(raw))


def test_a_format_4_manifest_is_refused_as_parsed(tmp_path):
  path = tmp_path / "ckpt"
  pzp.save(path, _tree())
  pzp.save(tmp_path / "good", _tree())
  _compact_twice(path / "penzai" / manifest_lib.MANIFEST_FILENAME)
  with pytest.raises(errors.ManifestError, match=MATCH):
    manifest_lib.read(path / "penzai")
  _refused_by_every_way_in(path, tmp_path / "good")


def test_a_save_never_publishes_it(tmp_path):
  """The publish-time check runs the reader's parse: a manifest referring to
  an array twice is refused before anything is written."""
  pzp.save(tmp_path / "c", _tree())
  for forge in (_tree_twice, _within_one_value):
    data = manifest_json.read(tmp_path / "c" / "penzai" / manifest_lib.MANIFEST_FILENAME)
    forge(data)
    manifest = manifest_lib.read(tmp_path / "c" / "penzai")
    forged = manifest_lib.Manifest(
        tree=data["tree"], variables=tuple(data["variables"]), arrays=manifest.arrays,
        writer=manifest.writer, format_version=manifest.format_version,
        leaf_keys=manifest.leaf_keys)
    with pytest.raises(errors.EncodingError, match="refers to already"):
      manifest_lib.check_publishable(forged, what="the model")
    compact = dataclasses.replace(forged, format_version=manifest_lib.FORMAT_VERSION)
    with pytest.raises(errors.EncodingError, match="refers to already"):
      manifest_lib.check_publishable(compact, what="the model")


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
  into = pzp.load_into(tmp_path / "c", {"x1": x, "x2": x, "s1": shared, "s2": shared})
  assert into["s1"] is into["s2"]


def test_the_orbax_type_handlers_records_refuse_it(tmp_path):
  """A mutable variable saved as a leaf of a plain Orbax tree is recorded by
  pz_persist's type handler in typed JSON of its own: its records are checked
  as a manifest's typed JSON is (`Manifest.check_typed_nodes`)."""
  path = tmp_path / "c"
  ocp.PyTreeCheckpointer().save(path, {"w": _tree()["w"]})
  (file,) = path.glob("pz_persist_variables-*.json")
  records = json.loads(file.read_text())
  first, second = records["w"]["tree"]["value"]["items"]
  second["ref"] = first["ref"]
  file.write_text(json.dumps(records))
  with pytest.raises(errors.ManifestError, match=r"leaf 'w'.*" + MATCH):
    ocp.PyTreeCheckpointer().restore(path)
