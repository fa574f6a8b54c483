"""Nesting counted through shared and variable entries (issue 36).

A format 4 manifest writes a static value met twice once, in its ``shared``
table, and each mutable variable once, in its ``variables`` table; nodes
refer to them by index. The decoder decodes an entry where it is first met
and reuses it, so an entry first met shallow and then again under deep
nesting once loaded 185 levels deep, though readers refuse past
`nodes.MAX_DEPTH`. The manifest's check (`pz_persist.format.compact`), which
every reader runs, now counts depth through every use of every entry.

Each case takes a checkpoint written by a save path (`pzp.save`, Orbax's v0
``Checkpointer``, `pzp.CheckpointManager`, Orbax's v1 API), edits its
manifest so that an entry is used under deep nesting, and has every reader
refuse it naming where: ``load``, ``inspect``, ``open``, ``load_model``,
``verify`` (as damage), the ``pz-persist`` command and the save path's own
restore. And a save never writes such a tree: it is refused, naming its path.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import nodes
from pz_persist.tools import cli

HEIGHT = 40
"""Levels of the value used twice (a metadata dict of nested lists)."""

LEVELS = 60
"""Lists the second use is moved under: far within each limit alone, over
`nodes.MAX_DEPTH` through the entry."""


def _nested(value, levels: int):
  for _ in range(levels):
    value = [value]
  return value


def _shared_value_tree():
  """Two frozen variables with equal metadata: one ``shared`` entry."""
  metadata = {"m": _nested(1, HEIGHT)}
  def value(label):
    return pz.ParameterValue(value=pz.nx.wrap(jnp.arange(3.0)).tag("x"), label=label,
                             metadata=metadata)
  return {"a": value("a"), "b": value("b")}


def _shared_variable_tree():
  """One mutable variable used twice: one ``variables`` entry."""
  variable = pz.Parameter(value=pz.nx.wrap(jnp.arange(3.0)).tag("x"), label="w",
                          metadata={"m": _nested(1, HEIGHT)})
  return {"a": variable, "b": variable}


TREES = {"shared entry": _shared_value_tree, "variable entry": _shared_variable_tree}

MATCH = {
    "shared entry": r"refers to shared\[\d+\], which nests \d+ levels below it.* deeper than 100",
    "variable entry": r"holds variables\[0\], which nests \d+ levels below it.* deeper than 100",
}


def _deepen(manifest: pathlib.Path) -> None:
  """Moves the tree's entry ``"b"`` under `LEVELS` list nodes (``"a"``, the
  first use, stays where it is)."""
  data = json.loads(manifest.read_text())
  assert data["format_version"] == 4
  types = data["types"]
  if "list" not in types:
    types.append("list")
  list_type = types.index("list")
  (pairs,) = [node[1] for node in [data["tree"]] if types[node[0]] == "dict"]
  for pair in pairs:
    if pair[0] == "b":
      for _ in range(LEVELS):
        pair[1] = [list_type, [pair[1]]]
  manifest.write_text(json.dumps(data))


def _pzp_save(path, tree):
  pzp.save(path, tree)
  return path / "penzai", lambda: pzp.load(path)


def _v0(path, tree):
  with ocp.Checkpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
    checkpointer.save(path, args=pzp.PenzaiSave(tree))

  def restore():
    with ocp.Checkpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
      return checkpointer.restore(path)

  return path, restore


def _manager(path, tree):
  with pzp.CheckpointManager(path) as manager:
    manager.save(1, params=tree)

  def restore():
    with pzp.CheckpointManager(path) as manager:
      return manager.restore(1)

  return path / "1" / "params", restore


def _v1(path, tree):
  ocp_v1.save_checkpointables(path, {"model": tree})
  return path / "model", lambda: ocp_v1.load_checkpointables(path)


SAVES = {"pzp.save": _pzp_save, "v0 Checkpointer": _v0, "pzp.CheckpointManager": _manager,
         "v1": _v1}


@pytest.mark.parametrize("save", list(SAVES))
@pytest.mark.parametrize("entry", list(TREES))
def test_an_entry_used_too_deep_is_refused_by_every_reader(entry, save, tmp_path, capsys):
  item, restore = SAVES[save](tmp_path / "c", TREES[entry]())
  assert pzp.load(item)  # Valid as saved: the second use is shallow too.
  _deepen(item / manifest_lib.MANIFEST_FILENAME)
  match = MATCH[entry]
  readers = {
      "load": lambda: pzp.load(item),
      "inspect": lambda: pzp.inspect(item),
      "open": lambda: pzp.open(item).load(),
      "load_model": lambda: pzp.load_model(item),
      "the save path's restore": restore,
  }
  for name, read in readers.items():
    with pytest.raises(errors.ManifestError, match=match):
      read()
      pytest.fail(f"{name} read it")
  report = pzp.verify(item)
  assert not report.ok and any("deeper than 100" in line for line in report.damaged), report
  capsys.readouterr()
  for command in ("inspect", "verify"):
    code = cli.main([command, str(item)])
    out = capsys.readouterr()
    assert code in (1, 2) and "deeper than 100" in out.out + out.err, (command, code, out)


def test_every_use_within_the_limit_loads(tmp_path):
  """The same entries used at depths that stay within the limit load."""
  for name, make in TREES.items():
    tree = make()
    used = tree["b"]
    tree["b"] = _nested(used, nodes.MAX_DEPTH - HEIGHT - 8)
    pzp.save(tmp_path / name, tree)
    loaded = pzp.load(tmp_path / name)
    assert pzp.verify(tmp_path / name).ok
    inner = loaded["b"]
    while isinstance(inner, list):
      inner = inner[0]
    assert inner.label == used.label and inner.metadata == used.metadata


@pytest.mark.parametrize("entry", list(TREES))
def test_a_save_never_writes_a_tree_deeper_than_readers_accept(entry, tmp_path):
  tree = TREES[entry]()
  tree["b"] = _nested(tree["b"], LEVELS)
  for name, save in SAVES.items():
    path = tmp_path / name.replace(" ", "_")
    with pytest.raises(errors.EncodingError, match=r"tree\['b'\](\[0\])+.*deeper than 100"):
      save(path, tree)
    assert not any(path.rglob(manifest_lib.MANIFEST_FILENAME)), name


def test_a_variable_under_deep_nesting_in_its_own_entry_is_refused(tmp_path):
  """A variable entry holding a value nested past the limit, used at the
  root: refused by the manifest's check, naming the entry."""
  pzp.save(tmp_path / "c", {"w": pz.Parameter(value=np.ones(2, np.float32), label="w")})
  manifest = tmp_path / "c" / "penzai" / manifest_lib.MANIFEST_FILENAME
  data = json.loads(manifest.read_text())
  types = data["types"]
  if "list" not in types:
    types.append("list")
  data["variables"][0][2] = _nested_compact(types.index("list"), nodes.MAX_DEPTH + 1)
  manifest.write_text(json.dumps(data))
  with pytest.raises(errors.ManifestError, match=r"variables\[0\]\.metadata.* nests deeper"):
    pzp.load(tmp_path / "c")


