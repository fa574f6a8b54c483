"""Outsider attacks on issue 36's guarantees, kept as tests (round 4).

Each test is a case a save accepted, a reader refused, or a public entry
point raised something other than a `pz_persist.errors.PzPersistError` for,
found by attacking the merged surfaces from outside; the fix lives where the
guarantee is enforced, named in each test's docstring.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
from penzai import pz

import pz_persist as pzp
from hostile.path_entry_points import entry_points
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


def _path_calls(bad, local):
  """Every public call naming a path (path_entry_points), the writers of a
  named output, the command line's readers."""
  return [
      *entry_points(bad, local),
      ("open", lambda: pzp.open(bad)),
      ("export_safetensors", lambda: pzp.export_safetensors(local, bad)),
      ("render_html", lambda: pzp.render_html({"a": 1}, bad)),
  ]


TOO_LONG = {
    "a name of 300 bytes": lambda tmp: f"{tmp}/{'c' * 300}",
    "a relative name of 300 bytes": lambda tmp: "c" * 300,
    "a path of 5,000 bytes": lambda tmp: f"{tmp}/" + "abcdefgh/" * 560,
    "2,000 folders deep": lambda tmp: f"{tmp}/" + "a/" * 2000,
    "a file:// URL of a long name": lambda tmp: f"file://{tmp}/{'%41' * 300}",
}


@pytest.mark.parametrize("name", list(TOO_LONG))
def test_a_path_no_file_system_holds_is_refused_by_name_everywhere(
    name, tmp_path, monkeypatch, capsys):
  """The system refused these only when the path first reached it: a bare
  OSError ('File name too long') from load/inspect/open/verify/save/diff, and
  a RecursionError from render_html's os.makedirs for a deep one.
  `urls.check_local_length`, on the path every entry point asks its scheme
  of (`urls.scheme`), refuses them first."""
  monkeypatch.chdir(tmp_path)
  local = str(tmp_path / "ok")
  pzp.save(local, {"a": np.ones(2)})
  bad = TOO_LONG[name](tmp_path)
  for call_name, call in _path_calls(bad, local):
    with pytest.raises(errors.ArgumentError, match="no file system can hold this path"):
      call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"], call_name
  for argv in (["inspect", bad], ["verify", bad], ["diff", local, bad],
               ["inspect", local, "--html", bad]):
    assert cli.main(argv) == 2, argv  # An error, not damage (1) nor a failed check (3).
    assert "no file system can hold this path" in capsys.readouterr().err, argv


@pytest.mark.parametrize("bad", [None, 1, 2.5, b"/tmp/ckpt", ["a"]], ids=repr)
def test_a_path_of_the_wrong_type_is_an_argument_type_error(bad, tmp_path):
  """``bytes`` paths met ``'\\0' in text`` first: 'a bytes-like object is
  required, not str'; None and numbers a TypeError from os.fspath."""
  local = str(tmp_path / "ok")
  pzp.save(local, {"a": np.ones(2)})
  for call_name, call in _path_calls(bad, local):
    if call_name.startswith("diff"):
      continue  # diff compares values in memory too: None, 1, b"..." are values.
    with pytest.raises(errors.ArgumentTypeError, match="a path must be a str"):
      call()


SELECTOR_TYPES = {
    "only=1": {"only": 1},
    "only=a function": {"only": lambda label: True},
    "only=[1]": {"only": [1]},
    "only=[None]": {"only": [None]},
    "rename=1": {"rename": 1},
    "rename=a pair too short": {"rename": [("w",)]},
    "rename={1: 'x'}": {"rename": {1: "x"}},
    "rename= not a regex": {"rename": {"(": "x"}},
    "dtype='notadtype'": {"dtype": "notadtype"},
    "dtype={'w': 'int4x'}": {"dtype": {"w": "int4x"}},
    "dtype=object()": {"dtype": object()},
    "dtype={1: 'float16'}": {"dtype": {1: "float16"}},
}


