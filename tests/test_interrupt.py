"""An interrupted save stops at once, says so in one line and cleans up;
what saves that died left is found and removed, never a live writer's.

Saves are interrupted with SIGINT in subprocesses (a script, as a user runs
one) and with a KeyboardInterrupt raised mid-save in this process (as in a
notebook); saves killed with SIGKILL leave leftovers for a later save or
``pz-persist clean``. Leftovers of running writers are simulated by live
subprocesses holding a marker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import inspect
import io
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import REPO
from penzai import pz

import pz_persist as pzp
from pz_persist import errors
from pz_persist.orbax import v0_handler
from pz_persist.storage import orbax_seam
from pz_persist.storage import stores
from pz_persist.storage.lifecycle import leftovers
from pz_persist.storage.writing import direct_write
from pz_persist.tools import cli

SAVER = textwrap.dedent("""
    import os, signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Even if started ignoring it.
    import numpy as np
    import pz_persist as pzp
    from penzai import pz

    path, value = sys.argv[1], float(sys.argv[2])
    base = np.arange(2**24, dtype=np.float32)  # 64 MiB (not compressed)
    to_array = np.asarray
    if sys.argv[4:] == ["jax"]:  # Arrays on a device: copied to host, then hashed.
      import jax.numpy as to_array_module
      to_array = to_array_module.asarray
    tree = [pz.ParameterValue(label=f"w{i}", value=pz.nx.wrap(to_array(base + (value + i)), "x"))
            for i in range(int(sys.argv[3]))]
    print("saving", flush=True)
    pzp.save(path, tree, overwrite=True)
    print("saved", flush=True)
""")

_TIMEOUT = 120
"""Far above what any step takes; only there so that a hang fails."""


@pytest.fixture(autouse=True)
def _ctrl_c_raises():
  """Ctrl-C raises KeyboardInterrupt here, as in a terminal or a notebook,
  even when the test run itself was started ignoring SIGINT (a background
  job of a shell without job control inherits SIGINT ignored)."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)


def _start_save(path, value: float, arrays: int = 12, kind: str = "numpy") -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, "-c", SAVER, str(path), str(value), str(arrays), kind],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
  )


def _wait_until_writing(process: subprocess.Popen, path, written: int = 2**20) -> None:
  """Waits until the save has written more than ``written`` bytes under its
  hidden name (with ``written=-1``: until its hidden folder exists)."""
  assert process.stdout.readline() == "saving\n"
  deadline = time.monotonic() + _TIMEOUT
  while time.monotonic() < deadline:
    found = leftovers.find(*stores.choose(path))
    if found and sum(l.nbytes for l in found) > written:
      return
    if process.poll() is not None:
      raise AssertionError(f"the save ended early: {process.stderr.read()[-2000:]}")
    time.sleep(0.005)
  raise AssertionError("the save wrote nothing")


def _hidden(directory) -> list[str]:
  return sorted(n for n in os.listdir(directory) if n.startswith("."))


def _tree(value: float, size: int = 1000):
  data = np.arange(size, dtype=np.float32) + value
  return [pz.ParameterValue(label="w", value=pz.nx.wrap(data, "x"))]


def _assert_holds(path, value: float) -> None:
  loaded = pzp.load(path)
  np.testing.assert_array_equal(np.asarray(loaded[0].value.unwrap("x"))[:3], value + np.arange(3))


