"""``export_hf`` without ``like=``, for every family with an export path:
the folder written from the model alone loads in transformers
(``AutoModelForCausalLM.from_pretrained``, no arguments) and computes the
original model's logits.

Two classes of failure this closes: a config class's default pad id outside
the model's vocabulary (Phi-3's 32000, SmolLM3's 128004: transformers sizes
``nn.Embedding``'s ``padding_idx`` from it and refused the folder), and
sizes no parameter shows (Qwen3-30B-A3B's ``intermediate_size`` beside
experts of another size, every layer a mixture: export refused
``mlp_hidden_dim``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pretrained import test_hf_qwen3_5
from pretrained.test_hf_defaults import MINIMAL
from pz_persist.pretrained.hf import families


def _factors(n: int) -> list[float]:
  return [1.0 + 0.5 * i for i in range(n)]


_LONGROPE = {"max_position_embeddings": 64, "original_max_position_embeddings": 4}

CASES = {
    **{name: (name, {}) for name in MINIMAL},
    # Phi-3.5-mini's shape: longrope on whole heads (and Phi-3's default pad id 32000).
    "phi3.5_mini": ("phi3", {**_LONGROPE, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": _factors(4),
        "long_factor": _factors(4)[::-1]}}),
    # Phi-4-mini's: longrope on 3/4 of each head, tied embeddings.
    "phi4_mini": ("phi3", {**_LONGROPE, "hidden_size": 64, "head_dim": 16,
                           "tie_word_embeddings": True, "rope_parameters": {
                               "rope_type": "longrope", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.75, "short_factor": _factors(6),
                               "long_factor": _factors(6)[::-1]}}),
    # Phi-2's layout with query/key LayerNorms and three quarters rotated.
    "phi_qk": ("phi", {"qk_layernorm": True, "partial_rotary_factor": 0.75}),
    # StableLM 2 12B's: parallel blocks, per-head query/key norms, qkv biases.
    "stablelm_12b": ("stablelm", {"use_parallel_residual": True, "qk_layernorm": True,
                                  "use_qkv_bias": True}),
    # StarCoder2 with a window on every layer and no biases.
    "starcoder2_window": ("starcoder2", {"sliding_window": 3, "use_bias": False}),
    # SmolLM3's: NoPE every fourth layer (and its default pad id 128004).
    "smollm3_nope": ("smollm3", {"num_hidden_layers": 4}),
    # Qwen3-30B-A3B's: every layer a mixture, intermediate_size (6144 there)
    # other than the experts' moe_intermediate_size (768 there).
    "qwen3_30b_a3b": ("qwen3_moe", {"intermediate_size": 48, "moe_intermediate_size": 16}),
    # The Mamba-2 hybrids from their sizes (transformers' default chunk size).
    "bamba": ("bamba", {}),
    # Granite-4.0-H-Tiny's: Mamba-2 mixers, NoPE attention, experts beside the shared MLP.
    "granite_4_h": ("granitemoehybrid", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                         "intermediate_size": 16, "position_embedding_type": "nope",
                                         "embedding_multiplier": 2.0}),
    # Falcon-H1-0.5B's shape: a mixer width of its own, every constant away
    # from 1, no mixer norm, tied embeddings.
    "falcon_h1_05b": ("falcon_h1", {
        "mamba_d_ssm": 48, "mamba_d_head": 12, "tie_word_embeddings": True,
        "embedding_multiplier": 5.66, "lm_head_multiplier": 0.039, "key_multiplier": 0.39,
        "attention_in_multiplier": 1.5, "attention_out_multiplier": 0.94,
        "ssm_in_multiplier": 1.25, "ssm_out_multiplier": 0.24, "mlp_multipliers": [0.88, 0.59],
        "ssm_multipliers": [0.35, 0.25, 0.35, 0.5, 0.35]}),
    # Jamba-1.5-Mini's pattern (attention 4 of 8, experts every other layer
    # from 1), shrunk to 8 layers, 4 experts, a time-step rank of its own.
    "jamba_15_mini": ("jamba", {"num_hidden_layers": 8, "num_experts": 4, "mamba_dt_rank": 4,
                                "mamba_d_state": 8}),
}
"""Each case: the ``model_type`` and the fields beyond `MINIMAL`'s sizes."""


def test_every_exported_model_type_has_a_case():
  exported = {name for name, t in families.MODEL_TYPES.items() if t.exported}
  assert exported <= {model_type for model_type, _ in CASES.values()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_without_like_loads_in_transformers(tmp_path, case):
  model_type, extra = CASES[case]
  fields = {**MINIMAL[model_type], **extra}
  torch.manual_seed(0)
  randomized = (test_hf_qwen3_5.randomized if model_type.startswith("qwen3_5")
                else checks.randomized)
  source = randomized(transformers.AutoModelForCausalLM.from_config(
      transformers.AutoConfig.for_model(model_type, **fields)).float())
  source.save_pretrained(tmp_path / "source", safe_serialization=True)
  reference = checks.reference_logits(source)

  pzp.export_hf(pzp.pretrained.load_hf(tmp_path / "source"), tmp_path / "alone")
  written = json.loads((tmp_path / "alone" / "config.json").read_text())
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "alone").eval()
  logits = checks.reference_logits(theirs)
  np.testing.assert_allclose(logits, reference, **checks.TOLERANCE)
  print(f"{case} exported without like= as {written['model_type']}: transformers' float32"
        f" logits max abs difference {np.abs(logits - reference).max():.2g}")