@pytest.mark.parametrize("name", list(SELECTOR_TYPES))
def test_a_selector_of_the_wrong_kind_is_refused_by_name(name, tmp_path):
  """load_into/load_model(into=) raised bare TypeErrors ('int' object is not
  iterable, data type 'notadtype' not understood) or re.error for these;
  `binding._globs`, `binding._rules` and `binding._check_selectors` (where
  every load into a model passes) refuse them naming the option."""
  model = {"w": pz.Parameter(value=pz.nx.wrap(np.ones(3, np.float32)).tag("x"), label="w")}
  pzp.save(tmp_path / "c", model)
  kwargs = SELECTOR_TYPES[name]
  option = name.split("=")[0]
  for call in (lambda: pzp.load_into(tmp_path / "c", model, **kwargs),
               lambda: pzp.load_into(tmp_path / "c", model, **kwargs)):
    with pytest.raises(errors.PzPersistError, match=f"{option}="):
      call()


INSIDE = {
    "its item folder": lambda a: f"{a}/penzai",
    "a new folder in it": lambda a: f"{a}/x",
    "a new folder in its item": lambda a: f"{a}/penzai/x",
    "through '..'": lambda a: f"{a}/penzai/../y",
    "a file:// URL, percent-encoded": lambda a: "file://" + a.replace("/penzai", "") + "/%7A",
}


@pytest.mark.parametrize("name", list(INSIDE))
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_save_inside_another_checkpoint_is_refused_and_the_outer_one_kept(
    name, overwrite, tmp_path):
  """pzp.save(overwrite=True) onto a checkpoint's item folder replaced it
  with a whole checkpoint (the outer one no longer loaded), and a save into
  a folder inside one added files verify reports as damage. The destination
  rule's `destinations.check_outside_checkpoints` is asked by every save
  (`checkpoint.save`: pzp.save, save_model, the CLI's convert)."""
  outer = tmp_path / "outer"
  pzp.save(outer, {"w": np.arange(3.0)})
  before = sorted(str(p.relative_to(outer)) for p in outer.rglob("*"))
  with pytest.raises(errors.ArgumentError, match="lies inside the checkpoint"):
    pzp.save(INSIDE[name](str(outer)), {"v": np.ones(2)}, overwrite=overwrite)
  assert sorted(str(p.relative_to(outer)) for p in outer.rglob("*")) == before
  np.testing.assert_array_equal(pzp.load(outer)["w"], np.arange(3.0))
  assert pzp.verify(outer).ok


@pz.pytree_dataclass
class RoundFourLayer(pz.nn.Layer):
  """A layer as a notebook cell defines it (moved into ``__main__`` below)."""
  w: pz.Parameter

  def __call__(self, x, **unused_side_inputs):
    return x


@pytest.mark.parametrize("module", ["__main__.os", "__main__.sub.pkg"])
def test_a_submodule_of_main_is_looked_up_never_imported(module, tmp_path, monkeypatch):
  """allow_modules=['__main__'] allows ``__main__.x`` too, and loading a
  checkpoint naming ``__main__.os``/``system`` called
  importlib.import_module('__main__.os') (which failed only because
  ``__main__`` has no ``__path__``). Every ``__main__`` name is looked up in
  the running process only (`code_references._import`)."""
  import importlib  # pylint: disable=import-outside-toplevel
  main = sys.modules["__main__"]
  monkeypatch.setattr(RoundFourLayer, "__module__", "__main__")
  monkeypatch.setattr(main, "RoundFourLayer", RoundFourLayer, raising=False)
  model = RoundFourLayer(w=pz.Parameter(value=np.ones(2, np.float32), label="w"))
  pzp.save(tmp_path / "c", model, allow_modules=["__main__"])
  assert type(pzp.load(tmp_path / "c", allow_modules=["__main__"])) is RoundFourLayer
  file = tmp_path / "c" / "penzai" / "pz_persist.json"
  text = file.read_text()
  assert '["__main__","RoundFourLayer"]' in text  # Format 4's classes table.
  file.write_text(text.replace('["__main__","RoundFourLayer"]', f'["{module}","system"]'))
  imported = []
  real_import = importlib.import_module
  monkeypatch.setattr(importlib, "import_module",
                      lambda name, *a: imported.append(name) or real_import(name, *a))
  with pytest.raises(errors.NotDefinedError, match=f"{module}.system is not defined"):
    pzp.load(tmp_path / "c", allow_modules=["__main__"])
  assert not [name for name in imported if name.startswith("__main__")]


