"""Processes saving and loading one path at once: one save wins, no read mixes.

Workers are long-lived subprocesses driven line by line over stdin, so JAX is
imported once per worker rather than once per round; a "go" line sent to both
workers at once makes their saves overlap.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from conftest import REPO

import pz_persist as pzp
from pz_persist import errors
from pz_persist.storage import stores
from pz_persist.storage.reading import opening

TREE_CODE = textwrap.dedent("""
    import numpy as np
    from penzai import pz

    def tree(value, megabytes=32):
      # Random (incompressible) data, so a save takes long enough to overlap.
      rng = np.random.default_rng(value)
      n = megabytes * 2**20 // 4 // 4
      return {
          "value": value,
          "w": [pz.ParameterValue(label=f"w{i}",
                                  value=pz.nx.wrap(rng.random(n, dtype=np.float32), "x"))
                for i in range(4)],
      }
""")

SAVER = TREE_CODE + textwrap.dedent("""
    import json, sys
    import pz_persist as pzp
    from pz_persist import errors

    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
      path, value, overwrite = json.loads(line)
      data = tree(value)
      print(json.dumps("ready"), flush=True)
      sys.stdin.readline()  # "go"
      try:
        pzp.save(path, data, overwrite=overwrite)
        result = {"ok": True}
      except errors.CheckpointExistsError as e:
        result = {"ok": False, "error": type(e).__name__, "message": str(e)}
      print(json.dumps(result), flush=True)
""")

_namespace: dict = {}
exec(TREE_CODE, _namespace)  # pylint: disable=exec-used
tree = _namespace["tree"]


def _start(code: str, *args: str) -> subprocess.Popen:
  process = subprocess.Popen(
      [sys.executable, "-c", code, *args], stdin=subprocess.PIPE,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
  )
  process.lines = queue.Queue()  # Filled by a thread, so reads can time out.
  threading.Thread(
      target=lambda: [process.lines.put(line) for line in process.stdout]
      + [process.lines.put("")], daemon=True,
  ).start()
  return process


def _receive(process: subprocess.Popen, timeout: float = 60):
  """The worker's next JSON line (the test fails, not hangs, if none comes)."""
  try:
    line = process.lines.get(timeout=timeout)
  except queue.Empty:
    line = ""
  if not line:
    process.kill()
    raise AssertionError(f"worker ended or hung:\n{process.stderr.read()[-3000:]}")
  return json.loads(line)


def _send(process: subprocess.Popen, message) -> None:
  process.stdin.write(json.dumps(message) + "\n")
  process.stdin.flush()


def _assert_same(loaded, expected):
  assert loaded["value"] == expected["value"]
  for got, want in zip(loaded["w"], expected["w"], strict=True):
    assert got.label == want.label
    np.testing.assert_array_equal(np.asarray(got.value.data_array),
                                  np.asarray(want.value.data_array))


@pytest.fixture
def savers():
  workers = [_start(SAVER), _start(SAVER)]
  try:
    for worker in workers:
      assert _receive(worker, timeout=120) == "ready"
    yield workers
  finally:
    for worker in workers:
      if worker.poll() is None:
        worker.stdin.close()
        try:
          worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
          worker.kill()


def _race(savers, path, values, overwrite):
  """Both savers save at once; returns their results."""
  for worker, value in zip(savers, values):
    _send(worker, [str(path), value, overwrite])
  for worker in savers:
    assert _receive(worker) == "ready"
  for worker in savers:
    _send(worker, "go")
  return [_receive(worker) for worker in savers]


@pytest.mark.parametrize("overwrite", [False, True], ids=["new-path", "overwrite"])
def test_simultaneous_saves_one_wins(savers, tmp_path, overwrite):
  races_lost = 0
  for round_ in range(5):
    path = tmp_path / f"ckpt{round_}"
    if overwrite:
      pzp.save(path, tree(999, megabytes=1))
    values = [2 * round_, 2 * round_ + 1]
    results = _race(savers, path, values, overwrite)
    winners = [value for value, r in zip(values, results) if r["ok"]]
    losers = [r for r in results if not r["ok"]]
    assert len(winners) == 1 and len(losers) == 1, results
    assert losers[0]["error"] in ("ConcurrentSaveError", "CheckpointExistsError")
    assert str(path) in losers[0]["message"]
    races_lost += losers[0]["error"] == "ConcurrentSaveError"
    _assert_same(pzp.load(path), tree(winners[0]))
    assert sorted(os.listdir(tmp_path)) == [f"ckpt{i}" for i in range(round_ + 1)]
  # Both started before either finished: the race was decided at the move.
  assert races_lost, "the saves never overlapped; the test exercised nothing"


