"""No output a user names is written over, inside or around what is read.

``pz-persist diff A B --html A/penzai/pz_persist.json`` overwrote A's
manifest; ``pzp.export_safetensors(ck, ck/"penzai"/"pz_persist.json")``
replaced the checkpoint being exported. Every writer now goes through one
rule, `pz_persist.storage.destinations.check_output` (files:
``write_output``). Here:

* `WRITERS` is every way of writing a file or folder a user names (library
  and command line), each exercised against every way of pointing into its
  source in `WAYS` (links, relative paths, ``..``, ``file://`` URLs, trailing
  slashes, ``~``, hard links): each is refused, the source is byte for byte
  as it was, nothing is left behind, and the message names the destination
  as given and how to fix it;
* `test_every_writing_call_goes_through_the_rule` scans the package for
  file-writing calls: a new writer that neither applies the rule nor is one
  of the reviewed internal writers (a checkpoint's own files, written by a
  save) fails it, as do new public writers and command options
  (`test_every_public_writer_is_exercised`, `test_every_cli_output_is_exercised`)
  missing from `WRITERS`.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import os
import pathlib
import textwrap
import urllib.parse
from collections.abc import Callable
from typing import Any

import jax
import pytest

import pz_persist as pzp
from pz_persist import errors
from pz_persist.tools import cli

_BUILD = """
import jax
from penzai.models.transformer.variants import llamalike_common

def build():
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=2, query_head_multiplier=1, embedding_dim=8, projection_dim=4,
      mlp_hidden_dim=16, num_decoder_blocks=1, vocab_size=16, mlp_variant="swiglu",
      tie_embedder_and_logits=False)
  return llamalike_common.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))
"""

_MODULE = "dest_rule_model"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  """A: a checkpoint of a small transformer; B: the same; H: a Hugging Face
  folder exported from it (the source of ``export_hf(like=)`` and
  ``convert hf``); the module the CLI's ``migrate --model`` builds it with."""
  root = tmp_path_factory.mktemp("dest")
  (root / "code").mkdir()
  (root / "code" / f"{_MODULE}.py").write_text(textwrap.dedent(_BUILD))
  namespace: dict[str, Any] = {}
  exec(compile(textwrap.dedent(_BUILD), "build", "exec"), namespace)  # noqa: S102 (ours)
  model = namespace["build"]()
  pzp.save_model(root / "A", model)
  pzp.save_model(root / "B", model)
  pzp.export_hf(model, root / "H")
  return {"root": root, "model": model, "A": str(root / "A"), "B": str(root / "B"),
          "H": str(root / "H"), "diff": pzp.diff(str(root / "A"), str(root / "B"))}


@dataclasses.dataclass(frozen=True)
class Writer:
  """One way of writing what a user names.

  Attributes:
    source: Which of `env`'s folders it reads ("A" or "H").
    write: Writes ``out``; returns the error message if refused (library:
      the `PzPersistError`; command line: what it printed, exit status 2).
  """

  source: str
  write: Callable[[str, dict[str, Any]], str | None]


def _library(call: Callable[[str, dict[str, Any]], Any]) -> Callable[[str, dict[str, Any]], str | None]:
  def write(out: str, env: dict[str, Any]) -> str | None:
    try:
      call(out, env)
    except errors.PzPersistError as e:
      return str(e)
    return None
  return write


def _command(*argv: str) -> Callable[[str, dict[str, Any]], str | None]:
  """The command line with ``{A}``, ``{B}``, ``{H}`` and ``{out}`` filled in."""
  def write(out: str, env: dict[str, Any]) -> str | None:
    capsys = env["capsys"]
    capsys.readouterr()
    status = cli.main([arg.format(out=out, **env) for arg in argv])
    printed = capsys.readouterr().err
    if status == 0:
      return None
    assert status == 2, printed  # Refused as a bad argument, not a crash.
    return printed
  return write


