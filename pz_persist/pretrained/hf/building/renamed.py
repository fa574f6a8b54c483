"""A family whose folders hold another family's tensors under other names
(EXAONE 3's ``transformer.h.N.attn.attention.q_proj`` for Llama's
``model.layers.N.self_attn.q_proj``), read with that family's own plan.

transformers renames such tensors as it loads them and back as it saves
(its ``conversion_mapping``); here the plan is run on the names as the other
family spells them, and each `TensorSpec` then reads (and `export_hf`
writes) the stored name, so the folder's own names go both ways.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import left_out_renamed


@dataclasses.dataclass(frozen=True)
class Renaming:
  """How a folder's tensor names map onto the plan's family's.

  Attributes:
    prefixes: ``(stored, planned)`` pairs of name prefixes, the first that
      starts a name replacing it.
    parts: ``(stored, planned)`` pairs of inner name parts, each replaced in
      turn where found (once), after the prefix; a later pair may see an
      earlier one's result (``.attn.attention.`` -> ``.self_attn.``, then
      ``.self_attn.out_proj.`` -> ``.self_attn.o_proj.``), which `stored`
      undoes in reverse order.
  """

  prefixes: tuple[tuple[str, str], ...]
  parts: tuple[tuple[str, str], ...]

  def planned(self, name: str) -> str:
    """The plan family's name of stored tensor ``name``."""
    for stored, planned in self.prefixes:
      if name.startswith(stored):
        name = planned + name[len(stored):]
        break
    for stored, planned in self.parts:
      name = name.replace(stored, planned, 1)
    return name

  def stored(self, name: str) -> str:
    """The folder's name of the plan family's tensor ``name`` (the inverse
    of `planned` on every name `planned` gives)."""
    for stored, planned in reversed(self.parts):
      name = name.replace(planned, stored, 1)
    for stored, planned in self.prefixes:
      if name.startswith(planned):
        return stored + name[len(planned):]
    return name


class _PlannedNames:
  """The folder's weights (or export's stand-in) as the plan asks for them:
  its names in the plan family's spelling, everything else its own."""

  def __init__(self, weights: Any, renaming: Renaming):
    self._weights = weights
    # Only names that map back to themselves: a Llama-named tensor in an
    # EXAONE folder is not one of its tensors, and must not count as a layer.
    self.names = {planned for name in weights.names
                  if renaming.stored(planned := renaming.planned(name)) == name}

  def __getattr__(self, name: str) -> Any:
    return getattr(self._weights, name)


def renamed_plan(plan: Callable[[Config, Any], Plan], renaming: Renaming,
                 cfg: Config, weights: Any) -> Plan:
  """``plan`` run on ``weights`` renamed as ``renaming`` says, its specs then
  reading the folder's own names. A stored name `Renaming.planned` does
  not round-trip through `Renaming.stored` would read another tensor, so
  none is trusted: each spec's stored name is checked to map back."""
  built = plan(cfg, _PlannedNames(weights, renaming))
  specs = []
  for spec in built.tensors:
    source = renaming.stored(spec.source)
    assert renaming.planned(source) == spec.source, (spec.source, source)
    specs.append(dataclasses.replace(spec, source=source))
  # What the plan leaves out, asked of the folder's names in its spelling.
  left_out = tuple(left_out_renamed(declared, renaming.planned) for declared in built.left_out)
  return dataclasses.replace(built, tensors=tuple(specs), left_out=left_out)
