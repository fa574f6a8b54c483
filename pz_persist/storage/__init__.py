"""Bytes on disk: opening a checkpoint item, reading and writing its arrays.

Its rooms, each importing only those below it:

* `destinations`: what a writer may replace, and where any output may go.
* `reading/`: `opening` (the one way in for every reader), `reader` (the one
  array reader), `restoring` (what was read, as the saved tree), `slices`,
  `direct_read`, `raw_chunks`, `placements`, `batching`, `host_memory`.
* `writing/`: `writer` (the one writer of every save), `direct_write`.
* `lifecycle/`: `leftovers` of unfinished saves, Orbax's `steps`.
* `integrity/`: `checksums`, `file_digests`, `containment`,
  `orbax_metadata_checks`.
* `stores/`: the kinds of storage (local disk, ``gs://``, ``s3://``), one
  `Store` each, chosen once per entry point (`stores.choose`,
  `stores.open_path`) and handed down; each publishes a checkpoint whole its
  own way (`stores.local`: a locked rename; `stores.commit_objects`: a commit
  object on object stores).
* `orbax_seam`: every private Orbax name pz_persist touches.

Internal: the public names are re-exported by `pz_persist` (see ARCHITECTURE.md).
"""
