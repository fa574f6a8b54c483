"""The exceptions pz_persist raises.

Every failure pz_persist detects is a `PzPersistError`, so callers can catch one
class. Subclasses say *what kind* of problem it was; the message always says
*where*: the checkpoint path, the position in the tree (``tree['params'][3]``),
the variable label or the axis name at fault.

Two families matter to users:

* Save-time errors (`EncodingError`, `DisallowedModuleError`,
  `CheckpointExistsError`) are raised before anything is written, so a failed
  save never leaves a partial checkpoint or touches an existing one.
* Load-time errors (`NotACheckpointError`, `ManifestError`,
  `FormatVersionError`, `UnsafeCheckpointError`, `DisallowedModuleError`,
  `IntegrityError`) are raised before any array is bound into a user's model,
  so a failed load never half-mutates anything.

A public function given an argument it cannot use raises `ArgumentError` (also
a `ValueError`) or `ArgumentTypeError` (also a `TypeError`), so ``except
ValueError`` still works. Every exception class pz_persist defines lives in
this module, but for the pretrained loaders' own (a Gemma preset, a
safetensors file, a Hugging Face folder or export), which live with them in
`pz_persist.pretrained.errors`, also `PzPersistError` subclasses
(``tests/test_error_classes.py`` checks both); modules that documented one
before re-export it, as the same class.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from typing import Any

from pz_persist import deprecations

MOVED_TO_PRETRAINED = (
    "CheckpointFolderError", "DequantizedWeightsWarning", "ExportError",
    "FileChangedError", "GemmaCheckpointError", "SafetensorsFormatError",
)
"""The pretrained loaders' own classes, defined here up to 0.7 and now in
`pz_persist.pretrained.errors`: ``except pz_persist.errors.ExportError`` in
users' code keeps working, with a warning naming where the class lives now,
until `pz_persist.deprecations.REMOVAL`. Named as text, so this module (the
ground the loaders stand on) imports them only when a former spelling is
used."""

__getattr__ = deprecations.module_getattr(
    __name__, {name: f"pz_persist.pretrained.errors.{name}" for name in MOVED_TO_PRETRAINED})


class PzPersistError(Exception):
  """Base class of every error raised by pz_persist."""


class EncodingError(PzPersistError, TypeError):
  """A value in the tree cannot be saved (raised before anything is written).

  Also a `TypeError`, since it is raised for values of unsupported types.
  """


class DisallowedModuleError(PzPersistError):
  """A class or function lives in a module that is not allow-listed.

  Raised at save time (naming the tree path) and at load time (before the
  module is imported). See `pz_persist.allow_modules`.
  """


class NotDefinedError(PzPersistError, NameError):
  """A checkpoint names a class or function of ``__main__`` (a notebook
  cell, the script being run) that this process has not defined.

  Loading never runs code to define it: it looks the name up among what the
  running ``__main__`` already holds. Run the cell that defines it (or move
  it into a module) and load again. See docs/guides/notebooks.md.
  """


class CheckpointExistsError(PzPersistError, FileExistsError):
  """The destination already exists and ``overwrite=True`` was not given."""


class ConcurrentSaveError(CheckpointExistsError):
  """Another process saved the same path at the same time, and won.

  Raised by `pz_persist.save` when, by the time its new checkpoint was
  complete, another save had already put (or replaced) a checkpoint at the
  path: the other one is kept, whole, and nothing of this save is. Also
  raised by `pz_persist.load` when the checkpoint was replaced under it on
  every attempt to read it.
  """


class UnsupportedStorageError(PzPersistError, ValueError):
  """A path on a storage pz_persist cannot keep checkpoints whole on.

  Only local paths, ``gs://`` and ``s3://`` are supported: on those the
  commit protocol is known to be atomic (see `pz_persist.storage.stores`).
  Also raised for a ``gs://`` / ``s3://`` URL that the libraries reading it
  would resolve differently (``..``, ``.``, empty segments, an upper-case
  scheme, ``%``, ``?``, ``#``): see `pz_persist.storage.stores.urls.check_url`.
  """


class MissingExtraError(PzPersistError, ImportError):
  """A feature needs an optional package that is not installed.

  The message names the ``pip install 'pz-persist[...]'`` extra that
  installs it (``[gcs]`` for ``gs://``, ``[s3]`` for ``s3://``), and what
  to run in a clone of the repository (`pz_persist.version.install_command`).
  """


class NotACheckpointError(PzPersistError, FileNotFoundError):
  """The path is not a pz_persist checkpoint (or does not exist)."""


class ManifestError(PzPersistError, ValueError):
  """The checkpoint's manifest is malformed, inconsistent or unsafe."""


class FormatVersionError(ManifestError):
  """The checkpoint was written by a newer pz_persist format than this one."""


class IntegrityError(PzPersistError):
  """Stored bytes no longer match the checksums recorded when they were saved.

  The message names every damaged label (or file). Raised by
  ``load(..., verify=True)`` and by `pz_persist.VerifyReport.raise_if_damaged`.

  Attributes:
    damaged: One line per damaged array or file.
  """

  def __init__(self, message: str, damaged: tuple[str, ...] = ()):
    super().__init__(message)
    self.damaged = tuple(damaged)


class UnsafeCheckpointError(ManifestError):
  """The checkpoint tries to reach outside itself or to exhaust memory.

  For example a symlink pointing out of the checkpoint directory, or arrays
  declaring far more bytes than the machine could hold.
  """


class CheckpointReplacedError(PzPersistError):
  """The checkpoint a `pz_persist.open` handle was opened on was replaced
  (saved again, or its `CheckpointManager` step replaced or deleted) since.

  Raised by the handle's reads, so that it never returns a mix of the old
  checkpoint and the new one; open the path again to read the new one.
  """


class UnknownLabelError(PzPersistError, KeyError):
  """A label asked of a `pz_persist.open` handle is not in the checkpoint, or
  a selector (``only=``, ``rename=``, ``rename_axes=``, ``dtype=`` rules)
  matches none of its labels or axis names.

  Also a `KeyError` (``handle[label]`` is a lookup); the message lists the
  closest labels the checkpoint has.
  """

  def __str__(self) -> str:  # KeyError's would quote the message.
    return str(self.args[0]) if self.args else ""


class WrongItemsError(PzPersistError, ValueError):
  """A step's items are not the ones a helper expects.

  For example `pz_persist.restore_trainer` given a step saved by a plain optax
  loop (``params``, ``opt_state``...) instead of by `pz_persist.trainer_items`.
  """


class ArgumentError(PzPersistError, ValueError):
  """A public function was called with an argument value it cannot use.

  Also a `ValueError` (what such calls raised before), so ``except
  ValueError`` keeps working; the message names the argument and the values
  that would work.
  """


class ArgumentTypeError(PzPersistError, TypeError):
  """A public function was called with an argument of the wrong type.

  Also a `TypeError`, for the same reason `ArgumentError` is a `ValueError`.
  """


class BindingError(PzPersistError, ValueError):
  """A checkpoint does not fit the model; ``report`` lists every difference.

  Re-exported as `pz_persist.BindingError` (``pz_persist.binding.BindingError``
  warns until it is removed on 2027-06-01).

  Attributes:
    report: The `pz_persist.LoadReport` of the refused load.
  """

  def __init__(self, where: str, report: Any):
    self.report = report
    lines = "\n".join(report.problems())
    super().__init__(
        f"{where} does not fit the model; nothing was loaded (pass"
        f" strict=False to load what fits and get a report back):\n{lines}"
    )


class LossyCastError(PzPersistError, ValueError):
  """A dtype cast would change values beyond rounding a float (wrap an
  integer, overflow a float, turn inf into NaN, drop a fraction...), and
  ``allow_lossy=True`` was not given. The message names the file and tensor
  (or label), the dtypes and an offending value. Loading into a model reports
  the same as a `BindingError` listing every such variable.
  """


class MeshError(PzPersistError, ValueError):
  """A saved device mesh does not fit the devices at hand or the mesh passed.

  A checkpoint keeps a mesh as what it means (axis names and sizes; never
  devices), rebuilt on load: over this process's devices, or as the
  ``mesh=`` the load was given (`pz_persist.format.meshes`).
  """


class ArrayReadError(PzPersistError):
  """Reading the stored array under ``key`` failed (``cause`` says why).

  Internal to the direct read path, which turns it into an error naming the
  checkpoint.
  """

  def __init__(self, key: str, cause: BaseException):
    super().__init__(f"{key}: {cause}")
    self.key = key
    self.cause = cause






class UnsupportedConfigError(PzPersistError, ValueError):
  """A Hugging Face ``config.json`` asks for something Penzai cannot build.

  Raised for an unsupported ``model_type`` (listing the supported ones) and
  for a configuration field whose value would change the model's math
  (naming the field and its value), before any tensor is read. Re-exported
  as ``pz_persist.pretrained.hf.UnsupportedConfigError``.
  """



def save_interrupted(message: str) -> KeyboardInterrupt:
  """The `KeyboardInterrupt` an interrupted save raises, shown as one line.

  A plain `KeyboardInterrupt`, not a `PzPersistError`: an interrupt is the
  user's wish, not a failure; ``except Exception`` must not catch it, and
  Python exits by SIGINT (status 130 in a shell, which stops a shell loop)
  only for that exact class. It shows as one line, ``message``, in IPython /
  Jupyter (through ``_render_traceback_``) and in scripts (a wrapper of the
  default ``sys.excepthook``; a hook the program set itself is left alone),
  instead of a traceback through Orbax's internals.
  """
  interrupt = KeyboardInterrupt(message)
  # Attributes IPython and our excepthook look for, on this one instance.
  interrupt._render_traceback_ = lambda: [f"KeyboardInterrupt: {message}"]  # type: ignore[attr-defined]  # pylint: disable=protected-access
  interrupt.pz_persist_one_line = True  # type: ignore[attr-defined]
  _print_one_line_on_exit()
  _quiet_callbacks_into_closed_loops()
  _close_abandoned_coroutines(sys.exc_info()[2])
  return interrupt


def _close_abandoned_coroutines(traceback: types.TracebackType | None) -> None:
  """Closes the coroutines the interrupted stack made and never started, and
  quiets the tasks it left pending in closed loops.

  Why: a Ctrl-C that lands between Orbax making a save's coroutine and its
  event loop running it (while the loop is built, say) leaves that coroutine,
  and the one wrapping it, never awaited; as the stack unwinds Python prints
  "coroutine ... was never awaited" for each, after the interrupt's one line.
  The save is abandoned, so nothing will ever run them: closing them is what
  an unwinding stack would have done. Only coroutines in the ``created``
  state, held by the interrupted frames (or by such a coroutine), are
  touched; one that has started belongs to a running loop and is left alone.

  Likewise a task the interrupt left pending in a loop Orbax has closed
  since (the save's task, when Ctrl-C lands before its first step): nothing
  can run it again, and as it is collected asyncio logged "Task was
  destroyed but it is pending!" after the one line (one SIGINT test in 40).
  Its coroutine is closed as above, and that report is dropped for it alone.
  """
  import asyncio  # pylint: disable=import-outside-toplevel

  pending: list[object] = []
  while traceback is not None:
    pending.extend(traceback.tb_frame.f_locals.values())
    traceback = traceback.tb_next
  seen: set[int] = set()
  while pending:
    value = pending.pop()
    if isinstance(value, asyncio.Task) and not value.done() and value.get_loop().is_closed():
      value._log_destroy_pending = False  # type: ignore[attr-defined]  # pylint: disable=protected-access
      pending.append(value.get_coro())
      continue
    if not isinstance(value, types.CoroutineType) or id(value) in seen:
      continue
    seen.add(id(value))
    if inspect.getcoroutinestate(value) == inspect.CORO_CREATED:
      if value.cr_frame is not None:
        pending.extend(value.cr_frame.f_locals.values())  # A coroutine it wraps.
      value.close()


def _print_one_line_on_exit() -> None:
  import sys  # pylint: disable=import-outside-toplevel

  if sys.excepthook is not sys.__excepthook__:
    return  # Ours already, or the program's own.
  default = sys.excepthook

  def hook(kind, value, traceback):
    if getattr(value, "pz_persist_one_line", False):
      print(f"{kind.__name__}: {value}", file=sys.stderr)
    else:
      default(kind, value, traceback)

  sys.excepthook = hook


def _quiet_callbacks_into_closed_loops() -> None:
  """Drops the two reports an interrupt leaves behind in Orbax's event loops.

  Why: TensorStore's writes already under way when a save is interrupted
  cannot be cancelled; when they finish, their callbacks try to wake Orbax's
  event loop, which the cancelled save has closed, and Python prints each
  failure as an "Exception ignored" traceback, long after the one line that
  says what happened. And a Ctrl-C that lands while Orbax constructs an event
  loop leaves a half-built loop whose finalizer fails on the attributes it
  never got (an ``AttributeError`` in ``BaseEventLoop.__del__``). Only those
  two exact reports are dropped (from then on, in this process, since
  neither is ever actionable); every other unraisable exception still
  reaches the previous hook.
  """
  import sys  # pylint: disable=import-outside-toplevel

  previous = sys.unraisablehook
  if getattr(previous, "pz_persist_quiet_closed_loops", False):
    return

  def hook(unraisable):
    value = unraisable.exc_value
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
      return
    if isinstance(value, AttributeError) and getattr(
        unraisable.object, "__qualname__", None) == "BaseEventLoop.__del__":
      return  # A loop the interrupt stopped half-way through its __init__.
    previous(unraisable)

  hook.pz_persist_quiet_closed_loops = True  # type: ignore[attr-defined]
  sys.unraisablehook = hook


class OptimizerMismatchError(PzPersistError, ValueError):
  """A restored optimizer state was saved by another optimizer.

  The message names the first state that differs (its class and its path in
  the state); the full structures stay available for debugging.

  Attributes:
    expected: The structure (``PyTreeDef``) of the state the optimizer builds.
    found: The structure of the restored state.
  """

  def __init__(self, message: str, *, expected: object = None, found: object = None):
    super().__init__(message)
    self.expected = expected
    self.found = found


@dataclasses.dataclass(frozen=True)
class Location:
  """Where something is, for messages: a file (or checkpoint item), the path
  inside it, and the label of the variable it belongs to.

  Code that names a place in a checkpoint passes this instead of a string, so
  code that needs a part of it (the file, to name the same file's variables
  table) reads the part instead of parsing a message back (which broke on
  labels or paths holding ``": "``). ``str()`` is the text messages print.

  Attributes:
    file: The file or checkpoint item, or None for a bare tree path.
    tree_path: The place inside it as messages print it (``tree.body[2]``,
      ``variables[3] (label 'w')``).
    label: The label of the variable the place is in, if any (already part of
      ``tree_path``'s text where messages show it).
  """

  file: str | None
  tree_path: str
  label: object = None

  def __str__(self) -> str:
    if self.file is None:
      return self.tree_path
    return f"{self.file}: {self.tree_path}"

  def joined(self, suffix: str) -> Location:
    """This location extended by ``suffix`` (``".value"``, ``"[3]"``)."""
    return dataclasses.replace(self, tree_path=self.tree_path + suffix)