@pytest.mark.parametrize("kind", ["numpy", "jax"])
@pytest.mark.parametrize("written", [-1, 2**20], ids=["folder_made", "arrays_written"])
def test_sigint_stops_the_save_prints_one_line_and_cleans_up(tmp_path, written, kind):
  """At either stage the process ends by SIGINT: never aborted by a
  TensorStore write still running as the interpreter exits (exit 134,
  "terminate called without an active exception", seen as the hidden folder
  is made and hashing has begun)."""
  path = tmp_path / "ckpt"
  previous = _start_save(path, 1.0, arrays=1)
  assert previous.communicate(timeout=_TIMEOUT)[0].endswith("saved\n")
  process = _start_save(path, 2.0, kind=kind)
  _wait_until_writing(process, path, written)
  process.send_signal(signal.SIGINT)
  out, err = process.communicate(timeout=_TIMEOUT)
  assert "saved" not in out, "the interrupt came after the save; nothing was tested"
  assert process.returncode == -signal.SIGINT, err[-3000:]  # A shell loop sees Ctrl-C.
  assert len(err.splitlines()) == 1, err  # Not Orbax's threads' tracebacks.
  assert f"pz_persist.save('{path}') interrupted; {path} is unchanged" in err
  # Every write had ended before the save gave up, so all it wrote is gone,
  # its marker too, as the message says.
  assert "it removed everything it had written" in err
  assert _hidden(tmp_path) == []
  _assert_holds(path, 1.0)
  pzp.save(path, _tree(3.0), overwrite=True)
  assert _hidden(tmp_path) == []


def test_keyboard_interrupt_mid_save_in_process(tmp_path, monkeypatch):
  """As in a notebook: the interrupt comes while Orbax's threads write."""
  path = tmp_path / "ckpt"
  pzp.save(path, _tree(1.0))
  started = v0_handler.PenzaiCheckpointHandler.async_save

  async def interrupted(self, *args, **kwargs):
    await started(self, *args, **kwargs)  # Background writing under way.
    raise KeyboardInterrupt

  monkeypatch.setattr(v0_handler.PenzaiCheckpointHandler, "async_save", interrupted)
  with pytest.raises(KeyboardInterrupt) as raised:
    pzp.save(path, _tree(2.0, size=2**22), overwrite=True)
  assert type(raised.value) is KeyboardInterrupt  # pylint: disable=unidiomatic-typecheck
  assert raised.value._render_traceback_() == [  # pylint: disable=protected-access
      f"KeyboardInterrupt: {raised.value}"
  ]
  assert "interrupted" in str(raised.value) and "\n" not in str(raised.value)
  assert "removed everything it had written" in str(raised.value)
  monkeypatch.undo()
  assert _hidden(tmp_path) == []  # Removed before the interrupt went on.
  _assert_holds(path, 1.0)
  pzp.save(path, _tree(3.0), overwrite=True)
  assert _hidden(tmp_path) == []
  _assert_holds(path, 3.0)


def test_interrupt_while_the_marker_is_written_leaves_nothing(tmp_path, monkeypatch):
  """Ctrl-C as the save creates its marker: held back until the marker is
  whole, then the save is abandoned like any other and the marker removed."""
  path = tmp_path / "ckpt"
  pzp.save(path, _tree(1.0))
  real = leftovers._this_writer  # pylint: disable=protected-access

  def interrupted():
    os.kill(os.getpid(), signal.SIGINT)  # Arrives while the marker is made.
    return real()

  monkeypatch.setattr(leftovers, "_this_writer", interrupted)
  with pytest.raises(KeyboardInterrupt, match="removed everything it had written"):
    pzp.save(path, _tree(2.0), overwrite=True)
  monkeypatch.undo()
  assert _hidden(tmp_path) == []
  _assert_holds(path, 1.0)


