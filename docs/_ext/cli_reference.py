"""The ``pz-cli-reference`` directive: the CLI reference, from the parser itself.

Why: a hand-written CLI page drifts from the command the moment an option is
added; this renders ``pz-persist --help`` and each command's ``--help`` from
`pz_persist.tools.cli.build_parser` at build time, so the page is what a user's
terminal prints (at 80 columns). Each command gets a section (with an anchor,
``#pz-persist-inspect``...) whose text is argparse's own description and usage.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

WIDTH = 80


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
  found = []
  for action in parser._actions:  # noqa: SLF001 (argparse has no public walk)
    if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
      found.extend(action.choices.items())
  return found


def _help(parser: argparse.ArgumentParser) -> str:
  previous = os.environ.get("COLUMNS")
  os.environ["COLUMNS"] = str(WIDTH)  # argparse reads it for every formatter.
  try:
    return parser.format_help()
  finally:
    if previous is None:
      del os.environ["COLUMNS"]
    else:
      os.environ["COLUMNS"] = previous


class CliReference(SphinxDirective):
  """Renders the parser's help: the command, then one section per subcommand."""

  has_content = False

  def run(self) -> list[Any]:
    from pz_persist.tools import cli

    parser = cli.build_parser()
    out: list[Any] = [nodes.literal_block(text=_help(parser), language="text")]
    for name, sub in _subcommands(parser):
      section = nodes.section(ids=[f"pz-persist-{name}"], names=[f"pz-persist {name}"])
      section += nodes.title(text=f"pz-persist {name}")
      section += nodes.literal_block(text=_help(sub), language="text")
      self.state.document.note_implicit_target(section)
      out.append(section)
    return out


def setup(app: Any) -> dict[str, Any]:
  app.add_directive("pz-cli-reference", CliReference)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
