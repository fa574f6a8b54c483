"""Thin adapters of equal standing that teach Orbax about Penzai values.

`v0_handler` (Orbax's stable API: `PenzaiSave`, `PenzaiRestore`),
`v1_handler` (``orbax.checkpoint.v1``), `variable_type_handler` (mutable
``pz.Parameter`` leaves inside ordinary Orbax pytrees), `registration` and
`handler_registry` (registering them). None of them reads arrays or
manifests itself: they call `pz_persist.storage.reading.opening` and
`pz_persist.storage.reading.reader`. Reading checkpoints that plain Orbax wrote is
`pz_persist.plain_orbax`.

Internal: the public names are re-exported by `pz_persist` (see ARCHITECTURE.md).
"""
