"""The dataclass field the layers of `pz_persist.nn` use for configuration."""

from __future__ import annotations

import dataclasses
from typing import Any


def static(default: Any = dataclasses.MISSING) -> Any:
  """A field that is part of the layer's structure, not a pytree leaf: a
  size, a name, a factor, saved in the manifest rather than as an array.

  Typed ``Any`` as `dataclasses.field` is: it stands for the field's value
  in the class body, whatever the field's type."""
  return dataclasses.field(default=default, metadata={"pytree_node": False})
