"""Every ``pz_persist.x.y`` a docstring of the package names still exists.

Why: docstrings point readers at other modules and functions by dotted name
(`pz_persist.storage.reading.reader.read_arrays`), and modules move (``pretrained.layers``
became `pz_persist.nn`; ``storage/`` is regrouped); a docstring naming a module
that is gone sends the reader nowhere, and nobody rereads every docstring after
a move. So each dotted name under ``pz_persist`` in a module, class or function
docstring is resolved here: imported as a module as far as it goes, the rest
looked up as attributes (or as a dataclass field / annotated class attribute,
which has no class attribute when it has no default).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "pz_persist"

DOTTED = re.compile(r"\bpz_persist(?:\.[A-Za-z_][A-Za-z0-9_]*)+")

# Names of files a checkpoint holds, and the digest list's "format" tag: not Python paths.
FILE_NAMES = frozenset(
    {"pz_persist.json", "pz_persist.files.json", "pz_persist.commit", "pz_persist.files",
     "pz_persist.export.json"})


def _has(obj: object, name: str) -> bool:
  if hasattr(obj, name):
    return True
  if isinstance(obj, type):  # A field without a default has no class attribute.
    if dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
      return True
    return any(name in getattr(k, "__annotations__", {}) for k in obj.__mro__)
  return False


def _resolves(name: str) -> bool:
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for part in parts[i:]:
      if not _has(obj, part):
        return False
      obj = getattr(obj, part, None)
    return True
  return False


def _named_in_docstrings() -> list[tuple[str, int, str]]:
  found = []
  for path in sorted(PACKAGE.rglob("*.py")):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
      if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        continue
      doc = ast.get_docstring(node, clean=False)
      for name in sorted(set(DOTTED.findall(doc or ""))):
        if name not in FILE_NAMES:
          relative = path.relative_to(PACKAGE.parent).as_posix()
          found.append((relative, getattr(node, "lineno", 1), name))
  return found


def test_docstrings_name_some_dotted_paths():
  # Guards the test below against passing because the pattern found nothing.
  assert len(_named_in_docstrings()) > 100


def test_every_dotted_name_in_a_docstring_resolves():
  missing = [f"{file}:{line}: {name}" for file, line, name in _named_in_docstrings()
             if not _resolves(name)]
  if missing:
    pytest.fail(
        "These docstrings name a pz_persist module or attribute that does not exist"
        " (moved or renamed?). Point each at where it lives now:\n  "
        + "\n  ".join(missing)
    )
