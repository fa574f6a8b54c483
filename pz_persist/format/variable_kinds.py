"""The two kinds of Penzai variables, as checkpoints name them, and their classes.

A checkpoint records each variable's kind as ``"parameter"`` or
``"state_variable"``, and tags its frozen values and slots
``"parameter_value"`` / ``"parameter_slot"`` (and the same for state
variables); Penzai has three classes for each (the frozen value, the mutable
variable and the slot an unbound model holds). This table is the one place
that maps between them, so that the node table, the encoder, the decoder,
binding, the variable listing (`manifest_queries`), the Orbax handlers and
the safetensors export agree, and a new kind would be added once.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from penzai import pz

from pz_persist import errors

KindName = Literal["parameter", "state_variable"]
"""How checkpoints name a kind."""


@dataclasses.dataclass(frozen=True)
class Kind:
  """One kind of variable.

  Attributes:
    name: How checkpoints name it (``"parameter"``).
    value_class: Its frozen value (``pz.ParameterValue``).
    variable_class: Its mutable variable (``pz.Parameter``).
    slot_class: Its slot in an unbound model (``pz.ParameterSlot``).
  """

  name: KindName
  value_class: type[pz.AbstractVariableValue]
  variable_class: type
  slot_class: type

  @property
  def value_tag(self) -> str:
    """The node tag of its frozen values (``"parameter_value"``)."""
    return f"{self.name}_value"

  @property
  def slot_tag(self) -> str:
    """The node tag of its slots (``"parameter_slot"``)."""
    return f"{self.name}_slot"


KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        Kind("parameter", pz.ParameterValue, pz.Parameter, pz.ParameterSlot),
        Kind("state_variable", pz.StateVariableValue, pz.StateVariable, pz.StateVariableSlot),
    )
}
"""Every kind, by the name checkpoints give it."""

BY_VALUE_TAG: dict[str, Kind] = {kind.value_tag: kind for kind in KINDS.values()}
"""Every kind, by the node tag of its frozen values."""

BY_SLOT_TAG: dict[str, Kind] = {kind.slot_tag: kind for kind in KINDS.values()}
"""Every kind, by the node tag of its slots."""


def kind_of(obj: object) -> str:
  """The kind's name of a Penzai variable, variable value or slot."""
  for kind in KINDS.values():
    if isinstance(obj, (kind.value_class, kind.variable_class, kind.slot_class)):
      return kind.name
  raise errors.ArgumentTypeError(
      f"{type(obj).__name__} is not a Penzai parameter or state variable"
      " (value, variable or slot)."
  )


def value_class(name: str) -> type:
  """The frozen value class of the kind named ``name`` (it must be in `KINDS`)."""
  return KINDS[name].value_class
