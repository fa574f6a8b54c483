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
