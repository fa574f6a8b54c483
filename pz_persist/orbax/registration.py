"""Registering pz_persist with Orbax, once."""

from pz_persist.orbax import v1_handler
from pz_persist.orbax import variable_type_handler


def register_handlers() -> None:
  """Registers pz_persist's handlers with Orbax; safe to call any number of times.

  Importing pz_persist calls it, so users rarely need to. It registers:

  * the v0 argument classes `PenzaiSave` / `PenzaiRestore` with their handler
    (done when `pz_persist.orbax.v0_handler` is imported), so ``ocp.Checkpointer`` and
    ``ocp.CheckpointManager`` accept them and restore without arguments;
  * `VariableTypeHandler` for mutable ``pz.Parameter`` / ``pz.StateVariable``
    leaves in Orbax's ``PyTreeCheckpointHandler``;
  * `PenzaiCheckpointableHandler` with Orbax v1's global handler registry.
  """
  variable_type_handler.register()
  v1_handler.register()