WRITERS: dict[str, Writer] = {
    "CheckpointDiff.save_html": Writer("A", _library(lambda out, env: env["diff"].save_html(out))),
    "diff(B, A).save_html": Writer("A", _library(
        lambda out, env: pzp.diff(env["B"], env["A"]).save_html(out))),
    "diff(open(A), B).save_html": Writer("A", _library(
        lambda out, env: pzp.diff(pzp.open(env["A"]), env["B"]).save_html(out))),
    "render_html": Writer("A", _library(
        lambda out, env: pzp.render_html(env["A"], out, arrays=False))),
    "render_html(open(A))": Writer("A", _library(
        lambda out, env: pzp.render_html(pzp.open(env["A"]), out, arrays=False))),
    "export_safetensors": Writer("A", _library(
        lambda out, env: pzp.export_safetensors(env["A"], out))),
    "export_safetensors(open(A))": Writer("A", _library(
        lambda out, env: pzp.export_safetensors(pzp.open(env["A"]), out))),
    "export_hf": Writer("H", _library(
        lambda out, env: pzp.export_hf(env["model"], out, like=env["H"], overwrite=True))),
    "migrate": Writer("A", _library(
        lambda out, env: pzp.migrate(env["A"], out, env["model"], overwrite=True))),
    "cli inspect --html": Writer("A", _command("inspect", "{A}", "--html", "{out}")),
    "cli diff --html": Writer("A", _command("diff", "{A}", "{B}", "--html", "{out}")),
    "cli diff B A --html": Writer("A", _command("diff", "{B}", "{A}", "--html", "{out}")),
    "cli export": Writer("A", _command("export", "hf", "{A}", "{out}", "--overwrite")),
    "cli export --like": Writer("H", _command(
        "export", "hf", "{B}", "{out}", "--like", "{H}", "--overwrite")),
    "cli convert": Writer("H", _command("convert", "hf", "{H}", "{out}", "--overwrite",
                                        "--quiet")),
    "cli migrate": Writer("A", _command(
        "migrate", "{A}", "{out}", "--model", f"{_MODULE}:build", "--overwrite")),
}
"""Every writer of a user-named output, by name (the scans below require
each public writer and command option to be here)."""

_FILE_IN = {"A": ("penzai", "pz_persist.json"), "H": ("config.json",)}
"""A file of each source, and the folders leading to it."""


def _ways(source: str, scratch: pathlib.Path, home: pathlib.Path) -> dict[str, str]:
  """Every way of naming a place over, inside or around ``source`` (made in
  ``scratch``: the links); ``home`` is ``~``."""
  parts = _FILE_IN[pathlib.Path(source).name]
  file = os.path.join(source, *parts)
  (scratch / "folder_link").symlink_to(source, target_is_directory=True)
  (scratch / "file_link").symlink_to(file)
  (scratch / "dangling_link").symlink_to(os.path.join(source, "new.out"))
  (scratch / "chain_2").symlink_to(scratch / "folder_link", target_is_directory=True)
  (scratch / "chain_1").symlink_to(scratch / "chain_2", target_is_directory=True)
  os.link(file, scratch / "hard_link")
  first = os.path.join(source, parts[0])
  return {
      "a file of it": file,
      "a new file inside it": os.path.join(source, "new", "new.out"),
      "itself": source,
      "itself with a trailing slash": source + "/",
      "a folder of it with a trailing slash": first + "/" if len(parts) > 1 else source + "//",
      "around it (its parent)": str(pathlib.Path(source).parent),
      "relative": os.path.relpath(file, scratch),
      "relative with ..": os.path.join("..", os.path.relpath(file, scratch.parent)),
      "with .. inside": os.path.join(first, "..", *parts),
      "doubled slashes": source + "//" + "//".join(parts),
      "a file:// URL": "file://" + file,
      "a percent-encoded file://localhost URL": "file://localhost" + urllib.parse.quote(
          file).replace("_", "%5F"),
      "through a linked folder": os.path.join(scratch / "folder_link", *parts),
      "a link to a file of it": str(scratch / "file_link"),
      "a dangling link into it": str(scratch / "dangling_link"),
      "a chain of links": os.path.join(scratch / "chain_1", *parts),
      "a hard link to a file of it": str(scratch / "hard_link"),
      "under ~": "~/" + os.path.relpath(file, home),
  }


