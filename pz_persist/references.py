"""Naming classes and functions in a checkpoint, and finding them again safely.

A model's structure refers to code: layer classes (``penzai.nn.Linear``),
activation functions (``jax.nn.gelu``), dtypes used as values
(``jax.numpy.float32``). The checkpoint stores each as ``{"module": ...,
"qualname": ...}``. Saving checks that the name finds the very same object
again and that its module is allowed (see `pz_persist.allowlist`); loading
checks the module *before* importing it, then checks that the object found is
the kind of thing expected (a class, a ``pz.Struct`` subclass, a function).

Functions are stored under their public name when they have one: JAX defines
``jax.nn.gelu`` in ``jax._src.nn.functions``, a private module that may move
between JAX releases, so the reference is ``jax.nn.gelu``.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from pz_persist import allowlist
from pz_persist import errors

Reference = dict[str, str]


def _walk(root: Any, qualname: str) -> Any:
  obj = root
  for part in qualname.split("."):
    obj = getattr(obj, part, None)
    if obj is None:
      return None
  return obj


def _is_private(module_name: str) -> bool:
  return any(part.startswith("_") for part in module_name.split("."))


def _public_home(obj: Any, module_name: str, name: str, candidates) -> tuple[str, str]:
  """A public module that exports ``obj`` under ``name``, if ``module_name``
  is private: the name a checkpoint should use, since private modules move."""
  if not _is_private(module_name):
    return module_name, name
  for candidate in candidates:
    module = sys.modules.get(candidate)
    if module is not None and getattr(module, name, None) is obj:
      return candidate, name
  return module_name, name


def _public_ancestors(module_name: str) -> list[str]:
  """``optax._src.transform`` -> ``["optax"]``: public packages above it."""
  parts = module_name.split(".")
  prefixes = [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
  return [p for p in prefixes if not _is_private(p)]


def class_reference(cls: type, *, where: str) -> Reference:
  """The reference to a class (a layer, a namedtuple, an Enum, a dtype)."""
  module_name = getattr(cls, "__module__", None)
  qualname = getattr(cls, "__qualname__", None)
  if not isinstance(module_name, str) or not isinstance(qualname, str):
    raise errors.EncodingError(f"{where}: {cls!r} has no module and qualified name.")
  if "." not in qualname:  # optax.ScaleByAdamState, not optax._src.transform...
    module_name, qualname = _public_home(
        cls, module_name, qualname, _public_ancestors(module_name)
    )
  if not allowlist.is_allowed(module_name):
    raise errors.DisallowedModuleError(
        f"{where}: {module_name}.{qualname} is defined in module"
        f" {module_name!r}, which is not allow-listed, so loading this"
        f" checkpoint would have to import it. {allowlist.hint(module_name)}"
    )
  _check_findable(cls, module_name, qualname, where)
  return {"module": module_name, "qualname": qualname}


def _check_findable(obj: Any, module_name: str, qualname: str, where: str) -> None:
  if "<" in qualname or not allowlist.DOTTED_NAME.match(qualname):
    raise errors.EncodingError(
        f"{where}: {module_name}.{qualname} cannot be found again by name (it"
        " is a lambda or is defined inside a function); define it at module"
        " level."
    )
  module = sys.modules.get(module_name)
  if module is None or _walk(module, qualname) is not obj:
    raise errors.EncodingError(
        f"{where}: {module_name}.{qualname} does not name {obj!r:.60}, so it"
        " could not be found again when loading."
    )


def function_reference(fn: Callable[..., Any], *, where: str) -> Reference:
  """The reference to a function, under its public name when it has one."""
  name = getattr(fn, "__name__", None)
  module_name = getattr(fn, "__module__", None)
  qualname = getattr(fn, "__qualname__", name)
  if isinstance(fn, np.ufunc):
    module_name, qualname = "numpy", fn.__name__
  if not isinstance(module_name, str) or not isinstance(qualname, str):
    raise errors.EncodingError(
        f"{where}: the callable {fn!r:.60} has no module and name; only named"
        " functions can be saved."
    )
  if isinstance(name, str) and _is_private(module_name):
    module_name, qualname = _public_home(
        fn, module_name, name, allowlist.CALLABLE_MODULES
    )
  _check_findable(fn, module_name, qualname, where)
  if not _function_allowed(module_name, qualname, fn):
    raise errors.DisallowedModuleError(
        f"{where}: the function {module_name}.{qualname} may not be named by a"
        " checkpoint: a loaded model would call it, and only numerical"
        f" functions of {', '.join(allowlist.CALLABLE_MODULES)} and NumPy"
        f" ufuncs are allowed by default. {allowlist.hint(module_name)}"
    )
  return {"module": module_name, "qualname": qualname}


def _function_allowed(module_name: str, qualname: str, fn: Any) -> bool:
  if module_name == "numpy" and isinstance(fn, np.ufunc):
    return True
  return allowlist.is_function_allowed(module_name, qualname)


def _parse(ref: Any, where: str) -> tuple[str, str]:
  if (
      not isinstance(ref, dict)
      or set(ref) != {"module", "qualname"}
      or not isinstance(ref["module"], str)
      or not isinstance(ref["qualname"], str)
      or not allowlist.DOTTED_NAME.match(ref["module"])
      or not allowlist.DOTTED_NAME.match(ref["qualname"])
  ):
    raise errors.ManifestError(f"{where}: malformed reference {ref!r:.120}.")
  if any(part.startswith("__") for part in ref["qualname"].split(".")):
    raise errors.ManifestError(f"{where}: refusing dunder name {ref['qualname']!r}.")
  return ref["module"], ref["qualname"]


def _import(module_name: str, where: str) -> Any:
  module = sys.modules.get(module_name)
  if module is not None:
    return module
  try:
    return importlib.import_module(module_name)
  except ImportError as e:
    raise errors.ManifestError(
        f"{where}: cannot import module {module_name!r} named by the checkpoint: {e}"
    ) from e


def _find(module_name: str, qualname: str, where: str) -> Any:
  """The object a checked reference names, found without leaving its module.

  Why: an allowed module's namespace also holds the modules it imported
  (``penzai.core.struct`` holds ``inspect``), and the functions and classes
  it imported from elsewhere. A reference such as ``penzai.core.struct`` /
  ``inspect.getsource`` would pass the allow-list check on its module yet
  reach a module that is not allowed. Saved references never pass through a
  module, and always name objects defined in an allowed module, so both are
  refused here.
  """
  obj = _import(module_name, where)
  for part in qualname.split("."):
    obj = getattr(obj, part, None)
    if obj is None:
      return None
    if isinstance(obj, types.ModuleType):
      raise errors.ManifestError(
          f"{where}: {module_name}.{qualname} passes through module"
          f" {obj.__name__!r}; a checkpoint names a class or function by the"
          " module that defines it."
      )
  home = getattr(obj, "__module__", None)
  if not isinstance(obj, np.ufunc) and (
      not isinstance(home, str) or not allowlist.is_allowed(home)
  ):
    raise errors.DisallowedModuleError(
        f"{where}: {module_name}.{qualname} is defined in module {home!r},"
        f" which is not allow-listed. {allowlist.hint(str(home))}"
    )
  return obj


def resolve_class(
    ref: Any, *, where: str, accept: Callable[[Any], bool], kind: str
) -> type:
  """The class a reference names; imports its module only if allowed.

  Raises:
    ManifestError: malformed reference, or it names something other than
      ``kind`` (as checked by ``accept``).
    DisallowedModuleError: the module is not allowed (nothing was imported).
  """
  module_name, qualname = _parse(ref, where)
  if not allowlist.is_allowed(module_name):
    raise errors.DisallowedModuleError(
        f"{where}: the checkpoint names {module_name}.{qualname}; module"
        f" {module_name!r} is not allow-listed, so it was not imported."
        f" {allowlist.hint(module_name)}"
    )
  obj = _find(module_name, qualname, where)
  if not isinstance(obj, type) or not accept(obj):
    raise errors.ManifestError(f"{where}: {module_name}.{qualname} is not {kind}.")
  return obj


def resolve_function(ref: Any, *, where: str) -> Callable[..., Any]:
  """The function a reference names; imports its module only if allowed."""
  module_name, qualname = _parse(ref, where)
  if not (
      allowlist.is_function_allowed(module_name, qualname) or module_name == "numpy"
  ):
    raise errors.DisallowedModuleError(
        f"{where}: the checkpoint names the function {module_name}.{qualname},"
        " which is not allowed, so its module was not imported."
        f" {allowlist.hint(module_name)}"
    )
  obj = _find(module_name, qualname, where)
  if obj is None or isinstance(obj, type) or not callable(obj):
    raise errors.ManifestError(f"{where}: {module_name}.{qualname} is not a function.")
  if not _function_allowed(module_name, qualname, obj):
    raise errors.DisallowedModuleError(
        f"{where}: {module_name}.{qualname} may not be named by a checkpoint."
    )
  return obj