def test_work_queued_on_a_pool_shut_down_by_the_save_is_waited_for(tmp_path, monkeypatch):
  """Orbax makes a save's temporary directory through ``asyncio.to_thread``.
  A Ctrl-C in its event loop leaves that ``mkdir`` queued on the loop's
  pool, which the loop's ``close`` shuts down but does not cancel: it ran
  after the save deleted what it wrote, leaving an empty
  ``.orbax-checkpoint-tmp`` (one run of the SIGINT test in 40). Such work
  is now waited for before anything is deleted, and while it runs the save
  is not "settled" (a placeholder then stops it, as for Orbax's threads).
  A pool still open, the program's own, is not waited for."""
  monkeypatch.setattr(leftovers, "_JOIN_SECONDS", 0.2)  # Only bounds the waits below.
  before = set(threading.enumerate())
  program_pool, program_done = concurrent.futures.ThreadPoolExecutor(1), threading.Event()
  program_pool.submit(program_done.wait, _TIMEOUT)  # Runs on, never shut down.
  save_pool, release = concurrent.futures.ThreadPoolExecutor(1), threading.Event()
  late = tmp_path / "made late"
  save_pool.submit(lambda: (release.wait(_TIMEOUT), late.mkdir()))
  save_pool.shutdown(wait=False)  # What closing the save's event loop does.
  try:
    assert not leftovers.cancel_background(lambda: True, before)  # Still to run.
    release.set()
    assert leftovers.cancel_background(lambda: True, before)
    assert late.is_dir()  # It ran before the abandoned save went on.
  finally:
    release.set()
    program_done.set()
    program_pool.shutdown()


def test_a_save_thread_whose_start_the_interrupt_cut_short_is_waited_for(monkeypatch):
  """Ctrl-C inside ``Thread.start`` of one of Orbax's save threads (seen:
  inside the pool thread ``asyncio.to_thread`` was starting) leaves a
  thread ``threading.enumerate`` lists but ``join`` refuses ("cannot join
  thread before it is started"). That error replaced the interrupt: the
  script ended with status 1 and a traceback instead of SIGINT and one line.
  Such a thread is waited for to start; one that has not started by the
  deadline counts as still running (the save then leaves its placeholder)."""
  monkeypatch.setattr(leftovers, "_JOIN_SECONDS", 0.2)  # Only bounds the waits below.
  before = set(threading.enumerate())
  kind = orbax_seam.orbax_save_threads()
  ran = threading.Event()
  cut_short = kind(target=ran.set, send_signals=[], receive_signals=[])
  listed = threading.enumerate
  monkeypatch.setattr(threading, "enumerate", lambda: [*listed(), cut_short])
  assert not leftovers.cancel_background(lambda: True, before)  # Never started: running.
  starts_late = threading.Thread(target=cut_short.start)

  def cancel() -> bool:
    starts_late.start()  # Its start goes on after the interrupt.
    return True

  assert leftovers.cancel_background(cancel, before)
  assert ran.is_set() and not cut_short.is_alive()
  starts_late.join()


def test_an_interrupted_save_outwaits_its_queued_file_operations(tmp_path, monkeypatch):
  """The same through `pzp.save`: Ctrl-C while a file operation of the save
  is still queued on its event loop's pool, as when Orbax's ``mkdir`` of the
  temporary directory is; it runs once the save is cancelled, and then
  nothing of the save stays, as its one line says."""
  path = tmp_path / "ckpt"
  pzp.save(path, _tree(1.0))
  cancelled = threading.Event()
  cancel = v0_handler.PenzaiCheckpointHandler.cancel

  def cancelling(self):
    cancelled.set()
    return cancel(self)

  async def interrupted(self, directory, *args, **kwargs):
    made_again = os.path.dirname(os.fspath(directory))  # Orbax's temporary directory.
    asyncio.get_running_loop().run_in_executor(
        None, lambda: (cancelled.wait(_TIMEOUT), os.makedirs(made_again, exist_ok=True))
    )
    raise KeyboardInterrupt

  monkeypatch.setattr(v0_handler.PenzaiCheckpointHandler, "cancel", cancelling)
  monkeypatch.setattr(v0_handler.PenzaiCheckpointHandler, "async_save", interrupted)
  with pytest.raises(KeyboardInterrupt, match="removed everything it had written"):
    pzp.save(path, _tree(2.0), overwrite=True)
  monkeypatch.undo()
  assert cancelled.is_set()
  assert _hidden(tmp_path) == []
  _assert_holds(path, 1.0)


def _interrupted_holding_a_pending_task_of_a_closed_loop():
  """The coroutine of a task left pending in a closed loop, after an
  interrupt whose frames held the task was turned into a save's."""

  async def never_started():
    pass

  loop = asyncio.new_event_loop()
  task = loop.create_task(never_started())
  loop.close()
  try:
    raise KeyboardInterrupt
  except KeyboardInterrupt:
    errors.save_interrupted("pz_persist.save('x') interrupted")
  return task.get_coro()


