"""The package's layout: layers that only import downward, and paths that stay.

ARCHITECTURE.md draws the layers; this test holds the code to the drawing,
so a new import that runs back up fails here instead of quietly growing a
cycle. And what users and checkpoints name (documented module paths, the
handler names Orbax records in every checkpoint) must survive moves.
"""

from __future__ import annotations

import ast
import importlib
import json
import pathlib
import re
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import run_python
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz

import pz_persist as pzp
from pz_persist.orbax import v0_handler
from pz_persist.orbax import v1_handler

PACKAGE = pathlib.Path(pzp.__file__).parent

LAYERS = {
    # The ground: no pz_persist imports but these.
    "deprecations": 0, "version": 0, "penzai_seam": 0,
    "errors": 1,
    "safety": 2, "nn": 2,
    "format": 3,
    "progress": 4, "sharding": 4,
    "storage": 5,
    "orbax": 6,
    "checkpoint": 7, "binding": 7, "lazy": 7,
    "plain_orbax": 8,
    "model": 9, "training": 9,
    "extension": 10,
    "pretrained": 11,
    "tools": 12,
    "__init__": 13,
    "demo": 14,
}
"""Each part of the package (a subpackage or a top-level module) by layer:
a part imports only parts of lower layers, and modules of its own part."""


def _part(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: pathlib.Path) -> list[str]:
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pz_persist"):
      if node.module == "pz_persist":
        found += [f"pz_persist.{alias.name}" for alias in node.names]
      else:
        found.append(node.module)
    elif isinstance(node, ast.Import):
      found += [a.name for a in node.names if a.name.startswith("pz_persist")]
  return found


def _modules():
  for path in sorted(PACKAGE.rglob("*.py")):
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    yield path, module.removesuffix(".__init__")


def test_every_part_has_a_layer():
  parts = {_part(module) for _, module in _modules()}
  assert parts <= set(LAYERS), f"give these a layer: {parts - set(LAYERS)}"


def test_no_import_runs_back_up():
  upward = []
  for path, module in _modules():
    part = _part(module)
    if part == "__init__":
      continue
    for imported in _imports(path):
      target = _part(imported)
      if target != part and LAYERS[target] >= LAYERS[part]:
        upward.append(f"{module} -> {imported}")
  assert not upward, "imports that run back up:\n" + "\n".join(upward)


def _import_graph() -> dict[str, set[str]]:
  """Every pz_persist module and the pz_persist modules it imports: each
  import statement anywhere in it (at the top, under ``if TYPE_CHECKING``, or
  inside a function, run on first use), named as the module it loads
  (``from pz_persist.tools import diff_view`` is ``pz_persist.tools.diff_view``,
  ``from pz_persist.storage import stores`` the package
  ``pz_persist.storage.stores``). A parent package a dotted import runs
  first is no edge: every module would otherwise lean on ``pz_persist``."""
  paths = {module: path for path, module in _modules()}
  graph = {}
  for module, path in paths.items():
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
          base = f"{parent}.{base}" if base else parent
        found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base
                  for a in node.names}
      elif isinstance(node, ast.Import):
        found |= {a.name for a in node.names}
    graph[module] = {name for name in found if name in paths and name != module}
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan's
  algorithm, iterative): each is a set of modules that import each other,
  directly or round a loop."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  found = []
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      node, edges = work[-1]
      step = next(edges, None)
      if step is not None:
        if step not in index:
          index[step] = low[step] = len(index)
          stack.append(step)
          on_stack.add(step)
          work.append((step, iter(sorted(graph[step]))))
        elif step in on_stack:
          low[node] = min(low[node], index[step])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        component = []
        while True:
          member = stack.pop()
          on_stack.discard(member)
          component.append(member)
          if member == node:
            break
        if len(component) > 1:
          found.append(sorted(component))
  return found


def test_no_import_cycle_anywhere():
  """ARCHITECTURE.md says the package has no import cycle; the layers test
  above sees only imports between parts, so this one holds the modules
  inside each part to it too (``tools/diffing`` and ``tools/diff_view`` were
  one cycle, through an import inside a function)."""
  cycles = _cycles(_import_graph())
  assert not cycles, "modules importing each other:\n" + "\n".join(
      " <-> ".join(cycle) for cycle in cycles)


