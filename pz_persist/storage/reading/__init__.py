"""Reading a checkpoint item: the one way in, and the one array reader.

`opening` is the one way in for every reader (item found, containment
checked once, the reader's lock taken, manifest read once, a concurrent save
detected and the read redone); `reader` the one array reader (limits,
Orbax's metadata checked, `direct_read` or Orbax's restore, checksums
verified, storage dtypes converted back), with `placements` (where each
array goes), `streaming` (each array checked and sent to its devices as it
lands), `batching`, `host_memory` and `raw_chunks` (small arrays read as
key-value entries); `slices` reads part of one array, verified; `restoring`
turns what was read into the saved tree. Imports `lifecycle`, `writing`
(the layout `direct_write` writes), `integrity` and `stores` below it.
"""
