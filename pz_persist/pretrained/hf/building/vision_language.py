"""Shared code (no record): the language model of a vision-language folder
whose text model is one a family already reads (Qwen2-VL and Qwen2.5-VL:
Qwen2's; Qwen3-VL: that of Qwen 3; Mistral 3: Mistral's or Ministral 3's).

Three steps are the same for all of them, written once here:

- the text model's config: ``text_config``, or, in the Hub's older flat
  files (Qwen2-VL, Qwen2.5-VL), the folder's own fields that are not the
  folder's (`text_fields`); a field given both ways with two values is
  refused, never guessed;
- multimodal RoPE at text positions (`text_positions_rope`): transformers
  gives a text-only input the same temporal, height and width positions
  (``get_rope_index`` without images), so every frequency section rotates by
  the same angle and the rotation is ordinary RoPE whatever
  ``mrope_section`` and ``mrope_interleaved`` say. The sections are checked
  (transformers' own ``split`` fails on sections that do not cover half the
  head) and then dropped; they matter only for image and video tokens, which
  this loader does not read;
- the tensor names (`renamed_plan`): the text family's plan runs on the
  folder's tensors seen under their text-model names
  (``model.language_model.layers.0...`` as ``model.layers.0...``), and its
  specs are pointed back at the stored names. The vision tower and projector
  are declared left out (`multimodal.towers_left_out`): the load says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import cast

from pz_persist.pretrained.hf import multimodal
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import IGNORED_FIELDS
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import OBJECT
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import left_out_renamed
from pz_persist.pretrained.hf.weights import Weights

VL_FIELDS: dict[str, Any] = {
    "mrope_section": (lambda v: isinstance(v, list) and len(v) == 3
                      and all(NON_NEGATIVE_INT[0](x) for x in v),
                      "a list of three non-negative integers"),
    "mrope_interleaved": BOOLEAN,
    "text_config": OBJECT,
    "vision_config": OBJECT,
}
"""The fields a vision-language folder's family reads: the multimodal RoPE
keys of a ``rope_parameters`` / ``rope_scaling`` dict, the nested configs."""

Layout = tuple[tuple[str, str], ...]
"""``(stored prefix, text-model prefix)`` pairs: how a folder names the text
model's tensors (``("model.language_model.", "model.")``)."""


def text_fields(cfg: Config, folder_fields: frozenset[str]) -> dict[str, Any]:
  """The text model's config of a vision-language folder: its
  ``text_config``, with the folder's own top-level fields that belong to the
  text model (every field but ``folder_fields`` and the harmless ones of
  `IGNORED_FIELDS`) merged in, as transformers reads the Hub's flat
  Qwen2-VL files. A field given at both levels with different values is
  refused. Marks every field it takes as used."""
  nested = cfg.get("text_config")
  text = dict(nested or {})
  for key, value in cfg.raw.items():
    if key in folder_fields or key in IGNORED_FIELDS or key == "text_config":
      continue
    cfg.used.add(key)
    if key in text and text[key] != value:
      raise cfg.unsupported(key, value, f"text_config says {key}={text[key]!r:.60}; a field of"
                            " the text model given twice must agree")
    text[key] = value
  for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
    if key not in text and key in cfg.raw:  # Harmless; kept for the exported config.
      text[key] = cfg.raw[key]
  return text


def text_positions_rope(cfg: Config, interleaved: bool, default_section: list[int]) -> None:
  """Checks the multimodal RoPE keys of ``cfg``'s RoPE dict and removes them
  (module docstring: at text positions they change nothing). ``interleaved``:
  whether the family lays the sections out interleaved (Qwen3-VL), so
  ``mrope_interleaved`` is read; otherwise it is refused and the sections
  must cover half of each head, as transformers' ``split`` requires."""
  for key in ("rope_parameters", "rope_scaling"):
    params = cfg.raw.get(key)
    if not isinstance(params, dict):
      continue
    params = dict(params)
    section = cfg.checked(f"{key}.mrope_section", params.pop("mrope_section", default_section))
    if "mrope_interleaved" in params:
      flag = cfg.checked(f"{key}.mrope_interleaved", params.pop("mrope_interleaved"))
      if flag != interleaved:
        raise cfg.unsupported(f"{key}.mrope_interleaved", flag, "this family's multimodal RoPE"
                              f" is {'' if interleaved else 'not '}interleaved in transformers")
    if not interleaved:
      heads = cfg.require("num_attention_heads")
      half = cfg.get("head_dim") or cfg.require("hidden_size") // heads
      if sum(section) * 2 != half:
        raise cfg.unsupported(f"{key}.mrope_section", section, "the three sections must add up"
                              f" to half of each head's {half} dimensions (transformers splits"
                              " the frequencies by them)")
    for name in ("rope_type", "type"):
      if params.get(name) == "mrope":  # transformers reads it as "default".
        params[name] = "default"
    cfg.raw[key] = params


class _Renamed:
  """``weights`` seen with the text model's tensor names, for the text
  family's plan (which asks for ``names``, ``dtype`` and ``path``)."""

  def __init__(self, weights: Weights, layout: Layout):
    self.dtype = weights.dtype
    self.path = weights.path
    self.stand_in = getattr(weights, "stand_in", False)
    self.stored: dict[str, str] = {}
    for name in weights.names:
      for stored, text in layout:
        if name.startswith(stored):
          self.stored.setdefault(text + name[len(stored):], name)
          break
    self.names = set(self.stored)


