"""The text model of a multimodal Hugging Face folder (``gemma3``, ``gemma4``,
``llama4``, ``qwen3_5``...): its ``text_config`` and the tensors left unread.

Why one module: every such family reads the same way (the text model's
config nested in ``text_config`` and its tensors under a prefix, the other
modalities' towers declared left unread), and the two steps that are the
same for all of them (the nested config's ``model_type`` checked, the towers
declared left out) are written once here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.plan import LeftOut
from pz_persist.pretrained.hf.plan import Plan


def text_config(cfg: Config, text: Any, folder_type: str, text_type: str,
                fields: Mapping[str, Any], ignored: frozenset[str] = frozenset()) -> Config:
  """The folder's ``text_config`` (``text``, which the family required from
  ``cfg`` before checking that it used every field) as a `Config` checked
  by the family's ``fields``, with ``cfg``'s defaults (the folder type's
  row of the table, its text model's) and the text ``model_type``'s
  ``ignored`` fields, refused unless its ``model_type`` is ``text_type`` (or
  absent)."""
  text_cfg = Config(text, f"{cfg.where} (text_config)", fields, cfg.defaults, ignored)
  found = text_cfg.get("model_type", text_type)
  if found != text_type:
    raise text_cfg.unsupported("model_type", found,
                               f"a {folder_type} folder's text model is {text_type!r}")
  return text_cfg


def towers_left_out(plan: Plan, text: Callable[[str], bool], what: str, builds: str) -> Plan:
  """``plan`` declaring every stored tensor outside the text model (``text``
  says which names are the text model's) knowingly left out: ``what`` they
  are, ``builds`` what load_hf builds instead. The load says how many it
  left, grouped by their top module (`pz_persist.pretrained.hf.unread`),
  e.g. ``"…: 12 tensors of the vision tower and projector (vision_tower.*)
  are not read: load_hf builds Gemma 3's text model only."``; a tensor of
  the text model the plan does not read is refused there."""
  left_out = LeftOut(lambda name: not text(name), what, f"load_hf builds {builds}")
  return dataclasses.replace(plan, left_out=(*plan.left_out, left_out))
