"""Checking a restored optimizer state against the optimizer that will use it.

An optimizer state restores by itself (optax's state classes are named in the
checkpoint). But resuming with a different optimizer (another learning-rate
schedule wrapper, a changed chain) would either fail deep inside
``optimizer.update`` or, worse, run with a state that silently means something
else. `check_state` compares the restored state with the state the optimizer
would build, ``jax.eval_shape(optimizer.init, params)``, and rebuilds it in
exactly that structure.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pz_persist import errors


def check_state(state: Any, optimizer: Any, params: Any, *, where: str) -> Any:
  """``state`` in the structure ``optimizer.init(params)`` has; raises if it
  does not fit (different number, shapes or dtypes of arrays).

  Example::

    opt_state = pzp.optimizers.check_state(restored, optimizer, params, where="ckpt")
  """
  template = jax.eval_shape(optimizer.init, params)
  expected, expected_def = jax.tree_util.tree_flatten_with_path(template)
  found, found_def = jax.tree.flatten(state)
  if len(found) != len(expected):
    raise errors.PzPersistError(
        f"{where}: the optimizer state holds {len(found)} arrays, but this"
        f" optimizer's state has {len(expected)}; was it saved with another"
        f" optimizer?\n  saved:    {found_def}\n  expected: {expected_def}"
    )
  for (path, want), got in zip(expected, found):
    dtype = getattr(got, "dtype", None) or np.result_type(got)
    if (np.shape(got), dtype) != (want.shape, want.dtype):
      raise errors.PzPersistError(
          f"{where}: optimizer state{jax.tree_util.keystr(path)} is"
          f" {dtype}{list(np.shape(got))}, but this optimizer expects"
          f" {want.dtype}{list(want.shape)}."
      )
  return jax.tree.unflatten(expected_def, found)
