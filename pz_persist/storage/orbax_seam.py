"""Every private Orbax name pz_persist touches, and every Orbax function it wraps.

Why one module: Orbax's ``_src`` modules and its objects' underscored
attributes carry no compatibility promise, so each release may move or
change them. Gathered here, each with what pz_persist relies on (its
docstring) and a contract test (``tests/test_orbax_seam.py``) that fails,
naming the symbol, when an Orbax release changes it, a new Orbax is checked
in one place; and ``tests/test_orbax_seam.py`` also fails if any other
module of the package imports ``orbax.checkpoint._src`` or
``orbax.checkpoint.experimental.v1._src``. Everything else pz_persist uses of
Orbax is public (``orbax.checkpoint``, ``orbax.checkpoint.v1``,
``ocp.path.atomicity``, ``ocp.metadata``, ...), and where Orbax has a public
hook pz_persist passes it (``temporary_path_class`` of the checkpointer and
of ``CheckpointManagerOptions``) rather than changing Orbax.

The orbax-checkpoint versions this seam supports are the ones
``pyproject.toml`` declares (`SUPPORTED_ORBAX`); CI installs the oldest and
the newest of them and runs the tests that touch Orbax against each.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import orbax.checkpoint as ocp

SUPPORTED_ORBAX = ">=0.12.5,<0.13"
"""The orbax-checkpoint versions pz_persist is tested with (as pyproject.toml
says): what a failing private name's message asks for."""


def _private_module(name: str) -> ModuleType:
  """The Orbax module ``name``, or an ImportError that says what to install."""
  try:
    return importlib.import_module(name)
  except ImportError as e:
    raise ImportError(
        f"pz_persist needs Orbax's module {name}, which this orbax-checkpoint"
        f" ({ocp.__version__}) does not have; install a version pz_persist"
        f" supports: pip install 'orbax-checkpoint{SUPPORTED_ORBAX}'."
    ) from e


_tensorstore_utils = _private_module("orbax.checkpoint._src.serialization.tensorstore_utils")
_futures = _private_module("orbax.checkpoint._src.futures.future")
_v1_context = _private_module("orbax.checkpoint.experimental.v1._src.context.context")


def _private(module: ModuleType, name: str) -> Any:
  """``module.name``, or an AttributeError that says what to install."""
  try:
    return getattr(module, name)
  except AttributeError as e:
    raise AttributeError(
        f"pz_persist needs {module.__name__}.{name}, which this"
        f" orbax-checkpoint ({ocp.__version__}) does not have; install a"
        f" version pz_persist supports: pip install"
        f" 'orbax-checkpoint{SUPPORTED_ORBAX}'."
    ) from e


# ---- Reading private names. -------------------------------------------------


def build_array_write_spec(**kwargs: Any) -> Any:
  """Orbax's ``tensorstore_utils.build_array_write_spec``: the TensorStore
  spec (``.json``) and chunk layout (``.metadata.chunk_shape``) Orbax's array
  handler writes one array with.

  Relied on by `pz_persist.storage.writing.direct_write`, which writes Orbax's files
  byte for byte from it: keyword arguments ``info`` (a
  ``ocp.type_handlers.ParamInfo``), ``arg`` (``ocp.SaveArgs``),
  ``global_shape``, ``local_shape``, ``dtype``, ``use_ocdbt`` and
  ``process_index``. No public function gives the spec Orbax writes with.
  """
  return _private(_tensorstore_utils, "build_array_write_spec")(**kwargs)


def orbax_save_threads() -> type[Any]:
  """The class of the threads Orbax's asynchronous saves run in
  (``orbax.checkpoint._src.futures.future._SignalingThread``, a
  `threading.Thread` subclass).

  Relied on by `pz_persist.storage.lifecycle.leftovers`, which waits for the ones an
  abandoned save started before deleting what it wrote; Orbax exports no way
  to tell its threads from others.
  """
  return _private(_futures, "_SignalingThread")


