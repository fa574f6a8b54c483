"""Cleaning leftovers never deletes anything outside the directory cleaned.

A leftover's entries, anything inside them, and its marker may be symlinks
planted to lead elsewhere; every deletion of `pz_persist.storage.lifecycle.leftovers` goes
through `leftovers.delete`, which removes links, never what they lead to.
A sentinel directory outside must survive every case, forced or not.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading

import pytest
from conftest import REPO

from pz_persist import errors
from pz_persist.storage import stores
from pz_persist.storage.lifecycle import leftovers
from pz_persist.tools import cli

_FAMILY = ".ckpt.pz_persist-new-0123abcd"


@pytest.fixture
def sentinel(tmp_path):
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "precious").write_text("keep me")
  yield outside
  assert (outside / "precious").read_text() == "keep me"


def _dead_marker() -> str:
  this = leftovers._this_writer()  # pylint: disable=protected-access
  return json.dumps(dict(this, pid=2**22 + 12345, start=None))  # No such pid.


def _run_dir(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  return run


def _plant_entry_symlink(run, sentinel):
  os.symlink(sentinel, run / f"{_FAMILY}.orbax-checkpoint-tmp")
  (run / f"{_FAMILY}.writer").write_text(_dead_marker())


def _plant_symlink_inside(run, sentinel):
  inside = run / f"{_FAMILY}.orbax-checkpoint-tmp" / "penzai"
  inside.mkdir(parents=True)
  os.symlink(sentinel, inside / "d")
  os.symlink(sentinel / "precious", inside / "file")
  (run / f"{_FAMILY}.writer").write_text(_dead_marker())


def _plant_marker_symlink(run, sentinel):
  (sentinel / "marker").write_text(_dead_marker())
  (run / f"{_FAMILY}.orbax-checkpoint-tmp").mkdir()
  os.symlink(sentinel / "marker", run / f"{_FAMILY}.writer")


def _plant_old_symlink(run, sentinel):
  (run / "ckpt").mkdir()
  os.symlink(sentinel, run / ".ckpt.pz_persist-old-99ff")


def _plant_tmp_step_symlink(run, sentinel):
  os.symlink(sentinel, run / "5.orbax-checkpoint-tmp-1")


@pytest.mark.parametrize("plant", [
    _plant_entry_symlink, _plant_symlink_inside, _plant_marker_symlink,
    _plant_old_symlink, _plant_tmp_step_symlink,
])
@pytest.mark.parametrize("force", [False, True])
def test_clean_never_deletes_through_symlinks(tmp_path, sentinel, plant, force):
  run = _run_dir(tmp_path)
  plant(run, sentinel)
  found = leftovers.find_all(run) + leftovers.find(*stores.choose(run / "ckpt"))
  assert found
  for leftover in found:
    leftovers.remove(leftover, force=force)
  assert sorted(os.listdir(sentinel)) == sorted(
      ["precious"] + (["marker"] if plant is _plant_marker_symlink else [])
  )


def test_a_symlinked_marker_proves_nothing(tmp_path, sentinel):
  """Its contents are not trusted: the family's writer counts as unknown."""
  run = _run_dir(tmp_path)
  _plant_marker_symlink(run, sentinel)
  [found] = leftovers.find(*stores.choose(run / "ckpt"))
  assert found.status == "unknown"
  assert leftovers.remove_dead(*stores.choose(run / "ckpt")) == []
  assert not leftovers.remove(found)


@pytest.mark.parametrize("status", ["dead", "unknown", "live"])
def test_remove_refuses_a_leftover_no_save_named(tmp_path, sentinel, status):
  """A hand-made `Leftover` whose name is no family's fails with a
  `PzPersistError` naming it (it raised a bare TypeError), deleting nothing."""
  run = _run_dir(tmp_path)
  (run / "ckpt").mkdir()
  made = leftovers.Leftover(
      name=run / "ckpt", entries=(run / "ckpt", sentinel), nbytes=0,
      status=status, reason="hand-made", store=stores.LOCAL,
  )
  with pytest.raises(errors.ArgumentError, match="ckpt is not named like"):
    leftovers.remove(made, force=True)
  assert (run / "ckpt").is_dir()


