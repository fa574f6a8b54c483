"""Several processes (jax.distributed on localhost) save and load together.

Each process sees the global 8-device CPU mesh but holds only its own
devices' shards: it writes those, reads those back, and the manifest is
written once, by the primary process. Hung processes fail the test instead of
hanging CI.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import REPO

import pz_persist as pzp

TIMEOUT = 300


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(num_processes: int, directory) -> list[dict]:
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  processes = [
      subprocess.Popen(
          [sys.executable, os.path.join(REPO, "tests", "multiprocess_run.py"),
           str(i), str(num_processes), str(port), str(directory)],
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
      )
      for i in range(num_processes)
  ]
  reports = []
  try:
    for process in processes:
      out, err = process.communicate(timeout=TIMEOUT)
      assert process.returncode == 0, f"process failed:\n{err[-3000:]}"
      reports.append(json.loads(out.strip().splitlines()[-1]))
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
  return reports


# Four processes by default: a primary and several others, each holding two
# devices' shards, which takes every path two processes take (one primary, one
# other; tests/remote/test_multiprocess_remote.py also runs two, on gs://).
# Two processes run with -m slow only, to keep the suite's time.
@pytest.mark.parametrize("num_processes", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_save_and_load_across_processes(num_processes, tmp_path):
  reports = _run(num_processes, tmp_path)
  assert [r["process"] for r in reports] == list(range(num_processes))
  for report in reports:
    assert report["devices"] == 8 and report["local"] == 8 // num_processes
    for key in ("load_shards", "overwrite_shards", "manager_shards", "manager_again_shards",
                "bound_shards"):
      assert report[key] > 0, key
    assert report["manager_steps"] == [2] and report["manager_meta"] == {"step": 2}
  # The manifest of each save is written once, by the primary process.
  assert [r["saved_manifest_writes"] for r in reports] == [1] + [0] * (num_processes - 1)
  # Two saves, then two steps of three items each: eight manifests, all by process 0.
  assert [r["manifest_writes"] for r in reports] == [8] + [0] * (num_processes - 1)
  # Every process held a different part of the arrays, together all of them.
  assert len({r["load_shards"] for r in reports}) == 1
  assert sorted(os.listdir(tmp_path)) == ["ckpt", "run"]
  # Each process hashed its own shards; together they cover every shard, and
  # each matches what a single reader of the whole checkpoint finds.
  manifest = pzp.checkpoint.read_manifest(tmp_path / "ckpt")
  assert max(len(spec.checksums) for spec in manifest.arrays) == 8
  assert all(spec.checksums for spec in manifest.arrays if spec.is_stored)
  report = pzp.verify(tmp_path / "ckpt")
  assert report.ok and report.arrays_checked == len(manifest.arrays), str(report)
