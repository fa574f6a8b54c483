"""Making text from a checkpoint safe to print on a terminal.

Why: writer strings, tree paths, axis names, class names and file names come
from the checkpoint, whoever wrote it. Printed raw, an escape sequence in one
can clear the screen, set the window title, or move the cursor back and
redraw a ``DAMAGED`` line as ``OK``. The command line passes everything it
prints through `printable`, at the one place it prints, so no output can
forget it.
"""

from __future__ import annotations

import re

_UNSAFE = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f"  # C0 (but newline), DEL, C1 (incl. CSI).
    "\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"  # Bidi, breaks.
    "\ufeff\ufff9-\ufffb]"
)


def _escape(match: re.Match[str]) -> str:
  char = match.group()
  return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def printable(text: object, *, newlines: bool = True) -> str:
  """``text`` with every control, bidi or line-breaking character escaped
  (``\\x1b``, ``\\u202e``...), so it shows as written and moves nothing.

  Args:
    text: Anything to be printed.
    newlines: Keep ``\\n`` (for whole output); with False it is escaped too,
      for one value that must stay on its line.
  """
  escaped = _UNSAFE.sub(_escape, str(text))
  return escaped if newlines else escaped.replace("\n", "\\x0a")


def size_text(nbytes: float) -> str:
  """A byte count as people read it (``1.5 GiB``), for tables and notes."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if nbytes < 1024 or unit == "TiB":
      return f"{nbytes} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
    nbytes /= 1024
  raise AssertionError
