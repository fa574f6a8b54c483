"""GLM-4.5 (``glm4_moe``) through `load_hf` and `export_hf`, against
transformers' own Glm4MoeForCausalLM on tiny random models (no downloads).

GLM-4.5 is Llama's attention with query/key/value biases, optional
query/key norms and RoPE on half of each head, and DeepSeek-V3's experts
after its dense first layers; each addition is shown to bind.
"""

from __future__ import annotations

import numpy as np
import pytest
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as harness

_SIZES = {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "n_routed_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 3}

CASES = {
    # Query/key norms, q/k/v biases, half-rotary heads, groups, one dense layer.
    "glm4_moe": harness.Case(transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM,
                             {**_SIZES, "use_qk_norm": True, "attention_bias": True,
                              "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                              "routed_scaling_factor": 2.5}),
    # No norms or biases, a quarter of each head rotated, two dense layers.
    "glm4_moe_plain": harness.Case(transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM,
                                   {**_SIZES, "first_k_dense_replace": 2, "norm_topk_prob": False,
                                    "rope_parameters": {"rope_type": "default",
                                                        "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.25}}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return harness.saved_biased_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_float32_logits_match_transformers(saved, name):
  harness.check_float32(saved[name], name)


def test_kv_cache_sampling_matches_a_forward_pass(saved):
  harness.check_kv_cache(pzp.pretrained.load_hf(saved["glm4_moe"].folder))


def test_save_model_round_trip(saved, tmp_path):
  harness.check_save_model(saved["glm4_moe_plain"], tmp_path)


@pytest.mark.parametrize("name", list(CASES))
def test_export_gives_back_the_folder(saved, tmp_path, name):
  harness.check_export(saved[name], tmp_path, "glm4_moe",
                       same_fields=("use_qk_norm", "attention_bias", "first_k_dense_replace",
                                    "n_group", "topk_group", "routed_scaling_factor"))


def _changed(saved_case: harness.Saved, case: harness.Case, **config) -> float:
  model = case.model_cls(case.config(**config))
  model.load_state_dict(saved_case.hf_model.state_dict())
  changed = float(np.abs(harness.reference_logits(model.eval()) - saved_case.reference).max())
  assert changed > 100 * harness.TOLERANCE["atol"], changed
  return changed


@pytest.mark.parametrize("what, config", [
    ("partial rotary (all rotated)", {"rope_parameters": {"rope_type": "default",
                                                         "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 1.0}}),
    ("group-limited routing", {"n_group": 1, "topk_group": 1}),
    ("routed scaling", {"routed_scaling_factor": 1.0}),
])
def test_features_bind(saved, what, config):
  print(f"without {what}: logits change by"
        f" {_changed(saved['glm4_moe'], CASES['glm4_moe'], **config):.3g}")


GLM_4_5_AIR_CONFIG = {
    # The Hub's config.json of zai-org/GLM-4.5-Air (transformers 4.54: top-level
    # partial_rotary_factor, rope_theta, rope_scaling null), its sizes shrunk.
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 0, "eos_token_id": [1, 2], "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 32, "partial_rotary_factor": 0.5, "initializer_range": 0.02,
    "intermediate_size": 48, "max_position_embeddings": 131072, "model_type": "glm4_moe",
    "moe_intermediate_size": 16, "norm_topk_prob": True, "num_attention_heads": 4,
    "n_group": 1, "topk_group": 1, "n_routed_experts": 8, "n_shared_experts": 1,
    "routed_scaling_factor": 1.0, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.54.0",
    "use_cache": True, "use_qk_norm": False, "vocab_size": 64,
}


def test_the_hubs_glm_4_5_air_config(tmp_path):
  saved = harness.hub_saved(tmp_path, GLM_4_5_AIR_CONFIG)
  harness.check_float32(saved, "GLM-4.5-Air hub")
  pzp.export_hf(pzp.pretrained.load_hf(saved.folder), tmp_path / "out", like=saved.folder)
  harness.assert_same_tensors(harness.tensors(tmp_path / "out"), harness.tensors(saved.folder))


@pytest.mark.parametrize("changes, match", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"partial_rotary_factor": 0.25}, "partial_rotary_factor"),  # Besides rope_parameters' 0.5.
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                          "original_max_position_embeddings": 16,
                          "partial_rotary_factor": 0.5}}, "rope_type"),
    ({"n_routed_experts": 10**9, "n_group": 1}, "n_routed_experts"),
    ({"n_group": 3}, "n_group"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"use_qk_norm": "yes"}, "use_qk_norm"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  folder = harness.edited(saved["glm4_moe"].folder, tmp_path, **changes)
  harness.check_refused_before_building(folder, match, monkeypatch)

