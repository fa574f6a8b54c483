"""The on-disk contract, pure: what a checkpoint's JSON says and how a tree maps to it.

Nothing here depends on Orbax or on how bytes reach the disk: the node table
(`nodes`) that the encoder (`encode`), the decoder (`decode`) and every reader
of a manifest go through; the manifest document (`manifest`); how one array
(`array_specs`) and its checksums (`checksum_records`) are described; the
variable kinds (`variable_kinds`); queries over a manifest
(`manifest_queries`); and how code (classes, functions) is named and found
again without importing what a checkpoint names (`code_references`), under
the name it has now if it moved (`former_names`).
A change here is a change of the file format.

Internal: the public names are re-exported by `pz_persist` (see ARCHITECTURE.md).
"""