WRITER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import pz_persist as pzp
    from penzai import pz

    path, generations = sys.argv[1], int(sys.argv[2])
    for g in range(1, generations + 1):
      pzp.save(path, {"gen": g, "w": [
          pz.ParameterValue(label=f"w{i}", value=pz.nx.wrap(np.full(2**18, g, np.float32), "x"))
          for i in range(8)]}, overwrite=True)
    print(json.dumps("done"), flush=True)
""")

READER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import pz_persist as pzp
    from pz_persist.storage.reading import opening

    attempts = 0
    identity = opening._identity
    def counting(store, path, item):  # Called 3 times per attempt.
      global attempts
      attempts += 1
      return identity(store, path, item)
    opening._identity = counting

    path = sys.argv[1]
    loads, generations, mixed = 0, set(), []
    while json.loads(sys.stdin.readline()) == "load":
      tree = pzp.load(path, verify=loads % 2 == 0)  # Checksums would also catch a mix.
      values = {int(tree["gen"])} | {float(v) for p in tree["w"]
                                     for v in np.unique(np.asarray(p.value.data_array))}
      if len(values) != 1:
        mixed.append(sorted(values))
      loads += 1
      generations.add(int(tree["gen"]))
      print(json.dumps("loaded"), flush=True)
    print(json.dumps({"loads": loads, "generations": sorted(generations),
                      "mixed": mixed[:5], "retries": attempts // 3 - loads}), flush=True)
""")


def test_reader_sees_one_whole_checkpoint_while_overwritten(tmp_path):
  path = tmp_path / "ckpt"
  pzp.save(path, {"gen": 0, "w": []})
  reader = _start(READER, str(path))
  writer = None
  try:
    _send(reader, "load")
    assert _receive(reader, timeout=120) == "loaded"  # Imported and ready.
    writer = _start(WRITER, str(path), "60")
    finished = False
    while not finished:
      finished = writer.poll() is not None
      _send(reader, "load")
      assert _receive(reader) == "loaded"
    assert writer.returncode == 0, writer.stderr.read()[-3000:]
    _send(reader, "stop")
    report = _receive(reader)
  finally:
    for process in (reader, writer):
      if process is not None and process.poll() is None:
        process.kill()
  assert report["mixed"] == [], report
  assert len(report["generations"]) > 10, report  # Reads overlapped the writes.
  print(report)


@pytest.mark.parametrize("overwrite", [False, True], ids=["new-path", "overwrite"])
def test_save_losing_the_race_keeps_nothing(tmp_path, monkeypatch, overwrite):
  """Deterministically: another save lands just before this one's move."""
  path = tmp_path / "ckpt"
  if overwrite:
    pzp.save(path, {"first": 1})
  move = stores.LOCAL.publish

  def another_save_first(*args):
    monkeypatch.setattr(stores.LOCAL, "publish", move)
    pzp.save(path, {"winner": 1}, overwrite=True)
    return move(*args)

  monkeypatch.setattr(stores.LOCAL, "publish", another_save_first)
  with pytest.raises(errors.ConcurrentSaveError, match=f"another process saved {path}"):
    pzp.save(path, {"loser": 1}, overwrite=overwrite)
  assert pzp.load(path) == {"winner": 1}
  assert os.listdir(tmp_path) == ["ckpt"]


def test_load_gives_up_when_replaced_during_every_attempt(tmp_path, monkeypatch):
  path = tmp_path / "ckpt"
  pzp.save(path, {"x": 1})
  changes = iter(range(100))
  monkeypatch.setattr(opening, "_identity", lambda *_: next(changes))
  with pytest.raises(errors.ConcurrentSaveError, match="replaced by other saves"):
    pzp.load(path)


def test_load_raises_real_errors_at_once(tmp_path, monkeypatch):
  path = tmp_path / "ckpt"
  pzp.save(path, {"x": np.arange(3)})
  attempts = []
  identity = opening._identity
  monkeypatch.setattr(opening, "_identity", lambda *a: attempts.append(1) or identity(*a))
  for name in os.listdir(path / "penzai" / "d"):
    os.remove(path / "penzai" / "d" / name)  # Damaged, but not being replaced.
  with pytest.raises(errors.PzPersistError) as raised:
    pzp.load(path)
  assert not isinstance(raised.value, errors.ConcurrentSaveError)
  assert len(attempts) == 3  # One attempt: identity before finding, before and after reading.