def active_v1_context() -> Any:
  """The ``orbax.checkpoint.v1.Context`` active where this is called (a new
  default one outside any ``with ocp.Context(...)``): Orbax's private
  ``get_context``.

  Relied on by `pz_persist.orbax.v1_handler`: Orbax builds handlers inside
  the caller's context and exports no accessor for it (a public
  ``ocp_v1.Context()`` would start from defaults, dropping the caller's
  multiprocessing options).
  """
  return _private(_v1_context, "get_context")()


def replace_step_deleter(manager: ocp.CheckpointManager, deleter: Any) -> None:
  """Makes ``manager`` delete steps with ``deleter`` (the ``CheckpointDeleter``
  protocol: ``delete(step)``, ``delete_steps(steps)``, ``close()``).

  Relied on by `pz_persist.training.manager` on object stores, where a
  step's commit marker must go first. Orbax's public deleter options
  (``todelete_subdir``, ``todelete_full_path``, ``enable_background_delete``)
  choose among its own deleters only, none of which deletes the marker
  first; this sets the private ``CheckpointManager._checkpoint_deleter``
  (after closing the one Orbax made).

  Raises:
    AttributeError: this Orbax keeps its deleter elsewhere (a version
      pz_persist is not tested with).
  """
  current = _private(manager, "_checkpoint_deleter")
  current.close()
  manager._checkpoint_deleter = deleter  # pylint: disable=protected-access


def has_step_deleter(manager: ocp.CheckpointManager) -> bool:
  """Whether `replace_step_deleter` can replace ``manager``'s deleter."""
  return hasattr(manager, "_checkpoint_deleter")


# ---- Wrapping Orbax functions. ------------------------------------------------

_WRAPPABLE: dict[str, tuple[ModuleType, str]] = {
    "build_kvstore_tspec": (_tensorstore_utils, "build_kvstore_tspec"),
    "get_default_temporary_path_class": (
        ocp.path.atomicity_defaults, "get_default_temporary_path_class",
    ),
    "get_item_default_temporary_path_class": (
        ocp.path.atomicity_defaults, "get_item_default_temporary_path_class",
    ),
}
"""Every Orbax function pz_persist may wrap, by name: where it lives. Orbax
calls each through its module attribute, so a wrap reaches every caller.

* ``build_kvstore_tspec(directory, name=None, *, use_ocdbt=True, ...)``:
  the TensorStore kvstore spec of an Orbax array directory (``gs://`` and
  local paths only); `pz_persist.storage.stores.s3_kvstore` teaches it ``s3://``.
* ``get_default_temporary_path_class(path, ...)`` and
  ``get_item_default_temporary_path_class(path, ...)``: how Orbax publishes a
  checkpoint or an item at ``path`` when the caller passes no
  ``temporary_path_class`` (``CommitFileTemporaryPath`` for ``gs://``);
  `s3_kvstore` makes them answer for ``s3://`` what they answer for
  ``gs://``, for Orbax's own entry points (pz_persist's own saves pass
  ``temporary_path_class`` instead).

Only `enable_orbax_s3` wraps them (the user's opt-in; see there)."""

_MARK = "__wrapped_by_pz_persist__"


def orbax_function(name: str) -> Callable[..., Any]:
  """The Orbax function ``name`` of `_WRAPPABLE` as Orbax calls it now."""
  module, attribute = _WRAPPABLE[name]
  return _private(module, attribute)


def wrap(name: str, teach: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
  """Replaces the Orbax function ``name`` by ``teach(function)``, marked so
  `unwrap` can undo it. Not thread-safe: the caller holds its lock."""
  module, attribute = _WRAPPABLE[name]
  original = _private(module, attribute)
  wrapped = teach(original)
  setattr(wrapped, _MARK, original)
  setattr(module, attribute, wrapped)


def unwrap(name: str) -> None:
  """Undoes `wrap` of ``name``. A function something else wrapped since is
  left alone (undoing it would remove that wrap too)."""
  module, attribute = _WRAPPABLE[name]
  original = getattr(getattr(module, attribute), _MARK, None)
  if original is not None:
    setattr(module, attribute, original)


def is_wrapped(name: str) -> bool:
  """Whether `wrap` has wrapped the Orbax function ``name`` (and it is still
  the function Orbax calls)."""
  return hasattr(orbax_function(name), _MARK)
