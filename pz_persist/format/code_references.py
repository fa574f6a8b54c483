"""Naming classes and functions in a checkpoint, and finding them again safely.

A model's structure refers to code: layer classes (``penzai.nn.Linear``),
activation functions (``jax.nn.gelu``), dtypes used as values
(``jax.numpy.float32``). The checkpoint stores each as ``{"module": ...,
"qualname": ...}``. Saving checks that the name finds the very same object
again and that its module is allowed (see `pz_persist.safety.allowlist`); loading
checks the module *before* importing it, then checks that the object found is
the kind of thing expected (a class, a ``pz.Struct`` subclass, a function).

Functions are stored under their public name when they have one: JAX defines
``jax.nn.gelu`` in ``jax._src.nn.functions``, a private module that may move
between JAX releases, so the reference is ``jax.nn.gelu``.

Loading never imports a module because a checkpoint names it, since importing
runs the module's code: names are found among the modules already imported,
or the few `allowlist.IMPORTABLE_MODULES`, or the modules the user allowed;
and through ``__dict__`` lookups, never ``getattr``, whose module-level
``__getattr__`` hooks import submodules (``numpy.testing``) on demand.

Whatever a name finds is judged as itself, where it is defined, never by
the name that found it (`_judged_as_itself`): loading computes the object's
own reference, with the very function saving uses, and applies the same
checks to it. A module re-exporting ``numpy.memmap`` or ``numpy.save``
(``from numpy import memmap``) therefore lends it nothing, even when the user
allowed that module; and a name descending through a class finds only what
the allow-list allows in its own right. No part of a qualified name may be
private (``gaussian_kde._setattr``, ``__class__``): those reach what a library
keeps to itself, such as a setter that rewrites ``jax.nn.relu`` or an Enum's
value for the whole process.

Classes are named for two different purposes, with two different rules:

* The class of a node being rebuilt (a layer, a namedtuple, an Enum, a label
  dataclass): the decoder builds the instance itself from checked fields, so
  any class of an allowed module will do (`resolve_class`).
* A class held as a *value* (a layer field, a ``functools.partial``'s
  function, an entry of metadata): whoever receives it may call it, and
  calling a class runs its constructor: ``numpy.memmap(path, mode="w+")``
  truncates a file. Such a class is a callable like any function, so it must
  be safe to call (`class_value_reference`, `resolve_class_value`).

A class of pz_persist's that moved is found under its former name through
the recorded table of `pz_persist.format.former_names`, translated in `_parse`
before anything else judges the name; saving writes the current name only.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import sys
import types
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
from penzai import pz

from pz_persist import errors
from pz_persist.format import former_names
from pz_persist.safety import allowlist

Reference = dict[str, str]


def _own_attribute(obj: Any, name: str) -> Any:
  """``obj.name`` read from a module's or class's own ``__dict__``, else None.

  Why not ``getattr``: a module's ``__getattr__`` may import a submodule
  (``numpy.testing``, ``numpy.f2py``) and a class's attributes may be
  descriptors that run code. A qualified name only ever descends through
  the namespaces that define its parts, so their ``__dict__`` suffices, and
  saving uses this same lookup, so what was saved is found again.
  """
  if not isinstance(obj, (types.ModuleType, type)):
    return None
  return vars(obj).get(name)


def _walk(root: Any, qualname: str) -> Any:
  obj = root
  for part in qualname.split("."):
    obj = _own_attribute(obj, part)
    if obj is None:
      return None
  return obj


def _is_private(module_name: str) -> bool:
  return any(part.startswith("_") for part in module_name.split("."))


def private_part(qualname: str) -> str | None:
  """The first ``_``-prefixed part of ``qualname`` (dunders too), if any.

  Why none may be named: a private attribute is what a library keeps to
  itself, and some write process-wide state (``gaussian_kde._setattr`` set
  ``jax.nn.relu.fun`` when a loaded model ran it as an activation).
  """
  return next((p for p in qualname.split(".") if p.startswith("_")), None)


def _public_home(
    obj: Any, module_name: str, qualname: str, name: str, candidates
) -> tuple[str, str]:
  """The first public module of ``candidates`` that exports ``obj`` as
  ``name``: the name a checkpoint should use, since private modules move
  (``module_name``, ``qualname`` if there is none)."""
  for candidate in candidates:
    if not _is_private(candidate) and (
        _own_attribute(sys.modules.get(candidate), name) is obj
    ):
      return candidate, name
  return module_name, qualname


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
  if (
      _is_private(module_name)  # optax.ScaleByAdamState, not optax._src.transform...
      or _walk(sys.modules.get(module_name), qualname) is not cls  # jax.Array.
  ):
    module_name, qualname = _public_home(
        cls, module_name, qualname, qualname.rsplit(".", 1)[-1],
        (module_name, *_public_ancestors(module_name)),
    )
  if not allowlist.is_allowed(module_name):
    raise errors.DisallowedModuleError(
        f"{where}: {module_name}.{qualname} is defined in module"
        f" {module_name!r}, which is not allow-listed, so loading this"
        f" checkpoint would have to {_find_or_import(module_name)} it."
        f" {allowlist.hint(module_name)}"
    )
  _check_findable(cls, module_name, qualname, where)
  _check_nameable(module_name, qualname, where)
  return {"module": module_name, "qualname": qualname}


_JAX_SCALAR_TYPE = type(jnp.float32)
"""The metaclass of ``jax.numpy.float32`` and its kin (not a public name)."""


def _is_safe_to_call(cls: type) -> bool:
  """Whether calling ``cls`` only builds a value, so a checkpoint may hold it.

  Scalar types (``numpy.float32``, ``ml_dtypes.bfloat16``,
  ``jax.numpy.float32``: the dtypes layers are configured with) convert a
  number; a ``pz.Struct`` class is a dataclass whose constructor stores its
  fields; calling an Enum class looks a member up. Every other class is
  refused, wherever it comes from: the allowed libraries hold classes whose
  constructors create files (``numpy.memmap``), threads, processes or
  callbacks, and no list of those could be trusted to be complete.
  """
  return isinstance(cls, _JAX_SCALAR_TYPE) or issubclass(
      cls, (np.generic, pz.Struct, enum.Enum)
  )


def _check_class_value(cls: type, module_name: str, qualname: str, where: str) -> None:
  if allowlist.is_user_allowed(module_name) or _is_safe_to_call(cls):
    return
  raise errors.DisallowedModuleError(
      f"{where}: the class {module_name}.{qualname} is held as a value, so a"
      " loaded model could call it, and calling a class runs its constructor"
      " (numpy.memmap's writes a file). Only scalar types (numpy.float32,"
      " jax.numpy.bfloat16), pz.Struct classes and Enums may be held as values"
      f" by default. {allowlist.hint(module_name)}"
  )


def class_value_reference(cls: type, *, where: str) -> Reference:
  """The reference to a class held as a value: a callable (module docstring)."""
  ref = class_reference(cls, where=where)
  _check_class_value(cls, ref["module"], ref["qualname"], where)
  return ref


def _check_nameable(module_name: str, qualname: str, where: str) -> None:
  """Refuses at save time the modules loading would refuse to look in."""
  part = allowlist.refused_part(module_name)
  if part is not None:
    raise errors.DisallowedModuleError(
        f"{where}: {module_name}.{qualname} can only be named through module"
        f" {module_name!r}, and loading refuses modules with a private, test or"
        f" entry-point part such as {part!r}. Export it from a public module,"
        f" or if you trust it pass allow_modules=[{module_name!r}]."
    )


def _check_findable(obj: Any, module_name: str, qualname: str, where: str) -> None:
  if "<" in qualname or not allowlist.DOTTED_NAME.match(qualname):
    raise errors.EncodingError(
        f"{where}: {module_name}.{qualname} cannot be found again by name (it"
        " is a lambda or is defined inside a function); define it at module"
        " level."
    )
  if former_names.is_former(module_name, qualname):
    current = ".".join(former_names.current_name(module_name, qualname))
    raise errors.EncodingError(
        f"{where}: {module_name}.{qualname} is recorded as the former name of"
        f" {current} (pz_persist.format.former_names), so loading would find"
        f" {current} instead; rename {obj!r:.60} or move it to another module."
    )
  part = private_part(qualname)
  if part is not None:
    raise errors.DisallowedModuleError(
        f"{where}: {module_name}.{qualname} has the private name part {part!r},"
        " and loading refuses private names (a library's private attributes"
        " include setters of process-wide state); give it a public name."
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
    library = module_name.split(".")[0]  # jax.nn exports JAX's functions, not NumPy's.
    module_name, qualname = _public_home(
        fn, module_name, qualname, name,
        (*(m for m in allowlist.CALLABLE_MODULES if m.split(".")[0] == library),
         *_public_ancestors(module_name)),
    )
  _check_findable(fn, module_name, qualname, where)
  if not _function_allowed(module_name, qualname, fn):
    raise errors.DisallowedModuleError(
        f"{where}: the function {module_name}.{qualname} may not be named by a"
        " checkpoint: a loaded model would call it, and only numerical"
        f" functions of {', '.join(allowlist.CALLABLE_MODULES)} and NumPy"
        f" ufuncs are allowed by default. {allowlist.hint(module_name)}"
    )
  _check_nameable(module_name, qualname, where)
  return {"module": module_name, "qualname": qualname}


def _function_allowed(module_name: str, qualname: str, fn: Any) -> bool:
  if module_name == "numpy" and isinstance(fn, np.ufunc):
    return True
  return allowlist.is_function_allowed(module_name, qualname)


def _parse(ref: Any, where: str) -> tuple[str, str]:
  """The module and qualname a checkpoint's reference names, now.

  Every class and function a checkpoint names is resolved through here, so
  this is the one place a recorded former name becomes the current one
  (`former_names`): before the allow-list and the lookup, which judge the
  current name exactly as if the checkpoint had written it. Only an exact,
  recorded ``(module, qualname)`` is translated; any other name is judged as
  written.
  """
  if (
      not isinstance(ref, dict)
      or set(ref) != {"module", "qualname"}
      or not isinstance(ref["module"], str)
      or not isinstance(ref["qualname"], str)
      or not allowlist.DOTTED_NAME.match(ref["module"])
      or not allowlist.DOTTED_NAME.match(ref["qualname"])
  ):
    raise errors.ManifestError(f"{where}: malformed reference {ref!r:.120}.")
  part = private_part(ref["qualname"])
  if part is not None:
    raise errors.ManifestError(
        f"{where}: refusing private name {ref['module']}.{ref['qualname']}"
        f" (part {part!r}): a checkpoint names public classes and functions only."
    )
  return former_names.current_name(ref["module"], ref["qualname"])


@contextlib.contextmanager
def running_checkpoint_code(where: str, what: str) -> Iterator[None]:
  """Turns whatever code run for a checkpoint raises into a `ManifestError`.

  Loading runs some code a checkpoint chooses: the import of a module the user
  allowed, the constructor of a namedtuple or dataclass it names. That code
  may raise anything, ``SystemExit`` included, and a load must never end the
  process or escape as anything but a `PzPersistError` naming ``where``. Only
  ``KeyboardInterrupt`` (the user's own Ctrl-C) passes through.
  """
  try:
    yield
  except (errors.PzPersistError, KeyboardInterrupt):
    raise
  except BaseException as e:  # pylint: disable=broad-exception-caught
    raise checkpoint_code_error(where, what, e) from e


def call_checkpoint_code(
    where: str, cls: type, make: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
  """``make(*args, **kwargs)``, building a ``cls``, within
  `running_checkpoint_code` (``what``: "cannot rebuild <class>").

  Why not the context manager itself: the decoder rebuilds every layer of a
  model through here, and entering a generator-based context manager cost
  more than the constructor it guards."""
  try:
    return make(*args, **kwargs)
  except (errors.PzPersistError, KeyboardInterrupt):
    raise
  except BaseException as e:  # pylint: disable=broad-exception-caught
    raise checkpoint_code_error(where, f"cannot rebuild {cls.__qualname__}", e) from e


def checkpoint_code_error(where: str, what: str, e: BaseException) -> errors.ManifestError:
  """What `running_checkpoint_code` raises for ``e``."""
  return errors.ManifestError(f"{where}: {what}: {type(e).__name__}: {e}")


def _import(module_name: str, qualname: str, where: str) -> types.ModuleType:
  """The module a reference names, imported only if that is known to be safe.

  Already imported modules are taken from ``sys.modules`` (running nothing);
  others are imported only if pz_persist lists them or the user allowed them
  (see `allowlist.IMPORTABLE_MODULES`). Private, test and entry-point modules
  are refused even when imported (see `allowlist.refused_part`).
  """
  part = allowlist.refused_part(module_name)
  if part is not None:
    raise errors.DisallowedModuleError(
        f"{where}: the checkpoint names {module_name}.{qualname}; part {part!r}"
        f" of module {module_name!r} makes it private, a test or an entry"
        " point, which a checkpoint may not name, so it was not imported."
    )
  module = sys.modules.get(module_name)
  if isinstance(module, types.ModuleType):
    return module
  if module_name.split(".")[0] == allowlist.MAIN_MODULE:
    # Importing it anew would run a program; ``__main__.x`` (allowed with
    # ``__main__``) would import ``__main__`` as a package: looked up only.
    raise _not_defined(module_name, qualname, where)
  if not allowlist.may_import(module_name):
    raise errors.DisallowedModuleError(
        f"{where}: the checkpoint names {module_name}.{qualname}; module"
        f" {module_name!r} is not imported, and loading imports no module a"
        " checkpoint names unless pz_persist lists it or you allow it, so it"
        " was not imported. If you trust it, import it before loading or pass"
        f" allow_modules=[{module_name!r}]."
    )
  with running_checkpoint_code(where, f"importing module {module_name!r} failed"):
    return importlib.import_module(module_name)


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
  obj: Any = _import(module_name, qualname, where)  # A module, then its attributes.
  for part in qualname.split("."):
    obj = _own_attribute(obj, part)
    if obj is None and module_name == allowlist.MAIN_MODULE:
      raise _not_defined(module_name, qualname, where)
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


def _find_or_import(module_name: str) -> str:
  return "find" if module_name == allowlist.MAIN_MODULE else "import"


def _looked_in(module_name: str) -> str:
  return "looked in" if module_name == allowlist.MAIN_MODULE else "imported"


def _not_defined(module_name: str, qualname: str, where: str) -> errors.NotDefinedError:
  """The error for a name of ``__main__`` this process has not defined.

  Why a message of its own: a class defined in a notebook cell is found again
  only in a kernel that has run that cell (loading looks it up in the running
  ``__main__`` and never runs code to define it), so the fix is the user's,
  and it is one of two.
  """
  return errors.NotDefinedError(
      f"{where}: {module_name}.{qualname} is not defined in this process: run the"
      " cell that defines it, or move it into a module (the checkpoint names it,"
      " and loading only looks it up among what this notebook or script has"
      " defined; see docs/guides/notebooks.md)."
  )


def resolve_class(
    ref: Any, *, where: str, accept: Callable[[Any], bool], kind: str
) -> type[Any]:
  """The class of a node being rebuilt, named by an allowed, findable module.

  For a class the decoder constructs itself from checked fields; a class held
  as a value goes through `resolve_class_value`. Modules are found as `_import`
  says: already imported, or listed, or allowed by the user.

  Raises:
    ManifestError: malformed reference, or it names something other than
      ``kind`` (as checked by ``accept``).
    DisallowedModuleError: the module is not allowed, or is not imported and
      may not be (nothing was imported).
  """
  module_name, qualname = _parse(ref, where)
  if not allowlist.is_allowed(module_name):
    raise errors.DisallowedModuleError(
        f"{where}: the checkpoint names {module_name}.{qualname}; module"
        f" {module_name!r} is not allow-listed, so it was not {_looked_in(module_name)}."
        f" {allowlist.hint(module_name)}"
    )
  obj = _find(module_name, qualname, where)
  if not isinstance(obj, type) or not accept(obj):
    raise errors.ManifestError(f"{where}: {module_name}.{qualname} is not {kind}.")
  _judged_as_itself(class_reference, obj, module_name, qualname, where)
  return obj


def resolve_class_value(ref: Any, *, where: str) -> type:
  """A class held as a value; refused unless safe to call (module docstring)."""
  cls = resolve_class(ref, where=where, accept=lambda _: True, kind="a class")
  module_name, qualname = _parse(ref, where)
  _check_class_value(cls, module_name, qualname, where)
  _judged_as_itself(class_value_reference, cls, module_name, qualname, where)
  return cls


def resolve_function(ref: Any, *, where: str) -> Callable[..., Any]:
  """The function a reference names, found as `resolve_class` finds classes."""
  module_name, qualname = _parse(ref, where)
  if not (
      allowlist.is_function_allowed(module_name, qualname) or module_name == "numpy"
  ):
    raise errors.DisallowedModuleError(
        f"{where}: the checkpoint names the function {module_name}.{qualname},"
        f" which is not allowed, so its module was not {_looked_in(module_name)}."
        f" {allowlist.hint(module_name)}"
    )
  obj = _find(module_name, qualname, where)
  if obj is None or isinstance(obj, type) or not callable(obj):
    raise errors.ManifestError(f"{where}: {module_name}.{qualname} is not a function.")
  if not _function_allowed(module_name, qualname, obj):
    raise errors.DisallowedModuleError(
        f"{where}: {module_name}.{qualname} may not be named by a checkpoint."
    )
  _judged_as_itself(function_reference, obj, module_name, qualname, where)
  return obj


def _judged_as_itself(
    reference_of: Callable[..., Reference], obj: Any, module_name: str, qualname: str,
    where: str,
) -> None:
  """Refuses ``obj`` unless saving would name it itself (module docstring).

  Why: a module's namespace holds what it imported as well as what it
  defines. Checking the name a checkpoint gives let an allowed module lend
  anything it imported (``numpy.memmap``, ``numpy.save``), and a name
  descending through a class reach attributes no allow-list rule was about.
  ``reference_of`` is the function saving names such objects with
  (`class_reference`, `class_value_reference`, `function_reference`): it
  derives the name from the object's own ``__module__`` and ``__qualname__``,
  checks that the name finds that very object again, and applies the
  allow-list to it, so loading accepts exactly what saving could write.
  """
  try:
    reference_of(obj, where=where)
  except errors.PzPersistError as e:
    kind = (
        errors.DisallowedModuleError
        if isinstance(e, errors.DisallowedModuleError) else errors.ManifestError
    )
    raise kind(
        f"{e} (The checkpoint names it {module_name}.{qualname}; an object is"
        " judged as itself, by the module that defines it, never by the module"
        " that names it.)"
    ) from None