def _contents(folder: str) -> dict[str, str]:
  """Every entry under ``folder``: files by sha256, links by target."""
  found = {}
  for parent, folders, files in os.walk(folder):
    for name in folders + files:
      path = os.path.join(parent, name)
      if os.path.islink(path):
        found[path] = "-> " + os.readlink(path)
      elif os.path.isfile(path):
        with open(path, "rb") as f:
          found[path] = hashlib.sha256(f.read()).hexdigest()
      else:
        found[path] = "folder"
  return found


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_no_writer_writes_into_its_source(name, env, tmp_path, monkeypatch, capsys):
  writer = WRITERS[name]
  source = env[writer.source]
  scratch = tmp_path / "scratch"
  scratch.mkdir()
  monkeypatch.chdir(scratch)  # For the relative spellings.
  monkeypatch.setenv("HOME", str(env["root"]))
  monkeypatch.syspath_prepend(str(env["root"] / "code"))  # cli migrate's --model.
  ways = _ways(source, scratch, env["root"])
  root_before = sorted(os.listdir(env["root"]))
  before = _contents(source), _contents(str(scratch))
  for way, out in ways.items():
    message = writer.write(out, {**env, "capsys": capsys})
    assert message is not None, f"{name} wrote {out!r} ({way})"
    assert out in message, f"{name}, {way}: the message does not name {out!r}: {message}"
    assert any(fix in message for fix in ("Choose", "Remove", "name a file")), (
        f"{name}, {way}: the message says no way forward: {message}")
    assert (_contents(source), _contents(str(scratch))) == before, f"{name} changed ({way})"
    assert sorted(os.listdir(env["root"])) == root_before, f"{name} left files ({way})"


