"""Hostile file systems: links, FIFOs, devices and swaps in checkpoint and run
directories never make pz_persist (or Orbax through it) delete, read or hang
outside them.

Deletions are detected with a sentinel directory outside the run; reads that
could hang or exhaust memory run in a subprocess with a timeout and an
address-space limit.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import REPO

import pz_persist as pzp
from pz_persist import errors
from pz_persist.orbax import v0_handler
from pz_persist.safety import safe_io
from pz_persist.storage import destinations
from pz_persist.storage import stores
from pz_persist.storage.lifecycle import leftovers
from pz_persist.storage.reading import direct_read
from pz_persist.storage.reading import raw_chunks
from pz_persist.storage.stores import local

TRASH = ".pz_persist_deleted"
SEVEN, OUTSIDE_VALUE = 7.0, 666.0


def _sentinel(tmp_path: pathlib.Path) -> pathlib.Path:
  """A directory outside every checkpoint, with subdirectories and files."""
  root = tmp_path / "outside"
  for name in ("a", "b/c"):
    (root / name).mkdir(parents=True)
    (root / name / "keep.txt").write_text(name)
  (root / "top.txt").write_text("top")
  return root


def _listing(root: pathlib.Path) -> list[tuple[str, bytes]]:
  """Every entry under ``root`` and each file's content, to see nothing changed."""
  found = []
  for parent, dirs, files in os.walk(root):
    for name in sorted(dirs + files):
      path = pathlib.Path(parent) / name
      content = path.read_bytes() if path.is_file() and not path.is_symlink() else b"/"
      found.append((str(path.relative_to(root)), content))
  return sorted(found)


def _run(tmp_path: pathlib.Path, steps=(0, 1)) -> pathlib.Path:
  run = tmp_path / "run"
  with pzp.CheckpointManager(run, async_save=False) as manager:
    for step in steps:
      manager.save(step, params={"w": np.full(8, float(step))})
  assert (run / TRASH).is_dir() or not (run / TRASH).exists()
  return run


def _link_out(link: pathlib.Path, target: pathlib.Path, relative: bool) -> None:
  if link.is_dir() and not link.is_symlink():
    shutil.rmtree(link)
  elif link.exists() or link.is_symlink():
    link.unlink()
  link.symlink_to(os.path.relpath(target, link.parent) if relative else target)


# Item 1: the trash is never followed out of the run directory.


@pytest.mark.parametrize("make_trash", [
    "link_to_outside", "relative_link_to_outside", "link_to_a_step", "file", "link_to_file",
])
def test_a_trash_that_is_not_a_real_directory_is_refused(tmp_path, make_trash):
  run = _run(tmp_path)
  outside = _sentinel(tmp_path)
  trash = run / TRASH
  if trash.exists():
    trash.rmdir()
  if make_trash == "link_to_outside":
    trash.symlink_to(outside)
  elif make_trash == "relative_link_to_outside":
    trash.symlink_to(os.path.relpath(outside, run))
  elif make_trash == "link_to_a_step":  # Inside the run, but emptying it kills step 0.
    trash.symlink_to("0")
  elif make_trash == "file":
    trash.write_text("not a directory")
  else:
    trash.symlink_to(outside / "top.txt")
  before, step0 = _listing(outside), _listing(run / "0")
  with pytest.raises(errors.PzPersistError, match=TRASH):
    with pzp.CheckpointManager(run, max_to_keep=1) as manager:
      manager.save(5, params={"w": np.zeros(2)})
  assert _listing(outside) == before
  assert _listing(run / "0") == step0
  assert sorted(os.listdir(run)) == sorted(["0", "1", TRASH, leftovers.RUN_LOCK])


