"""A process killed at any moment, even mid-save, loses nothing saved.

Sync saves (`pzp.save` to new paths and with ``overwrite=True``) and async
`CheckpointManager` saves are killed with SIGKILL at random moments; every
checkpoint saved before the kill must still load exactly, and no partial
checkpoint may be visible at a checkpoint's path.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
from conftest import REPO

import pz_persist as pzp

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
      report = pzp.verify(os.path.join(directory, str(step), "state"))
      assert report.ok, str(report)
  return steps


def test_sigkill_during_async_saves(tmp_path):
  """5 kills of async `CheckpointManager` saves (steps are never re-saved)."""
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
  assert process.wait(timeout=120) == pzp.training.manager.SIGTERM_EXIT_CODE
  assert "SIGTERM received; saved step" in process.stderr.read()
  steps = _check_every_step(directory)
  assert steps[-1] == last  # The step in progress when the signal came.


SAVERS = textwrap.dedent("""
    # Imports once, then forks a fresh saving process per request, so 15 kills
    # do not pay 15 imports of JAX. Nothing has started JAX's backend or a
    # thread yet, so forking is safe; each child starts its own backend.
    import json, os, shutil, signal, sys
    import numpy as np
    import pz_persist as pzp
    from penzai import pz

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # Killed children vanish at once.
    base = np.random.default_rng(0).random(2**22, dtype=np.float32)  # 16 MiB each

    def tree(g):  # 64 MiB, incompressible, so that each save takes a while.
      return {"g": g, "w": [pz.ParameterValue(label=f"w{i}", value=pz.nx.wrap(base + (g + i), "x"))
                            for i in range(4)]}

    def tell(**message):  # One write(), so lines of several processes never mix.
      os.write(1, (json.dumps(message) + "\\n").encode())

    def save_forever(mode, directory):
      g = 0
      while True:
        g += 1
        if mode == "overwrite":
          pzp.save(os.path.join(directory, "ckpt"), tree(g), overwrite=True)
          tell(pid=os.getpid(), saved=g)
        else:
          pzp.save(os.path.join(directory, f"ckpt{g}"), tree(g))
          tell(pid=os.getpid(), saved=g)
          shutil.rmtree(os.path.join(directory, f"ckpt{g - 1}"), ignore_errors=True)  # Disk use.

    tell(ready=True)
    for line in sys.stdin:
      request = json.loads(line)
      if request == "ping":
        tell(pong=True)
        continue
      pid = os.fork()
      if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
          save_forever(*request)
        finally:
          os._exit(1)
      tell(started=request[1], pid=pid)
""")

_BASE = np.random.default_rng(0).random(2**22, dtype=np.float32)


class _Savers:
  """Drives SAVERS: starts saving processes, kills them, says what they saved."""

  def __init__(self):
    self.process = subprocess.Popen(
        [sys.executable, "-c", SAVERS], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )
    self.replies: queue.Queue = queue.Queue()
    self.saved: dict[int, queue.Queue] = {}
    self._lock = threading.Lock()
    threading.Thread(target=self._read, daemon=True).start()
    assert self._reply(timeout=120) == {"ready": True}

  def _read(self):
    try:
      for line in self.process.stdout:
        message = json.loads(line)
        if "saved" in message:
          self._queue(message["pid"]).put(message["saved"])
        else:
          self.replies.put(message)
    finally:
      self.replies.put(None)  # The test fails instead of waiting.

  def _queue(self, pid: int) -> queue.Queue:
    with self._lock:
      return self.saved.setdefault(pid, queue.Queue())

  def _reply(self, timeout: float = 60):
    try:
      message = self.replies.get(timeout=timeout)
    except queue.Empty:
      message = None
    if message is None:
      self.process.kill()
      raise AssertionError(f"savers failed: {self.process.stderr.read()[-3000:]}")
    return message

  def _send(self, request) -> None:
    self.process.stdin.write(json.dumps(request) + "\n")
    self.process.stdin.flush()

  def start(self, mode: str, directory) -> int:
    directory.mkdir()
    self._send([mode, str(directory)])
    return self._reply()["pid"]

  def wait_saved(self, pid: int, timeout: float = 120) -> int:
    try:
      return self._queue(pid).get(timeout=timeout)
    except queue.Empty:
      raise AssertionError(f"no save completed: {self.process.stderr.read()[-3000:]}") from None

  def kill(self, pid: int) -> int:
    """SIGKILLs a saving process; returns the last generation it saved."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
      try:
        os.kill(pid, 0)
      except ProcessLookupError:
        break
      time.sleep(0.01)
    else:
      raise AssertionError(f"process {pid} did not die")
    self._send("ping")  # Its lines are all read once the answer comes.
    assert self._reply() == {"pong": True}
    saved = self._queue(pid)
    return max([saved.get() for _ in range(saved.qsize())], default=1)

  def close(self) -> None:
    for pid in self.saved:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    self.process.kill()
    self.process.wait(timeout=60)


def _check_saved(path, g: int) -> None:
  """``path`` holds exactly generation ``g`` of SAVERS' tree."""
  tree = pzp.load(path)
  assert tree["g"] == g, (path, tree["g"], g)
  for i, param in enumerate(tree["w"]):
    np.testing.assert_array_equal(np.asarray(param.value.data_array), _BASE + (g + i))
  report = pzp.verify(path)
  assert report.ok, str(report)


def _check_after_kill(mode: str, directory, last: int) -> bool:
  """Checks what a killed saver left; returns whether it was mid-save."""
  names = os.listdir(directory)
  mid_save = any(".pz_persist-new-" in n or ".orbax-checkpoint-tmp" in n for n in names)
  if mode == "overwrite":
    path = directory / "ckpt"
    # The last saved generation, or the next one if killed after its move.
    found = pzp.inspect(path)["g"]
    assert found in (last, last + 1), (found, last)
    _check_saved(path, found)
  else:
    path = directory / f"ckpt{last + 1}"
    _check_saved(directory / f"ckpt{last}", last)
    if path.exists():  # Killed after the move: it must be whole.
      _check_saved(path, last + 1)
  # Whatever the kill left beside it, saving there again works.
  pzp.save(path, {"g": -1}, overwrite=True)
  assert pzp.load(path) == {"g": -1}
  return mid_save


def test_sigkill_during_sync_saves(tmp_path):
  """15 kills of `pzp.save`, to new paths and with overwrite, 5 processes at once."""
  moments = random.Random(1)
  modes = ["new"] * 7 + ["overwrite"] * 8
  moments.shuffle(modes)
  mid_save = 0
  savers = _Savers()
  try:
    for wave in range(0, len(modes), 5):
      running = []
      for k in range(wave, min(wave + 5, len(modes))):
        directory = tmp_path / f"kill{k}"
        running.append((modes[k], directory, savers.start(modes[k], directory)))
      for _, _, pid in running:
        savers.wait_saved(pid)  # Its first save is complete.
      last = []
      for _, _, pid in running:
        time.sleep(moments.uniform(0.0, 1.0))
        last.append(savers.kill(pid))
      for (mode, directory, _), saved in zip(running, last):
        mid_save += _check_after_kill(mode, directory, saved)
  finally:
    savers.close()
  print(f"{mid_save} of {len(modes)} kills landed mid-save")
  assert mid_save >= 3, f"only {mid_save} of {len(modes)} kills landed mid-save"
