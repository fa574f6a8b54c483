"""A mixture of experts sharded by its ``experts`` axis: `pz_persist.AxisRules`
puts ``experts`` on a mesh axis (8 CPU devices), in one process and across
two (``jax.distributed`` on localhost), and the sharded model computes what
the unsharded one does."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from hostile.test_pretrained_hostile import MIXTRAL
from hostile.test_pretrained_hostile import hf_folder
from hostile.test_pretrained_hostile import mixtral_tensors
from penzai import pz

import pz_persist as pzp

TIMEOUT = 300


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  return hf_folder(tmp_path_factory.mktemp("mixtral") / "hf", MIXTRAL, mixtral_tensors())


def test_experts_sharded_over_a_mesh_axis(folder):
  """Each expert parameter is split over ``expert`` (4 devices, one expert
  each), replicated over ``data``; the logits equal the unsharded model's."""
  assert jax.device_count() == 8
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("expert", "data"))
  rules = pzp.AxisRules(mesh, {"experts": "expert"})
  sharded = pzp.pretrained.load_hf(folder, sharding=rules)
  plain = pzp.pretrained.load_hf(folder)
  found = 0
  for param in pz.unbind_params(sharded)[1]:
    axes = tuple(param.value.named_axes)
    spec = param.value.data_array.sharding.spec
    if "experts" in axes:
      found += 1
      assert spec[axes.index("experts")] == "expert", param.label
      shard = param.value.data_array.addressable_shards[0]
      assert shard.data.shape[axes.index("experts")] == 1, param.label
    else:
      assert all(s is None for s in spec), param.label
  assert found == 2 * 4  # Two layers: router + three expert projections each.
  tokens = pz.nx.wrap(jnp.array([[1, 5, 9, 3, 7, 2], [4, 4, 8, 15, 0, 1]]), "batch", "seq")
  sharded_logits = jax.jit(lambda m, t: m(t))(pz.freeze_params(sharded), tokens)
  np.testing.assert_allclose(np.asarray(sharded_logits.unwrap("batch", "seq", "vocabulary")),
                             np.asarray(plain(tokens).unwrap("batch", "seq", "vocabulary")),
                             atol=1e-5, rtol=1e-5)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_load_a_mixture_sharded_by_experts(folder):
  """Two processes (4 devices each) load the folder with ``experts`` over a
  mesh axis spanning both: each holds exactly its devices' experts (two of
  the four), with the folder's values; together they hold all."""
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  processes = [subprocess.Popen(
      [sys.executable, os.path.join(REPO, "tests", "moe_multiprocess_run.py"), str(i), "2",
       str(port), str(folder)],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
      for i in range(2)]
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
  assert [r["process"] for r in reports] == [0, 1]
  labels = set(reports[0]["experts"])
  assert len(labels) == 6  # Three projections in each of two layers.
  for label in labels:
    held = [r["experts"][label]["held"] for r in reports]
    assert all(len(h) == 2 for h in held), (label, held)
    assert sorted(held[0] + held[1]) == [0, 1, 2, 3], (label, held)
    assert all(r["experts"][label]["matches"] for r in reports), label
    assert all("expert" in r["experts"][label]["spec"] for r in reports)
