"""A manifest's limits hold every legitimate save, and still refuse bombs (issue 36).

Format 4 writes a list of scalars, ``None`` or empty tuples as densely as any
JSON can be written (``[3],[3],...``: 2 bytes per value), so a limit on JSON
values per byte refused manifests that saves had just written ("damaged or
forged"). The limits are now what legitimate saves stay inside
(`pz_persist.format.manifest.parse_json`: values bounded only by
``MAX_MANIFEST_NODES``, objects one per ``MIN_BYTES_PER_OBJECT`` bytes), and
every save checks its manifest with them before writing anything
(`pz_persist.format.manifest.check_publishable`), whatever they are.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import run_python
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import manifest as manifest_lib
from pz_persist.tools import cli

W = np.ones(3)


def _nest(value, levels):
  for _ in range(levels):
    value = (value,)
  return value


DENSE = {
    "history of 6,000 ints": lambda: {"w": W, "history": list(range(6000))},
    "history of 6,000 floats": lambda: {"w": W, "loss": [i / 7 for i in range(6000)]},
    "20,000 None": lambda: {"w": W, "x": [None] * 20000},
    "20,000 empty tuples": lambda: {"w": W, "x": [()] * 20000},
    "20,000 empty lists": lambda: {"w": W, "x": [[]] * 20000},
    "20,000 empty dicts": lambda: {"w": W, "x": [{}] * 20000},
    "20,000 bools": lambda: {"w": W, "x": [True, False] * 10000},
    "20,000 zeros": lambda: {"w": W, "x": [0] * 20000},
    "nested empty tuples": lambda: {"w": W, "x": [_nest((), 90)] * 300},
    "dict of 20,000 keys": lambda: {"w": W, "x": {str(i): None for i in range(20000)}},
    "metadata history": lambda: {"p": pz.ParameterValue(
        value=pz.nx.wrap(W.astype(np.float32)), label="p", metadata={"h": [None] * 20000})},
}


@pytest.mark.parametrize("name", list(DENSE))
def test_a_dense_legitimate_save_is_read_by_every_entry_point(name, tmp_path, capsys):
  tree = DENSE[name]()
  pzp.save(tmp_path / "c", tree)
  item = tmp_path / "c" / "penzai"
  data = (item / manifest_lib.MANIFEST_FILENAME).read_bytes()
  loaded = pzp.load(item)
  assert jax.tree.structure(loaded) == jax.tree.structure(tree)
  assert pzp.inspect(item) is not None and pzp.open(item).load() is not None
  assert pzp.verify(item).ok
  capsys.readouterr()
  assert cli.main(["verify", str(item)]) == 0
  assert cli.main(["inspect", str(item)]) == 0
  with ocp.Checkpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
    assert jax.tree.structure(checkpointer.restore(item)) == jax.tree.structure(tree)
  assert len(data) > 10_000  # Dense, large enough to have met the old limit.


def _manager(path, tree):
  with pzp.CheckpointManager(path) as manager:
    manager.save(1, params=tree)


def _v0(path, tree):
  with ocp.Checkpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
    checkpointer.save(path, args=pzp.PenzaiSave(tree))


def _v1(path, tree):
  ocp_v1.save_checkpointables(path, {"model": [tree, pz.nx.wrap(W)]})


def _type_handler(path, tree):
  variable = pz.Parameter(value=pz.nx.wrap(W.astype(np.float32)), label="p",
                          metadata={"history": tree["history"]})
  with ocp.PyTreeCheckpointer() as checkpointer:
    checkpointer.save(path, {"p": variable})


SAVES = {
    "pzp.save": pzp.save, "pzp.CheckpointManager": _manager, "v0 Checkpointer": _v0,
    "v1": _v1, "type handler": _type_handler,
    "save_model": lambda path, tree: pzp.save_model(path, _model_holding(tree["history"])),
}


def _model_holding(history):
  """A layer whose structure holds the history (a constant of the model)."""
  return pz.nn.Sequential([pz.nn.Elementwise(functools.partial(jax.numpy.add, history))])


@pytest.mark.parametrize("save", list(SAVES))
def test_every_save_path_refuses_what_the_reader_would_whatever_the_limits(
    save, tmp_path, monkeypatch
):
  """With the reader's value limit lowered, a save that would now exceed it
  is refused before anything is written, by every save path: the writer
  checks with the reader's own limits, not a copy of them."""
  monkeypatch.setattr(manifest_lib, "MAX_MANIFEST_NODES", 3000)
  path = tmp_path / "c"
  with pytest.raises(errors.EncodingError, match=r"JSON values .* over the limit of 3000"):
    SAVES[save](path, {"history": list(range(2000))})
  assert not list(path.rglob(manifest_lib.MANIFEST_FILENAME)) if path.exists() else True
  monkeypatch.undo()
  SAVES[save](tmp_path / "fine", {"history": list(range(2000))})  # Within the real limits.
  assert pzp.verify(next((tmp_path / "fine").rglob(manifest_lib.MANIFEST_FILENAME)).parent).ok


