"""Typed JSON for Penzai trees and models: everything but the array bytes.

The tree format lives in three modules: `pz_persist.nodes` (the table of node
types: tags, fields, children), `pz_persist.encode` (trees to typed JSON and
arrays) and `pz_persist.decode` (back). This module re-exports their public
names under the names the rest of the package has always imported.

A saved tree becomes one JSON node tree plus a list of arrays. Every node is an
object with a type tag ``"t"``, so decoding never guesses: a tuple comes back a
tuple (not a list, as with Orbax's own metadata), a ``ScopedStateVarLabel``
comes back a ``ScopedStateVarLabel``, an Enum in a variable's metadata comes
back the same Enum member. Nothing evaluates or unpickles anything.
"""

from __future__ import annotations

from pz_persist.decode import decode
from pz_persist.decode import decode_static
from pz_persist.encode import EncodedTree
from pz_persist.encode import encode
from pz_persist.encode import encode_static
from pz_persist.nodes import MAX_DEPTH
from pz_persist.nodes import Node
from pz_persist.nodes import PRNG_IMPLS
from pz_persist.nodes import describe_label
from pz_persist.nodes import fits_its_axes
from pz_persist.nodes import named_array_problem

__all__ = [
    "EncodedTree",
    "MAX_DEPTH",
    "Node",
    "PRNG_IMPLS",
    "decode",
    "decode_static",
    "describe_label",
    "encode",
    "encode_static",
    "fits_its_axes",
    "named_array_problem",
]
