"""Writing a checkpoint item: the one writer every save goes through.

`writer` writes the manifest, the arrays and the file digests of an item,
whichever entry point started the save; `direct_write` is its fast path for
one process (Orbax's layout, file for file). Publishing the written item
whole is its store's (`storage.stores`: a locked rename locally, a commit
object on ``gs://`` / ``s3://``). Imports only `integrity`, `stores` and the
Orbax seam below it.
"""