def _nested_compact(list_type: int, levels: int) -> list:
  node: list = [list_type, []]
  for _ in range(levels):
    node = [list_type, [node]]
  return node


def test_a_variable_used_too_deep_in_a_format_2_manifest_is_refused(tmp_path):
  """Formats 1 to 3 have no shared table, but a variables table: the same
  class, in the typed JSON readers read for ever."""
  import manifest_json  # pylint: disable=import-outside-toplevel

  pzp.save(tmp_path / "c", _shared_variable_tree())
  item = tmp_path / "c" / "penzai"
  data = manifest_json.read(item / manifest_lib.MANIFEST_FILENAME)
  assert data["format_version"] == 2
  for pair in data["tree"]["items"]:
    if pair[0]["v"] == "b":
      for _ in range(LEVELS):
        pair[1] = {"t": "list", "items": [pair[1]]}
  manifest_json.write(item / manifest_lib.MANIFEST_FILENAME, data)
  match = r"a variable node \d+ levels deep uses variables\[0\].* deeper than 100"
  for read in (pzp.load, pzp.inspect, pzp.load_model, lambda path: pzp.open(path).load()):
    with pytest.raises(errors.ManifestError, match=match):
      read(item)
  with ocp.Checkpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
    with pytest.raises(errors.ManifestError, match=match):
      checkpointer.restore(item)
  assert not pzp.verify(item).ok
