"""What users run on checkpoints: diff, verify, view, migrate, and the command line.

Each is a thin caller of `pz_persist.storage.reading.opening` / `reader` and the
queries of `pz_persist.format`.

Internal: the public names are re-exported by `pz_persist` (see ARCHITECTURE.md).
"""
