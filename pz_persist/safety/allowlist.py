"""Which modules a checkpoint may name.

A checkpoint names classes and functions by module and qualified name (a
namedtuple container, an Enum in a parameter's metadata, a layer class, an
activation function). Finding them again means importing their module, and
importing a module runs its code. So a checkpoint may only name modules on an
allow-list: Penzai, JAX, NumPy, ml_dtypes and optax by default, plus what the
user allows with `allow_modules`. `pz_persist.format.code_references` applies the policy
twice: at save time, so a checkpoint that could not be loaded safely is never
written, and at load time *before* anything is imported, so a hostile
checkpoint cannot make pz_persist import ``os`` or a module with side effects.

An allowed module tree is not a licence to import all of it: NumPy's tree holds
``numpy.f2py.__main__``, which runs a program when imported, and test suites
that reset global state. So loading imports no module a checkpoint names,
except `IMPORTABLE_MODULES` and the user's; it finds names among the modules
already imported, and never names a private, test or entry-point module
(`refused_part`). Functions and classes held as values are callables, with a
narrower list still (`CALLABLE_MODULES`, `pz_persist.format.code_references`).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterable
from collections.abc import Iterator

from pz_persist import errors

DEFAULT_ALLOWED_MODULES: tuple[str, ...] = (
    "penzai",
    "jax",
    "jaxlib",
    "numpy",
    "ml_dtypes",
    "optax",
    "pz_persist.nn",
)
"""Module trees every checkpoint may name. A name covers its submodules.
``pz_persist.nn`` holds the few layers pz_persist adds to Penzai's
architectures (scaled RoPE, mixture of experts...), so a converted model
saves and loads like one built from Penzai alone. Their former home,
``pz_persist.pretrained.layers``, needs no entry: a checkpoint naming it is
read through the recorded former names of `pz_persist.format.former_names`
before this list judges the current name."""

_globally_allowed: set[str] = set()
_scoped_allowed: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "pz_persist_scoped_allowed_modules", default=frozenset()
)

DOTTED_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
"""A module name or qualified name: identifiers joined by dots."""


def _check_module_name(name: str) -> str:
  if not isinstance(name, str) or not DOTTED_NAME.match(name):
    raise errors.ArgumentError(f"Not a module name: {name!r}")
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


def _within(module_name: str, trees: Iterable[str]) -> bool:
  return any(
      module_name == tree or module_name.startswith(tree + ".") for tree in trees
  )


def is_allowed(module_name: str) -> bool:
  """Whether ``module_name`` is inside an allowed module tree."""
  return _within(module_name, allowed_modules())


CALLABLE_MODULES: tuple[str, ...] = (
    "jax.nn",
    "jax.numpy",
    "jax.lax",
    "jax.scipy",
    "jax.random",
    "jax.image",
    "penzai.core",
    "penzai.nn",
    "penzai.models",
)
"""Modules whose functions a checkpoint may name by default.