@pytest.mark.parametrize("only", ["", [""], ["q", ""]], ids=["empty", "[empty]", "q and empty"])
def test_an_empty_selector_selects_nothing_and_is_refused(only, tmp_path):
  """``only=""`` loaded every variable: as a prefix, "" matched each label,
  since ``"" in _SEPARATORS`` is true of any string. An empty string is no
  label and no prefix (`lazy.indexing._matches`), so it matches nothing and
  is refused as every selector matching nothing is."""
  pzp.save(tmp_path / "c", {
      "p": pz.Parameter(value=np.ones(2, np.float32), label="blocks/p"),
      "q": pz.Parameter(value=np.ones(2, np.float32), label="q"),
  })
  opened = pzp.open(tmp_path / "c")
  with pytest.raises(errors.UnknownLabelError, match="no variable labelled ''"):
    opened.load(only=only)
  with pytest.raises(errors.UnknownLabelError, match="no variable labelled ''"):
    opened.select(only)


@pytest.mark.parametrize("with_penzai", [True, False])
def test_orbax_v1_refuses_a_tree_holding_itself_and_keeps_working(with_penzai, tmp_path):
  """Orbax v1 asks each handler whether a tree is its own; ours flattened it
  with JAX, whose flatten of a list holding itself raised a SystemError and
  left the thread's recursion count behind: every later v1 save or load in
  the process raised RecursionError. `v1_handler._unflattenable` finds the
  cycle first; the tree is claimed and refused by name."""
  from orbax.checkpoint import v1 as ocp_v1  # pylint: disable=import-outside-toplevel
  marker = pz.nx.wrap(np.zeros(2, np.float32)).tag("m")
  held = _self_holding_list()
  tree = {"t": held, "m": marker} if with_penzai else {"t": held}
  with pytest.raises(errors.EncodingError, match="contains itself"):
    ocp_v1.save_checkpointables(tmp_path / "bad", {"model": tree})
  ocp_v1.save_checkpointables(tmp_path / "ok", {"model": {"m": marker}})
  loaded = ocp_v1.load_checkpointables(tmp_path / "ok")["model"]
  np.testing.assert_array_equal(np.asarray(loaded["m"].data_array), np.zeros(2))
  assert [[1]] == [[1]]  # The thread compares nested values again.


UNREACHABLE = {
    "a link to itself": lambda tmp: (os.symlink(tmp / "loop", tmp / "loop"), tmp / "loop")[1],
    "a path through a file": lambda tmp: ((tmp / "f").write_text("x"), tmp / "f" / "x")[1],
}


@pytest.mark.parametrize("name", list(UNREACHABLE))
def test_a_path_the_system_cannot_reach_is_refused_by_name(name, tmp_path, capsys):
  """A link loop or a path through a file raised a bare OSError ('Too many
  levels of symbolic links', 'Not a directory') from every reader and
  save, and `pz-persist verify` reported it as a failed check (3) rather
  than an error (2). `LocalStore.normalise`, where every local path is
  made absolute, refuses it first."""
  local = str(tmp_path / "ok")
  pzp.save(local, {"a": np.ones(2)})
  bad = str(UNREACHABLE[name](tmp_path))
  for call_name, call in [*_path_calls(bad, local), ("load_into", lambda: pzp.load_into(bad, {}))]:
    with pytest.raises(errors.ArgumentError, match="no file or folder can be reached"):
      call()
    assert pzp.verify(local).ok, call_name
  for argv in (["inspect", bad], ["verify", bad], ["verify", "--json", bad], ["ls", bad]):
    assert cli.main(argv) == 2, argv
    assert "no file or folder can be reached" in capsys.readouterr().err, argv
