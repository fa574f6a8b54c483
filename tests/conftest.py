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
  """The labels (or paths) of the arrays `pz_persist.storage.reading.direct_read` opens
  with ``ts.open``, as they are opened; the others it reads as raw chunks
  (`pz_persist.storage.reading.raw_chunks`)."""
  from pz_persist.storage.reading import direct_read  # pylint: disable=import-outside-toplevel

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
#   test of a folder in INTEGRATION_FOLDERS; and every test that builds or
#   runs a transformer (TRANSFORMER_CALLS, found as the process calls are, and
#   in the builders it is parametrized with): compiling one, layer by layer,
#   takes seconds, which the quick run cannot spend on each.
# * unit: the rest: one module, or one save and load, in this interpreter
#   (never a test marked slow: `-m unit` replaces the default `-m 'not slow'`).
#
# A run that can select no integration or process test (`pytest -m unit`) does
# not even import the modules whose every test is one (`pytest_ignore_collect`):
# they import torch and transformers, and would only be deselected.

PROCESS_FIXTURES = frozenset({"store", "gcs", "s3", "remote"})
"""Fixtures that start servers (tests/remote/conftest.py: the emulators)."""

PROCESS_CALLS = (
    "run_python(", "subprocess.", "multiprocessing", "multiprocess_run", "Popen(",
    "sys.executable", "docs_browser", "os.fork", "os.kill(",
)
"""What, in a test's source or a helper it calls, starts or signals a process."""

TRANSFORMER_CALLS = (
    "llamalike_transformer(", "gemma_style_transformer(", "sampling_model(",
    "edited_transformer(", "build_llamalike_transformer(", "_hf_model(",
)
"""What, in a test's source, a helper it calls or a builder it is
parametrized with, builds a transformer: Penzai's (tests/model_zoo.py,
tests/surgery.py) or transformers' in torch (tests/pretrained/test_hf.py)."""

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
    # Property tests over whole saves and loads, and inputs of tens of thousands of items:
    # the guarantees of issue 36, each proven across every entry point (minutes, not a loop).
    "test_saved_always_loads", "test_legitimate_density", "test_diff_scale",
    "test_held_memory", "test_lazy_read_matches_load",
    # Issue 38's: former names and release fixtures through every entry point (a fresh
    # process among them), the diff's views against its tree over generated pairs, and the
    # outside attack's cases (a 20,000-variable model among them).
    "test_former_names", "test_release_fixtures", "test_diff_one_model", "test_round5_attacks",
})
"""Modules (by file name, in any folder) whose every test is an integration test."""

LAYER_MARKERS = ("unit", "integration", "process")


_sources: dict[object, str] = {}


def _source(obj) -> str:
  """``obj``'s source, once per object (parametrized tests share a function)."""
  import inspect  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  try:
    return _sources[obj]
  except (KeyError, TypeError):
    pass
  try:
    text = inspect.getsource(obj)
  except (OSError, TypeError):
    text = ""
  try:
    _sources[obj] = text
  except TypeError:  # Unhashable: not cached.
    pass
  return text


_helpers_by_module: dict[tuple[str, tuple[str, ...]], frozenset[str]] = {}


def _helpers_calling(module, calls: tuple[str, ...]) -> frozenset[str]:
  """The names of the module's functions whose source holds one of
  ``calls``, directly or through another such function of the module (to a
  fixed point)."""
  key = (module.__name__, calls)
  if key not in _helpers_by_module:
    functions = {
        name: _source(value) for name, value in vars(module).items()
        if callable(value) and getattr(value, "__module__", None) == module.__name__
    }
    helpers = {name for name, text in functions.items() if any(c in text for c in calls)}
    while True:
      more = {
          name for name, text in functions.items()
          if name not in helpers and any(f"{h}(" in text or f" {h}," in text for h in helpers)
      }
      if not more:
        break
      helpers |= more
    _helpers_by_module[key] = frozenset(helpers)
  return _helpers_by_module[key]


def _calls(item, calls: tuple[str, ...]) -> bool:
  """Whether ``item``'s test function, a fixture or helper of its module it
  uses, or a callable it is parametrized with holds one of ``calls``."""
  function = getattr(item, "function", None)
  text = _source(function) if function is not None else ""
  if any(c in text for c in calls):
    return True
  module = getattr(item, "module", None)
  if module is not None:
    helpers = _helpers_calling(module, calls)
    if set(item.fixturenames) & helpers or any(f"{h}(" in text for h in helpers):
      return True
  callspec = getattr(item, "callspec", None)
  values = list(callspec.params.values()) if callspec is not None else []
  while values:
    value = values.pop()
    if isinstance(value, (tuple, list)):
      values.extend(value)
    elif callable(value) and any(c in _source(value) for c in calls):
      return True
  return False


def _integration_only(path) -> bool:
  """Whether every test of the module (or folder) at ``path`` is an
  integration test by name alone."""
  stem = path.stem if path.suffix == ".py" else path.name
  return stem in INTEGRATION_MODULES or bool(INTEGRATION_FOLDERS & set(path.parent.parts[-1:])) or (
      path.suffix != ".py" and path.name in INTEGRATION_FOLDERS)


def layer_of(item) -> str:
  """The layer marker the rule gives ``item`` (see the table above)."""
  if PROCESS_FIXTURES & set(item.fixturenames):
    return "process"
  if _calls(item, PROCESS_CALLS):
    return "process"
  if item.get_closest_marker("slow") is not None:  # Long: never in the quick run.
    return "integration"
  if _integration_only(item.path):
    return "integration"
  if _calls(item, TRANSFORMER_CALLS):
    return "integration"
  return "unit"


def pytest_ignore_collect(collection_path, config):
  """Skips a module or folder whose every test is an integration or process
  test when the run's ``-m`` selects neither (``pytest -m unit``)."""
  markexpr = config.getoption("markexpr", "")
  if not markexpr or not _integration_only(collection_path):
    return None
  from _pytest.mark.expression import Expression  # pylint: disable=import-outside-toplevel

  try:
    expression = Expression.compile(markexpr)
  except Exception:  # pylint: disable=broad-except
    return None  # Let pytest report a malformed expression.
  could_select = any(expression.evaluate(lambda name, layer=layer: name == layer)
                     for layer in ("integration", "process"))
  return None if could_select else True


def pytest_collection_modifyitems(config, items):
  del config  # The rule needs only the items.
  for item in items:
    item.add_marker(getattr(pytest.mark, layer_of(item)))