def test_the_cycle_finder_finds_cycles():
  """The check above can fail: a loop of three, a pair, and no loop."""
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d", "a"}, "f": {"a"}}
  assert sorted(_cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []
  graph = _import_graph()
  assert "pz_persist.tools.diff_tree" in graph["pz_persist.tools.diffing"]
  assert "pz_persist.tools.diff_view" in graph["pz_persist.tools.diffing"]


def _module_aliases() -> list[str]:
  """Every module-level ``name = other`` or ``name = module.attribute`` of the
  package (an assignment whose value is only a name or an attribute: what a
  rename or a move used to leave behind), as ``module: name = value``."""
  found = []
  for path, module in _modules():
    for node in ast.parse(path.read_text()).body:
      if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target, value = node.targets[0], node.value
      elif isinstance(node, ast.AnnAssign) and node.value is not None:
        target, value = node.target, node.value
      else:
        continue
      if isinstance(target, ast.Name) and isinstance(value, (ast.Name, ast.Attribute)):
        found.append(f"{module}: {target.id} = {ast.unparse(value)}")
  return found


ALIASES_ALLOWED = {
    # Type shorthands for annotations (the node type of the typed JSON).
    "pz_persist.format.compact: Node = nodes.Node",
    "pz_persist.format.decode: Node = nodes.Node",
    "pz_persist.format.encode: Node = nodes.Node",
    "pz_persist.format.manifest_queries: Node = nodes.Node",
    # A bound builtin, for the frozen dataclass's own __post_init__.
    "pz_persist.format.array_specs: _set = object.__setattr__",
    # A tuple type named for what it holds.
    "pz_persist.storage.integrity.containment: Snapshot = tuple",
    # Orbax's modules by their job (the seam's private names stay there).
    "pz_persist.storage.lifecycle.steps: _step_paths = ocp.path.step",
    "pz_persist.storage.lifecycle.steps: _atomicity = ocp.path.atomicity",
    "pz_persist.storage.lifecycle.steps: COMMIT_MARKER = _atomicity.COMMIT_SUCCESS_FILE",
    # A file name given the role it plays for the digest list (its docstring).
    "pz_persist.storage.integrity.file_digests: _ORBAX_METADATA ="
    " stores.local.ORBAX_CHECKPOINT_METADATA",
    # The extension surface names, for loaders, what they may rely on.
    "pz_persist.extension: FolderSnapshot = containment.Snapshot",
    # Public faces naming the classes their users catch or annotate with.
    "pz_persist.pretrained.hf: UnsupportedConfigError = errors.UnsupportedConfigError",
    "pz_persist.pretrained.hf: CheckpointFolderError = errors.CheckpointFolderError",
    "pz_persist.storage.stores: Store = base.Store",
}
"""Module-level aliases that are not leftovers of a rename or a move."""

def test_no_new_module_level_aliases():
  """A rename or a move leaves no ``old = new`` line behind: an internal
  spelling is replaced at its callers in the same change, a public one is
  served with a warning and a date by `pz_persist.deprecations`. This lists
  every module-level alias and fails on one not allowed above."""
  found = set(_module_aliases())
  new = sorted(found - ALIASES_ALLOWED)
  assert not new, (
      "module-level aliases (replace the old spelling at its callers, or serve a"
      " public one with pz_persist.deprecations.module_getattr):\n" + "\n".join(new))


def test_the_alias_scan_sees_aliases():
  assert "pz_persist.format.decode: Node = nodes.Node" in _module_aliases()
  tree = ast.parse("a = b\nc: int = d.e\nf = g()\nh = 1\n")
  assert [ast.unparse(n) for n in tree.body
          if isinstance(getattr(n, "value", None), (ast.Name, ast.Attribute))] == [
              "a = b", "c: int = d.e"]


STORAGE_ROOMS = {
    "orbax_seam": 0,  # Every private Orbax name.
    "stores": 1,  # The kinds of storage, and how each publishes a checkpoint whole.
    "integrity": 2,  # Checksums, file digests, containment, Orbax's metadata checked.
    "writing": 3, "lifecycle": 3,  # The one writer; leftovers and steps.
    "reading": 4,  # The one way in and the one array reader.
    "destinations": 5,  # What a writer may replace, where an output may go.
}
"""The rooms of `storage/` by floor: a room imports only rooms of lower floors,
and modules of its own room (ARCHITECTURE.md draws them)."""


def _storage_room(module: str) -> str | None:
  parts = module.split(".")
  return parts[2] if len(parts) > 2 and parts[1] == "storage" else None


def _storage_imports(path: pathlib.Path) -> list[str]:
  """`_imports`, with ``from pz_persist.storage import ROOM`` as ROOM itself."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module == "pz_persist.storage":
      found += [f"pz_persist.storage.{alias.name}" for alias in node.names]
  return found + _imports(path)


def test_storage_rooms_import_only_downward():
  rooms = {_storage_room(module) for _, module in _modules()} - {None}
  assert rooms == set(STORAGE_ROOMS), f"give these a floor: {rooms - set(STORAGE_ROOMS)}"
  upward = []
  for path, module in _modules():
    room = _storage_room(module)
    if room is None:
      continue
    for imported in _storage_imports(path):
      target = _storage_room(imported)
      if target is not None and target != room and STORAGE_ROOMS[target] >= STORAGE_ROOMS[room]:
        upward.append(f"{module} -> {imported}")
  assert not upward, "storage imports that run back up:\n" + "\n".join(upward)


_PRIVATE_ORBAX = re.compile(r"^orbax\.checkpoint(\.experimental\.v1)?\._src(\.|$)")


PRETRAINED_MAY_IMPORT = (
    "pz_persist.extension", "pz_persist.errors", "pz_persist.progress", "pz_persist.sharding",
    "pz_persist.nn", "pz_persist.penzai_seam", "pz_persist.pretrained",
)
"""What `pz_persist.pretrained` may import of pz_persist (each with its
submodules): the extension surface, the public modules a loader needs, the
Penzai seam and its own modules; nothing of storage/, format/ or safety/."""


def test_pretrained_is_a_client_of_the_extension_surface():
  """`pretrained/` reads, casts, allocates and publishes only through
  `pz_persist.extension`, so the internal layers move without it."""
  reaching = [
      f"{module} -> {imported}"
      for path, module in _modules() if _part(module) == "pretrained"
      for imported in _imports(path)
      if not any(imported == allowed or imported.startswith(allowed + ".")
                 for allowed in PRETRAINED_MAY_IMPORT)
  ]
  assert not reaching, (
      "pz_persist.pretrained reaches under the extension surface; go through"
      " pz_persist.extension (add what a loader needs there, documented):\n"
      + "\n".join(reaching)
  )


def test_the_pretrained_rule_catches_a_reach_under_the_surface(tmp_path):
  """The rule above reads every form of import (module, name, inside a
  function), so it cannot pass by missing one."""
  source = tmp_path / "m.py"
  source.write_text(
      "from pz_persist.storage import commit\n"
      "from pz_persist import extension, model\n"
      "def f():\n  import pz_persist.format.casts\n"
  )
  assert _imports(source) == [
      "pz_persist.storage", "pz_persist.extension", "pz_persist.model",
      "pz_persist.format.casts",
  ]


def test_only_the_seam_touches_private_orbax_names():
  """Every private Orbax name is in `storage/orbax_seam.py`, with its
  contract test (tests/test_orbax_seam.py): an import of Orbax's ``_src``
  modules, or a string naming one, anywhere else fails here."""
  found = []
  for path, module in _modules():
    if module == "pz_persist.storage.orbax_seam":
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      names = []
      if isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
      elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        names = [node.value]
      found += [f"{module}: {name}" for name in names if _PRIVATE_ORBAX.match(name)]
  assert not found, "private Orbax names outside orbax_seam:\n" + "\n".join(found)


def _is_private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


_PRIVATE_PENZAI_PATH = re.compile(r"^penzai(\.\w+)*\._(?!_)")


def _private_penzai_names(source: str) -> list[str]:
  """Every private Penzai name ``source`` touches: a private module or name
  imported from Penzai, an underscored attribute of anything imported from
  Penzai (``pz_gemma._GEMMA_PRESETS``, ``pz.nx._x``), ``getattr`` of one by
  string, ``vars()`` of a Penzai module, or a string naming one by path."""
  tree = ast.parse(source)
  penzai_names: set[str] = set()
  found: list[str] = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] == "penzai":
          penzai_names.add(alias.asname or "penzai")
          found += [alias.name] if any(map(_is_private, alias.name.split("."))) else []
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "penzai":
      if any(map(_is_private, node.module.split("."))):
        found.append(node.module)
      for alias in node.names:
        penzai_names.add(alias.asname or alias.name)
        if _is_private(alias.name):
          found.append(f"{node.module}.{alias.name}")

  def from_penzai(expr: ast.expr) -> bool:
    while isinstance(expr, (ast.Attribute, ast.Subscript, ast.Call)):
      expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return isinstance(expr, ast.Name) and expr.id in penzai_names

  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and _is_private(node.attr) and from_penzai(node.value):
      found.append(ast.unparse(node))
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
      if node.func.id == "vars" and from_penzai(node.args[0]):
        found.append(ast.unparse(node))
      elif (node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
            and from_penzai(node.args[0]) and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str) and _is_private(node.args[1].value)):
        found.append(ast.unparse(node))
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and _PRIVATE_PENZAI_PATH.match(node.value)):
      found.append(node.value)
  return found


def test_only_the_seam_touches_private_penzai_names():
  """Every private Penzai name is in `penzai_seam.py`, with its contract test
  (tests/test_penzai_seam.py): one anywhere else fails here."""
  found = [
      f"{module}: {name}"
      for path, module in _modules() if module != "pz_persist.penzai_seam"
      for name in _private_penzai_names(path.read_text())
  ]
  assert not found, (
      "private Penzai names outside pz_persist/penzai_seam.py (add what you need"
      " there, with a contract test):\n" + "\n".join(found))


def test_the_penzai_rule_catches_each_form():
  source = """
import penzai
from penzai import pz
from penzai.core import _private_module
from penzai.models.transformer.variants import gemma as pz_gemma
from penzai.models.transformer.variants.gemma import _GEMMA_PRESETS
x = pz_gemma._NEEDS_GATING_TRANSPOSE
y = pz.nx._helper(1)._field
z = getattr(penzai.core, "_secret")
w = vars(pz_gemma)
v = "penzai.core._treescope_handlers"
ok = (pz_gemma.__name__, pz.nx.wrap, self._own, "penzai.core.variables")
"""
  assert sorted(_private_penzai_names(source)) == sorted([
      "penzai.core._private_module",
      "penzai.models.transformer.variants.gemma._GEMMA_PRESETS",
      "pz_gemma._NEEDS_GATING_TRANSPOSE",
      "pz.nx._helper(1)._field",
      "pz.nx._helper",
      "getattr(penzai.core, '_secret')",
      "vars(pz_gemma)",
      "penzai.core._treescope_handlers",
  ])


@pytest.mark.parametrize("module", [
    "pz_persist.errors", "pz_persist.safety", "pz_persist.pretrained",
    "pz_persist.pretrained.hf", "pz_persist.pretrained.gemma",
    "pz_persist.pretrained.safetensors_io", "pz_persist.demo", "pz_persist.progress",
    "pz_persist.sharding",
])
def test_documented_module_paths_import(module):
  importlib.import_module(module)


def test_documented_names_stay_where_the_readme_says():
  assert pzp.safety.MAX_ALLOCATION_BYTES is None  # Deprecated, still there.
  assert pzp.limits is pzp.safety.limits.limits
  assert pzp.errors.PzPersistError
  assert callable(pzp.pretrained.load_hf)


def test_the_command_is_declared_where_it_lives():
  text = (PACKAGE.parent / "pyproject.toml").read_text()
  assert 'pz-persist = "pz_persist.tools.cli:main"' in text
  script = shutil.which("pz-persist")
  argv = [script] if script else [sys.executable, "-m", "pz_persist.tools.cli"]
  result = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr


def test_the_v0_handler_keeps_the_name_checkpoints_record(tmp_path):
  """Orbax records a handler's name in `_CHECKPOINT_METADATA` and finds it
  by that name on `restore(step)`: the name must not follow the module."""
  assert v0_handler.PenzaiCheckpointHandler.typestr() == (
      "pz_persist.orbax_v0.PenzaiCheckpointHandler"
  )
  pzp.save(tmp_path / "ckpt", {"w": jnp.arange(3.0)})
  metadata = json.loads((tmp_path / "ckpt" / "_CHECKPOINT_METADATA").read_text())
  assert "pz_persist.orbax_v0.PenzaiCheckpointHandler" in json.dumps(metadata)


def test_a_v1_checkpoint_naming_the_old_module_still_loads(tmp_path):
  path = tmp_path / "v1"
  tree = {"w": pz.nx.wrap(jnp.arange(4.0)).tag("x")}
  ocp_v1.save_checkpointables(path, {"model": tree})
  metadata_file = path / "_CHECKPOINT_METADATA"
  text = metadata_file.read_text()
  new_name = f"{v1_handler.__name__}.PenzaiCheckpointableHandler"
  assert new_name in text or v0_handler.TYPESTR in text
  metadata_file.write_text(
      text.replace(new_name, v1_handler.LEGACY_TYPESTR)
  )
  loaded = ocp_v1.load_checkpointables(path)["model"]
  assert loaded["w"].named_axes == {"x": 4}
  np.testing.assert_array_equal(loaded["w"].unwrap("x"), np.arange(4.0))


def test_orbax_v0_restores_with_no_arguments_by_the_recorded_name(tmp_path):
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(0, args=ocp.args.Composite(p=pzp.PenzaiSave({"w": jnp.ones(2)})))
    manager.wait_until_finished()
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    np.testing.assert_array_equal(manager.restore(0).p["w"], np.ones(2))


KIND_QUESTIONS = ("is_local(", "is_object_store(")
"""Asking which kind of storage a path is on; `storage.stores.for_path`
decides it once, and callers ask the store they got what differs."""

KIND_QUESTIONS_LEFT = {
    # The safety layer sits below the stores: its link-safe local primitives
    # fall back to epath for URLs, and say which they are.
    "safety/safe_io.py": 7,
    # Only a local directory can hold a link leading out of it.
    "storage/integrity/containment.py": 1,
    # The writer's (issue 29, item 1): digests and the direct write are local.
    "storage/integrity/file_digests.py": 2,
    "storage/writing/direct_write.py": 1,
    # The extension surface's (a local export folder; Orbax's _METADATA size).
    "extension.py": 2,
}
"""Modules still asking, and how many times: this may only shrink."""


def test_only_the_stores_tell_kinds_of_storage_apart():
  asked = {}
  for path, _ in _modules():
    lines = [
        line for line in path.read_text().splitlines()
        if any(q in line for q in KIND_QUESTIONS) and not line.lstrip().startswith("def ")
    ]
    if lines:
      asked[path.relative_to(PACKAGE).as_posix()] = len(lines)
  grown = {
      name: count for name, count in asked.items()
      if not name.startswith("storage/stores/") and count > KIND_QUESTIONS_LEFT.get(name, 0)
  }
  assert not grown, (
      f"these ask which kind of storage a path is on: {grown}; ask its Store"
      " (storage.stores.for_path) what differs instead"
  )


def test_import_leaves_pretrained_and_tools_until_first_use():
  """Most programs save and load: `import pz_persist` does not import the
  pretrained families or the tools (PEP 562 `__getattr__` does, on first use)."""
  out = run_python("""
      import sys
      import pz_persist as pzp
      def heavy():
        return sorted(m for m in sys.modules
                      if m.startswith(("pz_persist.pretrained", "pz_persist.tools")))
      print(heavy())
      assert pzp.load_hf is pzp.pretrained.load_hf
      pzp.verify
      print(bool(heavy()), "pz_persist.tools.verifying" in sys.modules)
  """)
  assert out.splitlines() == ["[]", "True True"]


def test_a_converted_model_loads_in_a_process_that_never_imported_pretrained(tmp_path):
  """`import pz_persist` leaves `pz_persist.pretrained` unimported, and
  loading imports only listed modules: the layers a converted model names
  (`pz_persist.nn`) are listed, so `load_model` finds them in a fresh process
  (the README's convert-once, reload-fast path)."""
  from pz_persist.safety import allowlist  # pylint: disable=import-outside-toplevel

  layers = sorted((PACKAGE / "nn").glob("*.py"))
  assert len(layers) > 1
  for path in layers:
    if path.stem != "__init__":
      assert allowlist.may_import(f"pz_persist.nn.{path.stem}"), path.stem
  run_python(f"""
      import pz_persist as pzp
      from penzai import pz
      from pz_persist.nn.constant_scale import ConstantScale
      pzp.save_model({str(tmp_path / "m")!r}, pz.nn.Sequential([ConstantScale(by=2.0)]))
  """)
  out = run_python(f"""
      import sys
      import pz_persist as pzp
      assert "pz_persist.pretrained" not in sys.modules
      model = pzp.load_model({str(tmp_path / "m")!r})
      print(type(model.sublayers[0]).__name__, model.sublayers[0].by)
  """)
  assert out.split() == ["ConstantScale", "2.0"]


def test_pretrained_entry_points_are_top_level_beside_export_hf():
  for name in ("load_hf", "load_gemma", "load_safetensors", "export_hf", "export_safetensors"):
    assert name in pzp.__all__, name
    assert getattr(pzp, name) is getattr(pzp.pretrained, name), name
  assert set(dir(pzp)) >= set(pzp.__all__)
  assert all(getattr(pzp, name) is not None for name in pzp.__all__)
  with pytest.raises(AttributeError, match="no_such_name"):
    pzp.no_such_name  # noqa: B018  # pylint: disable=pointless-statement


def test_public_names_live_where_their_names_say():
  from pz_persist import sharding  # pylint: disable=import-outside-toplevel

  assert pzp.AxisRules is sharding.AxisRules
  assert pzp.load_into.__module__ == "pz_persist.model"
  assert not hasattr(importlib.import_module("pz_persist.storage.reading.placements"), "AxisRules")


def test_one_table_of_variable_kinds():
  """`format/variable_kinds.py` is the one table: the node table holds a
  value and a slot node per kind, and no module keeps a second map."""
  from pz_persist.format import nodes  # pylint: disable=import-outside-toplevel
  from pz_persist.format import variable_kinds  # pylint: disable=import-outside-toplevel

  for kind in variable_kinds.KINDS.values():
    assert {kind.value_tag, kind.slot_tag} <= set(nodes.NODE_TYPES), kind.name
  second_tables = [
      f"{path.relative_to(PACKAGE)}: {name}"
      for path, _ in _modules() if path.name != "variable_kinds.py"
      for name in ("pz.StateVariableSlot:", "pz.StateVariableValue:", '"state_variable": pz.')
      if name in path.read_text()
  ]
  assert not second_tables, second_tables


def test_every_collected_test_has_one_layer(request):
  """tests/conftest.py gives each test one of unit / integration / process,
  by its rule: checked on every test collected with this one."""
  layers = {}
  for item in request.session.items:
    marks = [m for m in ("unit", "integration", "process") if item.get_closest_marker(m)]
    assert len(marks) == 1, f"{item.nodeid}: {marks}"
    layers[item.nodeid] = marks[0]
  this = request.node.nodeid
  assert layers[this] == "unit"
  starts_one = this.replace(
      "test_every_collected_test_has_one_layer",
      "test_import_leaves_pretrained_and_tools_until_first_use",
  )
  if starts_one in layers:  # It calls run_python: found as a process test.
    assert layers[starts_one] == "process"


def test_test_modules_import_each_other_as_pytest_finds_them():
  """The README's `pytest` puts tests/ itself on `sys.path` (tests/ has no
  `__init__.py`), not the checkout: `from tests import x` imports only where
  the checkout happens to be on the path too (`python -m pytest`, an IDE),
  and CI's `pytest` stops at collection. Helpers are imported as
  `import test_x` or `from hostile import x`."""
  tests_dir = pathlib.Path(__file__).parent
  wrong = []
  for path in sorted(tests_dir.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      names = []
      if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        names = [node.module]
      elif isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      wrong += [
          f"{path.relative_to(tests_dir)}:{node.lineno}: {name}"
          for name in names
          if name == "tests" or name.startswith("tests.")
      ]
  assert not wrong, wrong
