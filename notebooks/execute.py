"""Runs the notebooks and saves them with their outputs, as they are committed.

Usage (from the repository root, after ``pip install -e '.[test]'``)::

  python notebooks/execute.py [notebooks/quickstart.ipynb ...]

Why: a user browsing the repository should see the treescope renderings and
printed results each notebook promises. Each notebook runs in a fresh kernel
in a temporary directory (the files it writes are thrown away), exactly as
``tests/test_notebooks.py`` runs it; cells' execution counts are kept and the
kernel's timing metadata is dropped, so re-running changes only what changed.
"""

from __future__ import annotations

import glob
import os
import sys
import tempfile

import nbclient
import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))


def execute(path: str) -> int:
  notebook = nbformat.read(path, as_version=4)
  with tempfile.TemporaryDirectory() as tmp:
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = tmp
    try:
      nbclient.NotebookClient(
          notebook, timeout=600, kernel_name="python3",
          resources={"metadata": {"path": tmp}},
      ).execute()
    finally:
      if previous is None:
        del os.environ["TMPDIR"]
      else:
        os.environ["TMPDIR"] = previous
  for cell in notebook.cells:
    cell.get("metadata", {}).pop("execution", None)
  nbformat.write(notebook, path)
  return os.path.getsize(path)


def main(paths: list[str]) -> None:
  for path in paths or sorted(glob.glob(os.path.join(HERE, "*.ipynb"))):
    print(f"{path}: {execute(path) / 1024:.0f} KiB with outputs", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
