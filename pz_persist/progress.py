"""Progress of long operations: one place that decides whether to show a bar.

Every long operation (`pz_persist.verify`, `pz_persist.diff`,
`pz_persist.pretrained.load_hf`, `pz_persist.pretrained.load_gemma`, the
``pz-persist`` command) takes a ``progress`` argument meaning:

* ``None`` (the default): automatic. A tqdm bar on stderr when stderr is a
  terminal, or inside a Jupyter/IPython kernel; nothing otherwise, so logs of
  batch jobs and captured output never fill with bars.
* ``True``: always a bar (on stderr), even when it is not a terminal.
* ``False``: never.
* a callable: called as ``progress(done, total)`` after each step, instead
  of a bar (e.g. to drive the caller's own display). ``done`` only grows and
  ends equal to ``total``; ``total`` may grow while the work is discovered
  (e.g. `verify` learns the arrays' size after checking the files).

Bars count bytes where the steps differ in size (reading arrays), so a bar
moves in proportion to the time taken; tqdm's own ``TQDM_DISABLE=1`` turns
every bar off too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Callable
from collections.abc import Iterator
from typing import Protocol

from pz_persist import errors
from pz_persist.safety import terminal

Progress = bool | Callable[[int, int], None] | None
"""What the ``progress`` argument of long operations accepts (see above)."""


class Tracker:
  """Counts the steps of one operation and reports them to a bar or a hook.

  Attributes:
    done: Units done so far.
    total: Units in all (may grow, see `grow`).
  """

  def __init__(self, total: int, hook: Callable[[int, int], None] | None, bar: _Bar | None):
    self.done = 0
    self.total = total
    self._hook = hook
    self._bar = bar

  def advance(self, amount: int = 1) -> None:
    """Records ``amount`` more units done."""
    self.done += amount
    if self._bar is not None:
      self._bar.update(amount)
    if self._hook is not None:
      self._hook(self.done, self.total)

  def grow(self, amount: int) -> None:
    """Adds ``amount`` units to the total, for work found along the way."""
    self.total += amount
    if self._bar is not None:
      # Shown at the next step: a refresh would show a delayed bar at once.
      self._bar.total = self.total


def wanted(progress: Progress) -> bool:
  """Whether ``progress`` asks for a bar (True, or None where one can be seen)."""
  if progress is None:
    return _interactive()
  return progress is True


def _interactive() -> bool:
  """stderr is a terminal, or this runs in a Jupyter/IPython kernel."""
  if _in_kernel():
    return True
  isatty = getattr(sys.stderr, "isatty", None)
  try:
    return bool(isatty and isatty())
  except ValueError:  # A closed stream.
    return False


def _in_kernel() -> bool:
  """True inside a Jupyter kernel. Only looks at an IPython already imported
  (importing it would cost a second and change nothing)."""
  ipython = sys.modules.get("IPython")
  get_ipython = getattr(ipython, "get_ipython", None)
  shell = get_ipython() if callable(get_ipython) else None
  return getattr(shell, "kernel", None) is not None


class _Bar(Protocol):
  """What a `Tracker` uses of a tqdm bar."""

  total: float | None

  def update(self, n: float = 1) -> bool | None: ...

  def close(self) -> None: ...


def _bar(total: int, description: str, unit: str, delay: float) -> _Bar:
  """A tqdm bar on stderr: the notebook widget in a kernel when ipywidgets
  is installed, text elsewhere (tqdm.auto would warn about the missing
  widgets in every notebook that lacks them)."""
  if _in_kernel() and importlib.util.find_spec("ipywidgets") is not None:
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  else:
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  scaled = unit == "B"
  return tqdm(
      total=total, desc=terminal.printable(description, newlines=False), unit=unit,
      unit_scale=scaled, unit_divisor=1024 if scaled else 1000, file=sys.stderr,
      dynamic_ncols=True, delay=delay,
  )


@contextlib.contextmanager
def tracking(progress: Progress, description: str, total: int = 0,
             unit: str = "B", delay: float = 0.0) -> Iterator[Tracker]:
  """A `Tracker` for one operation, showing what ``progress`` asks for.

  Example::

    with progress_lib.tracking(progress, f"verifying {path}", total) as tracker:
      for batch in batches:
        ...
        tracker.advance(batch_bytes)

  Args:
    progress: The caller's ``progress`` argument (see the module docstring).
    description: What the bar says: the operation and its path (escape
      sequences in it are neutralized, as paths come from anywhere).
    total: Units in all, if known (else `Tracker.grow` them later).
    unit: ``"B"`` for bytes (shown as KiB, MiB...), or a step's name.
    delay: With ``progress=None``, show the bar only once the operation has
      taken this many seconds (for operations that are usually quick, such
      as loads: small ones then print nothing).

  Raises:
    TypeError: ``progress`` is neither None, a bool nor a callable.
  """
  if not (progress is None or isinstance(progress, bool) or callable(progress)):
    raise errors.ArgumentTypeError(
        f"progress={progress!r:.80}: pass None (a bar on a terminal), True,"
        " False, or a function called as progress(done, total)."
    )
  hook = progress if callable(progress) and not isinstance(progress, bool) else None
  bar = None
  if hook is None and wanted(progress):
    bar = _bar(total, description, unit, delay if progress is None else 0.0)
  try:
    yield Tracker(total, hook, bar)
  finally:
    if bar is not None:
      bar.close()