def test_a_writer_writes_beside_its_source(env, tmp_path, monkeypatch):
  """The rule refuses only what it must: beside the source, through a
  relative path, a ``file://`` URL or a linked folder outside it, each
  writer writes."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "out_link").symlink_to(tmp_path, target_is_directory=True)
  env["diff"].save_html("diff.html")
  pzp.render_html(pzp.open(env["A"]), f"file://{tmp_path}/r.html", arrays=False)
  pzp.export_safetensors(env["A"], str(tmp_path / "out_link" / "m.safetensors"))
  pzp.export_hf(env["model"], tmp_path / "hf", like=env["H"])
  assert sorted(os.listdir(tmp_path)) == ["diff.html", "hf", "m.safetensors", "out_link",
                                          "r.html"]
  assert pzp.verify(env["A"]).ok


def test_a_destination_inside_any_checkpoint_is_refused(env, tmp_path):
  """Not only the source's: a file added inside any checkpoint is damage
  `verify` reports, so no output goes there (a model in memory has no source)."""
  pzp.save(tmp_path / "other", {"w": jax.numpy.ones(2)})
  for out in (tmp_path / "other" / "penzai" / "view.html", tmp_path / "other" / "view.html"):
    with pytest.raises(errors.ArgumentError, match="lies inside the checkpoint"):
      pzp.render_html(env["model"], out)
  with pytest.raises(errors.ArgumentError, match="lies inside the checkpoint"):
    pzp.export_safetensors(env["model"], tmp_path / "other" / "penzai" / "pz_persist.json")
  assert pzp.verify(tmp_path / "other").ok


def test_the_demo_never_writes_inside_a_checkpoint(env, tmp_path, monkeypatch):
  from pz_persist import demo  # pylint: disable=import-outside-toplevel

  monkeypatch.chdir(tmp_path)  # Where a URL taken for a relative path would land.

  before = _contents(env["A"])
  for out in (env["A"], os.path.join(env["A"], "penzai"), f"file://{env['A']}/x"):
    with pytest.raises(errors.ArgumentError, match="lies inside"):
      demo.main(["--out", out])
  assert _contents(env["A"]) == before and not os.listdir(tmp_path)


def test_a_folder_for_a_file_is_refused_by_name(env, tmp_path):
  (tmp_path / "folder").mkdir()
  with pytest.raises(errors.ArgumentError, match="the destination is a folder; name a file"):
    env["diff"].save_html(tmp_path / "folder")
  assert not os.listdir(tmp_path / "folder")


# ---- The scans: a new writer that skips the rule fails here. ----------------

_PACKAGE = pathlib.Path(pzp.__file__).parent

_WRITE_CALLS = {"write_text", "write_bytes", "writing_whole", "write_small_file", "write_whole",
                "write_safetensors", "write_folder", "mkdir", "makedirs", "pipe_file",
                "create_if_absent", "write_output", "writing_file", "publishing_export"}
_WRITE_CALLS_OF = {"os": {"replace", "rename", "renames", "link", "symlink", "write", "mkdir",
                          "makedirs"},
                   "shutil": {"copy", "copy2", "copyfile", "copytree", "move"}}
_RULE = {"check_output", "write_output"}

REVIEWED = {
    "storage/destinations.py:write_output": "the rule itself: `check_output`'s checks, through"
                                            " `_checked_output`, which keeps the store it chose",
    "checkpoint.py:save": "a checkpoint save: replaces only a checkpoint"
                          " (destinations.check_replaceable)",
    "format/manifest.py:write": "a checkpoint's own manifest, by the save writing it",
    "storage/integrity/file_digests.py:write": "a checkpoint's own file list, by its save",
    "storage/writing/writer.py:LeafSave.write": "a checkpoint's own arrays, by its save",
    "storage/writing/direct_write.py:Started.finish": "a checkpoint's own arrays, by its save",
    "storage/lifecycle/leftovers.py:writing": "a save's marker beside the checkpoint it writes",
    "storage/lifecycle/leftovers.py:_abandon": "moves a save's own leftovers aside",
    "storage/stores/commit_objects.py:publish": "a save's commit object",
    "storage/stores/local.py:LocalStore.write_whole": "the store primitive write_output uses",
    "storage/stores/local.py:LocalStore.create_if_absent": "a save's commit object",
    "storage/stores/objects.py:FsspecStore.write_whole": "the store primitive write_output uses",
    "storage/stores/objects.py:FsspecStore.create_if_absent": "a save's commit object",
    "safety/safe_io.py:writing_whole": "the primitive write_output and saves use",
    "safety/safe_io.py:write_small_file": "the primitive saves and exports use",
    "safety/safe_io.py:_upload": "the primitive write_output uses remotely",
    "extension.py:writing_file": "the primitive loaders write files through, after"
                                 " check_output (export_safetensors, export_hf)",
    "extension.py:write_small_file": "the same, for small files",
    "extension.py:publishing_export": "an export's own new sibling folder, after"
                                      " check_output and check_export_destination",
    "pretrained/safetensors_io.py:write_safetensors": "not public: written by"
                                                      " export_safetensors and write_folder"
                                                      " after check_output",
    "pretrained/hf/folder_writer.py:write_folder": "called by export_hf after check_output,"
                                                   " into its own new sibling folder",
    "tools/cli.py:main": "opens os.devnull",
}
"""Functions that write files without applying the rule themselves, and why
each may (file: qualified function)."""


class _Writes(ast.NodeVisitor):
  """Collects, into ``found``, each function of one module holding a
  file-writing call, with the names of everything it calls."""

  def __init__(self, relative: str, source: str, found: dict[str, set[str]]):
    self.relative, self.source, self.found = relative, source, found
    self.stack: list[tuple[str, set[str]]] = []

  def _scope(self, node):
    self.stack.append((node.name, set()))
    self.generic_visit(node)
    name, calls = self.stack.pop()
    if isinstance(node, ast.ClassDef):
      return
    qualified = ".".join([*(n for n, _ in self.stack), name])
    if "<write>" in calls:
      self.found[f"{self.relative}:{qualified}"] = calls
    if self.stack:  # A nested function's calls are its parent's too.
      self.stack[-1][1].update(calls)

  visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

  def visit_Call(self, node):
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    owner = (func.value.id if isinstance(func, ast.Attribute)
             and isinstance(func.value, ast.Name) else None)
    writes = name in _WRITE_CALLS or name in _WRITE_CALLS_OF.get(owner or "", ())
    if name == "open":
      text = ast.get_source_segment(self.source, node) or ""
      if owner == "os":
        writes = any(flag in text for flag in ("O_CREAT", "O_WRONLY", "O_RDWR"))
      else:
        modes = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)] + [
            k.value.value for k in node.keywords
            if k.arg == "mode" and isinstance(k.value, ast.Constant)]
        writes = any(isinstance(m, str) and set(m) & set("wax+") for m in modes)
    if name == "save" and "checkpointer" in ast.unparse(func).lower():
      writes = True  # Orbax writing a checkpoint.
    if self.stack and name:
      self.stack[-1][1].add(name)
      if writes:
        self.stack[-1][1].add("<write>")
    self.generic_visit(node)


def _writing_functions() -> dict[str, set[str]]:
  """``file:function`` of each function of the package holding a
  file-writing call, with the names of everything it calls."""
  found: dict[str, set[str]] = {}
  for path in sorted(_PACKAGE.rglob("*.py")):
    source = path.read_text()
    _Writes(path.relative_to(_PACKAGE).as_posix(), source, found).visit(ast.parse(source))
  return found


def test_every_writing_call_goes_through_the_rule():
  writing = _writing_functions()
  assert "tools/diffing.py:CheckpointDiff.save_html" in writing  # The scan sees writers.
  unreviewed = sorted(name for name, calls in writing.items()
                      if not calls & _RULE and name not in REVIEWED)
  assert not unreviewed, (
      "these functions write files without the destination rule: make them call"
      " pz_persist.storage.destinations.check_output / write_output with what they"
      f" read, or (for a checkpoint's own files) add them to REVIEWED: {unreviewed}")
  stale = sorted(set(REVIEWED) - set(writing))
  assert not stale, f"REVIEWED names functions that no longer write: {stale}"


_OUTPUT_PARAMETERS = {"out", "dst", "folder", "destination", "output", "html"}
_WRITER_NAME = ("save", "export", "write", "render", "dump", "migrate", "convert")
_CHECKPOINT_SAVES = {"save", "save_model", "CheckpointManager.save",
                     "PenzaiCheckpointHandler.save", "PenzaiCheckpointableHandler.save"}
"""Writers of checkpoints, whose destination rule is that only a checkpoint
is replaced (`test_replace_destination`), or of the item folder Orbax hands
its handlers inside the step it writes."""


def _public_callables() -> dict[str, Any]:
  found = {}
  for module, names in ((pzp, pzp.__all__), (pzp.pretrained, pzp.pretrained.__all__)):
    for name in names:
      value = getattr(module, name)
      if inspect.isclass(value) or callable(value):
        found[name] = value
  found["CheckpointDiff"] = type(pzp.diff({}, {}))
  for name, value in list(found.items()):
    if inspect.isclass(value):
      for attribute, member in vars(value).items():
        if callable(member) and not attribute.startswith("_"):
          found[f"{name}.{attribute}"] = member
  return found


def test_every_public_writer_is_exercised():
  covered = {name.split("(")[0] for name in WRITERS}
  missing = []
  for name, value in _public_callables().items():
    if inspect.isclass(value):
      continue
    try:
      parameters = set(inspect.signature(value).parameters)
    except (TypeError, ValueError):
      continue
    short = name.rsplit(".", 1)[-1]
    if (parameters & _OUTPUT_PARAMETERS or short.startswith(_WRITER_NAME)) and (
        name not in covered and name not in _CHECKPOINT_SAVES):
      missing.append(name)
  assert not missing, f"public writers not tried against their sources in WRITERS: {missing}"


def test_every_cli_output_is_exercised():
  from pz_persist import demo  # pylint: disable=import-outside-toplevel

  parser = cli.build_parser()
  commands = next(action for action in parser._actions  # pylint: disable=protected-access
                  if action.dest == "command").choices
  outputs = {
      (command, action.dest)
      for command, sub in commands.items()
      for action in sub._actions  # pylint: disable=protected-access
      if action.dest in _OUTPUT_PARAMETERS
  }
  tried = {(argv.split()[1], "html" if "--html" in argv else "dst") for argv in WRITERS
           if argv.startswith("cli ")}
  assert outputs <= tried, f"command outputs not in WRITERS: {sorted(outputs - tried)}"
  assert "--out" in inspect.getsource(demo.main)  # test_the_demo_never_writes_inside_a_checkpoint


def test_object_store_outputs_follow_the_rule(remote):
  """On gs:// and s3:// too: never into the checkpoints compared (however
  the commit objects lay them out), nor into any other checkpoint there."""
  from etils import epath  # pylint: disable=import-outside-toplevel

  tree = {"w": jax.numpy.arange(3.0)}
  source, other = f"{remote}/A", f"{remote}/other"
  pzp.save(source, tree)
  pzp.save(other, tree)
  result = pzp.diff(source, source)
  for out in (f"{source}/penzai/pz_persist.json", f"{source}/view.html", source, f"{source}/",
              remote, f"{other}/view.html", f"{other}/penzai/view.html"):
    with pytest.raises(errors.ArgumentError, match="Choose a destination outside") as raised:
      result.save_html(out)
    assert out in str(raised.value)
    with pytest.raises(errors.ArgumentError, match="Choose a destination outside"):
      pzp.export_safetensors(pzp.open(source), out)
  assert pzp.verify(source).ok and pzp.verify(other).ok
  written = result.save_html(f"{remote}/views/diff.html")
  assert "<html" in epath.Path(written).read_text()


def test_a_diff_remembers_its_sources_from_where_it_was_made(env, tmp_path, monkeypatch):
  """Compared by relative paths, then saved from another working directory:
  the sources are the checkpoints compared, not what the names mean later."""
  monkeypatch.chdir(env["root"])
  result = pzp.diff("A", "B")
  monkeypatch.chdir(tmp_path)
  with pytest.raises(errors.ArgumentError, match="lies inside the source"):
    result.save_html(os.path.join(env["A"], "view.html"))
  result.save_html("A")  # ./A here is no source: written.
  assert (tmp_path / "A").is_file()