def test_the_object_limit_is_checked_at_save_too(tmp_path, monkeypatch):
  """Objects are limited per byte; function references are objects (27
  bytes or more), so no legitimate save meets the limit, and a lowered one is
  met at save time, not after."""
  monkeypatch.setattr(manifest_lib, "MIN_BYTES_PER_OBJECT", 10**9)  # 4,096 objects at most.
  tree = {"f": [jax.nn.relu] * 5000}
  with pytest.raises(errors.EncodingError, match=r"5002 of them are objects, at most 4096"):
    pzp.save(tmp_path / "c", tree)
  assert not (tmp_path / "c").exists()
  monkeypatch.undo()
  pzp.save(tmp_path / "c", tree)
  assert len(pzp.load(tmp_path / "c")["f"]) == 5000


def test_an_object_bomb_in_a_format_4_manifest_is_refused_before_parsing(tmp_path):
  pzp.save(tmp_path / "c", {"w": W})
  manifest = tmp_path / "c" / "penzai" / manifest_lib.MANIFEST_FILENAME
  data = manifest.read_bytes()
  manifest.write_bytes(data[:-1] + b',"x":[' + b"{}," * 300_000 + b"{}]}")
  with pytest.raises(errors.ManifestError, match=r"300003 of them are objects, at most \d+"):
    pzp.load(tmp_path / "c")


def test_a_list_bomb_costs_no_more_memory_than_legitimate_content(tmp_path):
  """``[[],[],...]`` is no denser than 20,000 empty tuples as format 4 writes
  them (``[3,[]],...``), so no per-byte limit tells them apart; parsing it
  costs ~21 bytes per byte (a legitimate manifest up to ~27), and the
  format 4 check then refuses it. Measured in a fresh interpreter."""
  pzp.save(tmp_path / "c", {"w": W})
  manifest = tmp_path / "c" / "penzai" / manifest_lib.MANIFEST_FILENAME
  outcome = run_python(f"""
import tracemalloc
import pz_persist as pzp
from pz_persist import errors
path = {str(manifest)!r}
data = open(path, "rb").read()
open(path, "wb").write(data[:-1] + b',"x":[' + b"[]," * 2_000_000 + b"[]]}}")
size = len(open(path, "rb").read())
tracemalloc.start()
try:
  pzp.inspect({str(tmp_path / "c")!r})
  outcome = "no error"
except errors.PzPersistError as e:
  outcome = str(e)
print(outcome.replace("|", "/") + "|" + str(tracemalloc.get_traced_memory()[1]) + "|" + str(size))
""", timeout=300).strip()
  message, peak, size = outcome.rsplit("|", 2)
  assert "manifest fields" in message, message
  assert int(peak) < 32 * int(size) + 64 * 2**20, (peak, size)
