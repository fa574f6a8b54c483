"""Cohere 2 (``model_type`` ``cohere2``: Command R7B / A) through `load_hf` and
`export_hf`, against transformers, with the checks of `hf_family_harness`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.nn.llama4_attention import ApplyInterleavedRoPE


def _case(**fields) -> checks.Case:
  return checks.Case(transformers.Cohere2Config, transformers.Cohere2ForCausalLM,
                     dict(num_key_value_heads=2, sliding_window=4, logit_scale=0.5, **fields))


CASES = {
    # Command R7B's layout: three sliding layers (window 4 < the 10 tokens) then a global one.
    "cohere2": _case(num_hidden_layers=4, rope_theta=50_000.0),
    # layer_types given, global first; attention biases; an untied head.
    "cohere2_typed": _case(layer_types=["full_attention", "sliding_attention"],
                           attention_bias=True, tie_word_embeddings=False,
                           layer_norm_eps=0.05),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


@pytest.mark.parametrize("case", CASES)
def test_kv_cache_sampling_matches_the_forward_pass(saved, case):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved[case].folder))


@pytest.mark.parametrize("case", CASES)
def test_greedy_kv_cache_generation_matches_transformers_generate(saved, case):
  checks.check_generate(saved[case], steps=8)


def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["cohere2"], "cohere2")


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["cohere2"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "cohere2", same_fields=(
      "logit_scale", "layer_types", "sliding_window", "attention_bias", "tie_word_embeddings",
      "layer_norm_eps", "num_key_value_heads"))


@pytest.mark.parametrize("case, off", [
    ("cohere2", {"logit_scale": 1.0}),
    ("cohere2", {"sliding_window": 16}),
    ("cohere2", {"rope_theta": 10_000.0}),
    ("cohere2", {"layer_types": ["sliding_attention"] * 4}),
    ("cohere2", {"layer_types": ["full_attention"] * 4}),
    ("cohere2_typed", {"layer_norm_eps": 1e-5}),
])
def test_each_feature_binds(saved, case, off):
  checks.check_feature_binds(saved[case], CASES[case], **off)


def test_the_pairing_of_dimensions_binds(saved):
  """Llama's halves instead of adjacent pairs: other logits."""
  model = pzp.pretrained.load_hf(saved["cohere2"].folder)
  halves = pz.select(model).at_instances_of(ApplyInterleavedRoPE).apply(lambda r: r.rope)
  changed = float(np.abs(checks.penzai_logits(halves) - saved["cohere2"].reference).max())
  assert changed > 100 * checks.TOLERANCE["atol"]


def test_the_attention_bias_binds(saved):
  def no_bias(model):
    with torch.no_grad():
      for name, param in model.named_parameters():
        if name.endswith(("k_proj.bias", "q_proj.bias")):
          param.zero_()
  checks.check_modules_bind(saved["cohere2_typed"], CASES["cohere2_typed"], "q/k biases",
                            no_bias)


@pytest.mark.parametrize("changes, match", [
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"rms_norm_eps": 1e-6}, "rms_norm_eps"),
    ({"logit_scale": "0.5"}, "logit_scale"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_qk_norm": True}, "use_qk_norm"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, "rope"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, changes, match,
                                                              monkeypatch):
  folder = checks.edited(saved["cohere2"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)


_COMMAND_R7B = {  # CohereLabs/c4ai-command-r7b-12-2024, shrunk.
    "architectures": ["Cohere2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 5, "eos_token_id": 255001, "head_dim": 8, "hidden_act": "silu",
    "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
    "layer_norm_eps": 1e-05, "logit_scale": 0.25, "max_position_embeddings": 132096,
    "model_type": "cohere2", "num_attention_heads": 4, "num_hidden_layers": 4,
    "num_key_value_heads": 2, "pad_token_id": 0, "rope_scaling": None, "rope_theta": 50000,
    "sliding_window": 4, "sliding_window_pattern": 4, "torch_dtype": "bfloat16",
    "transformers_version": "4.48.0.dev0", "use_cache": True, "vocab_size": 64}


def test_hub_config(tmp_path):
  checks.check_float32(checks.hub_saved(tmp_path, _COMMAND_R7B), "command-r7b")


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  checks.check_cli_export_from_native(saved["cohere2"], tmp_path)
