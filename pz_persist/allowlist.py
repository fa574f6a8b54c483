"""Which modules a checkpoint may name, and how named classes are found again.

A checkpoint names classes by module and qualified name (a namedtuple container,
an Enum in a parameter's metadata, a label dataclass). Finding such a class
again means importing its module, and importing a module runs its code. So a
checkpoint may only name modules on an allow-list: Penzai, JAX, NumPy, ml_dtypes
and optax by default, plus what the user allows with `allow_modules`. The check
happens twice: at save time, so a checkpoint that could not be loaded safely is
never written, and at load time *before* anything is imported, so a hostile
checkpoint cannot make pz_persist import ``os`` or a module with side effects.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pz_persist import errors

DEFAULT_ALLOWED_MODULES: tuple[str, ...] = (
    "penzai",
    "jax",
    "jaxlib",
    "numpy",
    "ml_dtypes",
    "optax",
)
"""Module trees every checkpoint may name. A name covers its submodules."""

_globally_allowed: set[str] = set()
_scoped_allowed: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "pz_persist_scoped_allowed_modules", default=frozenset()
)

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_QUALNAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _check_module_name(name: str) -> str:
  if not isinstance(name, str) or not _MODULE_NAME.match(name):
    raise ValueError(f"Not a module name: {name!r}")
  return name


def allow_modules(*module_names: str) -> None:
  """Allows checkpoints to name classes from these modules (and submodules).

  Needed when a saved tree holds, say, a namedtuple or an Enum defined in your
  own code. The allowance is process-wide; pass ``allow_modules=`` to a single
  `pz_persist.save` / `pz_persist.load` call to scope it to that call.

  Example::

    import pz_persist as pzp
    pzp.allow_modules("my_project.train_state")

  Args:
    *module_names: Fully qualified module names, e.g. ``"my_project"``.
  """
  for name in module_names:
    _globally_allowed.add(_check_module_name(name))


def allowed_modules() -> frozenset[str]:
  """The module trees currently allowed (defaults, global and scoped)."""
  return (
      frozenset(DEFAULT_ALLOWED_MODULES)
      | frozenset(_globally_allowed)
      | _scoped_allowed.get()
  )


@contextlib.contextmanager
def scoped_allowance(module_names: Iterable[str] | None) -> Iterator[None]:
  """Temporarily allows extra modules (the ``allow_modules=`` keyword)."""
  extra = frozenset(_check_module_name(n) for n in (module_names or ()))
  token = _scoped_allowed.set(_scoped_allowed.get() | extra)
  try:
    yield
  finally:
    _scoped_allowed.reset(token)


def is_allowed(module_name: str) -> bool:
  """Whether ``module_name`` is inside an allowed module tree."""
  return any(
      module_name == allowed or module_name.startswith(allowed + ".")
      for allowed in allowed_modules()
  )


def _hint(module_name: str) -> str:
  top = module_name.split(".")[0]
  return (
      f"If you trust it, call pz_persist.allow_modules({top!r}) or pass"
      f" allow_modules=[{top!r}]."
  )


def reference_to(obj: Any, *, where: str) -> dict[str, str]:
  """A JSON reference ``{"module", "qualname"}`` to a class (checked on save).

  Raises:
    DisallowedModuleError: the module is not allowed.
    EncodingError: the object could not be found again by that name (for
      instance a class defined inside a function).
  """
  module_name = getattr(obj, "__module__", None)
  qualname = getattr(obj, "__qualname__", None)
  if not isinstance(module_name, str) or not isinstance(qualname, str):
    raise errors.EncodingError(f"{where}: {obj!r} has no module/qualified name.")
  if not is_allowed(module_name):
    raise errors.DisallowedModuleError(
        f"{where}: {module_name}.{qualname} is defined in module"
        f" {module_name!r}, which is not allow-listed, so loading this"
        f" checkpoint would have to import it. {_hint(module_name)}"
    )
  if "<locals>" in qualname or not _QUALNAME.match(qualname):
    raise errors.EncodingError(
        f"{where}: {module_name}.{qualname} cannot be found again by name"
        " (it is defined inside a function); define it at module level."
    )
  module = sys.modules.get(module_name)
  found = _walk_qualname(module, qualname) if module is not None else None
  if found is not obj:
    raise errors.EncodingError(
        f"{where}: {module_name}.{qualname} does not name {obj!r}, so it could"
        " not be found again when loading."
    )
  return {"module": module_name, "qualname": qualname}


def _walk_qualname(root: Any, qualname: str) -> Any:
  obj = root
  for part in qualname.split("."):
    obj = getattr(obj, part, None)
    if obj is None:
      return None
  return obj


def resolve(
    ref: Any,
    *,
    where: str,
    accept: Callable[[Any], bool],
    kind: str,
) -> Any:
  """Finds the object a checkpoint reference names, importing only if allowed.

  Args:
    ref: The ``{"module", "qualname"}`` JSON object from the manifest.
    where: Position in the checkpoint, for error messages.
    accept: Predicate the resolved object must satisfy (for instance "is an
      Enum class").
    kind: What ``accept`` checks, for error messages.

  Raises:
    ManifestError: the reference is malformed or names the wrong kind of thing.
    DisallowedModuleError: the module is not allowed (nothing was imported).
  """
  if (
      not isinstance(ref, dict)
      or set(ref) != {"module", "qualname"}
      or not isinstance(ref["module"], str)
      or not isinstance(ref["qualname"], str)
      or not _MODULE_NAME.match(ref["module"])
      or not _QUALNAME.match(ref["qualname"])
  ):
    raise errors.ManifestError(f"{where}: malformed class reference {ref!r}.")
  module_name, qualname = ref["module"], ref["qualname"]
  if not is_allowed(module_name):
    raise errors.DisallowedModuleError(
        f"{where}: the checkpoint names {module_name}.{qualname}; module"
        f" {module_name!r} is not allow-listed, so it was not imported."
        f" {_hint(module_name)}"
    )
  if any(part.startswith("__") for part in qualname.split(".")):
    raise errors.ManifestError(f"{where}: refusing dunder name {qualname!r}.")
  module = sys.modules.get(module_name)
  if module is None:
    try:
      module = importlib.import_module(module_name)
    except ImportError as e:
      raise errors.ManifestError(
          f"{where}: cannot import module {module_name!r} named by the"
          f" checkpoint: {e}"
      ) from e
  obj = _walk_qualname(module, qualname)
  if obj is None or not accept(obj):
    raise errors.ManifestError(
        f"{where}: {module_name}.{qualname} is not {kind}."
    )
  return obj
