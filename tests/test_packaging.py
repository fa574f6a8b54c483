"""The package as a user gets it: sdist, wheel, installed, run from elsewhere.

Why: tests run against the source tree, which hides what a release leaves
out (a module or data file missing from the wheel, metadata PyPI rejects, a
demo that only works beside the sources). So the repository's package sources
(copied without build outputs, tests, notebooks or docs) are built by ``python -m build``
(an sdist, then the wheel from that sdist), checked by ``twine check``, and the
wheel is installed into a fresh virtual environment (its dependencies from
this environment's packages, no network) where the
demo runs in an empty directory, importing pz_persist from the wheel.

The fresh environment sees exactly the packages of the interpreter running the
tests (a ``.pth`` file naming its site directories), never a download: that
interpreter may itself be a virtual environment (the README's ``pip install -e
'.[test]' && pytest`` in a venv, which CI runs), whose packages
``--system-site-packages`` would miss (it names the base interpreter's).
"""

from __future__ import annotations

import glob
import os
import shutil
import site
import subprocess
import sys

from conftest import REPO

import pz_persist

_NOT_SOURCE = shutil.ignore_patterns(
    ".git", "build", "dist", "_build", "*.egg-info", "__pycache__", ".hypothesis",
    ".pytest_cache", "pz_persist_demo", "results", "notebooks", "benchmarks", "tests",
    "docs", ".venv", "venv",  # The README's virtual environment, in the clone.
)


def _run(args: list[str], cwd: str, env: dict[str, str] | None = None) -> str:
  result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
  return result.stdout


def _site_directories() -> list[str]:
  """Where this interpreter finds installed packages: a venv's own (and its
  base's, if it was made with ``--system-site-packages``), the user's."""
  found = list(site.getsitepackages())
  if site.ENABLE_USER_SITE:
    found.append(site.getusersitepackages())
  return [d for d in found if os.path.isdir(d)]


def _venv_seeing_this_interpreters_packages(venv: str, cwd: str) -> str:
  """A fresh virtual environment whose interpreter imports what this one
  does: its site directories, named in a ``.pth`` file, after the venv's own.

  Plain directory lines, so the ``.pth`` files inside them (an editable
  install of this checkout) are not run there: pz_persist comes only from
  what is installed into the venv. Returns its ``python``."""
  _run([sys.executable, "-m", "venv", venv], cwd=cwd)
  python = os.path.join(venv, "bin", "python")
  own = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
             cwd=cwd).strip()
  with open(os.path.join(own, "_outer_site_packages.pth"), "w", encoding="utf-8") as f:
    f.write("".join(f"{d}\n" for d in _site_directories()))
  return python


def test_wheel_builds_passes_twine_and_runs_the_demo_installed(tmp_path):
  source = str(tmp_path / "src")
  shutil.copytree(REPO, source, ignore=_NOT_SOURCE)
  dist = str(tmp_path / "dist")
  # --no-isolation: setuptools comes from this environment, not a download.
  _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, source], cwd=source)
  version = pz_persist.__version__
  sdists = glob.glob(os.path.join(dist, f"pz_persist-{version}.tar.gz"))
  wheels = glob.glob(os.path.join(dist, f"pz_persist-{version}-py3-none-any.whl"))
  assert len(sdists) == 1 and len(wheels) == 1, os.listdir(dist)
  out = _run([sys.executable, "-m", "twine", "check", "--strict", *sdists, *wheels], cwd=dist)
  assert out.count("PASSED") == 2, out

  venv = str(tmp_path / "venv")
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
  python = _venv_seeing_this_interpreters_packages(venv, str(tmp_path))
  _run([python, "-m", "pip", "install", "--no-index", "--no-build-isolation", "--quiet",
        wheels[0]], cwd=str(tmp_path), env=env)
  elsewhere = tmp_path / "user"
  elsewhere.mkdir()
  where = _run([python, "-c", "import pz_persist; print(pz_persist.__file__, pz_persist.__version__)"],
               cwd=str(elsewhere), env=env).split()
  assert where[0].startswith(venv) and where[1] == version, where
  assert version in _run([os.path.join(venv, "bin", "pz-persist"), "--version"],
                         cwd=str(elsewhere), env=env)
  demo = _run([python, "-m", "pz_persist.demo"], cwd=str(elsewhere), env=env)
  assert "bit-identical to the original's: True" in demo, demo
  assert (elsewhere / "pz_persist_demo" / "restored.html").is_file()