def test_a_task_the_interrupt_left_pending_in_a_closed_loop_is_not_reported(caplog):
  """Ctrl-C before the save's task took its first step leaves it pending in
  the loop Orbax then closes; as it was collected, asyncio logged "Task was
  destroyed but it is pending!" after the interrupt's one line (one SIGINT
  test in 40, at the process's end). The interrupt's frames hold it: it is
  marked as nothing to report, and its never-started coroutine closed."""
  with caplog.at_level(logging.ERROR, logger="asyncio"):
    coroutine = _interrupted_holding_a_pending_task_of_a_closed_loop()
    gc.collect()  # The task, held by nothing now, is gone.
  assert "destroyed but it is pending" not in caplog.text
  assert inspect.getcoroutinestate(coroutine) == inspect.CORO_CLOSED


def test_when_late_writes_cannot_be_ruled_out_the_message_says_what_stays(tmp_path, monkeypatch):
  """Orbax's own array writer: its writes cannot be followed from pz_persist,
  so an empty placeholder and the marker stay, and the one line says so."""
  path = tmp_path / "ckpt"
  pzp.save(path, _tree(1.0))
  monkeypatch.setattr(direct_write, "applies", lambda *args, **kwargs: False)
  started = v0_handler.PenzaiCheckpointHandler.async_save

  async def interrupted(self, *args, **kwargs):
    await started(self, *args, **kwargs)  # Orbax's writes under way.
    raise KeyboardInterrupt

  monkeypatch.setattr(v0_handler.PenzaiCheckpointHandler, "async_save", interrupted)
  with pytest.raises(KeyboardInterrupt) as raised:
    pzp.save(path, _tree(2.0, size=2**20), overwrite=True)
  monkeypatch.undo()
  message = str(raised.value)
  stays = [n for n in _hidden(tmp_path) if not n.endswith(".pz_persist-deleting")]
  assert len(stays) == 2 and all(n in message for n in stays), (stays, message)
  assert any(n.endswith(".orbax-checkpoint-tmp") for n in stays)
  assert any(n.endswith(leftovers.MARKER_SUFFIX) for n in stays)
  assert f"the next save of {path} or `pz-persist clean {path}` removes" in message
  assert "\n" not in message
  _wait_for_deletions()
  _assert_holds(path, 1.0)
  pzp.save(path, _tree(3.0), overwrite=True)
  assert _hidden(tmp_path) == []  # As the message promised.


def _wait_for_deletions() -> None:
  for thread in threading.enumerate():
    if thread.name == "pz_persist_delete":
      thread.join(_TIMEOUT)


def _killed_mid_save(path) -> None:
  process = _start_save(path, 2.0)
  _wait_until_writing(process, path)
  process.kill()
  process.wait(timeout=_TIMEOUT)


def test_sigkill_leftovers_removed_by_next_save(tmp_path):
  path = tmp_path / "ckpt"
  pzp.save(path, _tree(1.0))
  _killed_mid_save(path)
  [found] = leftovers.find(*stores.choose(path))
  assert found.removable and found.nbytes > 2**20, found
  assert "has exited" in found.reason
  pzp.save(path, _tree(3.0), overwrite=True)
  assert _hidden(tmp_path) == []
  _assert_holds(path, 3.0)


def _cli(*argv: str) -> tuple[int, str]:
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    status = cli.main(list(argv))
  return status, out.getvalue()