Narrower than `DEFAULT_ALLOWED_MODULES`: a named function runs when the model
runs (say, as an ``Elementwise`` layer's activation), so by default only
numerical modules without side effects qualify, plus NumPy ufuncs and the
modules the user allows. A function counts as one of these modules' only if
it is theirs: `pz_persist.format.code_references` judges every function by
where it is defined, so ``jax.numpy.save`` (NumPy's ``numpy.save``,
re-exported) is NumPy's, not JAX's.
"""

_DENIED_FUNCTION_NAMES = frozenset({
    "save", "savez", "savez_compressed", "savetxt", "load", "loadtxt",
    "fromfile", "tofile", "genfromtxt", "fromregex", "memmap",
    "set_printoptions", "printoptions",
})  # fmt: skip
"""File I/O that ``jax.numpy`` re-exports from NumPy, and the setters of NumPy's
process-wide print options: never allowed by default."""


def is_function_allowed(module_name: str, name: str) -> bool:
  """Whether a checkpoint may name function ``name`` of ``module_name``.

  By default only module-level functions: a function found through a class
  (``Class.method``) is a method, whose first argument a ``functools.partial``
  could bind to a process-wide object (a function, a class, an Enum member)
  for the method to change.
  """
  if is_user_allowed(module_name):
    return True
  return (
      _within(module_name, CALLABLE_MODULES)
      and "." not in name
      and name not in _DENIED_FUNCTION_NAMES
  )


IMPORTABLE_MODULES: tuple[str, ...] = (
    "penzai.core",
    "penzai.nn",
    "penzai.pz",
    "penzai.models",
    "penzai.toolshed.auto_nmap",
    "penzai.toolshed.gradient_checkpointing",
    "penzai.toolshed.isolate_submodel",
    "penzai.toolshed.jit_wrapper",
    "penzai.toolshed.lora",
    "penzai.toolshed.model_rewiring",
    "penzai.toolshed.save_intermediates",
    "penzai.toolshed.sharding_util",
    "optax",
    "pz_persist.nn",
)
"""Modules loading may import when a checkpoint names one not imported yet.

Importing a module runs its code, so loading never imports a module just
because a checkpoint names it: a reference is found in the modules already
imported (``sys.modules``, where finding it runs nothing), in these modules,
whose import only defines layers and optimizer states (checked by reading
them: ``penzai.toolshed.patch_ipdb``, ``token_visualization`` and
``unflaxify`` are left out, as they import or patch IPython and Flax), and
pz_persist's own layers (``pz_persist.nn``: a converted model names them,
and ``import pz_persist`` does not import them until they are used), or in
the modules the user allows. Any other module, such as an unimported part of
JAX or NumPy (``numpy.f2py.__main__`` runs the f2py tool when imported), is
refused: the message says to import it first, or to allow it.
"""

_UNNAMEABLE_PARTS = frozenset({"test", "tests", "testing", "conftest", "setup"})


PRIVATE_STATE_MODULES: tuple[str, ...] = ("optax",)
"""Libraries whose private modules (``optax.schedules._inject``) a checkpoint
may name. optax defines some optimizer-state classes only there
(``WrappedScheduleState`` of ``inject_hyperparams``, ...), never re-exported,
and ``import optax`` imports every one of them: naming them imports nothing
new, and refusing them would make those optimizers' states unsaveable.
Entry points (``__main__``) and test modules stay refused there too."""


def _is_unnameable_part(part: str, *, private_ok: bool = False) -> bool:
  return (
      (part.startswith("_") and not (private_ok and not part.startswith("__")))
      or part in _UNNAMEABLE_PARTS
      or part.startswith("test_")
      or part.endswith(("_test", "_tests"))
  )


def refused_part(module_name: str) -> str | None:
  """The part of ``module_name`` that no checkpoint may name, if any.

  A checkpoint names the public modules of a library: private modules
  (``_``-prefixed: they move between releases, and ``__main__`` modules run a
  program when imported), test suites (``tests``, ``test_*``, ``conftest``:
  importing one may change global state, as NumPy's reset its global random
  generator) and ``setup`` scripts are never what a saved model refers to.
  Parts of the module tree the user allowed by name are theirs to trust: with
  ``allow_modules=["my_tests._helpers"]`` that module may be named, but
  ``allow_modules=["my_project"]`` does not allow ``my_project._secret`` or
  ``my_project.__main__``.

  Returns:
    The first refused part beyond the user's own allowance, or None.
  """
  parts = module_name.split(".")
  user_trees = frozenset(_globally_allowed) | _scoped_allowed.get()
  covered = max(
      (len(t.split(".")) for t in user_trees if _within(module_name, (t,))),
      default=0,
  )
  private_ok = _within(module_name, PRIVATE_STATE_MODULES)
  return next(
      (p for p in parts[covered:] if _is_unnameable_part(p, private_ok=private_ok)),
      None,
  )


def may_import(module_name: str) -> bool:
  """Whether loading may import ``module_name`` (see `IMPORTABLE_MODULES`)."""
  return is_user_allowed(module_name) or _within(module_name, IMPORTABLE_MODULES)


MAIN_MODULE = "__main__"
"""What a notebook cell or the script being run defines lives in this module.

A checkpoint may name it only with the user's opt-in
(``allow_modules=["__main__"]``), on save and again on load, and loading only
ever looks names up in the running ``__main__``: it is never imported, since
importing ``__main__`` anew would run a program
(`pz_persist.format.code_references`)."""


def hint(module_name: str) -> str:
  """How to allow ``module_name``, for error messages."""
  top = module_name.split(".")[0]
  if top == MAIN_MODULE:
    return (
        "'__main__' holds what a notebook or the running script defines: if you"
        " trust it, pass allow_modules=['__main__'] (to the save and to the load);"
        " loading then finds such a class only among those this process has"
        " defined, so run the cell that defines it first, or move it into a module"
        " (docs/guides/notebooks.md)."
    )
  return (
      f"If you trust it, call pz_persist.allow_modules({top!r}) or pass"
      f" allow_modules=[{top!r}]."
  )


def is_user_allowed(module_name: str) -> bool:
  """Whether the user (not the defaults) allowed ``module_name``."""
  return _within(module_name, frozenset(_globally_allowed) | _scoped_allowed.get())
