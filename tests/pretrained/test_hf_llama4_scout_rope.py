"""Llama 4 Scout's own RoPE scaling (``llama3`` with ``factor`` 16 and
``low_freq_factor == high_freq_factor == 1``) loads and matches transformers.

Equal factors leave llama3's smoothing band empty: transformers' blend
divides by ``high - low = 0`` but selects none of it, so every wavelength
above ``original_max_position_embeddings`` is divided by 16 and the rest is
kept. A high factor below the low one is still refused
(tests/pretrained/test_rope_scaling.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from pretrained import hf_family_harness as checks
from pretrained.test_hf_llama4 import SCOUT_TEXT_CONFIG

_SCOUT_ROPE = {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}
"""meta-llama/Llama-4-Scout-17B-16E's ``text_config.rope_scaling``, as on the Hub."""


def _scout(tmp_path, rope_scaling):
  """A random two-layer model of Scout's Hub text config with
  ``rope_scaling``; the folder keeps the Hub's spelling (transformers 5
  wants ``attn_temperature_tuning`` as a bool for the reference)."""
  fields = {k: v for k, v in SCOUT_TEXT_CONFIG.items()
            if k not in ("for_llm_compressor", "model_type", "torch_dtype")}
  fields["rope_scaling"] = rope_scaling
  torch.manual_seed(0)
  model = checks.randomized(transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
      **dict(fields, attn_temperature_tuning=True))))
  model.save_pretrained(tmp_path, safe_serialization=True)
  (tmp_path / "config.json").write_text(json.dumps(dict(
      SCOUT_TEXT_CONFIG, rope_scaling=rope_scaling, architectures=["Llama4ForCausalLM"])))
  return model


@pytest.mark.parametrize("original", [8192, 8])
def test_scouts_rope_scaling_matches_transformers(tmp_path, original):
  """As on the Hub (8192), and with the original context shrunk to 8 so
  that three of the four frequencies of a head of 8 are divided."""
  model = _scout(tmp_path, dict(_SCOUT_ROPE, original_max_position_embeddings=original))
  error = checks.float32_error(tmp_path, checks.reference_logits(model))
  print(f"Scout rope (original context {original}): float32 max abs error {error:.2g}")


def test_scouts_rope_scaling_binds(tmp_path):
  """The shrunk case's scaling changes transformers' logits (so ignoring it
  would fail the test above)."""
  scaled = _scout(tmp_path / "scaled", dict(_SCOUT_ROPE, original_max_position_embeddings=8))
  plain = _scout(tmp_path / "plain", {"rope_type": "default"})
  change = np.abs(checks.reference_logits(scaled) - checks.reference_logits(plain)).max()
  assert change > 100 * checks.TOLERANCE["atol"]
