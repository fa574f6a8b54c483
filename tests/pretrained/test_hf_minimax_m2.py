"""MiniMax-M2 (``minimax_m2``) through `load_hf` and `export_hf`, against
transformers' own MiniMaxM2ForCausalLM on tiny random models (no downloads).

MiniMax-M2 is Llama's attention with query/key RMS norms over all heads and
RoPE on part of each head, and a mixture of experts in every layer routed
by sigmoid scores with a correction bias; each feature is shown to bind.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as harness

_SIZES = {"hidden_size": 32, "intermediate_size": 16, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
          "num_local_experts": 8, "num_experts_per_tok": 2}

CASES = {
    # Half of each head rotated (the Hub's rotary_dim, as transformers reads it).
    "minimax_m2": harness.Case(transformers.MiniMaxM2Config, transformers.MiniMaxM2ForCausalLM,
                               {**_SIZES, "rotary_dim": 8, "rope_theta": 1000.0}),
    # Every entry rotated, one key/value head.
    "minimax_m2_full": harness.Case(transformers.MiniMaxM2Config,
                                    transformers.MiniMaxM2ForCausalLM,
                                    {**_SIZES, "num_key_value_heads": 1}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return harness.saved_biased_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_float32_logits_match_transformers(saved, name):
  harness.check_float32(saved[name], name)


def test_kv_cache_matches_transformers_cache(saved):
  model = pzp.pretrained.load_hf(saved["minimax_m2"].folder)
  harness.check_kv_cache(model)
  harness.check_kv_cache_like_transformers(model, saved["minimax_m2"].hf_model)


def test_greedy_generation_matches_generate(saved):
  harness.check_generate(saved["minimax_m2"])


def test_save_model_round_trip(saved, tmp_path):
  harness.check_save_model(saved["minimax_m2"], tmp_path)


@pytest.mark.parametrize("name", list(CASES))
def test_export_gives_back_the_folder(saved, tmp_path, name):
  harness.check_export(saved[name], tmp_path, "minimax_m2",
                       same_fields=("num_local_experts", "num_experts_per_tok",
                                    "num_key_value_heads", "head_dim"))


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  harness.check_cli_export_from_native(saved["minimax_m2"], tmp_path)


# --- each feature binds -------------------------------------------------------


def _no_query_key_norms(model):
  for layer in model.model.layers:
    layer.self_attn.q_norm = torch.nn.Identity()
    layer.self_attn.k_norm = torch.nn.Identity()


class _PerHead(torch.nn.Module):
  """An RMS norm of each head alone (Qwen3's) with a whole-projection norm's
  weights."""

  def __init__(self, whole: torch.nn.Module, head_dim: int):
    super().__init__()
    self.whole, self.head_dim = whole, head_dim

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    heads = x.view(*x.shape[:-1], -1, self.head_dim)
    normed = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True)
                                 + self.whole.variance_epsilon)
    return self.whole.weight * normed.reshape(x.shape)


def _per_head_query_key_norms(model):
  """Norms of each head alone, the same weights: they differ from norms
  over all heads unless every head has the same RMS."""
  for layer in model.model.layers:
    attn = layer.self_attn
    attn.q_norm = _PerHead(attn.q_norm, attn.head_dim)
    attn.k_norm = _PerHead(attn.k_norm, attn.head_dim)


@pytest.mark.parametrize("what, edit", [
    ("the routing correction bias", harness.zero_correction_biases),
    ("the query/key norms", _no_query_key_norms),
    ("norms over all heads (per head instead)", _per_head_query_key_norms),
])
def test_modules_bind(saved, what, edit):
  harness.check_modules_bind(saved["minimax_m2"], CASES["minimax_m2"], what, edit)


def test_partial_rotary_binds(saved):
  harness.check_feature_binds(saved["minimax_m2"], CASES["minimax_m2"], rotary_dim=16)


MINIMAX_M2_CONFIG = {
    # The Hub's config.json of MiniMaxAI/MiniMax-M2 (MiniMax's own fields:
    # rotary_dim, use_qk_norm, the MTP modules...), its sizes shrunk.
    "architectures": ["MiniMaxM2ForCausalLM"], "attn_type_list": [1, 1],
    "auto_map": {"AutoConfig": "configuration_minimax_m2.MiniMaxM2Config",
                 "AutoModelForCausalLM": "modeling_minimax_m2.MiniMaxM2ForCausalLM"},
    "head_dim": 16, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 16,
    "max_position_embeddings": 196608, "model_type": "minimax_m2", "mtp_transformer_layers": 1,
    "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "num_local_experts": 8, "num_mtp_modules": 3,
    "output_router_logits": False, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06,
    "rope_theta": 5000000, "rotary_dim": 8, "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0, "scoring_func": "sigmoid", "shared_intermediate_size": 0,
    "tie_word_embeddings": False, "transformers_version": "4.46.1", "use_cache": True,
    "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 64,
    "torch_dtype": "bfloat16", "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}


def test_the_hubs_minimax_m2_config(tmp_path):
  config = {k: v for k, v in MINIMAX_M2_CONFIG.items() if k != "auto_map"}
  saved = harness.hub_saved(tmp_path, config)
  (saved.folder / "config.json").write_text(json.dumps(MINIMAX_M2_CONFIG))
  harness.check_float32(saved, "MiniMax-M2 hub")
  pzp.export_hf(pzp.pretrained.load_hf(saved.folder), tmp_path / "out", like=saved.folder)
  harness.assert_same_tensors(harness.tensors(tmp_path / "out"), harness.tensors(saved.folder))
  written = harness.config(tmp_path / "out")
  assert written["rotary_dim"] == 8
  assert "auto_map" not in written


@pytest.mark.parametrize("changes, match", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"num_local_experts": 10**9}, "num_local_experts"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"rotary_dim": 4}, "rotary_dim"),  # Beside rope_parameters' partial_rotary_factor 0.5.
    ({"rotary_dim": 5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e3}},
     "rotary_dim"),
    ({"rotary_dim": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1e3}},
     "rotary_dim"),
    ({"partial_rotary_factor": 0.25, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e3, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e3, "factor": 2.0,
                          "original_max_position_embeddings": 16,
                          "partial_rotary_factor": 0.5}}, "rope_type"),
    ({"use_qk_norm": False}, "use_qk_norm"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type"),
    ({"use_routing_bias": False}, "use_routing_bias"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"shared_intermediate_size": 16}, "shared_intermediate_size"),
    ({"attn_type_list": [0, 1]}, "attn_type_list"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  folder = harness.edited(saved["minimax_m2"].folder, tmp_path, **changes)
  harness.check_refused_before_building(folder, match, monkeypatch)
