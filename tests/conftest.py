"""Shared fixtures. Tests import helpers as top-level modules (model_zoo...)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# Sharding is tested on 8 CPU devices; this must be set before JAX starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def ckpt(tmp_path):
  """A path for a checkpoint that does not exist yet."""
  return tmp_path / "ckpt"


@pytest.fixture
def tensorstore_opens(monkeypatch) -> list[str]:
  """The labels (or paths) of the arrays `pz_persist.storage.direct_read` opens
  with ``ts.open``, as they are opened; the others it reads as raw chunks
  (`pz_persist.storage.raw_chunks`)."""
  from pz_persist.storage import direct_read  # pylint: disable=import-outside-toplevel

  opened: list[str] = []
  real = direct_read._open  # pylint: disable=protected-access

  def spy(directory, specs, *args):
    opened.extend(spec.label or spec.path for spec in specs)
    return real(directory, specs, *args)

  monkeypatch.setattr(direct_read, "_open", spy)
  return opened


def run_python(code: str, *, timeout: float = 300, env: dict | None = None) -> str:
  """Runs ``code`` in a fresh interpreter; returns stdout, raising on failure."""
  full_env = dict(os.environ, **(env or {}))
  result = subprocess.run(
      [sys.executable, "-c", textwrap.dedent(code)],
      capture_output=True,
      text=True,
      timeout=timeout,
      cwd=REPO,
      env=full_env,
  )
  if result.returncode != 0:
    raise AssertionError(
        f"subprocess failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    )
  return result.stdout


# --- Layers of tests: every test gets one of `unit`, `integration`, `process` --
#
# Set here, by rule, and nowhere else (the markers are registered in
# pyproject.toml): `pytest -m unit` is what a developer runs while working.
#
# * process: the test starts interpreters or servers. Found, not listed: it
#   uses an emulator fixture (gs://, s3:// servers), or its own source, a
#   fixture of its module or a helper of its module it calls starts a process
#   (`run_python`, `subprocess`, `multiprocessing`, the headless browser...).
# * integration: the whole stack, end to end: every test of the modules named
#   in INTEGRATION_MODULES (pretrained families, the README, notebooks,
#   benchmarks, training runs, the commit protocol under load, the process's
#   read buffers over time, hostile cases run through every read entry
#   point), and every
#   test of a folder in INTEGRATION_FOLDERS.
# * unit: the rest: one module, or one save and load, in this interpreter
#   (never a test marked slow: `-m unit` replaces the default `-m 'not slow'`).

PROCESS_FIXTURES = frozenset({"store", "gcs", "s3", "remote"})
"""Fixtures that start servers (tests/remote/conftest.py: the emulators)."""

PROCESS_CALLS = (
    "run_python(", "subprocess.", "multiprocessing", "multiprocess_run", "Popen(",
    "sys.executable", "docs_browser", "os.fork", "os.kill(",
)
"""What, in a test's source or a helper it calls, starts or signals a process."""

INTEGRATION_FOLDERS = frozenset({"pretrained", "remote"})
"""Folders of tests/ whose every test is an integration test."""

INTEGRATION_MODULES = frozenset({
    "test_benchmarks", "test_concurrency", "test_demo", "test_docs_site", "test_manager",
    "test_models", "test_notebooks", "test_optimizers", "test_packaging", "test_random_trees",
    "test_readme", "test_resume", "test_load_into_sharded", "test_sharding",
    "test_pretrained_hostile", "test_pretrained_load_time", "test_pretrained_guesses",
    "test_remote_commit", "test_remote_steps", "test_fuzz", "test_catalogue", "test_migrate",
    "test_cli", "test_cli_terminal", "test_kill", "test_interrupt", "test_multiprocess",
    "test_buffer_reuse",  # The process's read buffers, released on a timer, over many loads.
    "test_read_paths", "test_files_change_during_load",  # Every read entry point, per case.
})
"""Modules (by file name, in any folder) whose every test is an integration test."""

LAYER_MARKERS = ("unit", "integration", "process")


def _source(obj) -> str:
  import inspect  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  try:
    return inspect.getsource(obj)
  except (OSError, TypeError):
    return ""


_process_helpers_by_module: dict[str, frozenset[str]] = {}


def _process_helpers(module) -> frozenset[str]:
  """The names of the module's functions that start a process, directly or
  through another such function of the module (to a fixed point)."""
  if module.__name__ not in _process_helpers_by_module:
    functions = {
        name: _source(value) for name, value in vars(module).items()
        if callable(value) and getattr(value, "__module__", None) == module.__name__
    }
    helpers = {name for name, text in functions.items() if any(c in text for c in PROCESS_CALLS)}
    while True:
      more = {
          name for name, text in functions.items()
          if name not in helpers and any(f"{h}(" in text or f" {h}," in text for h in helpers)
      }
      if not more:
        break
      helpers |= more
    _process_helpers_by_module[module.__name__] = frozenset(helpers)
  return _process_helpers_by_module[module.__name__]


def layer_of(item) -> str:
  """The layer marker the rule gives ``item`` (see the table above)."""
  if PROCESS_FIXTURES & set(item.fixturenames):
    return "process"
  function = getattr(item, "function", None)
  module = getattr(item, "module", None)
  text = _source(function) if function is not None else ""
  if any(c in text for c in PROCESS_CALLS):
    return "process"
  if module is not None:
    helpers = _process_helpers(module)
    if set(item.fixturenames) & helpers or any(f"{h}(" in text for h in helpers):
      return "process"
  path = item.path
  if item.get_closest_marker("slow") is not None:  # Long: never in the quick run.
    return "integration"
  if path.stem in INTEGRATION_MODULES or INTEGRATION_FOLDERS & set(path.parent.parts[-1:]):
    return "integration"
  return "unit"


def pytest_collection_modifyitems(config, items):
  del config  # The rule needs only the items.
  for item in items:
    item.add_marker(getattr(pytest.mark, layer_of(item)))
