"""The Hugging Face model families: one module each, declaring one
`pz_persist.pretrained.hf.record.Family` as its ``RECORD``.

The modules of this package are found by listing the package itself (its own
files, never a name read from a checkpoint), so adding a family is adding one
module. Every module here is a family and defines ``RECORD``; the code
families share lives in `pz_persist.pretrained.hf.building`, and no family
imports another's module. Everything else reads
the tables built here: `MODEL_TYPES` (``load_hf``'s dispatch), `REFUSED`,
`detect` (``export_hf`` without ``like``) and `FAMILIES` (the CLI's help and
the pretrained guide's table (docs/guides/pretrained.md)).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType


def _records() -> tuple[Family, ...]:
  found = []
  for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    record = getattr(importlib.import_module(f"{__name__}.{module.name}"), "RECORD", None)
    assert isinstance(record, Family), (
        f"{module.name} defines no RECORD Family: shared code belongs in"
        " pz_persist.pretrained.hf.building")
    found.append(record)
  return tuple(found)


FAMILIES: tuple[Family, ...] = _records()
"""Every family, in the order of their modules' names."""

FAMILY_OF: dict[str, Family] = {}
"""The family reading each supported ``model_type``."""
for _family in FAMILIES:
  for _model_type in _family.model_types:
    assert _model_type not in FAMILY_OF, f"model_type {_model_type!r} is declared twice"
    FAMILY_OF[_model_type] = _family

MODEL_TYPES: dict[str, ModelType] = {
    name: family.model_types[name] for name, family in sorted(FAMILY_OF.items())}
"""The supported ``model_type`` values of ``config.json`` and how each is read."""

DEFAULTS: dict[str, dict[str, Any]] = {
    name: {**(MODEL_TYPES[t.written_as].defaults if t.written_as else {}), **t.defaults}
    for name, t in MODEL_TYPES.items()}
"""What an absent ``config.json`` field means, for every ``model_type`` (each
record's `ModelType.defaults`; a multimodal one's is its text model's):
the one table every mapping's defaults come from."""

EXPORTED: tuple[str, ...] = tuple(name for name, t in MODEL_TYPES.items() if t.exported)
"""The ``model_type`` values `export_hf` writes."""

REFUSED: dict[str, str] = {
    name: why for family in FAMILIES for name, why in family.refused_model_types.items()}
"""``model_type`` values refused with a reason of their own (a family's next
generation) rather than the list of supported ones."""

LAYER_PREFIXES: tuple[str, ...] = tuple(sorted({p for f in FAMILIES for p in f.layer_prefixes}))
"""Every prefix a plan counts layers under (export's stand-in weights hold each)."""

HEAD_NAMES: tuple[str, ...] = tuple(sorted({h for f in FAMILIES for h in f.head_names}))
"""Every untied output head a plan may ask for."""


def detect(model: pz.nn.Layer) -> str | None:
  """The ``model_type`` whose structure ``model`` has: the answer of the
  first record, by rank, that recognises it."""
  for family in sorted(FAMILIES, key=lambda f: f.rank):
    model_type = family.detect(model)
    if model_type is not None:
      return model_type
  return None


def names() -> str:
  """The families and their ``model_type`` values, for help texts."""
  return "; ".join(f"{f.title} ({', '.join(f.model_types)})" for f in FAMILIES)
