"""The README's first command, ``python -m pz_persist.demo``, works and reads well."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from conftest import REPO

from pz_persist import demo
from pz_persist.tools import cli


def test_demo_runs_and_fits_a_terminal(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "pz_persist.demo", "--out", str(tmp_path / "demo")],
      capture_output=True, text=True, timeout=600, cwd=REPO,
      env=dict(os.environ, COLUMNS="120"),
  )
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert "outputs are bit-identical to the original's: True" in out
  assert "stacked_sublayers: TransformerBlock" in out  # The restored model's outline.
  assert max(map(len, out.splitlines())) <= 160, "a line too wide for a terminal"
  assert (tmp_path / "demo" / "restored.html").is_file()
  assert out.rstrip().endswith(demo.next_steps(tmp_path / "demo" / "checkpoint"))
  # The commands it suggests work on what it saved.
  for line in out.splitlines():
    if line.startswith("  pz-persist "):
      command = shlex.split(line.split("  ")[1])
      assert cli.main(command[1:]) == 0, line
