"""Every failure is a PzPersistError, and every error class lives in errors.

Callers catch one class (`pz_persist.errors.PzPersistError`) and find every
class pz_persist raises in one module (the pretrained loaders' own, in
`pz_persist.pretrained.errors`); these tests keep both promises true as
modules are added, so a new error class defined elsewhere, or a bare
`ValueError` at a public entry point, fails here rather than in a user's
``except``.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil
import re
import tomllib

import jax
import numpy as np
import pytest

import pz_persist as pzp
from pz_persist import errors
from pz_persist import progress
from pz_persist import sharding
from pz_persist.pretrained import errors as pretrained_errors

_ROOT = pathlib.Path(pzp.__file__).parent

_HOMES = ("pz_persist.errors", "pz_persist.pretrained.errors")
"""The modules defining exception classes: the library's, and the pretrained
loaders' own."""


def _modules():
  yield pzp
  for info in pkgutil.walk_packages(pzp.__path__, prefix="pz_persist."):
    yield importlib.import_module(info.name)


def test_every_exception_class_is_defined_in_errors():
  defined_elsewhere = sorted(
      f"{value.__module__}.{value.__qualname__}"
      for module in _modules()
      for value in vars(module).values()
      if isinstance(value, type) and issubclass(value, BaseException)
      and value.__module__.startswith("pz_persist")
      and value.__module__ not in _HOMES
  )
  assert defined_elsewhere == []


def test_no_module_defines_an_exception_class_in_its_source():
  # Also catches classes a module defines and does not keep under their name.
  found = []
  for path in _ROOT.rglob("*.py"):
    if path.name == "errors.py" and path.parent in (_ROOT, _ROOT / "pretrained"):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ClassDef) and any(
          re.search(r"(Error|Exception)$", ast.unparse(base)) for base in node.bases
      ):
        found.append(f"{path.relative_to(_ROOT)}: {node.name}")
  assert found == []


def test_every_exception_class_in_errors_is_a_pz_persist_error():
  classes = [
      value for module in (errors, pretrained_errors) for value in vars(module).values()
      if isinstance(value, type) and issubclass(value, BaseException)
      and value.__module__ == module.__name__
  ]
  assert len(classes) > 20
  # Warnings are not failures (`DequantizedWeightsWarning` says what a load
  # produced); every other class is a PzPersistError.
  assert [c.__name__ for c in classes
          if not issubclass(c, (errors.PzPersistError, UserWarning))] == []
  assert [c.__name__ for c in classes if issubclass(c, Warning)] == ["DequantizedWeightsWarning"]


def test_the_pretrained_loaders_errors_live_with_them():
  """Classes only `pz_persist.pretrained` raises are defined in its errors
  module; one raised elsewhere in the package belongs in `pz_persist.errors`."""
  own = {name for name, value in vars(pretrained_errors).items()
         if isinstance(value, type) and value.__module__ == pretrained_errors.__name__}
  assert own == {"CheckpointFolderError", "DequantizedWeightsWarning", "ExportError",
                 "FileChangedError", "GemmaCheckpointError", "SafetensorsFormatError",
                 "UnreadTensorsError"}
  outside = [f"{path.relative_to(_ROOT)}: {name}"
             for path in _ROOT.rglob("*.py") if "pretrained" not in path.parts
             and path.name != "errors.py"
             for name in own if re.search(rf"\b{name}\b", path.read_text())]
  assert outside == []
  assert set(pretrained_errors.__all__) == {
      name for name, value in vars(pretrained_errors).items()
      if isinstance(value, type) and issubclass(value, BaseException)}


@pytest.mark.parametrize("name", sorted(errors.MOVED_TO_PRETRAINED))
def test_a_moved_class_is_still_found_where_it_was_with_a_warning(name):
  with pytest.warns(DeprecationWarning, match=rf"pz_persist\.errors\.{name} is deprecated.*"
                    rf"2027-06-01.*use pz_persist\.pretrained\.errors\.{name}"):
    found = getattr(errors, name)
  assert found is getattr(pretrained_errors, name)
  assert issubclass(found, (errors.PzPersistError, UserWarning))
  with pytest.raises(AttributeError, match="NoSuchError"):
    errors.NoSuchError  # noqa: B018  # pylint: disable=pointless-statement


def test_a_moved_class_imported_by_name_still_works():
  with pytest.warns(DeprecationWarning, match="pz_persist.pretrained.errors.ExportError"):
    from pz_persist.errors import ExportError  # pylint: disable=import-outside-toplevel
  try:
    raise pretrained_errors.ExportError("x")
  except ExportError:  # What user code catching the former spelling does.
    pass


def test_documented_homes_still_name_the_same_classes():
  from pz_persist import binding
  from pz_persist.pretrained import gemma
  from pz_persist.pretrained import hf
  from pz_persist.pretrained import safetensors_io

  with pytest.warns(DeprecationWarning, match="use pz_persist.errors.BindingError"):
    assert pzp.BindingError is binding.BindingError is errors.BindingError  # Until 2027-06-01.
  assert gemma.GemmaCheckpointError is pretrained_errors.GemmaCheckpointError
  assert hf.UnsupportedConfigError is errors.UnsupportedConfigError
  assert hf.CheckpointFolderError is pretrained_errors.CheckpointFolderError
  assert safetensors_io.SafetensorsFormatError is pretrained_errors.SafetensorsFormatError


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))


@pytest.mark.parametrize(
    "call, kind, message",
    [
        (lambda tmp: pzp.save_model(tmp / "m", {"not": "a model"}), TypeError,
         "save_model takes a Penzai model"),
        (lambda tmp: pzp.load_model(tmp / "m", rename={"a": "b"}), ValueError,
         "rename need a model to load into"),
        (lambda tmp: pzp.allow_modules("not a module!"), ValueError, "Not a module name"),
        (lambda tmp: pzp.handler_registry(), ValueError, "handler_registry needs item names"),
        (lambda tmp: sharding.AxisRules(_mesh(), {"embedding": "model"}), ValueError,
         "names mesh axis 'model'"),
        (lambda tmp: pzp.CheckpointManager(tmp / "m", best_mode="median"), ValueError,
         "best_mode must be 'min' or 'max'"),
        (lambda tmp: progress.tracking(3, "x").__enter__(), TypeError, "progress=3"),
    ],
    ids=["save_model-type", "load_model-options", "allow_modules", "handler_registry",
         "axis-rules", "manager-best-mode", "progress-type"],
)
def test_argument_errors_are_pz_persist_errors(call, kind, message, tmp_path):
  with pytest.raises(errors.PzPersistError, match=re.escape(message)) as raised:
    call(tmp_path)
  # Still the built-in class such calls always raised, for existing handlers.
  assert isinstance(raised.value, kind)


def _imported_top_level_modules() -> set[str]:
  names = set()
  for path in _ROOT.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        names.update(alias.name.split(".")[0] for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        names.add(node.module.split(".")[0])
  return names


def test_every_runtime_dependency_is_imported_by_the_package():
  # A dependency the package never imports only costs users an install.
  pyproject = tomllib.loads((_ROOT.parent / "pyproject.toml").read_text())
  import_names = {"orbax-checkpoint": "orbax"}
  imported = _imported_top_level_modules()
  unused = []
  for requirement in pyproject["project"]["dependencies"]:
    distribution = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
    if import_names.get(distribution, distribution) not in imported:
      unused.append(distribution)
  assert unused == []
