"""The allocation cap is a scoped setting (`pz_persist.limits`), not a module
global: it holds inside its block, in that thread or task only, and a load
beyond it is refused before anything is allocated, whatever the entry point."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

import pz_persist as pzp
from pz_persist import checkpoint
from pz_persist import errors
from pz_persist import safety
from pz_persist.safety import limits

REFUSED = r"would allocate 400 bytes, more than the 64-byte limit.*pz_persist\.limits"


@pytest.fixture
def small(tmp_path):
  path = tmp_path / "c"
  pzp.save(path, {"w": np.ones(100, np.float32)})
  return path


def test_a_load_beyond_the_scoped_limit_is_refused(small):
  with pzp.limits(max_allocation_bytes=64) as inside:
    assert inside.max_allocation_bytes == 64
    with pytest.raises(errors.UnsafeCheckpointError, match=REFUSED):
      pzp.load(small)
    handler = pzp.PenzaiCheckpointHandler(direct_reads=False)  # Orbax's path.
    with pytest.raises(errors.UnsafeCheckpointError, match=REFUSED):
      handler.restore(small / checkpoint.ITEM_NAME, pzp.PenzaiRestore())
  with pzp.limits() as after:  # No argument: the limits in force, unchanged.
    assert after == limits.Limits()  # Reset on leaving.
  np.testing.assert_array_equal(pzp.load(small)["w"], np.ones(100, np.float32))


def test_nested_blocks_override_and_restore(small):
  with pzp.limits(max_allocation_bytes=64):
    with pzp.limits(max_allocation_bytes=None):  # The machine's memory.
      pzp.load(small)
    with pzp.limits():  # Names nothing: keeps the outer setting.
      with pytest.raises(errors.UnsafeCheckpointError):
        pzp.load(small)


def test_the_limit_holds_in_its_own_thread_only(small):
  """Another thread's load, while one thread is inside a tight block, is not
  refused (a module global would have refused it)."""
  inside, done = threading.Event(), threading.Event()
  seen = {}

  def tight():
    with pzp.limits(max_allocation_bytes=64):
      inside.set()
      done.wait(60)
      seen["limit"] = limits.allocation_limit()

  thread = threading.Thread(target=tight)
  thread.start()
  try:
    assert inside.wait(60)
    assert limits.allocation_limit() > 64
    pzp.load(small)
  finally:
    done.set()
    thread.join(60)
  assert seen["limit"] == 64


@pytest.mark.parametrize("bad", [0, -1, 1.5, "1GiB", True])
def test_bad_limits_are_refused(bad):
  with pytest.raises(ValueError, match="max_allocation_bytes"):
    with pzp.limits(max_allocation_bytes=bad):
      pass


def test_the_deprecated_global_still_applies_with_a_warning(small, monkeypatch):
  monkeypatch.setattr(safety, "MAX_ALLOCATION_BYTES", 64)
  with pytest.warns(DeprecationWarning, match="pz_persist.limits"):
    with pytest.raises(errors.UnsafeCheckpointError):
      pzp.load(small)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # The scoped setting wins, unwarned.
    with pzp.limits(max_allocation_bytes=2**40):
      pzp.load(small)