@pytest.mark.parametrize("when", ["before_save", "before_close"])
def test_a_trash_swapped_for_a_link_while_open_is_refused(tmp_path, when):
  run = _run(tmp_path)
  outside = _sentinel(tmp_path)
  before = _listing(outside)
  manager = pzp.CheckpointManager(run, max_to_keep=1, async_save=False)
  manager._emptying.join()  # pylint: disable=protected-access
  shutil.rmtree(run / TRASH, ignore_errors=True)
  (run / TRASH).symlink_to(outside)
  with pytest.raises(errors.PzPersistError, match=TRASH):
    if when == "before_save":  # Retention would move steps 0 and 1 out of the run.
      manager.save(2, params={"w": np.zeros(2)})
    manager.close()
  assert _listing(outside) == before
  assert {"0", "1"} <= set(os.listdir(run))


def test_emptying_the_trash_deletes_links_as_links(tmp_path):
  run = _run(tmp_path)
  outside = _sentinel(tmp_path)
  before = _listing(outside)
  trash = run / TRASH
  trash.mkdir(exist_ok=True)
  (trash / "7").symlink_to(outside)
  (trash / "8").mkdir()
  (trash / "8" / "d").symlink_to(outside / "a")
  (trash / "8" / "f").symlink_to(outside / "top.txt")
  (trash / "8" / "deep" / "er").mkdir(parents=True)
  (trash / "8" / "deep" / "er" / "up").symlink_to("../../../../../outside/b")
  safe_io.empty_directory(trash)
  assert list(trash.iterdir()) == []
  assert _listing(outside) == before


# Deleting: temporaries, leftovers and replaced checkpoints.


@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("where", ["target", "orbax_temporary"])
def test_an_unfinished_save_that_is_a_link_is_refused(tmp_path, where, relative):
  outside = _sentinel(tmp_path)
  before = _listing(outside)
  target = local.sibling(epath_of(tmp_path / "ckpt"), "new")
  link = target if where == "target" else target.parent / f"{target.name}.orbax-checkpoint-tmp-1"
  _link_out(pathlib.Path(link), outside, relative)
  with pytest.raises(errors.PzPersistError, match=os.path.basename(link)):
    leftovers.remove_unfinished(target)
  assert _listing(outside) == before
  assert os.path.islink(link)  # Refused, so left for the user to look at.


def test_an_unfinished_save_that_is_a_file_is_refused(tmp_path):
  target = local.sibling(epath_of(tmp_path / "ckpt"), "new")
  pathlib.Path(target).write_text("someone else's")
  with pytest.raises(errors.PzPersistError, match="not a directory"):
    leftovers.remove_unfinished(target)
  assert pathlib.Path(target).read_text() == "someone else's"


def test_rmtree_deletes_every_link_as_a_link(tmp_path):
  outside = _sentinel(tmp_path)
  before = _listing(outside)
  tree = tmp_path / "tree"
  (tree / "sub" / "deeper").mkdir(parents=True)
  (tree / "to_dir").symlink_to(outside)
  (tree / "sub" / "to_file").symlink_to(outside / "top.txt")
  (tree / "sub" / "deeper" / "relative").symlink_to("../../../outside/a")
  (tree / "sub" / "deeper" / "plain.txt").write_text("x")
  stores.LOCAL.remove(tree)
  assert not tree.exists()
  assert _listing(outside) == before
  link = tmp_path / "link"  # A link given as the tree itself goes as a link.
  link.symlink_to(outside)
  stores.LOCAL.remove(link)
  assert not os.path.lexists(link)
  assert _listing(outside) == before


def test_overwriting_through_a_link_keeps_its_target_and_leaves_nothing(tmp_path):
  """``path`` is a link to a checkpoint elsewhere: the exchange moves the link
  aside, which is then deleted as a link; the checkpoint it led to is kept."""
  real = tmp_path / "elsewhere" / "ckpt"
  pzp.save(real, {"x": np.ones(3)})
  before = _listing(real)
  link = tmp_path / "dir" / "ckpt"
  link.parent.mkdir()
  link.symlink_to(real)
  pzp.save(link, {"x": np.zeros(3)}, overwrite=True)
  assert _listing(real) == before
  np.testing.assert_array_equal(pzp.load(real)["x"], np.ones(3))
  np.testing.assert_array_equal(pzp.load(link)["x"], np.zeros(3))
  assert os.listdir(link.parent) == ["ckpt"]  # No hidden leftover.


