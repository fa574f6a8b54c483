"""Every public library call that names a checkpoint path, for the hostile
tests of path spellings (`test_remote_schemes`: unsupported URL schemes;
`test_object_store_paths`: ambiguous gs:// and s3:// spellings): one list, so
an entry point added here is tried by both."""

from __future__ import annotations

import jax.numpy as jnp
from penzai import pz

import pz_persist as pzp

TREE = {"w": pz.nx.wrap(jnp.arange(4.0)).tag("x")}
"""A small tree every entry point can save."""


def entry_points(url: str, local: str):
  """(name, call) of every public way to name a checkpoint path; ``local`` is
  a saved checkpoint for the calls that take two."""
  return [
      ("save", lambda: pzp.save(url, TREE)),
      ("save overwrite", lambda: pzp.save(url, TREE, overwrite=True)),
      ("save_model", lambda: pzp.save_model(url, pz.nn.Identity())),
      ("load", lambda: pzp.load(url)),
      ("inspect", lambda: pzp.inspect(url)),
      ("verify", lambda: pzp.verify(url)),
      ("load_model", lambda: pzp.load_model(url)),
      ("diff (first)", lambda: pzp.diff(url, local)),
      ("diff (second)", lambda: pzp.diff(local, url)),
      ("migrate (source)", lambda: pzp.migrate(url, local + "_m", pz.nn.Identity())),
      ("migrate (destination)", lambda: pzp.migrate(local, url, pz.nn.Identity())),
      ("CheckpointManager", lambda: pzp.CheckpointManager(url)),
  ]
