"""Importing, saving and loading change nothing process-wide in the user's
process: glibc's allocator settings are only tuned when asked
(`pz_persist.tune_host_allocator`)."""

from __future__ import annotations

import json

from conftest import run_python

# Runs in a fresh interpreter: ctypes' view of the C library records every
# mallopt call made through it (as pz_persist reaches glibc), from before
# pz_persist is imported, then the script's own steps run.
_RECORDING = """
import ctypes, json, sys, tempfile

calls = []
_real_cdll = ctypes.CDLL

class _Recording:
  def __init__(self, lib):
    self._lib = lib
  def __getattr__(self, name):
    real = getattr(self._lib, name)
    if name != "mallopt":
      return real
    def mallopt(param, value):
      calls.append([int(param), int(value)])
      return 1
    return mallopt

def _cdll(name, *args, **kwargs):
  lib = _real_cdll(name, *args, **kwargs)
  return _Recording(lib) if name is None else lib

ctypes.CDLL = _cdll
"""


def _mallopt_calls(steps: str) -> list[list[int]]:
  out = run_python(_RECORDING + steps + "\nprint(json.dumps(calls))\n", timeout=300)
  return json.loads(out.strip().splitlines()[-1])


def test_import_save_load_and_manager_leave_mallopt_alone():
  calls = _mallopt_calls("""
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pz_persist as pzp

directory = tempfile.mkdtemp()
tree = {"w": jnp.arange(6.0).reshape(2, 3)}
pzp.save(directory + "/c", tree)
pzp.load(directory + "/c")
pzp.load(directory + "/c", sharding=None, verify=False)
with ocp.Checkpointer(pzp.PenzaiCheckpointHandler(direct_reads=False)) as checkpointer:
  checkpointer.save(directory + "/o", args=pzp.PenzaiSave(tree))
  checkpointer.restore(directory + "/o", args=pzp.PenzaiRestore())
with pzp.CheckpointManager(directory + "/run") as manager:
  manager.save(1, params=tree)
  manager.wait_until_finished()
  manager.restore(1)
""")
  assert calls == []


def test_tune_host_allocator_is_the_opt_in():
  """The recorder sees the tuning when asked for (so the test above can fail)."""
  calls = _mallopt_calls("""
import pz_persist as pzp

pzp.tune_host_allocator()
pzp.tune_host_allocator()  # Idempotent.
""")
  assert calls == [[-3, 32 * 2**20], [-1, 64 * 2**20]]
