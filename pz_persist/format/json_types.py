"""`JSON`: the type of a JSON value, as the manifests pz_persist writes hold.

Why a name: a manifest, a node and a table column are JSON, and ``Any`` says
nothing about them; ``JSON`` says what such a value may be, and the type
checker holds the code that builds one (`compact.to_json`,
`ArraySpec.to_json`) to it. What is read from a file is not trusted to be any
particular JSON until it is checked: the functions that check it take
``object`` and narrow it themselves (`compact.array_specs`,
`ArraySpec.from_json`).
"""

from __future__ import annotations

from typing import TypeAlias

JSON: TypeAlias = "None | bool | int | float | str | list[JSON] | dict[str, JSON]"
"""A JSON value: what ``json.loads`` returns and ``json.dumps`` writes."""

JSONObject: TypeAlias = "dict[str, JSON]"
"""A JSON object (a manifest, a table of it)."""