def test_sigkill_leftovers_listed_and_removed_by_clean(tmp_path):
  path = tmp_path / "ckpt"
  pzp.save(path, _tree(1.0))
  _killed_mid_save(path)
  for command, where in (("inspect", path), ("ls", tmp_path)):
    status, out = _cli(command, str(where))
    assert status == 0
    assert "1 leftover(s) of unfinished saves" in out, out
    assert f"pz-persist clean {where}" in out
  status, out = _cli("clean", "--dry-run", str(tmp_path))
  assert "would remove" in out and len(_hidden(tmp_path)) == 2
  status, out = _cli("clean", str(tmp_path))
  assert status == 0 and out.startswith(f"removed {tmp_path}/.ckpt.pz_persist-new-"), out
  assert "MiB" in out
  assert _hidden(tmp_path) == []
  _assert_holds(path, 1.0)
  assert "unfinished saves" not in _cli("inspect", str(path))[1]
  assert _cli("clean", str(path))[1] == f"no leftovers of unfinished saves beside or in {path}\n"


HOLDER = textwrap.dedent("""
    # Writes a family the way a running save does, and keeps writing it.
    import sys, time
    from etils import epath
    from pz_persist.storage import stores
    from pz_persist.storage.lifecycle import leftovers
    target = epath.Path(sys.argv[1])
    tmp = target.parent / (target.name + ".orbax-checkpoint-tmp")
    with leftovers.writing(stores.LOCAL, target, cancel=lambda: None):
      tmp.mkdir()
      print("writing", flush=True)
      sys.stdin.read()
      tmp.rmdir()  # As a save's move into place would.
""")


def test_leftovers_of_a_running_writer_are_never_removed(tmp_path):
  path = tmp_path / "ckpt"
  target = tmp_path / ".ckpt.pz_persist-new-00000000000000aa"
  holder = subprocess.Popen(
      [sys.executable, "-c", HOLDER, str(target)], stdin=subprocess.PIPE,
      stdout=subprocess.PIPE, text=True, cwd=REPO,
  )
  try:
    assert holder.stdout.readline() == "writing\n"
    [found] = leftovers.find(*stores.choose(path))
    assert found.status == "live" and "lock" in found.reason
    pzp.save(path, _tree(1.0))
    status, out = _cli("clean", "--force", str(tmp_path))
    assert out.startswith(f"kept {target} ") and "live" in out
    assert len(_hidden(tmp_path)) == 2
  finally:
    holder.stdin.close()
    holder.wait(timeout=_TIMEOUT)
  assert holder.returncode == 0 and _hidden(tmp_path) == []


def _marker(tmp_path, token: str, **writer) -> str:
  """A family with a marker as a save would write, fields overridden, unlocked."""
  family = tmp_path / f".ckpt.pz_persist-new-{token}"
  (tmp_path / (family.name + ".orbax-checkpoint-tmp")).mkdir()
  record = dict(leftovers._this_writer(), **writer)  # pylint: disable=protected-access
  (tmp_path / (family.name + ".writer")).write_text(json.dumps(record))
  return family.name


def test_writer_decided_by_pid_start_time_host_and_boot(tmp_path):
  alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                           stdin=subprocess.PIPE)
  exited = subprocess.Popen([sys.executable, "-c", ""])
  exited.wait(timeout=_TIMEOUT)
  start = leftovers._start_time  # pylint: disable=protected-access
  try:
    statuses = {
        _marker(tmp_path, "a1", pid=alive.pid, start=start(alive.pid)): "live",
        _marker(tmp_path, "a2", pid=alive.pid, start=start(alive.pid) + 1): "dead",  # pid reused
        _marker(tmp_path, "a3", pid=exited.pid, start=None): "dead",
        _marker(tmp_path, "a4", pid=exited.pid, host="elsewhere"): "unknown",
        _marker(tmp_path, "a5", pid=alive.pid, boot="another-boot"): "dead",  # restarted
        _marker(tmp_path, "a6", pid=alive.pid, start=start(alive.pid), abandoned=True): "dead",
        _marker(tmp_path, "a7", pid=os.getpid()): "dead",  # This process: not saving it.
    }
    (tmp_path / ".ckpt.pz_persist-new-a8.orbax-checkpoint-tmp").mkdir()  # No marker.
    statuses[".ckpt.pz_persist-new-a8"] = "unknown"
    found = {l.name.name: l.status for l in leftovers.find(*stores.choose(tmp_path / "ckpt"))}
    assert found == statuses
    leftovers.remove_dead(*stores.choose(tmp_path / "ckpt"))
    assert {l.name.name for l in leftovers.find(*stores.choose(tmp_path / "ckpt"))} == {
        name for name, status in statuses.items() if status != "dead"
    }
    _cli("clean", "--force", str(tmp_path / "ckpt"))
    assert [l.name.name for l in leftovers.find(*stores.choose(tmp_path / "ckpt"))] == [
        name for name, status in statuses.items() if status == "live"
    ]
  finally:
    alive.stdin.close()
    alive.wait(timeout=_TIMEOUT)


