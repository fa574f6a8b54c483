"""Holes closed in round 7 (the streaming load), kept as tests.

Each test is a class of hole; the fix lives where the guarantee is
enforced, named in the test's docstring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from penzai import pz

import pz_persist as pzp
from pz_persist import errors


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs several devices")
def test_a_sharding_that_cannot_hold_an_array_is_refused_naming_it(tmp_path):
  """One ``sharding=`` for a whole tree that does not divide one of its
  arrays raised JAX's ``IndivisibleError``, naming neither the checkpoint nor
  the array. The read's plan (`pz_persist.storage.reading.reader.plan`, which
  every load goes through before anything is allocated) refuses it with an
  `ArgumentError` naming both and the way out, for each entry point."""
  path = tmp_path / "ck"
  pzp.save(path, {"w": pz.nx.wrap(jnp.arange(6.0)).tag("rows"), "ok": jnp.ones((8, 2))})
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
  spread = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  with pytest.raises(errors.ArgumentError, match=r"tree\['w'\].*shape \[6\].*AxisRules"):
    pzp.load(path, sharding=spread)
  with pytest.raises(errors.ArgumentError, match=r"tree\['w'\]"):
    with ocp.Checkpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
      checkpointer.restore(path / "penzai", args=pzp.PenzaiRestore(sharding=spread))
  with pytest.raises(errors.ArgumentError, match=r"tree\['w'\]"):
    pzp.open(path).load(sharding=spread)
