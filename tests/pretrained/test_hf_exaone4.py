"""EXAONE 4 (``model_type`` ``exaone4``) against transformers, with the checks
of `hf_family_harness`: post-norms only, per-head query/key norms, sliding
layers with RoPE and global layers without it (or, with no window, global
rotary layers only)."""

from __future__ import annotations

import pytest
import torch
import transformers

from pretrained import hf_family_harness as checks


def _case(**fields):
  return checks.Case(transformers.Exaone4Config, transformers.Exaone4ForCausalLM,
                     dict({"num_key_value_heads": 2, "head_dim": 8}, **fields))


CASES = {
    # Windows of 3 on three layers of four, the fourth global without RoPE.
    "exaone4": _case(num_hidden_layers=4, sliding_window=3, sliding_window_pattern=4),
    # EXAONE 4.0 1.2B's shape: no window, every layer global and rotary; tied
    # head, llama3 RoPE.
    "exaone4_global": _case(sliding_window=None, layer_types=["full_attention"] * 2,
                            tie_word_embeddings=True, rope_parameters={
                                "rope_type": "llama3", "rope_theta": 1e6, "factor": 16.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 4}),
}

HUB_32B = {
    "architectures": ["Exaone4ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 361, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "initializer_range": 0.02, "intermediate_size": 27392,
    "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 16,
    "max_position_embeddings": 131072, "model_type": "exaone4", "num_attention_heads": 40,
    "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 1000000, "sliding_window": 4096, "sliding_window_pattern": "LLLG",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0.dev0", "use_cache": True, "vocab_size": 102400}
"""EXAONE-4.0-32B's config.json as the Hub has it (a string window pattern
beside its layer types)."""

_TINY_32B = {**HUB_32B, **checks.TINY, "head_dim": 8, "num_hidden_layers": 4,
             "layer_types": HUB_32B["layer_types"][:4], "sliding_window": 3,
             "rope_scaling": {**HUB_32B["rope_scaling"], "original_max_position_embeddings": 4}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
  return checks.hub_saved(tmp_path_factory.mktemp("exaone4_hub"), _TINY_32B)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


def test_hub_config_with_its_string_pattern(hub):
  checks.check_float32(hub, "exaone4_32b_hub")


@pytest.mark.parametrize("case", CASES)
def test_kv_cache_and_greedy_generation_match_transformers(saved, case):
  checks.check_cached_decoding(saved[case])


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "exaone4",
                      same_fields=("layer_types", "sliding_window", "tie_word_embeddings"))


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["exaone4"], tmp_path)


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["exaone4"], "exaone4")


def _identity(module_name: str):
  def edit(model):
    for layer in model.model.layers:
      parent = layer.self_attn if module_name in ("q_norm", "k_norm") else layer
      setattr(parent, module_name, torch.nn.Identity())
  return edit


def _rope_on_global_layers(model):
  # transformers applies RoPE where the attention's window is None or the layer slides.
  for layer in model.model.layers:
    layer.self_attn.sliding_window = None


@pytest.mark.parametrize("what, edit", [
    ("the post-attention norms", _identity("post_attention_layernorm")),
    ("the post-MLP norms", _identity("post_feedforward_layernorm")),
    ("the query norms", _identity("q_norm")),
    ("the key norms", _identity("k_norm")),
    ("global layers without RoPE (RoPE on every layer)", _rope_on_global_layers),
])
def test_each_feature_binds(saved, what, edit):
  checks.check_modules_bind(saved["exaone4"], CASES["exaone4"], what, edit)


def test_the_window_binds(saved):
  checks.check_feature_binds(saved["exaone4"], CASES["exaone4"], sliding_window=64)


@pytest.mark.parametrize("changes, match", [
    ({"layer_types": ["full_attention"] * 3}, "layer_types.*expected 4 entries"),
    ({"layer_types": ["full_attention"] * 3 + ["chunked_attention"]}, "layer_types"),
    ({"layer_types": checks.DELETE}, "layer_types.*'LLLG'"),
    ({"sliding_window": None}, "sliding_window.*null"),
    ({"sliding_window_pattern": "LLXG"}, "sliding_window_pattern must be"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_hostile_configs_are_refused_before_building(hub, tmp_path, monkeypatch, changes, match):
  checks.check_refused_before_building(checks.edited(hub.folder, tmp_path, **changes), match,
                                       monkeypatch)


def test_a_forged_layer_count_is_refused_before_building(saved, tmp_path, monkeypatch):
  """Layer types built from the pattern for 10**9 layers: refused from the
  weights' names, before a list of them is made."""
  folder = checks.edited(saved["exaone4"].folder, tmp_path, num_hidden_layers=10**9,
                         layer_types=checks.DELETE)
  checks.check_refused_before_building(folder, "num_hidden_layers.*layers 0..3", monkeypatch)


def test_a_null_window_without_layer_types_is_refused(saved, tmp_path, monkeypatch):
  folder = checks.edited(saved["exaone4_global"].folder, tmp_path, layer_types=checks.DELETE)
  checks.check_refused_before_building(folder, "layer_types.*sliding_window is null",
                                       monkeypatch)
