"""Checkpoints opened lazily (`pz_persist.open`): the structure at once, the
arrays when asked."""
