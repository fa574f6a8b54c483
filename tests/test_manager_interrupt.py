"""Ctrl-C during a `CheckpointManager` save ends as `pzp.save`'s does.

One line saying which steps are intact, instead of Orbax's absl ERROR and
two tracebacks (or, for a synchronous save, an abort as TensorStore's writes
outlived the interpreter); the unfinished step is stopped and removed, and
the run resumes from the intact steps. Saves are interrupted with SIGINT in
a subprocess (a script, as a user runs one), synchronous and asynchronous,
once the step's temporary directory holds data (a condition waited on, never
a duration), and with a KeyboardInterrupt raised mid-save in this process
(as in a notebook), where the manager must stay usable and the process's
logging configuration unchanged.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import REPO
from penzai import pz

import pz_persist as pzp
from pz_persist.orbax import v0_handler
from pz_persist.storage.lifecycle import steps as steps_lib
from pz_persist.tools import cli

RUN = textwrap.dedent("""
    import signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Even if started ignoring it.
    import numpy as np
    import pz_persist as pzp
    from penzai import pz

    directory, async_save = sys.argv[1], sys.argv[2] == "async"
    base = np.arange(2**24, dtype=np.float32)  # 64 MiB per array (not compressed).
    def tree(n):
      return [pz.ParameterValue(label=f"w{i}", value=pz.nx.wrap(base + i, "x"))
              for i in range(n)]
    with pzp.CheckpointManager(directory, async_save=async_save) as manager:
      manager.save(1, params=tree(1), opt_state={"count": np.int32(1)})
      manager.wait_until_finished()
      print("saving", flush=True)
      manager.save(2, params=tree(12), opt_state={"count": np.int32(2)})
      manager.wait_until_finished()
      print("saved", flush=True)
""")

_TIMEOUT = 120
"""Far above what any step takes; only there so that a hang fails."""


@pytest.fixture(autouse=True)
def _ctrl_c_raises():
  """Ctrl-C raises KeyboardInterrupt here even if the run ignores SIGINT."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)


def _unfinished_bytes(directory) -> int:
  total = 0
  for info in steps_lib.list_steps(directory, commit_times=False):
    if not info.committed:
      for root, _, files in os.walk(info.path):
        total += sum(os.path.getsize(os.path.join(root, name)) for name in files
                     if os.path.exists(os.path.join(root, name)))
  return total


def _wait_until_writing(process: subprocess.Popen, directory) -> None:
  assert process.stdout.readline() == "saving\n"
  deadline = time.monotonic() + _TIMEOUT
  while time.monotonic() < deadline:
    if _unfinished_bytes(directory) > 2**20:
      return
    if process.poll() is not None:
      raise AssertionError(f"the run ended early: {process.stderr.read()[-2000:]}")
    time.sleep(0.005)
  raise AssertionError("the step wrote nothing")


def _reported(err: str) -> list[str]:
  """stderr without Orbax's ordinary warnings of the run before the
  interrupt (its cumulative "Waiting for previous save" timing)."""
  return [line for line in err.splitlines() if not line.startswith("WARNING:absl:")]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigint_during_a_manager_save_prints_one_line(tmp_path, mode):
  directory = tmp_path / "run"
  process = subprocess.Popen(
      [sys.executable, "-c", RUN, str(directory), mode],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
  )
  _wait_until_writing(process, directory)
  process.send_signal(signal.SIGINT)
  out, err = process.communicate(timeout=_TIMEOUT)
  assert "saved" not in out, "the interrupt came after the save; nothing was tested"
  assert process.returncode == -signal.SIGINT, err  # Not an abort (-6).
  (line,) = _reported(err)
  assert "Traceback" not in err and "ERROR" not in err
  prefix = f"KeyboardInterrupt: pz_persist.CheckpointManager({str(directory)!r}).save interrupted;"
  # What the line says is what the run holds. Mostly the step is stopped and
  # removed; on a starved machine its cancelled writes may outlive the wait
  # for them (the step then stays, for `clean --force`), or have all finished
  # by the time the cancellation reaches them (the step is then whole).
  outcomes = {
      " step 1 intact there; step 2 not saved, and what it had written was removed.":
          [(1, True)],
      " step 1 intact there; step 2 not saved: its unfinished 2.orbax-checkpoint-tmp stays,"
      f" which `pz-persist clean --force {directory}` removes once this process has ended.":
          [(1, True), (2, False)],
      " steps 1, 2 intact there; step 2 saved whole all the same (its writes had finished).":
          [(1, True), (2, True)],
  }
  assert line.startswith(prefix) and line[len(prefix):] in outcomes, err
  found = steps_lib.list_steps(directory, commit_times=False)
  assert [(info.step, info.committed) for info in found] == outcomes[line[len(prefix):]]
  if (2, False) in outcomes[line[len(prefix):]]:
    assert cli.main(["clean", "--force", str(directory)]) == 0
    assert [info.step for info in steps_lib.list_steps(directory)] == [1]
  with pzp.CheckpointManager(directory) as manager:  # The run resumes from its latest.
    latest = manager.latest_step()
    restored = manager.restore()
    assert int(restored["opt_state"]["count"]) == latest
    np.testing.assert_array_equal(
        np.asarray(restored["params"][0].value.unwrap("x"))[:3], [0.0, 1.0, 2.0]
    )


def _tree(value: float, size: int = 1000):
  data = np.arange(size, dtype=np.float32) + value
  return [pz.ParameterValue(label="w", value=pz.nx.wrap(data, "x"))]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_keyboard_interrupt_mid_save_in_process(tmp_path, monkeypatch, async_save):
  """As in a notebook: the one line, no logging left changed, the manager
  usable afterwards, and the next save of that step whole."""
  absl_logger = logging.getLogger("absl")
  filters_before = list(absl_logger.filters)
  started = v0_handler.PenzaiCheckpointHandler.async_save

  async def interrupted(self, *args, **kwargs):
    futures = await started(self, *args, **kwargs)  # Background writing under way.
    if len(futures) and "params" in str(args[0]):
      raise KeyboardInterrupt
    return futures

  with pzp.CheckpointManager(tmp_path / "run", async_save=async_save) as manager:
    manager.save(1, params=_tree(1.0))
    manager.wait_until_finished()
    monkeypatch.setattr(v0_handler.PenzaiCheckpointHandler, "async_save", interrupted)
    with pytest.raises(KeyboardInterrupt) as raised:
      manager.save(2, params=_tree(2.0, size=2**22))
      manager.wait_until_finished()
    monkeypatch.undo()
    message = str(raised.value)
    assert type(raised.value) is KeyboardInterrupt  # pylint: disable=unidiomatic-typecheck
    assert raised.value._render_traceback_() == [f"KeyboardInterrupt: {message}"]  # pylint: disable=protected-access
    assert "\n" not in message
    assert message.endswith(
        "save interrupted; step 1 intact there; step 2 not saved, and what it had written"
        " was removed."
    )
    assert absl_logger.filters == filters_before
    assert manager.all_steps() == [1]
    manager.save(2, params=_tree(3.0))
    manager.wait_until_finished()
    assert manager.all_steps() == [1, 2]
    restored = manager.restore(2)["params"]
  np.testing.assert_array_equal(np.asarray(restored[0].value.unwrap("x"))[:3], [3.0, 4.0, 5.0])
  assert absl_logger.filters == filters_before
