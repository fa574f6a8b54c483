"""The record a Hugging Face model family declares: everything loading,
export, detection, the CLI and the pretrained guide need to know about it, in one place.

Each module of `pz_persist.pretrained.hf.families` defines one `Family` as
its ``RECORD``; `pz_persist.pretrained.hf.families` collects them. Nothing
outside a family's module names the family: `load_hf` dispatches on
``model_type`` through `Family.model_types`, `export_hf` writes the fields
`Family.write_config` derives and checks the model against the same plans,
the family of an exported model is the first record (by `Family.rank`) whose
`Family.detect` recognises its structure, and the CLI's help and the pretrained guide's
table of families are rendered from the records (`describe`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.plan import DECODER_HEAD
from pz_persist.pretrained.hf.plan import DECODER_LAYERS
from pz_persist.pretrained.hf.plan import LeftOut
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.weights import Weights

PlanFn = Callable[[Config, Weights], Plan]
"""Maps a checkpoint's ``config.json`` (and the names in its weights) to a `Plan`."""

Field = tuple[Callable[[Any], bool], str]
"""A ``config.json`` field's check and what it says a value must be, as in
`pz_persist.pretrained.hf.config.SCHEMA`."""

IgnoredFields = Mapping[str, tuple[str, ...]]
"""``config.json`` fields a plan deliberately leaves unread, grouped by why
(``{"training only: the load-balancing loss": ("router_aux_loss_coef",
...)}``)."""


@dataclasses.dataclass(frozen=True)
class ModelType:
  """One ``model_type`` of a family.

  Attributes:
    plan: How `load_hf` maps a folder of this ``model_type`` to Penzai.
    architecture: The transformers class ``export_hf`` writes in
      ``architectures`` (``"LlamaForCausalLM"``).
    export_plans: Further Penzai layouts `export_hf` accepts for this
      ``model_type`` besides ``plan``'s (Penzai's own Gemma, as
      `pz_persist.pretrained.load_gemma` builds it), tried in order.
    exported: Whether `export_hf` writes this ``model_type`` (False for one
      read only, such as a multimodal folder whose text model is written under
      its text ``model_type``).
    written_as: For one read only: the ``model_type`` `export_hf` writes
      when ``like`` is of this one (whose ``text_config`` then gives the
      fields copied).
    defaults: What each field its plan may find absent means: transformers'
      config class's value (``rope_theta`` / ``partial_rotary_factor``:
      its ``rope_parameters``'). `pz_persist.pretrained.hf.config.Config`
      answers an absent field from it before any default a mapping passes;
      a multimodal ``model_type`` reads its ``text_config`` with
      ``written_as``'s. Checked against transformers' classes by
      tests/pretrained/test_hf_defaults.py.
    defaults_why: For each entry of ``defaults`` that differs from the
      config class, or is not one of its fields, why it means the same model.
    ignored_fields: The fields of this ``model_type``'s ``config.json`` its
      plan deliberately does not read (training-only settings, the other
      modalities' towers...), by why. `Config.check_all_used`, the one place
      unread fields are refused, accepts them (still checked against the
      schema when present); every other unread field is refused, as is
      anything in a nested ``text_config`` that is not the text model's.
      tests/pretrained/test_hf_ignored_fields.py checks that each is a field
      of transformers' config class, or declared in ``foreign_fields``.
    foreign_fields: Those of ``ignored_fields`` that transformers' config
      class lacks (written by the Hub's remote code, by llm-compressor or by
      an older transformers); the same test checks that the class still
      lacks each.
    left_out: Stored tensors this ``model_type``'s folders may hold that
      its plan knowingly leaves unread whatever the config: the buffers
      transformers' class ignores (its ``_keys_to_ignore_on_load_unexpected``:
      GPT-2's causal masks...). Every other stored tensor must be read or
      covered by the plan's own `Plan.left_out`, or `load_hf` refuses the
      folder (`pz_persist.pretrained.hf.unread`).
  """

  plan: PlanFn
  architecture: str
  export_plans: tuple[PlanFn, ...] = ()
  exported: bool = True
  written_as: str | None = None
  defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  defaults_why: Mapping[str, str] = dataclasses.field(default_factory=dict)
  ignored_fields: IgnoredFields = dataclasses.field(default_factory=dict)
  foreign_fields: frozenset[str] = frozenset()
  left_out: tuple[LeftOut, ...] = ()

  @property
  def ignored(self) -> frozenset[str]:
    """Every field of `ignored_fields`, whatever the reason."""
    return frozenset(field for group in self.ignored_fields.values() for field in group)


@dataclasses.dataclass(frozen=True)
class Family:
  """A Hugging Face model family, as every part of pz_persist sees it.

  Attributes:
    title: Its name for people (``"Qwen2 / Qwen2.5"``).
    model_types: The ``model_type`` values of ``config.json`` it reads, in
      the order shown.
    fields: The ``config.json`` fields its plans read beyond the shared ones
      (`pz_persist.pretrained.hf.config.SCHEMA`), each with its check; a
      field no plan reads is refused, so a family lists what it reads here
      or in ``SCHEMA``.
    detect: The ``model_type`` whose structure a Penzai model has, or None
      (for `export_hf` without ``like``). Asked in `rank` order, so it may
      assume the structures of records of lower rank were ruled out.
    write_config: The ``config.json`` fields of a model of the given
      ``model_type`` (`pz_persist.pretrained.hf.config_from_model` has the
      shared pieces); ``like`` is the user's config, whose spelling of a
      field may be kept when it means the same. The fields that do not change
      the math, ``model_type``, ``architectures`` and ``dtype`` are added by
      export itself.
    adds: What pz_persist reads and builds for it (the pretrained guide's table (docs/guides/pretrained.md)).
    refuses: What it refuses (the guide's table).
    rank: Detection order: lower first (a more specific structure before
      one it extends).
    refused_model_types: ``model_type`` values refused with a reason of this
      family's own (a newer generation it does not read yet), by
      ``model_type``.
    layer_prefixes: The prefixes of layer ``i``'s tensors
      (``model.layers.{i}.``) that its plans count layers under; export's
      stand-in weights hold layers under every record's prefixes.
    head_names: The untied output heads its plans may ask for.
  """

  title: str
  model_types: Mapping[str, ModelType]
  detect: Callable[[pz.nn.Layer], str | None]
  write_config: Callable[[pz.nn.Layer, str, Mapping[str, Any]], dict[str, Any]]
  adds: str
  refuses: str
  rank: int
  fields: Mapping[str, Field] = dataclasses.field(default_factory=dict)
  refused_model_types: Mapping[str, str] = dataclasses.field(default_factory=dict)
  layer_prefixes: tuple[str, ...] = (DECODER_LAYERS,)
  head_names: tuple[str, ...] = (DECODER_HEAD,)


def describe(families: tuple[Family, ...]) -> str:
  """The table of families in docs/guides/pretrained.md, rendered from the
  records (a test checks that the guide holds exactly this)."""
  rows = ["| `model_type` | family | what pz_persist reads and adds | refused |", "|---|---|---|---|"]
  for family in families:
    types = ", ".join(f"`{t}`" for t in family.model_types)
    rows.append(f"| {types} | {family.title} | {family.adds} | {family.refuses} |")
  return "\n".join(rows) + "\n"
