"""Outsider attacks on issue 36's guarantees, kept as tests (round 4).

Each test is a case a save accepted, a reader refused, or a public entry
point raised something other than a `pz_persist.errors.PzPersistError` for,
found by attacking the merged surfaces from outside; the fix lives where the
guarantee is enforced, named in each test's docstring.
"""

from __future__ import annotations

import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
from penzai import pz

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import nodes
from pz_persist.tools import cli


def _nest(value, levels):
  for _ in range(levels):
    value = [value]
  return value


def _self_holding_list():
  held = []
  held.append(held)
  return held


def _self_holding_metadata():
  meta = {}
  meta["again"] = meta
  return pz.Parameter(value=np.ones(2, np.float32), label="p", metadata=meta)


UNBOUNDED = {
    "a list holding itself": _self_holding_list,
    "metadata holding itself": _self_holding_metadata,
    "lists nested 20,000 deep": lambda: _nest(1, 20_000),
    "dicts nested 5,000 deep": lambda: {"w": _nest({"k": 1}, 5_000)},
}


@pytest.mark.parametrize("name", list(UNBOUNDED))
def test_a_tree_nested_without_bound_is_refused_by_name_not_a_recursion_error(name, tmp_path):
  """The encoder refused nesting past `nodes.MAX_DEPTH` only after walking it
  whole (the decoder's check), so a tree holding itself or nested thousands
  deep raised RecursionError from `pzp.save`. `encode._Encoder._deeper`
  bounds the walk: every save path (pzp.save, Orbax v0, the manager) meets
  it; the limit is the interpreter's own, unchanged."""
  limit = sys.getrecursionlimit()
  with pytest.raises(errors.EncodingError, match=f"nesting deeper than {nodes.MAX_DEPTH}"):
    pzp.save(tmp_path / "c", UNBOUNDED[name]())
  assert not (tmp_path / "c").exists()
  with pytest.raises(errors.EncodingError, match="nesting deeper"):
    with ocp.Checkpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
      checkpointer.save(tmp_path / "v0", args=pzp.PenzaiSave(UNBOUNDED[name]()))
  with pytest.raises(errors.EncodingError, match="nesting deeper"):
    with pzp.CheckpointManager(tmp_path / "run") as manager:
      manager.save(1, params=UNBOUNDED[name]())
      manager.wait_until_finished()
  assert sys.getrecursionlimit() == limit


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_nesting_at_the_limit_still_saves_and_one_more_is_refused_before_writing(kind, tmp_path):
  """The walk's bound refuses nothing a reader loads: 100 containers load."""
  wrap = (lambda v: [v]) if kind == "list" else (lambda v: {"k": v})
  value = np.arange(3)
  for _ in range(nodes.MAX_DEPTH):
    value = wrap(value)
  pzp.save(tmp_path / "ok", value)
  loaded = pzp.load(tmp_path / "ok")
  for _ in range(nodes.MAX_DEPTH):
    loaded = loaded[0] if kind == "list" else loaded["k"]
  np.testing.assert_array_equal(loaded, np.arange(3))
  with pytest.raises(errors.EncodingError, match="nesting deeper"):
    pzp.save(tmp_path / "deeper", wrap(value))
  assert not (tmp_path / "deeper").exists()


@pytest.mark.parametrize(
    "text", ["abc", "", "a\x00b", "x" * 200, "\ud800", "é" * 50],
    ids=["word", "empty", "nul", "long", "lone-surrogate", "accented"],
)
def test_a_string_saved_alone_loads_through_every_reader(text, tmp_path, capsys):
  """Format 4 writes a str node as its bare string, the root too; the reader
  refused a bare string root as 'a reference', so once the publish check
  existed every string saved alone was refused with a message about long
  lists (before it, saved and then refused). The reader takes a string root
  (`compact.check_manifest`)."""
  path = tmp_path / "c"
  pzp.save(path, text)
  assert pzp.load(path) == text
  assert pzp.inspect(path) == text
  assert pzp.open(path).load() == text
  assert pzp.verify(path).ok
  assert cli.main(["inspect", str(path)]) == 0
  assert cli.main(["verify", str(path)]) == 0
  with ocp.Checkpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
    checkpointer.save(tmp_path / "v0", args=pzp.PenzaiSave(text))
  assert pzp.load(tmp_path / "v0") == text