# Markers are read like every other small file (issue 26, item 10): a FIFO,
# a directory, a symlink, deep nesting or a huge file named like a marker is
# a leftover whose writer is unknown, never a hang or an exception.

_NESTED = "[" * 4000


def _marker_fifo(marker):
  os.mkfifo(marker)


def _marker_directory(marker):
  marker.mkdir()


def _marker_nested(marker):
  marker.write_text(_NESTED)


def _marker_huge(marker):
  marker.write_bytes(b" " * (8 << 20))


def _marker_pid_overflow(marker):
  marker.write_text(json.dumps(dict(json.loads(_dead_marker()), pid=10**30)))


MARKERS = {
    "fifo": (_marker_fifo, r"its writer marker is a FIFO, not a regular file"),
    "directory": (_marker_directory, r"its writer marker is a directory, not a regular file"),
    "nested": (_marker_nested, r"no readable writer marker"),
    "huge": (_marker_huge, r"its writer marker is 8388608 bytes, over the 4096-byte limit"),
    "pid_overflow": (_marker_pid_overflow, r"no valid pid in its writer marker"),
}


def _plant_family(run, make_marker):
  (run / f"{_FAMILY}.orbax-checkpoint-tmp").mkdir()
  make_marker(run / f"{_FAMILY}.writer")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", MARKERS)
def test_odd_markers_are_unknown_writers(tmp_path, kind):
  """In-process: the FIFO too, opened without blocking (the timeout stops a regression)."""
  make, reason = MARKERS[kind]
  run = _run_dir(tmp_path)
  _plant_family(run, make)
  [found] = leftovers.find(*stores.choose(run / "ckpt"))
  assert found.status == "unknown"
  assert re.search(reason, found.reason), found.reason
  assert leftovers.remove_dead(*stores.choose(run / "ckpt")) == []
  assert not leftovers.remove(found)
  assert leftovers.remove(found, force=True)
  assert os.listdir(run) == []


_ENTRY_POINTS_SCRIPT = """
import sys
import numpy as np
import pz_persist as pzp
from pz_persist.tools import cli
run = sys.argv[1]
pzp.save(run + "/ckpt", {"w": np.ones(3)})
print("saved")
pzp.inspect(run + "/ckpt")
print("inspect", cli.main(["inspect", run + "/ckpt"]))
print("clean", cli.main(["clean", run]))
print("ls", cli.main(["ls", run]))
with pzp.CheckpointManager(run + "/steps") as manager:
  manager.save(1, params={"w": np.ones(3)})
print("manager saved")
print("clean --force", cli.main(["clean", "--force", run]))
print("END")
"""


@pytest.mark.parametrize("kind", MARKERS)
def test_odd_markers_block_no_entry_point(tmp_path, kind):
  """save (which removes dead leftovers first), inspect, clean and the
  manager, in a fresh process with a timeout: a FIFO opened for reading
  waited for a writer forever."""
  make, reason = MARKERS[kind]
  run = _run_dir(tmp_path)
  _plant_family(run, make)
  result = subprocess.run(
      [sys.executable, "-c", _ENTRY_POINTS_SCRIPT, str(run)],
      capture_output=True, text=True, timeout=240, cwd=REPO,
  )
  out = result.stdout
  assert result.returncode == 0 and out.rstrip().endswith("END"), (
      result.returncode, out, result.stderr[-3000:])
  assert re.search(r"kept \S+\.ckpt\.pz_persist-new-0123abcd .*: unknown, " + reason, out), out
  assert re.search(r"removed \S+\.ckpt\.pz_persist-new-0123abcd .*: unknown", out), out
  assert "inspect 0" in out and "manager saved" in out, out
  # `ls` checks the whole directory as a run first, and refuses a FIFO in it.
  assert ("ls 2" in out and "is a FIFO" in result.stderr) if kind == "fifo" else "ls 0" in out
  assert not any(name.startswith(".ckpt.") for name in os.listdir(run))


# A live writer is never removed (issue 26, item 9): a CheckpointManager
# holds its run's lock from its opening to its close, and `clean --force`
# keeps the run's unfinished steps while it is held.

