"""The CLI reference page (docs/reference/cli.md) is what the parser prints.

Why: the page is read in the repository as much as on the site, so it holds
each command's ``--help`` as text, written by ``docs/_ext/cli_reference.py``
from `pz_persist.tools.cli.build_parser`; an option added to the parser and
not to the page fails here (run ``python docs/_ext/cli_reference.py``).
"""

from __future__ import annotations

import importlib.util
import os
import re

from conftest import REPO

from pz_persist.tools import cli


def _generator():
  path = os.path.join(REPO, "docs", "_ext", "cli_reference.py")
  spec = importlib.util.spec_from_file_location("cli_reference", path)
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_page_is_the_parsers_help():
  generator = _generator()
  page = generator.read_page()
  assert page.count(generator.MARKER) == 1, "the page lost its generated part's first line"
  if generator.written_by(page) != generator.python_version():
    # argparse lays options out differently in other Python releases: the
    # commands and options are checked below, the text only where it was written.
    return
  assert generator.page_text(page) == page, (
      "docs/reference/cli.md differs from pz_persist/tools/cli.py's parser:"
      " run `python docs/_ext/cli_reference.py`"
  )


def test_every_command_and_option_is_on_the_page():
  generator = _generator()
  page = generator.read_page()
  generated = page.split(generator.MARKER)[1]
  headings = re.findall(r"^## (.+)$", generated, re.M)
  commands = generator.subcommands(cli.build_parser())
  assert headings == ["pz-persist"] + [f"pz-persist {name}" for name, _, _ in commands]
  assert {name for name, _, _ in commands} >= {
      "inspect", "diff", "verify", "ls", "clean", "convert", "export", "migrate"}
  sections = generated.split("\n## ")[2:]
  for (name, _, parser), section in zip(commands, sections):
    for action in parser._actions:  # noqa: SLF001
      for option in action.option_strings:
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", section), (name, option)
      if not action.option_strings and action.help:
        assert action.dest in section, (name, action.dest)


def test_generated_help_ignores_the_terminal(monkeypatch):
  """The page does not depend on the terminal that wrote it."""
  generator = _generator()
  monkeypatch.setenv("COLUMNS", "200")
  wide = generator.generated()
  monkeypatch.setenv("COLUMNS", "40")
  assert generator.generated() == wide
  helps = re.findall(r"^```text\n(.*?)^```", wide, re.M | re.S)
  assert len(helps) >= 9
  assert max(len(line) for text in helps for line in text.splitlines()) <= 80
