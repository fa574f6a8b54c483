"""Former public spellings of module attributes: still found, with a warning and a date.

When a public name moves or is renamed, its old spelling keeps working until
`REMOVAL`: the module that held it lists it in a table handed to
`module_getattr`, whose result is that module's ``__getattr__`` (PEP 562).
Why not a plain ``old = new`` line (as was done before): such an alias
never tells its users, so it can never be removed, and it hides which
spelling is the real one (tests/test_layout.py now refuses new module-level
aliases). The new spelling is named as text and imported only when the old
one is used, so a table never adds an import to the module holding it.

Example::

  # In pz_persist/orbax/v0_handler.py:
  __getattr__ = deprecations.module_getattr(__name__, {
      "encode_manifest": "pz_persist.storage.writing.writer.encode_hashed",
  })
"""

from __future__ import annotations

import difflib
import importlib
import sys
import warnings
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Mapping
from typing import Any

REMOVAL = "2027-06-01"
"""When the former spellings listed with `module_getattr` stop working."""


def resolve(spelling: str) -> Any:
  """The object ``spelling`` (``package.module.attribute``) names."""
  module_name, _, attribute = spelling.rpartition(".")
  return getattr(importlib.import_module(module_name), attribute)


def warn(old: str, new: str, *, stacklevel: int = 3) -> None:
  """Warns that ``old`` is a deprecated spelling of ``new``."""
  warnings.warn(
      f"{old} is deprecated and will be removed on {REMOVAL}: use {new}.",
      DeprecationWarning, stacklevel=stacklevel,
  )


def module_getattr(module: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
  """A module ``__getattr__`` serving ``moved`` (``{old name: new spelling}``)
  with a `DeprecationWarning` naming both and `REMOVAL`; any other name is
  an `AttributeError`, as without it."""

  def __getattr__(name: str) -> Any:  # pylint: disable=invalid-name
    new = moved.get(name)
    if new is None:
      raise missing(module, name, moved)
    warn(f"{module}.{name}", new)
    return resolve(new)

  return __getattr__


def missing(module: str, name: str, former: Collection[str] = ()) -> AttributeError:
  """The `AttributeError` for a name ``module`` has under no spelling, with
  the names most like it (its own, and its former spellings ``former``).

  Why: a module ``__getattr__`` replaces Python's own error, whose message
  (and, from Python 3.12, its "Did you mean" line) is what a user reads
  after a typo such as ``binding.BindingErorr``.
  """
  names = [n for n in vars(sys.modules[module]) if not n.startswith("_")] + list(former)
  close = difflib.get_close_matches(name, names, n=3)
  hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
  error = AttributeError(f"module {module!r} has no attribute {name!r}{hint}")
  error.name, error.obj = name, sys.modules[module]
  return error
