"""What makes stored bytes trustworthy: checks below every reader and writer.

`checksums` (a hash of every stored array shard, computed when saving and
checked when loading), `file_digests` (a digest of every file of an item),
`containment` (every read kept inside the checkpoint it was given: no link,
FIFO or device followed out of it) and `orbax_metadata_checks` (what Orbax
says is stored, held to what the manifest promises before anything is
allocated), with `hashing_threads` (the bounded pool of threads each save,
load or check hashes on). Imports only `stores` below it.
"""
