"""Bytes on disk: opening a checkpoint item, reading and writing its arrays.

`opening` is the one way in for every reader (item found, `containment`
checked once, lock taken, manifest read once, a concurrent save detected and
the read redone); `reader` the one array reader (limits, Orbax's metadata
checked by `orbax_metadata_checks`, `direct_read` or Orbax's restore,
`checksums` verified, storage dtypes converted back), and `restoring` turns
what was read into the saved tree. Storage kinds: `stores` (one `Store` each
for the local disk, gs:// and s3://, chosen once by scheme; the commit
protocols live there), with `commit`, `object_commit` and `object_store`
running its operations for callers holding a path. Writing: `file_digests`, `leftovers` of
interrupted saves and `steps` (step directory names). Helpers: `host_memory`,
`batching`, `sharding` targets.

Internal: the public names are re-exported by `pz_persist` (see ARCHITECTURE.md).
"""
