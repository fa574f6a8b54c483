"""`JSON`: the type of a JSON value, as the manifests pz_persist writes hold.

Why a name: a manifest, a node, a table column are JSON, and writing ``Any``
for them says nothing; ``JSON`` says what a value may be (and the type
checker holds the code that builds one to it). What is read from a file is
not yet known to be any particular JSON: code that reads takes ``object``
and checks before it trusts (`pz_persist.format.compact`, `nodes.check_shape`).
"""

from __future__ import annotations

from typing import TypeAlias

JSON: TypeAlias = "None | bool | int | float | str | list[JSON] | dict[str, JSON]"
"""A JSON value: what ``json.loads`` returns and ``json.dumps`` writes."""

JSONObject: TypeAlias = "dict[str, JSON]"
"""A JSON object (a manifest, a typed node, a table)."""
