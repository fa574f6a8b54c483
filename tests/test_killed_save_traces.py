"""A path whose only trace is a killed save says so, at every entry point.

A save killed with SIGKILL leaves its hidden family beside the path (or
Orbax's unfinished step in a run directory): hundreds of MB no load can use.
`load`, `inspect`, `open`, `load_model`, `verify` and the command line say
how much is left, where, and that ``pz-persist clean`` removes it, instead
of only "it does not exist". Saves are killed in subprocesses once they
have written data (a condition waited on, as in test_kill).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO

import pz_persist as pzp
from pz_persist import errors
from pz_persist.storage import stores
from pz_persist.storage.lifecycle import leftovers
from pz_persist.storage.lifecycle import steps as steps_lib
from pz_persist.tools import cli

SAVER = textwrap.dedent("""
    import sys
    import numpy as np
    import pz_persist as pzp
    from penzai import pz

    base = np.arange(2**22, dtype=np.float32)  # 16 MiB per array.
    tree = [pz.ParameterValue(label=f"w{i}", value=pz.nx.wrap(base + i, "x")) for i in range(16)]
    print("saving", flush=True)
    if sys.argv[2] == "manager":
      with pzp.CheckpointManager(sys.argv[1], async_save=False) as manager:
        manager.save(2, params=tree)
    else:
      pzp.save(sys.argv[1], tree)
    print("saved", flush=True)
""")

_TIMEOUT = 120


def _kill_while_writing(path, kind: str, written) -> None:
  """Starts a save of ``path`` and SIGKILLs it once ``written()`` exceeds 1 MiB."""
  process = subprocess.Popen(
      [sys.executable, "-c", SAVER, str(path), kind],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
  )
  try:
    assert process.stdout.readline() == "saving\n"
    deadline = time.monotonic() + _TIMEOUT
    while written() <= 2**20:
      assert process.poll() is None, process.stderr.read()[-2000:]
      assert time.monotonic() < deadline, "the save wrote nothing"
      time.sleep(0.005)
  finally:
    process.send_signal(signal.SIGKILL)
    out, _ = process.communicate(timeout=_TIMEOUT)
  assert "saved" not in out, "the save finished before the kill; nothing was tested"


_ENTRY_POINTS = {
    "load": pzp.load,
    "inspect": pzp.inspect,
    "open": pzp.open,
    "load_model": pzp.load_model,
    "verify": pzp.verify,
}


def _cli_error(capsys, *argv: str) -> str:
  assert cli.main(list(argv)) != 0
  return capsys.readouterr().err


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
  """A checkpoint path whose save was killed midway (nothing else there)."""
  path = tmp_path_factory.mktemp("killed") / "ckpt"
  _kill_while_writing(
      path, "save", lambda: sum(found.nbytes for found in leftovers.find(*stores.choose(path)))
  )
  return path


@pytest.mark.parametrize("entry_point", sorted(_ENTRY_POINTS))
def test_every_reader_names_what_the_killed_save_left(killed, entry_point):
  (family,) = leftovers.find(*stores.choose(killed))
  size = re.escape(leftovers.terminal.size_text(family.nbytes))
  with pytest.raises(errors.NotACheckpointError) as raised:
    _ENTRY_POINTS[entry_point](killed)
  message = str(raised.value)
  assert re.fullmatch(
      rf"{re.escape(str(killed))} is not a pz_persist checkpoint: it does not exist\. Its only"
      rf" trace is an interrupted save that never finished: {size} left in"
      rf" {re.escape(family.name.name)} in {re.escape(str(killed.parent))}\. Nothing of it can"
      rf" be loaded; `pz-persist clean {re.escape(str(killed))}` removes it\.",
      message,
  ), message
  assert isinstance(raised.value, FileNotFoundError)  # Still what it always was.


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_the_command_line_says_it_too(killed, command, capsys):
  err = _cli_error(capsys, command, str(killed))
  assert "Its only trace is an interrupted save that never finished" in err
  assert f"`pz-persist clean {killed}` removes it" in err


def test_after_clean_it_says_only_that_nothing_is_there(tmp_path):
  path = tmp_path / "ckpt"
  _kill_while_writing(
      path, "save", lambda: sum(found.nbytes for found in leftovers.find(*stores.choose(path)))
  )
  assert cli.main(["clean", str(path)]) == 0
  assert leftovers.find(*stores.choose(path)) == []
  with pytest.raises(errors.NotACheckpointError) as raised:
    pzp.load(path)
  assert str(raised.value) == f"{path} is not a pz_persist checkpoint: it does not exist."


def test_a_killed_manager_step_is_named_when_that_step_is_asked_for(tmp_path):
  run = tmp_path / "run"

  def written() -> int:
    unfinished = [info for info in steps_lib.list_steps(run, commit_times=False)
                  if not info.committed] if run.exists() else []
    return sum(steps_lib.disk_bytes(info.path) for info in unfinished)

  _kill_while_writing(run, "manager", written)
  with pytest.raises(errors.NotACheckpointError) as raised:
    pzp.load(run / "2")
  message = str(raised.value)
  assert "Its only trace is an interrupted save that never finished" in message
  assert "2.orbax-checkpoint-tmp" in message and f"in {run}." in message
  # Nothing proves a run's writer gone; steps are cleaned from their run.
  assert f"`pz-persist clean --force {run}` removes it" in message
  assert cli.main(["clean", "--force", str(run)]) == 0  # As the message says.
  assert not [n for n in os.listdir(run) if "orbax-checkpoint-tmp" in n]
  with pytest.raises(errors.NotACheckpointError) as raised:
    pzp.load(run / "2")
  assert str(raised.value) == f"{run / '2'} is not a pz_persist checkpoint: it does not exist."
