"""Fields a family's ``config.json`` spells otherwise (transformers'
``attribute_map``: InternLM3's ``qkv_bias`` for ``attention_bias``, EXAONE's
``num_layers`` for ``num_hidden_layers``), read as the field they name."""

from __future__ import annotations

from collections.abc import Mapping

from pz_persist.pretrained.hf.config import Config


def read_aliases(cfg: Config, aliases: Mapping[str, str]) -> None:
  """Puts each alias's (checked) value in ``cfg`` under the field it names.

  transformers reads either spelling; both present and disagreeing is
  refused (which one it would keep is an accident of its loading order)
  rather than one guessed.
  """
  for alias, field in aliases.items():
    value = cfg.get(alias)
    if value is None:
      continue
    named = cfg.raw.get(field)
    if named is not None and named != value:
      raise cfg.unsupported(alias, value, f"it is {field}'s other name, and {field}={named!r}")
    cfg.raw[field] = value
