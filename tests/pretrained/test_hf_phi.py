"""Phi-1 / 1.5 / 2 (``model_type`` ``phi``) through `load_hf` and
`export_hf`, against transformers, with the checks of `hf_family_harness`."""

from __future__ import annotations

import pytest
import torch
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as checks


def _case(**fields) -> checks.Case:
  return checks.Case(transformers.PhiConfig, transformers.PhiForCausalLM, fields)


CASES = {
    # transformers' defaults: half the head rotated, gelu_new, an untied head.
    "phi": _case(),
    # Query/key LayerNorms, three quarters rotated, grouped-query attention,
    # exact GELU, a larger epsilon, a tied head.
    "phi_qk": _case(qk_layernorm=True, partial_rotary_factor=0.75, num_key_value_heads=2,
                    hidden_act="gelu", layer_norm_eps=1e-2, tie_word_embeddings=True),
}

_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
           "num_hidden_layers", "qk_layernorm", "hidden_act", "layer_norm_eps",
           "tie_word_embeddings")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["phi_qk"], "phi_qk")


@pytest.mark.parametrize("case", CASES)
def test_kv_cache_matches_the_forward_pass_and_transformers_cache(saved, case):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved[case].folder))
  checks.check_kv_cache_like_transformers(pzp.pretrained.load_hf(saved[case].folder),
                                          saved[case].hf_model)


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_matches_generate(saved, case):
  checks.check_generate(saved[case])


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["phi_qk"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "phi", same_fields=_FIELDS)


def test_partial_rotary_binds(saved):
  checks.check_feature_binds(saved["phi"], CASES["phi"], partial_rotary_factor=1.0)
  checks.check_feature_binds(saved["phi_qk"], CASES["phi_qk"], partial_rotary_factor=0.5)


def test_query_key_layernorms_bind(saved):
  def without(model):
    for layer in model.model.layers:
      layer.self_attn.q_layernorm = torch.nn.Identity()
      layer.self_attn.k_layernorm = torch.nn.Identity()
  checks.check_modules_bind(saved["phi_qk"], CASES["phi_qk"], "q/k LayerNorms", without)


def test_parallel_residual_binds(saved):
  """A sequential block (the MLP reading the attention's output) would
  give other logits: the parallel sum is what transformers computes."""
  def sequential(model):
    for layer in model.model.layers:
      def forward(hidden_states, layer=layer, **kwargs):
        normed = layer.input_layernorm(hidden_states)
        attn, _ = layer.self_attn(hidden_states=normed, **kwargs)
        hidden_states = hidden_states + attn
        return hidden_states + layer.mlp(layer.input_layernorm(hidden_states))
      layer.forward = forward
  checks.check_modules_bind(saved["phi"], CASES["phi"], "the parallel residual", sequential)


@pytest.mark.parametrize("module", ["q_proj", "dense", "fc1", "lm_head"])
def test_each_bias_binds(saved, module):
  def zeroed(model):
    with torch.no_grad():
      for name, param in model.named_parameters():
        if name.endswith(f"{module}.bias"):
          param.zero_()
  checks.check_modules_bind(saved["phi"], CASES["phi"], f"{module} bias", zeroed)


def test_epsilon_and_activation_bind(saved):
  checks.check_feature_binds(saved["phi_qk"], CASES["phi_qk"], layer_norm_eps=1e-5)
  checks.check_feature_binds(saved["phi_qk"], CASES["phi_qk"], hidden_act="relu")


def test_the_hubs_phi_2_config_loads(tmp_path):
  """Phi-2's own ``config.json`` (sizes shrunk, heads 20 wide so that its
  0.4 rotates 8 dimensions, as 32 of 80 there): transformers 4's spelling
  (top-level ``partial_rotary_factor`` and ``rope_theta``, a null
  ``rope_scaling``), dropouts that change nothing at inference."""
  hub = {"architectures": ["PhiForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
         "embd_pdrop": 0.0, "eos_token_id": 2, "hidden_act": "gelu_new",
         "initializer_range": 0.3, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
         "model_type": "phi", "partial_rotary_factor": 0.4, "qk_layernorm": False,
         "resid_pdrop": 0.1, "rope_scaling": None, "rope_theta": 10000.0,
         "tie_word_embeddings": False, "torch_dtype": "float32",
         "transformers_version": "4.37.0", "use_cache": True,
         **checks.TINY, "hidden_size": 80, "num_key_value_heads": 4}
  saved = checks.hub_saved(tmp_path, hub)
  checks.check_float32(saved, "phi-2 hub config")
  checks.check_generate(saved)


@pytest.mark.parametrize("changes, match", [
    ({"head_dim": 16}, "head_dim"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_type"),
    ({"hidden_act": "quick_gelu"}, "hidden_act"),
    ({"qk_layernorm": "yes"}, "qk_layernorm"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"layer_norm_eps": -1.0}, "layer_norm_eps"),
    ({"resid_pdrop": "high"}, "resid_pdrop"),
    ({"phi_new_feature": 1}, "phi_new_feature"),
])
def test_hostile_configs_are_refused(saved, tmp_path, changes, match, monkeypatch):
  folder = checks.edited(saved["phi"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)
