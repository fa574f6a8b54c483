"""A `CheckpointManager` save stopped by Ctrl-C ends in one line, as `pz_persist.save` does.

Why a module of its own: Orbax's manager answers an interrupt with an absl
ERROR and two tracebacks (the one it logs, the one it raises), and a
synchronous save interrupted while its arrays are written leaves TensorStore
writing as the interpreter exits (an abort: "terminate called without an
active exception"). `one_line` runs a manager call; on Ctrl-C it has the
manager abandon its save in flight (stop and wait for the background work,
remove what the unfinished step left) and raises the one-line
`pz_persist.errors.save_interrupted` saying which steps are intact.

Orbax's logging is quieted for that call only: a filter on the ``absl``
logger, added when the call starts and removed when it ends, drops the
records of the interrupt itself, and while the save is abandoned, the
records of its cancelled threads. Nothing of the process's logging
configuration changes; records of other calls, before or after, pass.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from collections.abc import Iterator

from pz_persist import errors


class _Quiet(logging.Filter):
  """Drops records of an interrupt (and, once abandoning, every record)."""

  def __init__(self) -> None:
    super().__init__()
    self.abandoning = False

  def filter(self, record: logging.LogRecord) -> bool:
    if self.abandoning:  # Cancelled threads' reports of what was cancelled.
      return False
    raised = record.exc_info[1] if record.exc_info else None
    return not isinstance(raised, KeyboardInterrupt)


@contextlib.contextmanager
def one_line(abandon: Callable[[], str | None]) -> Iterator[None]:
  """Runs the block; on Ctrl-C, ``abandon()`` and a one-line interrupt.

  ``abandon`` stops the save in flight and returns the line to show, or
  None when no save was in flight (the interrupt then goes on as it came).
  An interrupt already turned into one line (a nested call's) goes on as is.
  """
  quiet = _Quiet()
  logger = logging.getLogger("absl")
  logger.addFilter(quiet)
  try:
    try:
      yield
    except KeyboardInterrupt as e:
      if getattr(e, "pz_persist_one_line", False):
        raise
      quiet.abandoning = True
      message = abandon()
      if message is None:
        raise
      raise errors.save_interrupted(message) from None
  finally:
    logger.removeFilter(quiet)
