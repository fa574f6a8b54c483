"""The text model of a multimodal Hugging Face folder (``gemma3``, ``gemma4``,
``llama4``, ``qwen3_5``...): its ``text_config`` and the tensors left unread.

Why one module: every such family reads the same way (the text model's
config nested in ``text_config`` and its tensors under a prefix, the other
modalities' towers left unread and reported), and the two steps that are the
same for all of them (the nested config's ``model_type`` checked, the unread
tensors reported by group) are written once here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.weights import Weights

_log = logging.getLogger("pz_persist.pretrained.hf")


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


def report_unread(weights: Weights, read: Callable[[str], bool], what: str,
                  builds: str) -> None:
  """Warns how many tensors ``read`` leaves out (the other modalities'),
  grouped by their top module (two name parts under ``model.``), e.g.
  ``"…: 12 tensors of the vision tower and projector (vision_tower.*) are not
  read: load_hf builds Gemma 3's text model only."``"""
  unread = sorted(name for name in weights.names if not read(name))
  if not unread:
    return
  groups = sorted({".".join(name.split(".", 2)[:2]) if name.startswith("model.")
                   else name.split(".", 1)[0] for name in unread})
  _log.warning("%s: %d tensors%s (%s) are not read: load_hf builds %s.", weights.path,
               len(unread), f" of {what}" if what else "",
               ", ".join(f"{group}.*" for group in groups), builds)