_PAUSED_SAVE = """
import sys
import numpy as np
import pz_persist as pzp
from pz_persist.orbax import v0_handler
finalize = v0_handler.PenzaiCheckpointHandler.finalize

def paused(self, directory):
  print("PAUSED", directory, flush=True)
  sys.stdin.readline()  # Until the test has run `clean --force`.
  finalize(self, directory)

v0_handler.PenzaiCheckpointHandler.finalize = paused
run = sys.argv[1]
if sys.argv[2] == "manager":
  with pzp.CheckpointManager(run) as manager:
    manager.save(1, params={"w": np.ones(3)})
    manager.wait_until_finished()
    print("SAVED", manager.all_steps(), flush=True)
else:
  pzp.save(run + "/ckpt", {"w": np.ones(3)})
  print("SAVED", sorted(pzp.load(run + "/ckpt")), flush=True)
"""


def _read_line(stream, timeout: float) -> str:
  """The next line of ``stream``, waiting at most ``timeout`` s for it."""
  lines: queue.Queue[str] = queue.Queue()
  reader = threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True)
  reader.start()
  return lines.get(timeout=timeout)


@pytest.mark.parametrize("writer", ["manager", "save"])
def test_clean_force_keeps_a_running_save(tmp_path, capsys, writer):
  run = _run_dir(tmp_path)
  child = subprocess.Popen(
      [sys.executable, "-c", _PAUSED_SAVE, str(run), writer],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, cwd=REPO,
  )
  try:
    line = _read_line(child.stdout, timeout=240)
    assert line.startswith("PAUSED"), (line, child.stderr.read() if child.poll() else "")
    writing = sorted(os.listdir(run))
    assert any("tmp" in name for name in writing), writing
    capsys.readouterr()
    assert cli.main(["clean", "--force", "--dry-run", str(run)]) == 0
    out = capsys.readouterr().out
    assert "kept" in out and ": live, " in out and "would remove" not in out, out
    assert cli.main(["clean", "--force", str(run)]) == 0
    out = capsys.readouterr().out
    assert "kept" in out and ": live, " in out and "removed" not in out, out
    assert sorted(os.listdir(run)) == writing
    child.stdin.write("\n")
    child.stdin.flush()
    line = _read_line(child.stdout, timeout=240)
    assert line.startswith("SAVED"), (line, child.stderr.read())
    assert ("[1]" if writer == "manager" else "['w']") in line
    assert child.wait(timeout=120) == 0, child.stderr.read()
  finally:
    if child.poll() is None:
      child.kill()
      child.wait()


def _lock_fifo(lock):
  os.mkfifo(lock)


def _lock_directory(lock):
  lock.mkdir()


def _lock_symlink(lock):
  os.symlink("/dev/zero", lock)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make, kind", [
    (_lock_fifo, "a FIFO"), (_lock_directory, "a directory"), (_lock_symlink, "a symbolic link"),
])
def test_an_odd_run_lock_blocks_nothing_and_proves_nothing(tmp_path, make, kind):
  """The manager refuses to open the run (it could not hold its lock); clean
  keeps the run's unfinished steps, forced or not: nothing proves them unused."""
  import numpy as np  # pylint: disable=g-import-not-at-top,import-outside-toplevel

  import pz_persist as pzp  # pylint: disable=g-import-not-at-top,import-outside-toplevel

  run = _run_dir(tmp_path)
  make(run / leftovers.RUN_LOCK)
  (run / "3.orbax-checkpoint-tmp-1").mkdir()
  [found] = leftovers.find_inside(*stores.choose(run))
  assert found.status == "unknown" and kind in found.reason, found
  assert not leftovers.would_remove(found, force=True)
  assert not leftovers.remove(found, force=True)
  assert (run / "3.orbax-checkpoint-tmp-1").is_dir()
  with pytest.raises(  # The run's check of special files, or the lock's own.
      errors.UnsafeCheckpointError, match=rf"\.pz_persist-run\.lock is ({kind}|a symlink to)"):
    with pzp.CheckpointManager(run) as manager:
      manager.save(1, params={"w": np.ones(3)})
