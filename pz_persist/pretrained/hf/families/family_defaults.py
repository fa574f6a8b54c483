"""Shared code (no record): a family's transformers defaults for the fields
Llama's mapping reads with Llama's defaults.

`pz_persist.pretrained.hf.families.llama.llama_plan` reads ``rope_theta``
(default 10,000), ``tie_word_embeddings`` (false) and ``rms_norm_eps``
(1e-6) as transformers' ``LlamaConfig`` does; a family whose transformers
config has other defaults (SmolLM3: tied, base 2,000,000; OLMo and Phi-3:
epsilon 1e-5) fills them into the config it hands on, only where
``config.json`` lacks the field, so that a file relying on the default
means what transformers makes of it.
"""

from __future__ import annotations

from typing import Any

from pz_persist.pretrained.hf.config import Config


def with_defaults(cfg: Config, **fields: Any) -> None:
  """Sets each of ``fields`` in ``cfg`` where ``config.json`` has no value
  (``rope_theta``: nor the RoPE dict)."""
  params = cfg.raw.get("rope_parameters") or cfg.raw.get("rope_scaling") or {}
  for key, value in fields.items():
    if key == "rope_theta" and isinstance(params, dict) and params.get("rope_theta") is not None:
      continue
    if cfg.raw.get(key) is None:
      cfg.raw[key] = value