def test_overwriting_a_checkpoint_that_gained_links_out_keeps_their_targets(
    tmp_path, monkeypatch
):
  """Links planted after the replaceability check go with the old checkpoint,
  as links; what they lead to is kept."""
  outside = _sentinel(tmp_path)
  before = _listing(outside)
  ckpt = tmp_path / "ckpt"
  pzp.save(ckpt, {"x": np.ones(3)})
  check = destinations.check_replaceable

  def check_then_plant(store, path, kind):
    check(store, path, kind)  # Inside the item only: a change at the top is a concurrent save.
    (ckpt / "penzai" / "to_dir").symlink_to(outside)
    (ckpt / "penzai" / "to_file").symlink_to(outside / "top.txt")
    (ckpt / "penzai" / "d" / "relative").symlink_to("../../../outside/b")

  monkeypatch.setattr(destinations, "check_replaceable", check_then_plant)
  pzp.save(ckpt, {"x": np.zeros(3)}, overwrite=True)
  assert _listing(outside) == before
  np.testing.assert_array_equal(pzp.load(ckpt)["x"], np.zeros(3))
  assert sorted(os.listdir(tmp_path)) == ["ckpt", "outside"]


# Steps, items and temporaries of a run that lead out of it.


def _copy_out(path: pathlib.Path, outside: pathlib.Path) -> pathlib.Path:
  copy = outside / ("copy_" + path.name)
  shutil.copytree(path, copy, symlinks=True)
  return copy


@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("what", ["step", "item", "orbax_temporary", "step_metadata"])
def test_a_run_with_links_out_is_refused(tmp_path, what, relative):
  run = _run(tmp_path)
  outside = _sentinel(tmp_path)
  if what == "step":
    _link_out(run / "1", _copy_out(run / "1", outside), relative)
  elif what == "item":
    _link_out(run / "1" / "params", _copy_out(run / "1" / "params", outside), relative)
  elif what == "orbax_temporary":
    _link_out(run / "2.orbax-checkpoint-tmp-123", outside / "a", relative)
  else:
    (outside / "metadata").write_text((run / "1" / "_CHECKPOINT_METADATA").read_text())
    _link_out(run / "1" / "_CHECKPOINT_METADATA", outside / "metadata", relative)
  before = _listing(outside)
  with pytest.raises(errors.UnsafeCheckpointError, match="outside the checkpoint"):
    pzp.CheckpointManager(run)
  status, out = _cli("ls", str(run))
  assert status == 2 and "outside the checkpoint" in out, out
  assert _listing(outside) == before


def test_a_step_linked_out_after_opening_is_refused_by_restore(tmp_path):
  run = _run(tmp_path)
  outside = _sentinel(tmp_path)
  with pzp.CheckpointManager(run) as manager:
    _link_out(run / "1", _copy_out(run / "1", outside), relative=False)
    with pytest.raises(errors.UnsafeCheckpointError, match="outside the checkpoint"):
      manager.restore(1)
    with pytest.raises(errors.UnsafeCheckpointError, match="outside the checkpoint"):
      manager.metrics(1)


def _cli(*args: str) -> tuple[int, str]:
  result = subprocess.run(
      [sys.executable, "-m", "pz_persist.tools.cli", *args], capture_output=True,
      text=True, timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
  )
  return result.returncode, result.stdout + result.stderr


def epath_of(path: pathlib.Path):
  return stores.normalise(path)


# Item 4: special and oversized files where a small file is read. Each case runs
# every entry point in one subprocess, with a timeout and a memory limit.

