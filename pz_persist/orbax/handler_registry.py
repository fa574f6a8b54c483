"""An Orbax handler registry naming the items that hold Penzai values.

Why: a fresh ``ocp.CheckpointManager`` that restores with no arguments looks
each item's handler up in its registry before it falls back to the type string
recorded in the checkpoint. It finds pz_persist's handler that way and restores
correctly, but first logs ``Item "params" was found in the checkpoint, but
could not be restored`` (twice). Passing this registry tells the manager up
front which items are pz_persist's, so nothing alarming is printed, and the
manager accepts `PenzaiSave` / `PenzaiRestore` for exactly those items.
"""

from __future__ import annotations

import orbax.checkpoint as ocp

from pz_persist import errors
from pz_persist.orbax import v0_handler


def handler_registry(*item_names: str) -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  """A registry for ``ocp.CheckpointManager(..., handler_registry=...)``.

  Example::

    import orbax.checkpoint as ocp
    import pz_persist as pzp

    registry = pzp.handler_registry("params")
    with ocp.CheckpointManager("/tmp/orbax_run", handler_registry=registry) as m:
      m.save(1, args=ocp.args.Composite(params=pzp.PenzaiSave(params)))
      m.wait_until_finished()
      restored = m.restore(1).params  # No template, no warning.

  Args:
    *item_names: The items that hold Penzai trees (e.g. ``"params"``).

  Returns:
    A registry mapping each item to `PenzaiCheckpointHandler` for both
    `PenzaiSave` and `PenzaiRestore`.
  """
  if not item_names or not all(isinstance(n, str) and n for n in item_names):
    raise errors.ArgumentError(f"handler_registry needs item names, got {item_names!r}.")
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  for name in item_names:
    handler = v0_handler.PenzaiCheckpointHandler()
    registry.add(name, v0_handler.PenzaiSave, handler)
    registry.add(name, v0_handler.PenzaiRestore, handler)
  return registry
