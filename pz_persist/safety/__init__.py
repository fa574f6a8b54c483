"""The rules and primitives that keep a hostile checkpoint harmless.

`allowlist` (which modules a checkpoint may name), `limits` (how much one
load may allocate: `pz_persist.limits`), `bounded_json` (JSON parsed within
size and node limits), `safe_io` (small files read, whole files written and
trees deleted without following links) and `terminal` (text from a
checkpoint made safe to print). The walk that refuses links out of a
checkpoint is `pz_persist.storage.integrity.containment`.
"""

MAX_ALLOCATION_BYTES: int | None = None
"""Deprecated: use ``pz_persist.limits(max_allocation_bytes=...)``. Still
honoured for one release when set (with a ``DeprecationWarning``), below a
`limits` setting."""
