"""Every way of reading a checkpoint, while another process keeps replacing it.

A writer process saves, over and over with ``overwrite=True``, one of two
models that differ in every array (all 0s or all 1s) and in every variable's
metadata (tag A or B). A reader through each entry point must see either
whole: one tag, one value, or a `ConcurrentSaveError` (the save kept winning);
never a mix of the two, nor a raw error of files deleted under it. Every entry
point goes through `pz_persist.storage.reading.opening`, so the lock and the retry that
`pzp.load` alone had before hold for each.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import REPO
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz

import pz_persist as pzp
from pz_persist import errors

SIZES = [256, 512, 512, 256]
VALUES = {"A": 0.0, "B": 1.0}

MODEL = textwrap.dedent(f"""
    import jax
    from penzai import pz
    from penzai.models import simple_mlp

    def model(tag):
      mlp = simple_mlp.MLP.from_config(
          name="mlp", init_base_rng=jax.random.key(0), feature_sizes={SIZES!r})
      for p in pz.select(mlp).at_instances_of(pz.Parameter).get_sequence():
        p.value = p.value * 0 + {VALUES!r}[tag]
        p.metadata = {{"tag": tag}}
      return mlp
""")

WRITER = MODEL + textwrap.dedent("""
    import sys
    import pz_persist as pzp

    path = sys.argv[1]
    models = [model("A"), model("B")]
    pzp.save_model(path, models[0], overwrite=True)
    saves = 1
    print(saves, flush=True)
    while True:
      pzp.save_model(path, models[saves % 2], overwrite=True)
      saves += 1
      print(saves, flush=True)
""")

READ_SECONDS = 4.0
"""How long each entry point reads while the writer saves."""

MIN_SAVES = 3
"""Saves the writer must complete while an entry point reads (else it reads on
until it did, up to `MAX_SECONDS`): otherwise nothing was exercised."""

MAX_SECONDS = 60.0


def _model(tag: str) -> pz.Struct:
  namespace: dict = {}
  exec(MODEL, namespace)  # pylint: disable=exec-used  # The writer's own code.
  return namespace["model"](tag)


def _untagged() -> pz.Struct:
  """The model to load into: the variables keep its (empty) metadata, so
  only the values read say which checkpoint they came from."""
  model = _model("A")
  for variable in pz.select(model).at_instances_of(pz.Parameter).get_sequence():
    variable.metadata = {}
  return model


class _Writer:
  """The writing process, and how many saves it has completed."""

  def __init__(self, path):
    self.process = subprocess.Popen(
        [sys.executable, "-c", WRITER, os.fspath(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")),
    )
    self.saves = 0
    self._lines: queue.Queue = queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self) -> None:
    for line in self.process.stdout:
      self.saves = int(line)

  def wait_started(self, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while self.saves < 1:
      if self.process.poll() is not None or time.monotonic() > deadline:
        raise AssertionError(f"the writer did not start: {self.process.stderr.read()[-3000:]}")
      time.sleep(0.05)

  def stop(self) -> None:
    if self.process.poll() is None:
      self.process.kill()
    self.process.wait()


@pytest.fixture(scope="module")
def writer(tmp_path_factory):
  path = tmp_path_factory.mktemp("concurrent") / "ckpt"
  running = _Writer(path)
  try:
    running.wait_started()
    yield path, running
  finally:
    running.stop()


def _tags(tree) -> set[str]:
  """Which of the two models each variable of ``tree`` comes from."""
  found = set()
  variables = pz.select(tree).at_instances_of(
      (pz.Parameter, pz.ParameterValue)
  ).get_sequence()
  assert variables, tree
  for variable in variables:
    if "tag" in variable.metadata:
      found.add(variable.metadata["tag"])
    data = variable.value.data_array
    if not isinstance(data, jax.ShapeDtypeStruct):
      found |= {tag for tag, value in VALUES.items() if value in np.unique(np.asarray(data))}
      if not set(np.unique(np.asarray(data))) <= set(VALUES.values()):
        found.add(f"other values {np.unique(np.asarray(data))[:5]}")
  return found


def _diff_tags(path, reference_a) -> set[str]:
  result = pzp.diff(path, reference_a, progress=False)
  assert result.arrays and not result.only_in_a and not result.only_in_b, result
  return {"A" if array.max_abs == 0 else "B" if array.max_abs == 1 else "?"
          for array in result.arrays}


def _verify_tags(path) -> set[str]:
  report = pzp.verify(path, progress=False)
  return {"whole"} if report.ok else {f"damaged: {report}"}


ENTRY_POINTS = {
    "load": lambda path, _: _tags(pzp.load(path, progress=False)),
    "inspect": lambda path, _: _tags(pzp.inspect(path)),
    "load_model": lambda path, _: _tags(pzp.load_model(path, progress=False)),
    "load_model_into": lambda path, _: _tags(
        pzp.load_into(path, _untagged(), progress=False)
    ),
    "diff": _diff_tags,
    "verify": lambda path, _: _verify_tags(path),
    "v0_handler_on_item": lambda path, _: _tags(
        ocp.Checkpointer(pzp.PenzaiCheckpointHandler()).restore(path / "penzai")
    ),
    "v1_load_checkpointables": lambda path, _: _tags(
        ocp_v1.load_checkpointables(path)["penzai"]
    ),
}


@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
def test_reader_never_sees_a_mix(writer, tmp_path, entry_point):
  path, running = writer
  reference_a = tmp_path / "a"
  pzp.save_model(reference_a, _model("A"))
  read = ENTRY_POINTS[entry_point]
  start, first_save = time.monotonic(), running.saves
  seen, wrong = set(), []
  reads = gave_up = 0
  while time.monotonic() - start < READ_SECONDS or (
      running.saves - first_save < MIN_SAVES and time.monotonic() - start < MAX_SECONDS
  ):
    assert running.process.poll() is None, running.process.stderr.read()[-3000:]
    try:
      tags = read(path, reference_a)
    except errors.ConcurrentSaveError:
      gave_up += 1
      continue
    except Exception as e:  # pylint: disable=broad-exception-caught
      wrong.append(f"{type(e).__name__}: {str(e)[:300]}")
      continue
    finally:
      reads += 1
    if len(tags) != 1:
      wrong.append(f"a mix: {sorted(tags)}")
    seen |= tags
  saves = running.saves - first_save
  assert wrong == [], (f"{len(wrong)} of {reads} reads during {saves} saves:", wrong[:3])
  assert saves >= MIN_SAVES, f"only {saves} saves during the reads: nothing was exercised"
  assert gave_up < reads, "every read gave up"