def test_orbax_tmp_steps_are_left_to_orbax_unless_forced(tmp_path):
  (tmp_path / "7.orbax-checkpoint-tmp-123").mkdir()
  (tmp_path / "7.orbax-checkpoint-tmp-123" / "x").write_bytes(b"x" * 100)
  status, out = _cli("clean", str(tmp_path))
  assert out.startswith("kept") and "CheckpointManager" in out
  assert os.path.isdir(tmp_path / "7.orbax-checkpoint-tmp-123")
  _cli("clean", "--force", str(tmp_path))
  assert os.listdir(tmp_path) == []


def test_ctrl_c_during_the_move_waits_for_it(tmp_path, monkeypatch):
  """The move into place is never cut in half; the interrupt comes after it."""
  path = tmp_path / "ckpt"
  pzp.save(path, _tree(1.0))
  move = stores.LOCAL.publish

  def interrupted_move(*args):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the move starts.
    return move(*args)

  monkeypatch.setattr(stores.LOCAL, "publish", interrupted_move)
  with pytest.raises(KeyboardInterrupt, match="interrupted once complete"):
    pzp.save(path, _tree(2.0), overwrite=True)
  _wait_for_deletions()
  _assert_holds(path, 2.0)
  assert _hidden(tmp_path) == []


def test_the_reports_an_interrupt_leaves_in_event_loops_are_dropped_others_kept(monkeypatch):
  """A Ctrl-C that lands inside an event loop's constructor leaves a
  half-built loop whose finalizer fails; that report, and a late write's
  "Event loop is closed", are dropped after an interrupted save, while any
  other unraisable exception still reaches the hook that was there before."""
  import asyncio
  import gc

  from pz_persist import errors

  reached = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: reached.append(type(u.exc_value)))
  monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
  errors.save_interrupted("interrupted")

  half_built = object.__new__(asyncio.SelectorEventLoop)
  half_built._closed = False  # pylint: disable=protected-access
  half_built._thread_id = None  # Cut short before its selector and handlers.  # pylint: disable=protected-access
  del half_built

  class FailsWhenCollected:
    def __del__(self):
      raise ValueError("not ours to drop")

  FailsWhenCollected()  # Collected at once.
  gc.collect()
  assert reached == [ValueError]


def test_coroutines_the_interrupt_left_unstarted_are_closed_quietly():
  """A Ctrl-C while Orbax builds the loop that would run a save's coroutine
  (its ``run_sync``: a wrapper coroutine around the save's) leaves both never
  awaited; after the interrupted save's one line, Python must not print
  "coroutine ... was never awaited" for them. A coroutine already running
  belongs to its loop and is not touched."""
  import asyncio
  import gc
  import warnings

  from pz_persist import errors

  async def save_work():
    await asyncio.sleep(0)

  def via_new_loop(coro):
    raise KeyboardInterrupt  # As if it landed in asyncio.new_event_loop().

  def run_sync(coro):
    async def with_registration():
      return await coro
    return via_new_loop(with_registration())

  started = save_work()
  started.send(None)  # Suspended at its await: started, not ours to close.
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      run_sync(save_work())
    except KeyboardInterrupt:
      errors.save_interrupted("interrupted")
    gc.collect()
  assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []
  assert started.cr_frame is not None  # Still suspended, not closed.
  started.close()
