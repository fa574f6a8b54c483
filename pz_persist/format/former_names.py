"""The names classes were saved under before they moved: a recorded table.

A checkpoint names each class it holds by module path and qualname
(`pz_persist.format.code_references`), so moving a class, even with
``git mv``, would make every checkpoint that holds it unloadable. When one of
pz_persist's own classes moves, its former name is recorded here, and
loading reads a reference to the former name as a reference to the current
one. Saving always writes the current name.

Why a table and never a guess: a rule such as "try the last component" or
"find the class of that name elsewhere" would let a checkpoint reach classes
by names nobody ever gave them. An alias applies only to an exact
``(module, qualname)`` entry recorded here, in code: a checkpoint cannot add
one (references are exactly ``{"module", "qualname"}``), and a former name
not recorded is refused exactly as any unknown name.

What the table cannot do, by construction:

* point outside the allowed modules: `code_references` translates a name
  *before* the allow-list and the lookup, so these judge the current name
  as if the checkpoint had written it;
* chain or loop: a name is translated once, and no current name is itself
  a former name (`tests/test_former_names.py` keeps it so; when a class moves
  again, its older entries are updated to point at the newest home).

Adding a move: add a `Move` (the former and current module, the qualnames
that moved, the release that first writes the new name and the date), and
a release fixture (``tests/fixtures/releases/README.md``) written by the last
tree with the former names, so that the aliases are tested for ever.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

Name = tuple[str, str]
"""A ``(module, qualname)`` pair, as a checkpoint's reference holds it."""


@dataclasses.dataclass(frozen=True)
class Move:
  """Classes (or functions) that moved from one module to another.

  Attributes:
    former_module: The module path checkpoints written before the move name.
    current_module: The module path that defines them now.
    qualnames: Each name that moved, listed (never derived from what the
      modules define today, which would turn a record into a guess).
    release: The first release that writes the current name.
    date: The day of the move (ISO 8601).
  """

  former_module: str
  current_module: str
  qualnames: tuple[str, ...]
  release: str
  date: str


_LAYERS_MOVE = {
    "attention_sinks": ("SoftmaxWithSinks",),
    "constant_scale": ("ConstantScale",),
    "gated_delta_net": ("GatedDeltaNet", "CachingGatedDeltaNet"),
    "kv_sharing": ("PublishKV", "SharedKV", "SharesKV"),
    "latent_attention": (
        "WithLatent", "Pick", "ApplyToParts", "Deinterleave", "LatentAttentionLogits",
        "LatentAttentionValues",
    ),
    "llama4_attention": (
        "ApplyChunkedCausalAttentionMask", "TemperatureTuning", "ApplyInterleavedRoPE",
    ),
    "longrope": ("ApplyLongRoPE", "LongRopeKVCachingLM"),
    "mixture_of_experts": (
        "TopKRouter", "ClampedSwiGLUGate", "ClampedLinearUp", "MixtureOfExperts",
    ),
    "offset_scale": ("OffsetScale",),
    "per_layer_inputs": (
        "PerLayerInputs", "MultiplyByPerLayerInput", "ScalarScale", "WithPerLayerInputs",
    ),
    "position_query_scale": ("PositionQueryScale",),
    "proportional_rope": ("ApplyProportionalRoPE",),
    "scaled_rope": ("ApplyScaledRoPE",),
}
"""The layers of ``pz_persist.pretrained.layers``, by module, when they moved
to `pz_persist.nn` (commit 012e373). No function of theirs is in the table:
none is a numerical function checkpoints may name (``pz_persist.nn`` is not
in `pz_persist.safety.allowlist.CALLABLE_MODULES`), so no checkpoint holds
one."""

MOVES: tuple[Move, ...] = tuple(
    Move(
        former_module=f"pz_persist.pretrained.layers.{module}",
        current_module=f"pz_persist.nn.{module}",
        qualnames=qualnames, release="0.7.0", date="2026-11-28",
    )
    for module, qualnames in _LAYERS_MOVE.items()
)
"""Every recorded move, oldest first."""


def _table(moves: tuple[Move, ...]) -> Mapping[Name, Name]:
  table: dict[Name, Name] = {}
  for move in moves:
    for qualname in move.qualnames:
      table[(move.former_module, qualname)] = (move.current_module, qualname)
  return types.MappingProxyType(table)


FORMER_NAMES: Mapping[Name, Name] = _table(MOVES)
"""Former ``(module, qualname)`` -> current ``(module, qualname)``; read-only."""


def current_name(module_name: str, qualname: str) -> Name:
  """The name a class recorded as ``module_name.qualname`` has now.

  The name itself unless that exact pair is a recorded former name: one
  lookup, never repeated, so no table can send a name round a loop.
  """
  return FORMER_NAMES.get((module_name, qualname), (module_name, qualname))


def is_former(module_name: str, qualname: str) -> bool:
  """Whether loading reads ``module_name.qualname`` as another name (so
  saving may not write it)."""
  return (module_name, qualname) in FORMER_NAMES
