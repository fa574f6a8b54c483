"""Sphinx configuration of the pz_persist documentation site.

Build it from the repository root with::

  sphinx-build -W --keep-going -b html docs docs/_build/html

Why these tools: Penzai, treescope and Orbax build their sites with Sphinx,
MyST Markdown and myst-nb (Penzai's and treescope's with sphinx-book-theme), so
a reader moving between the four finds the same layout, the same API pages
and notebooks that render treescope's interactive output as in Jupyter.

Notebooks are rendered from their committed outputs, not executed again:
``tests/test_notebooks.py`` executes every notebook in the test suite, and
``notebooks/execute.py`` saves them with their outputs; executing them here
too would add minutes of model building to every docs build (which takes
about 25 s on two cores as it is) for the same renderings.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # The package of this checkout.
sys.path.insert(0, os.path.join(HERE, "_ext"))

import shutil  # noqa: E402

from pz_persist import version as _version  # noqa: E402


def _copy_notebooks() -> None:
  """Copies ``notebooks/*.ipynb`` into ``docs/notebooks/`` (ignored by git).

  Why: the notebooks live at the repository's root, where users look for
  them; Sphinx reads only its source directory, and a symbolic link there
  confuses MyST's link resolution (it resolves the link's target). Files are
  copied only when changed, so an unchanged notebook is not read again.
  """
  source = os.path.join(os.path.dirname(HERE), "notebooks")
  target = os.path.join(HERE, "notebooks")
  os.makedirs(target, exist_ok=True)
  for name in sorted(os.listdir(source)):
    if not name.endswith(".ipynb"):
      continue
    src, dst = os.path.join(source, name), os.path.join(target, name)
    with open(src, "rb") as f:
      data = f.read()
    if os.path.exists(dst):
      with open(dst, "rb") as f:
        if f.read() == data:
          continue
    shutil.copyfile(src, dst)


_copy_notebooks()

project = "pz_persist"
author = "pz_persist authors"
copyright = "the pz_persist authors (Apache-2.0)"
release = _version.__version__
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "cli_reference",
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
root_doc = "index"

# MyST: heading anchors so guides can link to sections (`file.md#section`).
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# myst-nb: render committed outputs (see the module docstring).
nb_execution_mode = "off"
nb_merge_streams = True

# API reference: from the docstrings (Google style), every name of
# pz_persist.__all__ (docs/reference/api.md lists them; a test checks).
autosummary_generate = True
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
add_module_names = False

html_theme = "sphinx_book_theme"
html_title = f"pz_persist {release}"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
}
# The theme's first-visit mode; without one it logs "Got invalid theme mode" to
# the console. Light, since treescope renders on a white background.
html_context = {"default_mode": "light"}
html_static_path = ["_static"]
# Without an icon, browsers ask the host for /favicon.ico (a 404 in the console).
html_favicon = "_static/favicon.svg"


OPTIONAL_PAGE = "reference/cli-json"
"""The ``--json`` schemas of the CLI, written with the CLI in another change."""


def _drop_missing_optional_pages(app, docname, source) -> None:
  """Leaves the lines naming `OPTIONAL_PAGE` (in the index's table of contents
  and the CLI reference) out while that page is not in this checkout, instead
  of failing the build with a missing-document warning."""
  if docname not in ("index", "reference/cli"):
    return
  if not os.path.exists(os.path.join(HERE, OPTIONAL_PAGE + ".md")):
    source[0] = "\n".join(
        line for line in source[0].split("\n") if "cli-json" not in line)


def _reread_index(app, env, added, changed, removed) -> list[str]:
  """The pages that name `OPTIONAL_PAGE` depend on whether it exists, which
  their own text does not show: read them again on every build."""
  return ["index", "reference/cli"]


def setup(app) -> None:
  app.connect("source-read", _drop_missing_optional_pages)
  app.connect("env-get-outdated", _reread_index)
