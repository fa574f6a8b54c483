"""Saving and resuming Penzai's ``StatefulTrainer`` with a `CheckpointManager`.

A ``penzai.toolshed.basic_training.StatefulTrainer`` keeps everything that
changes during training in variables: the model's parameters and state, and
its ``StatefulTrainer.state`` variable (step, optimizer state with its schedule
``count``, loss-function state). It also holds its root RNG key, from which
each step's key is derived by the step number. Saving those and putting them
back resumes training exactly; the trainer's functions (optimizer definition,
loss, jitted step) are code, rebuilt by your script as usual.

Example::

  trainer = basic_training.StatefulTrainer.build(rng, model, optimizer, loss_fn)
  with pzp.CheckpointManager("/tmp/run", max_to_keep=2) as manager:
    if manager.latest_step() is not None:
      trainer = pzp.restore_trainer(trainer, manager.restore())
    while (step := int(trainer.state.value.step)) < num_steps:
      trainer.step(**batch(step))
      manager.save(step + 1, **pzp.trainer_items(trainer))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

from penzai import pz

from pz_persist import binding
from pz_persist import errors
from pz_persist.format import nodes
from pz_persist.training import optimizers

if TYPE_CHECKING:  # Penzai's toolshed (and optax) are imported by the user's code.
  from penzai.toolshed import basic_training

TRAINER_ITEMS = ("root_rng", "variables")


def trainer_items(trainer: basic_training.StatefulTrainer) -> dict[str, object]:
  """The items to save to resume a ``StatefulTrainer``: its variables (frozen)
  and its root RNG key."""
  _, variables = pz.unbind_variables(trainer, freeze=True)
  return {"variables": variables, "root_rng": trainer.root_rng}


def restore_trainer(
    trainer: basic_training.StatefulTrainer, items: Mapping[str, Any]
) -> basic_training.StatefulTrainer:
  """Puts restored `trainer_items` back into ``trainer``.

  The trainer's variables (model parameters and state, the trainer's own
  state) are updated in place, after checking that every one has a value that
  fits (see `pz_persist.assign_variables`); the trainer is returned with the
  saved root RNG key. A trainer built with another optimizer than the saved
  one is refused first, naming the first differing optimizer state.

  Raises:
    WrongItemsError: ``items`` is not what `trainer_items` saved (a step of
      another training loop, say), naming the items it does hold.
    OptimizerMismatchError: the trainer's optimizer is not the saved one.
  """
  found = tuple(sorted(items)) if isinstance(items, Mapping) else None
  if found is None or not set(TRAINER_ITEMS) <= set(found):
    held = ", ".join(found) if found else "no items"
    raise errors.WrongItemsError(
        f"this step holds {held}, not a StatefulTrainer checkpoint (which holds"
        f" {', '.join(TRAINER_ITEMS)}, as saved with"
        " manager.save(step, **pz_persist.trainer_items(trainer))). Restore it"
        " with manager.restore() and use its items directly, or point the"
        " manager at the trainer's own run directory."
    )
  saved = _saved_value(items["variables"], trainer.state.label)
  if hasattr(saved, "opt_state"):
    optimizers.check_structure(
        trainer.state.value.opt_state, saved.opt_state,
        where=f"{nodes.describe_label(trainer.state.label)}.opt_state",
    )
  binding.assign_variables(trainer, items["variables"])
  return dataclasses.replace(trainer, root_rng=items["root_rng"])


def _saved_value(variables: object, label: Hashable) -> Any:
  """The saved value of the variable labelled ``label`` (None if absent)."""
  for variable in variables if isinstance(variables, (list, tuple)) else ():
    if getattr(variable, "label", None) == label:
      return variable.value
  return None