_SPECIAL_FILE_SCRIPT = """
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))
import pz_persist as pzp
from pz_persist import errors
from pz_persist.tools import cli
run, relpath, kind = sys.argv[1:4]
path = os.path.join(run, relpath)
original = path + ".orig"

def plant():
  os.rename(path, original)
  if kind == "fifo":
    os.mkfifo(path)
  elif kind == "dev_zero":
    os.symlink("/dev/zero", path)
  else:  # A sparse regular file far over any limit.
    with open(path, "wb") as f:
      f.truncate(2**40)

def unplant():
  os.unlink(path)
  os.rename(original, path)

results = {}
def attempt(name, call):
  try:
    call()
    results[name] = "no error"
  except errors.PzPersistError as e:
    results[name] = type(e).__name__ + ": " + str(e)

manager = pzp.CheckpointManager(run)  # Opened before the damage: restore.
plant()
attempt("restore", lambda: manager.restore(1))
attempt("init", lambda: pzp.CheckpointManager(run))
attempt("load", lambda: pzp.load(os.path.join(run, "1")))
results["ls"] = "exit %s" % cli.main(["ls", run])
unplant()
print(json.dumps(results))
"""


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "huge"])
@pytest.mark.parametrize(
    "relpath", ["1/_CHECKPOINT_METADATA", "1/params/_METADATA", "1/params/pz_persist.json"]
)
def test_special_files_where_small_files_are_read_are_refused(tmp_path, relpath, kind):
  run = _run(tmp_path)
  result = subprocess.run(
      [sys.executable, "-c", _SPECIAL_FILE_SCRIPT, str(run), relpath, kind],
      capture_output=True, text=True, timeout=240, cwd=REPO,
      env=dict(os.environ, PYTHONPATH=REPO),
  )
  assert result.returncode == 0, result.stderr[-3000:]
  import json  # pylint: disable=import-outside-toplevel
  results = json.loads(result.stdout.strip().splitlines()[-1])
  name = os.path.basename(relpath)
  for entry in ("restore", "init", "load"):
    assert name in results[entry] and "no error" not in results[entry], (entry, results)
  assert results["ls"] == "exit 2", (results, result.stdout[-2000:])
  assert name in result.stderr, result.stderr[-2000:]


def test_read_small_file_refuses_what_is_not_a_small_regular_file(tmp_path):
  fifo = tmp_path / "fifo"
  os.mkfifo(fifo)
  with pytest.raises(errors.UnsafeCheckpointError, match="a FIFO"):
    safe_io.read_small_file(fifo, 100)  # Non-blocking: no writer needed.
  link = tmp_path / "link"
  (tmp_path / "real").write_bytes(b"{}")
  link.symlink_to("real")  # Even inside: Orbax and pz_persist never write one.
  with pytest.raises(errors.UnsafeCheckpointError, match="symbolic link"):
    safe_io.read_small_file(link, 100)
  (tmp_path / "zero").symlink_to("/dev/zero")
  with pytest.raises(errors.UnsafeCheckpointError, match="symbolic link"):
    safe_io.read_small_file(tmp_path / "zero", 100)
  with pytest.raises(errors.ManifestError, match="over the 1-byte limit"):
    safe_io.read_small_file(tmp_path / "real", 1)
  with pytest.raises(errors.ManifestError, match="is a directory"):
    safe_io.read_small_file(tmp_path, 100)
  assert safe_io.read_small_file(tmp_path / "real", 2) == b"{}"


# Item 9: a data file swapped for a link between the check and TensorStore's open.


def _saved_sevens(
    tmp_path: pathlib.Path, count: int = 4096
) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
  """A checkpoint of ``count`` sevens (a multiple of 4096), the data file
  holding them, and an outside copy of that file whose sevens are 666s (a
  forged file TensorStore reads happily)."""
  ckpt = tmp_path / "ckpt"
  pzp.save(ckpt, {"x": np.full(count, SEVEN)})
  pattern = np.float64(SEVEN).tobytes() * 4096
  (data,) = [
      p for p in (ckpt / "penzai").rglob("*") if p.is_file() and pattern in p.read_bytes()
  ]
  forged = tmp_path / "outside_data"
  forged.write_bytes(
      data.read_bytes().replace(pattern, np.float64(OUTSIDE_VALUE).tobytes() * 4096)
  )
  return ckpt, data, forged


