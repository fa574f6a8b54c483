"""Training for days: checkpoint managers, trainer state, optimizers.

`manager` (`CheckpointManager`: Orbax's, with pz_persist's items and safety),
`trainer` (Penzai trainer state in and out) and `optimizers` (a restored
optimizer state checked against the optimizer that will use it). Step
directory names are `pz_persist.storage.lifecycle.steps` (the leftovers of interrupted
saves are found by them too).

Internal: the public names are re-exported by `pz_persist` (see ARCHITECTURE.md).
"""
