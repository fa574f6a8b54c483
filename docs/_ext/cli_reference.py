"""The CLI reference page (docs/reference/cli.md), generated from the parser.

Why: a hand-written CLI page drifts from the command the moment an option is
added, and a page filled in only when the site is built reads as empty in the
repository, where most users read it. So the part of the page below `MARKER`
is written by this module from `pz_persist.tools.cli.build_parser`: ``pz-persist
--help`` and each command's ``--help`` as a terminal of `WIDTH` columns prints
them, each command under its own heading (``#pz-persist-inspect``...).

Regenerate it after changing the parser (from the repository root)::

  python docs/_ext/cli_reference.py

``tests/test_cli_reference.py`` fails when the page differs from what this
writes, and the site build (a Sphinx extension, see `setup`) warns, which
``sphinx-build -W`` turns into an error.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = os.path.join(os.path.dirname(HERE), "reference", "cli.md")
WIDTH = 80

MARKER = "<!-- Generated from the parser below this line: edit pz_persist/tools/cli.py, then run"
"""The first line of the generated part; the page's introduction is above it."""


def python_version() -> str:
  """The Python whose argparse wrote the text (its layout differs between
  releases: 3.13 writes ``-o, --out OUT`` where 3.11 writes ``-o OUT, --out OUT``)."""
  return f"{sys.version_info.major}.{sys.version_info.minor}"


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
  """``(name, one-line help, parser)`` of each command, in the order ``--help`` lists them."""
  found = []
  for action in parser._actions:  # noqa: SLF001 (argparse has no public walk)
    if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
      helps = {a.dest: a.help or "" for a in action._choices_actions}  # noqa: SLF001
      found.extend((name, helps.get(name, ""), sub) for name, sub in action.choices.items())
  return found


def help_text(parser: argparse.ArgumentParser) -> str:
  """``parser``'s help in a terminal of `WIDTH` columns, whatever the terminal
  running this (argparse reads the terminal's size, and leaves two columns
  free, as here; nothing global is changed)."""
  original = parser.formatter_class
  parser.formatter_class = functools.partial(original, width=WIDTH - 2)  # type: ignore[assignment]
  try:
    return parser.format_help().rstrip() + "\n"
  finally:
    parser.formatter_class = original


def generated() -> str:
  """The generated part of the page, from `MARKER` to the end."""
  # pylint: disable-next=import-outside-toplevel
  from pz_persist.tools import cli

  parser = cli.build_parser()
  parts = [
      f"{MARKER}\n     `python docs/_ext/cli_reference.py` (argparse of Python"
      f" {python_version()}, {WIDTH} columns). -->\n",
      "## pz-persist\n",
      f"```text\n$ pz-persist --help\n{help_text(parser)}```\n",
  ]
  for name, summary, sub in subcommands(parser):
    summary = summary[:1].upper() + summary[1:]
    parts.append(f"## pz-persist {name}\n")
    parts.append(f"{summary}.\n" if summary else "")
    parts.append(f"```text\n$ pz-persist {name} --help\n{help_text(sub)}```\n")
  return "\n".join(p for p in parts if p)


def page_text(current: str) -> str:
  """``current`` (the page's text) with its generated part written anew."""
  introduction = current.split(MARKER)[0].rstrip() + "\n\n"
  return introduction + generated()


def written_by(page: str) -> str | None:
  """The Python version whose argparse wrote ``page``'s generated part."""
  found = re.search(r"argparse of Python (\d+\.\d+)", page.split(MARKER)[-1])
  return found[1] if found else None


def read_page() -> str:
  with open(PAGE, encoding="utf-8") as f:
    return f.read()


def main() -> int:
  """Rewrites the page's generated part; prints whether it changed."""
  current = read_page()
  new = page_text(current)
  if new != current:
    with open(PAGE, "w", encoding="utf-8") as f:
      f.write(new)
  print(f"{os.path.relpath(PAGE)}: {'rewritten' if new != current else 'up to date'}")
  return 0


def _check_page(app: Any) -> None:
  """At the start of a site build: warn when the page is stale."""
  from sphinx.util import logging  # pylint: disable=import-outside-toplevel

  current = read_page()
  if written_by(current) == python_version() and page_text(current) != current:
    logging.getLogger(__name__).warning(
        "docs/reference/cli.md differs from the parser (pz_persist/tools/cli.py):"
        " run `python docs/_ext/cli_reference.py`"
    )
  del app


def setup(app: Any) -> dict[str, Any]:
  app.connect("builder-inited", _check_page)
  return {"parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # This checkout's pz_persist.
  sys.exit(main())
