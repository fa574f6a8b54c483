"""A run killed at any moment, even during an async save, loses nothing saved."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np

import pz_persist as pzp
from conftest import REPO

SCRIPT = os.path.join(REPO, "tests", "training_run.py")


def _start(directory, *flags):
  return subprocess.Popen(
      [sys.executable, SCRIPT, "counting", str(directory), *flags],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
  )


def _wait_for_step(process, at_least: int, timeout: float = 120) -> int:
  """Reads the run's events until it reports step >= at_least."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    line = process.stdout.readline()
    if not line:
      raise AssertionError(f"run ended early: {process.stderr.read()[-2000:]}")
    event = json.loads(line)
    if event["event"] == "step" and event["step"] >= at_least:
      return event["step"]
  process.kill()
  raise AssertionError("run did not reach the step in time")


def _check_every_step(directory) -> list[int]:
  """Every committed step restores to exactly what was saved."""
  with pzp.CheckpointManager(directory) as manager:
    steps = manager.all_steps()
    assert manager.latest_step() == (max(steps) if steps else None)
    for step in steps:
      state = manager.restore(step)["state"]
      assert state["step"] == step
      for i, param in enumerate(state["params"]):
        data = np.asarray(param.value.data_array)
        assert data[0] == step + i and data[-1] == data.size - 1 + step + i
  return steps


def test_sigkill_during_async_saves(tmp_path):
  directory = tmp_path / "run"
  moments = random.Random(0)
  partial_seen = 0
  for attempt in range(5):
    # Keeping 2 steps, each save also drops one: kills land in deletions too.
    process = _start(directory, "--steps", "100000", "--megabytes", "48", "--max-to-keep", "2")
    _wait_for_step(process, at_least=1)
    time.sleep(moments.uniform(0.2, 2.0))
    process.kill()
    process.wait(timeout=60)
    partial_seen += any(".orbax-checkpoint-tmp" in p for p in os.listdir(directory))
    steps = _check_every_step(directory)
    assert steps, f"attempt {attempt}: nothing saved"
  assert partial_seen, "no kill landed during a save; the test exercised nothing"


def test_sigterm_saves_and_exits(tmp_path):
  directory = tmp_path / "run"
  process = _start(directory, "--steps", "100000", "--megabytes", "4",
                   "--interval", "1000", "--step-seconds", "0.2", "--sigterm")
  last = _wait_for_step(process, at_least=3)
  process.send_signal(signal.SIGTERM)
  for line in process.stdout:
    event = json.loads(line)
    last = max(last, event.get("step", last))
  assert process.wait(timeout=120) == pzp.manager.SIGTERM_EXIT_CODE
  assert "SIGTERM received; saved step" in process.stderr.read()
  steps = _check_every_step(directory)
  assert steps[-1] == last  # The step in progress when the signal came.