def _swap(data: pathlib.Path, forged: pathlib.Path, whole_dir: bool) -> None:
  if whole_dir:  # The data file's directory, as a link to a forged copy.
    copy = forged.parent / "outside_d"
    shutil.copytree(data.parent, copy)
    (copy / data.name).write_bytes(forged.read_bytes())
    shutil.rmtree(data.parent)
    data.parent.symlink_to(copy)
  else:
    data.unlink()
    data.symlink_to(forged)


_LARGE = 4096 * 40
"""Sevens over 1 MiB: read through ``ts.open``, not as a raw chunk."""


@pytest.mark.parametrize("whole_dir", [False, True])
@pytest.mark.parametrize("path", ["direct", "raw", "orbax"])
def test_a_file_swapped_after_the_check_is_never_returned(tmp_path, monkeypatch, path, whole_dir):
  # direct: a large array, through ts.open; raw: a small one, read as raw
  # OCDBT entries (`raw_chunks`); orbax: Orbax's restore.
  ckpt, data, forged = _saved_sevens(tmp_path, _LARGE if path == "direct" else 4096)
  swapped = []

  def swap_once():
    if not swapped:
      _swap(data, forged, whole_dir)
      swapped.append(True)

  if path == "direct":  # Right before TensorStore opens the arrays.
    open_store = direct_read.ts.open

    def swap_then_open(*args, **kwargs):
      swap_once()
      return open_store(*args, **kwargs)

    monkeypatch.setattr(direct_read.ts, "open", swap_then_open)
    load = lambda: pzp.load(ckpt, verify=False)
  elif path == "raw":  # Right before the chunks are read.
    read_chunks = raw_chunks.RawStore.read

    def swap_then_read(self, *args, **kwargs):
      swap_once()
      return read_chunks(self, *args, **kwargs)

    monkeypatch.setattr(raw_chunks.RawStore, "read", swap_then_read)
    load = lambda: pzp.load(ckpt, verify=False)
  else:
    restore = ocp.PyTreeCheckpointHandler.restore

    def swap_then_restore(self, *args, **kwargs):
      swap_once()
      return restore(self, *args, **kwargs)

    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "restore", swap_then_restore)
    handler = v0_handler.PenzaiCheckpointHandler(direct_reads=False)
    load = lambda: handler.restore(ckpt / "penzai", pzp.PenzaiRestore(verify=False))
  with pytest.raises(errors.UnsafeCheckpointError, match="outside the checkpoint"):
    loaded = load()
    assert not np.any(np.asarray(loaded["x"]) == OUTSIDE_VALUE), "read from outside"
  assert swapped


@pytest.mark.parametrize("count", [_LARGE, 4096], ids=["direct", "raw"])
def test_a_file_swapped_for_a_link_inside_is_refused_too(tmp_path, monkeypatch, count):
  """A swap that stays inside is still a swap: what was read is not trusted."""
  ckpt, data, _ = _saved_sevens(tmp_path, count)
  moved = data.parent / "moved"
  layout = direct_read._layout  # pylint: disable=protected-access

  def swap_then_read(directory):  # Before either read path opens anything.
    if not moved.exists():
      os.rename(data, moved)
      data.symlink_to("moved")
    return layout(directory)

  monkeypatch.setattr(direct_read, "_layout", swap_then_read)
  with pytest.raises(errors.UnsafeCheckpointError, match="changed while the checkpoint was being read"):
    pzp.load(ckpt, verify=False)
  np.testing.assert_array_equal(pzp.load(ckpt)["x"], np.full(count, SEVEN))  # Unharmed now.