def _layout(cfg: Config, weights: Weights, layouts: Sequence[Layout]) -> Layout:
  """The one layout whose layers the folder holds; refused if none or
  several do (two copies of the text model: which one is meant?)."""
  found = [layout for layout in layouts
           if any(name.startswith(layout[0][0] + "layers.") for name in weights.names)]
  if len(found) != 1:
    where = " and ".join(f"{layout[0][0]}layers.*" for layout in found) or "no text layers"
    raise cfg.unsupported("model_type", cfg.raw.get("model_type"), "its text model's tensors"
                          " are expected under exactly one of "
                          f"{[layout[0][0] for layout in layouts]}; the folder holds {where}")
  return found[0]


def text_names(cfg: Config, weights: Weights, layouts: Sequence[Layout]) -> dict[str, str]:
  """The folder's text-model tensors (under the one of ``layouts`` it
  holds): each stored name by its text-model name, as `renamed_plan` shows
  them to the text family's plan."""
  return _Renamed(weights, _layout(cfg, weights, layouts)).stored


def renamed_plan(cfg: Config, weights: Weights, layouts: Sequence[Layout],
                 text_plan: Callable[[Weights], Plan], builds: str) -> Plan:
  """``text_plan`` run on the folder's text-model tensors (under the one of
  ``layouts`` the folder holds), its sources pointed back at the stored
  names; the tensors it leaves (vision tower, projector) reported."""
  seen = _Renamed(weights, _layout(cfg, weights, layouts))
  plan = text_plan(cast(Weights, seen))
  specs = tuple(dataclasses.replace(spec, source=seen.stored.get(spec.source, spec.source))
                for spec in plan.tensors)
  if plan.views:  # No family read this way declares views (stacked or decoded tensors).
    raise AssertionError("renamed_plan does not rename views (a bug: please report it)")
  text = set(seen.stored.values())
  # The text plan's own declarations, asked of the text model's names.
  as_text = {stored: planned for planned, stored in seen.stored.items()}
  renamed = tuple(left_out_renamed(left_out, as_text.get) for left_out in plan.left_out)
  return multimodal.towers_left_out(Plan(plan.build, specs, left_out=renamed),
                                    text.__contains__, "the vision tower and projector", builds)


def folder_tie(cfg: Config, text: Mapping[str, Any]) -> bool | None:
  """The folder's ``tie_word_embeddings`` as transformers 5 reads it: the
  folder's own field, or true when only ``text_config`` says so (pre-v5
  saves put it there; transformers forwards it); None when neither sets it."""
  tied = cfg.get("tie_word_embeddings")
  if tied is None and text.get("tie_word_embeddings") is None:
    return None
  return bool(tied) or bool(text.get("tie_word_embeddings"))


QWEN_VL_LAYOUTS: tuple[Layout, ...] = (
    (("model.language_model.", "model."), ("lm_head.", "lm_head.")),
    (("model.", "model."), ("lm_head.", "lm_head.")),
)
"""Where Qwen2-VL, Qwen2.5-VL and Qwen3-VL folders keep the language model:
under ``model.language_model.`` (transformers 5's names), or under ``model.``
beside ``visual.*`` (the names transformers 4 saved, which transformers 5
still writes for Qwen2.x-VL); the head is ``lm_head.weight`` in both."""

QWEN_VL_FOLDER_FIELDS = frozenset({
    "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
    "vision_end_token_id"})
"""A Qwen-VL folder's own fields besides ``text_config`` and
``tie_word_embeddings``: the vision tower's and its special tokens' (the
Hub's Qwen2-VL files add ``vision_token_id``, which transformers' classes
lack)."""


def qwen_vl_text_config(cfg: Config, fields: Mapping[str, Any],
                        folder_fields: frozenset[str] = QWEN_VL_FOLDER_FIELDS) -> Config:
  """The language model's `Config` of a Qwen-VL folder (``qwen2_vl``,
  ``qwen2_5_vl``, ``qwen3_vl``): ``text_config`` (of ``model_type``
  ``<folder>_text``) or the flat fields, with the folder's
  ``tie_word_embeddings``; checked by the family's ``fields``, with the
  folder's row of defaults (its text model's class's). ``folder_fields``: the
  folder's own fields, which a flat file keeps beside the text model's."""
  folder = cfg.require("model_type")
  text = text_fields(cfg, folder_fields | {"tie_word_embeddings", "model_type"})
  tied = folder_tie(cfg, text)
  cfg.check_all_used()
  text_cfg = multimodal.text_config(cfg, text, folder, f"{folder}_text", fields)
  if tied is not None:
    text_cfg.raw["tie_word_embeddings"] = tied
  return text_cfg


_NO_WINDOW = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
"""The window fields of Qwen 3's config, which Qwen3-VL's text models lack
(every layer global)."""


def qwen3_vl_global_attention(text_cfg: Config, title: str) -> None:
  """Refuses a window in the text config of a Qwen3-VL folder (``title``:
  ``"Qwen3-VL"``, ``"Qwen3-VL-MoE"``), whose transformers text model attends
  globally in every layer and reads none of Qwen 3's window fields; checks
  those fields against the schema, then leaves them out (no window)."""
  window = text_cfg.get("use_sliding_window")
  types = text_cfg.get("layer_types")
  if window or (types and set(types) != {"full_attention"}):
    key, value = ("use_sliding_window", window) if window else ("layer_types", types[:8])
    raise text_cfg.unsupported(key, value, f"transformers' {title} text model has no sliding"
                               " window: every layer attends globally")
  for key in _NO_WINDOW:
    text_cfg.get(key)  # Read: checked against the schema, then left out.
    text_cfg.raw.pop(key, None)
  text_cfg.raw["use_sliding_window"] = False
