"""Progress of long operations (`pz_persist.progress`): real per-byte steps
for verify, diff, load_hf and load_gemma; bars only where someone sees them."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import types

import jax
import numpy as np
import pytest
from penzai import pz
from penzai.models import simple_mlp

import pz_persist as pzp
from pz_persist import progress as progress_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.pretrained import safetensors_io
from pz_persist.storage.reading import direct_read
from pz_persist.storage.reading import reader
from pz_persist.tools import cli

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _arrays() -> dict:
  """Arrays of different sizes, so byte counts differ from array counts."""
  rng = np.random.default_rng(0)
  return {"a": rng.normal(size=(64, 32)).astype(np.float32),
          "b": np.arange(7, dtype=np.int64), "c": rng.normal(size=300).astype(np.float16)}


def _array_bytes(tree: dict) -> int:
  return sum(np.asarray(a).nbytes for a in tree.values())


class _Terminal(io.StringIO):
  def isatty(self) -> bool:
    return True


class _Seen:
  """A ``progress(done, total)`` hook recording every call."""

  def __init__(self):
    self.calls: list[tuple[int, int]] = []

  def __call__(self, done: int, total: int) -> None:
    self.calls.append((done, total))

  def check_complete(self, total: int, steps: int) -> None:
    """``done`` grows at every call, by at least ``steps`` steps, up to ``total``."""
    done = [d for d, _ in self.calls]
    assert done == sorted(set(done)), self.calls
    assert len(self.calls) >= steps, self.calls
    assert self.calls[-1] == (total, total), self.calls


def _recorded_file_bytes(item) -> int:
  with open(os.path.join(item, manifest_lib.FILE_DIGESTS_FILENAME)) as f:
    return sum(size for size, _ in json.load(f)["files"].values())


def test_verify_counts_file_and_array_bytes(tmp_path):
  tree = _arrays()
  pzp.save(tmp_path / "ckpt", tree)
  seen = _Seen()
  report = pzp.verify(tmp_path / "ckpt", progress=seen, read_batch_bytes=1)
  assert report.ok
  files = _recorded_file_bytes(report.path)
  assert files > 0
  # One step per file, then one per array (batches of one array each here).
  seen.check_complete(files + _array_bytes(tree), steps=report.files_checked + len(tree))


def test_diff_counts_array_bytes(tmp_path):
  tree = _arrays()
  pzp.save(tmp_path / "a", tree)
  pzp.save(tmp_path / "b", {**tree, "b": tree["b"] + 1})
  seen = _Seen()
  result = pzp.diff(tmp_path / "a", tmp_path / "b", batch_bytes=1, progress=seen)
  assert not result.identical
  seen.check_complete(_array_bytes(tree), steps=len(tree))


@pytest.mark.parametrize("direct", [True, False])
def test_load_counts_array_bytes(tmp_path, monkeypatch, direct):
  tree = _arrays()
  pzp.save(tmp_path / "ckpt", tree)
  if not direct:  # Orbax's restore, a batch at a time (one batch here).
    monkeypatch.setattr(direct_read, "applies", lambda targets: False)
  seen = _Seen()
  loaded = pzp.load(tmp_path / "ckpt", progress=seen)
  np.testing.assert_array_equal(loaded["a"], tree["a"])
  seen.check_complete(_array_bytes(tree), steps=len(tree) if direct else 1)


def test_load_model_counts_array_bytes_alone_and_into_a_model(tmp_path):
  mlp = simple_mlp.MLP.from_config(
      name="mlp", init_base_rng=jax.random.key(0), feature_sizes=[8, 16, 4])
  pzp.save_model(tmp_path / "m", mlp)
  nbytes = sum(p.value.data_array.nbytes for p in pz.unbind_params(mlp)[1])
  for load in (lambda seen: pzp.load_model(tmp_path / "m", progress=seen),
               lambda seen: pzp.load_into(tmp_path / "m", mlp, progress=seen)):
    seen = _Seen()
    load(seen)
    seen.check_complete(nbytes, steps=1)


def test_quick_loads_show_no_automatic_bar_on_a_terminal(tmp_path, monkeypatch):
  pzp.save(tmp_path / "ckpt", _arrays())
  terminal = _Terminal()
  monkeypatch.setattr(sys, "stderr", terminal)
  monkeypatch.setattr(reader, "LOAD_PROGRESS_DELAY", 3600)
  pzp.load(tmp_path / "ckpt")
  assert terminal.getvalue() == ""
  monkeypatch.setattr(reader, "LOAD_PROGRESS_DELAY", 0)
  pzp.load(tmp_path / "ckpt")
  assert "loading" in terminal.getvalue()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
  from pretrained import test_hf  # pylint: disable=import-outside-toplevel

  path = str(tmp_path_factory.mktemp("hf") / "llama")
  test_hf._hf_model("llama").save_pretrained(path)  # pylint: disable=protected-access
  return path


def test_load_hf_counts_tensor_bytes(hf_folder):
  seen = _Seen()
  pzp.pretrained.load_hf(hf_folder, progress=seen)
  entries = safetensors_io.SafetensorsFile(os.path.join(hf_folder, "model.safetensors")).entries
  stored = sum(end - begin for _, _, begin, end in entries.values())
  seen.check_complete(stored, steps=len(entries))  # Each tensor is read once.


def test_load_gemma_counts_array_bytes_and_keeps_callables(tmp_path):
  from pretrained import test_gemma  # pylint: disable=import-outside-toplevel

  params = test_gemma.official_params(test_gemma.GEMMA2, gemma2=True)
  path = test_gemma.write(tmp_path / "ckpt", params)
  seen = _Seen()
  pzp.pretrained.load_gemma(path, preset={"like": "gemma2_2b"}, progress=seen)
  leaves = [a for arrays in params.values() for a in arrays.values()]
  seen.check_complete(sum(a.nbytes for a in leaves), steps=len(leaves))


def test_nothing_is_printed_by_default_when_stderr_is_not_a_terminal(tmp_path, capfd):
  pzp.save(tmp_path / "a", _arrays())
  pzp.save(tmp_path / "b", _arrays())
  capfd.readouterr()
  assert pzp.verify(tmp_path / "a").ok
  assert pzp.diff(tmp_path / "a", tmp_path / "b").identical
  assert cli.main(["verify", str(tmp_path / "a")]) == 0
  assert cli.main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
  assert capfd.readouterr().err == ""
  pzp.verify(tmp_path / "a", progress=True)  # Asked for: shown even here.
  assert "verifying" in capfd.readouterr().err


def test_a_bar_by_default_on_a_terminal_and_none_when_false(tmp_path, monkeypatch):
  pzp.save(tmp_path / "a", _arrays())
  terminal = _Terminal()
  monkeypatch.setattr(sys, "stderr", terminal)
  pzp.verify(tmp_path / "a")
  assert "verifying" in terminal.getvalue() and "100%" in terminal.getvalue()
  terminal.truncate(0)
  terminal.seek(0)
  pzp.verify(tmp_path / "a", progress=False)
  assert cli.main(["verify", "--quiet", str(tmp_path / "a")]) == 0
  assert terminal.getvalue() == ""


def test_a_jupyter_kernel_counts_as_interactive(monkeypatch):
  shell = types.SimpleNamespace(kernel=object())
  fake = types.ModuleType("IPython")
  fake.get_ipython = lambda: shell
  assert not progress_lib.wanted(None)  # pytest captures stderr: no terminal.
  monkeypatch.setitem(sys.modules, "IPython", fake)
  assert progress_lib.wanted(None)
  shell.kernel = None  # Terminal IPython: decided by stderr.
  assert not progress_lib.wanted(None)
  assert progress_lib.wanted(True) and not progress_lib.wanted(False)


def test_the_bar_description_cannot_move_the_cursor(tmp_path, capfd):
  with progress_lib.tracking(True, "verifying \x1b[2J\rfake", 2, unit="array") as tracker:
    tracker.advance(2)
  err = capfd.readouterr().err
  assert "\x1b[2J" not in err and "verifying \\x1b[2J\\x0dfake" in err


def test_an_invalid_progress_is_refused():
  with pytest.raises(TypeError, match="progress="):
    with progress_lib.tracking("yes", "x"):
      pass


def _convert_on_a_terminal(src: str, dst: str, *extra: str) -> str:
  """What ``pz-persist convert hf`` writes to a pseudo-terminal."""
  main, secondary = pty.openpty()
  # A new pseudo-terminal is 0 columns wide, where tqdm draws empty bars.
  fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
  # tqdm's own settings: draw every step, however fast.
  env = dict(os.environ, PYTHONPATH=_ROOT, TQDM_MININTERVAL="0", TQDM_MINITERS="1")
  process = subprocess.Popen(
      [sys.executable, "-m", "pz_persist.tools.cli", "convert", "hf", src, dst, *extra],
      stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary, env=env)
  os.close(secondary)
  output = b""
  try:
    while True:
      ready, _, _ = select.select([main], [], [], 120)
      if not ready:
        break
      try:
        chunk = os.read(main, 65536)
      except OSError:  # The other end closed (Linux).
        break
      if not chunk:
        break
      output += chunk
  finally:
    os.close(main)
    assert process.wait(timeout=120) == 0, output.decode(errors="replace")
  return output.decode(errors="replace")


def test_cli_convert_hf_advances_per_tensor_on_a_terminal(hf_folder, tmp_path):
  shown = _convert_on_a_terminal(hf_folder, str(tmp_path / "native"))
  frames = {frame.strip() for frame in shown.replace("\n", "\r").split("\r")
            if frame.strip().startswith("loading")}
  entries = safetensors_io.SafetensorsFile(os.path.join(hf_folder, "model.safetensors")).entries
  assert len(frames) > len(entries) // 2, shown  # Not 0 -> 1: a step per tensor.
  assert any("writing" in line for line in shown.split("\r")), shown
  quiet = _convert_on_a_terminal(hf_folder, str(tmp_path / "quiet"), "--quiet")
  assert "loading" not in quiet and "writing" not in quiet and "wrote" in quiet
