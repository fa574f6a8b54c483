"""GLM-4.7-Flash (``glm4_moe_lite``) through `load_hf` and `export_hf`,
against transformers' own Glm4MoeLiteForCausalLM on tiny random models (no
downloads).

GLM-4.7-Flash is DeepSeek-V3's latent attention and experts with its dense
layers where ``mlp_layer_types`` says; each feature is shown to bind.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as harness

_SIZES = {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
          "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
          "qk_rope_head_dim": 8, "qk_nope_head_dim": 10, "v_head_dim": 12,
          "n_routed_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 128}

CASES = {
    # Dense layers 0 and 2 (not all first), low-rank queries, interleaved
    # RoPE, routing within the best group of two, scaled.
    "glm4_moe_lite": harness.Case(
        transformers.Glm4MoeLiteConfig, transformers.Glm4MoeLiteForCausalLM,
        {**_SIZES, "num_hidden_layers": 4, "q_lora_rank": 24,
         "mlp_layer_types": ["dense", "sparse", "dense", "sparse"], "n_group": 2,
         "topk_group": 1, "routed_scaling_factor": 1.8}),
    # transformers' default layers (the first dense), one query projection,
    # RoPE in halves, no renormalisation.
    "glm4_moe_lite_plain": harness.Case(
        transformers.Glm4MoeLiteConfig, transformers.Glm4MoeLiteForCausalLM,
        {**_SIZES, "num_hidden_layers": 2, "q_lora_rank": None, "rope_interleave": False,
         "norm_topk_prob": False}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return harness.saved_biased_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_float32_logits_match_transformers(saved, name):
  harness.check_float32(saved[name], name)


def test_kv_cache_matches_transformers_cache(saved):
  model = pzp.pretrained.load_hf(saved["glm4_moe_lite"].folder)
  harness.check_kv_cache(model)
  harness.check_kv_cache_like_transformers(model, saved["glm4_moe_lite"].hf_model)


def test_greedy_generation_matches_generate(saved):
  harness.check_generate(saved["glm4_moe_lite"])


def test_save_model_round_trip(saved, tmp_path):
  harness.check_save_model(saved["glm4_moe_lite"], tmp_path)


def test_export_gives_back_the_folder(saved, tmp_path):
  harness.check_export(saved["glm4_moe_lite"], tmp_path, "glm4_moe_lite",
                       same_fields=("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                                    "mlp_layer_types", "n_group", "topk_group",
                                    "routed_scaling_factor", "rope_interleave"))


def test_only_the_first_layer_dense_exports_as_deepseek_v3(saved, tmp_path):
  """With ``like`` the folder comes back as it was; without, the model
  (DeepSeek-V3's layout with its first layer dense) is written as DeepSeek-V3,
  the same model, which transformers reads with the same logits."""
  case = saved["glm4_moe_lite_plain"]
  harness.check_export(case, tmp_path, None)
  pzp.export_hf(pzp.pretrained.load_hf(case.folder), tmp_path / "alone")
  assert harness.config(tmp_path / "alone")["model_type"] == "deepseek_v3"
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "alone").eval()
  np.testing.assert_allclose(harness.reference_logits(theirs), case.reference,
                             **harness.TOLERANCE)


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  harness.check_cli_export_from_native(saved["glm4_moe_lite"], tmp_path)


# --- each feature binds -------------------------------------------------------


@pytest.mark.parametrize("config", [{"rope_interleave": False},
                                    {"n_group": 1, "topk_group": 1},
                                    {"routed_scaling_factor": 1.0}])
def test_config_features_bind(saved, config):
  harness.check_feature_binds(saved["glm4_moe_lite"], CASES["glm4_moe_lite"], **config)


def test_the_correction_bias_binds(saved):
  harness.check_modules_bind(saved["glm4_moe_lite"], CASES["glm4_moe_lite"],
                             "the routing correction bias", harness.zero_correction_biases)


def test_mlp_layer_types_bind(saved, tmp_path):
  """The dense layers are read where ``mlp_layer_types`` says: the folder
  with the field left out (so transformers' default, the first layer only)
  is refused against its weights, not read with other layers."""
  folder = harness.edited(saved["glm4_moe_lite"].folder, tmp_path,
                          mlp_layer_types=harness.DELETE)
  with pytest.raises(pzp.errors.PzPersistError, match="layers.2.mlp|n_routed_experts|expert"):
    pzp.pretrained.load_hf(folder)


GLM_4_7_FLASH_CONFIG = {
    # The Hub's config.json of zai-org/GLM-4.7-Flash as written before
    # transformers 5 read it (first_k_dense_replace, num_nextn_predict_layers,
    # topk_method, a top-level rope_theta), its sizes shrunk.
    "architectures": ["Glm4MoeLiteForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "pad_token_id": 0, "eos_token_id": [1, 2], "hidden_act": "silu",
    "hidden_size": 32, "intermediate_size": 48, "max_position_embeddings": 202752,
    "model_type": "glm4_moe_lite", "moe_intermediate_size": 16, "topk_method": "noaux_tc",
    "norm_topk_prob": True, "num_attention_heads": 4, "n_group": 1, "topk_group": 1,
    "n_routed_experts": 8, "n_shared_experts": 1, "routed_scaling_factor": 1.8,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_hidden_layers": 3,
    "num_key_value_heads": 4, "num_nextn_predict_layers": 1, "partial_rotary_factor": 1.0,
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 10, "qk_rope_head_dim": 8,
    "v_head_dim": 12, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "tie_word_embeddings": False, "dtype": "bfloat16", "use_cache": True, "vocab_size": 64,
}


def test_the_hubs_glm_4_7_flash_config(tmp_path):
  saved = harness.hub_saved(tmp_path, GLM_4_7_FLASH_CONFIG)
  harness.check_float32(saved, "GLM-4.7-Flash hub")
  pzp.export_hf(pzp.pretrained.load_hf(saved.folder), tmp_path / "out", like=saved.folder)
  harness.assert_same_tensors(harness.tensors(tmp_path / "out"), harness.tensors(saved.folder))
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["first_k_dense_replace"] == 1
  assert written["mlp_layer_types"] == ["dense", "sparse", "sparse"]


@pytest.mark.parametrize("changes, match", [
    ({"num_hidden_layers": 10**9}, "mlp_layer_types|num_hidden_layers"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "dense", "sparse"]}, "mlp_layer_types"),
    ({"first_k_dense_replace": 2}, "first_k_dense_replace"),
    ({"first_k_dense_replace": 1}, "first_k_dense_replace"),  # Layer 2 is dense too.
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"n_routed_experts": 10**9, "n_group": 1}, "n_routed_experts"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"attention_bias": True}, "attention_bias"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  from pz_persist.pretrained.hf.building import latent_decoder  # pylint: disable=import-outside-toplevel

  def no_build(*args, **kwargs):
    raise AssertionError("a skeleton was built before the config was refused")

  monkeypatch.setattr(latent_decoder, "latent_attention", no_build)
  folder = harness.edited(saved["glm4_moe_lite"].folder, tmp_path, **changes)
  with pytest.raises(pzp.errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)
