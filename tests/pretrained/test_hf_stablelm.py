"""StableLM 2 / StableLM-3B (``model_type`` ``stablelm``) through `load_hf`
and `export_hf`, against transformers, with the checks of
`hf_family_harness`."""

from __future__ import annotations

import pytest
import torch
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as checks


def _case(**fields) -> checks.Case:
  return checks.Case(transformers.StableLmConfig, transformers.StableLmForCausalLM, fields)


CASES = {
    # StableLM 2 1.6B's layout: sequential blocks, a quarter of each head
    # rotated, no biases (the key/value heads are a size: 32 by default).
    "stablelm": _case(num_key_value_heads=4),
    # StableLM 2 12B's: parallel blocks on one LayerNorm, per-head query/key
    # LayerNorms, query/key/value biases, grouped-query attention; here also
    # half rotated, a tied head, a larger epsilon and the tanh GELU.
    "stablelm_12b": _case(use_parallel_residual=True, qk_layernorm=True, use_qkv_bias=True,
                          num_key_value_heads=2, partial_rotary_factor=0.5,
                          tie_word_embeddings=True, layer_norm_eps=1e-2,
                          hidden_act="gelu_pytorch_tanh"),
}

_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
           "num_hidden_layers", "use_qkv_bias", "qk_layernorm", "use_parallel_residual",
           "hidden_act", "layer_norm_eps", "tie_word_embeddings")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["stablelm_12b"], "stablelm_12b")


@pytest.mark.parametrize("case", CASES)
def test_kv_cache_matches_the_forward_pass_and_transformers_cache(saved, case):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved[case].folder))
  checks.check_kv_cache_like_transformers(pzp.pretrained.load_hf(saved[case].folder),
                                          saved[case].hf_model)


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_matches_generate(saved, case):
  checks.check_generate(saved[case])


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["stablelm_12b"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "stablelm", same_fields=_FIELDS)


def test_partial_rotary_binds(saved):
  checks.check_feature_binds(saved["stablelm"], CASES["stablelm"], partial_rotary_factor=1.0)
  checks.check_feature_binds(saved["stablelm_12b"], CASES["stablelm_12b"],
                             partial_rotary_factor=0.25)


def test_query_key_layernorms_bind(saved):
  def without(model):
    for layer in model.model.layers:
      layer.self_attn.q_layernorm = torch.nn.Identity()
      layer.self_attn.k_layernorm = torch.nn.Identity()
  checks.check_modules_bind(saved["stablelm_12b"], CASES["stablelm_12b"], "q/k LayerNorms",
                            without)


def test_each_head_has_its_own_layernorm(saved):
  """Every head's norm made head 0's changes the logits: one norm shared by
  the heads (Phi's) would not be StableLM's."""
  def shared(model):
    with torch.no_grad():
      for layer in model.model.layers:
        for norms in (layer.self_attn.q_layernorm.norms, layer.self_attn.k_layernorm.norms):
          for norm in norms[1:]:
            norm.weight.copy_(norms[0].weight)
  checks.check_modules_bind(saved["stablelm_12b"], CASES["stablelm_12b"],
                            "per-head norms", shared)


def test_parallel_residual_binds(saved):
  """The same weights in sequential blocks (the MLP reading the attention's
  output through the same LayerNorm) give other logits."""
  def sequential(model):
    for layer in model.model.layers:
      layer.use_parallel_residual = False
      layer.post_attention_layernorm = layer.input_layernorm
  checks.check_modules_bind(saved["stablelm_12b"], CASES["stablelm_12b"],
                            "the parallel residual", sequential)


def test_query_key_value_biases_bind(saved):
  def zeroed(model):
    with torch.no_grad():
      for layer in model.model.layers:
        layer.self_attn.k_proj.bias.zero_()
        layer.self_attn.v_proj.bias.zero_()
  checks.check_modules_bind(saved["stablelm_12b"], CASES["stablelm_12b"], "k/v biases", zeroed)


def test_epsilon_and_activation_bind(saved):
  checks.check_feature_binds(saved["stablelm_12b"], CASES["stablelm_12b"], layer_norm_eps=1e-5)
  checks.check_feature_binds(saved["stablelm_12b"], CASES["stablelm_12b"], hidden_act="silu")


def test_the_hubs_stablelm_2_12b_config_loads(tmp_path):
  """StableLM 2 12B's own ``config.json`` (sizes shrunk): transformers 4's
  spelling (top-level ``partial_rotary_factor``, an integer ``rope_theta``),
  parallel blocks and per-head query/key norms."""
  hub = {"architectures": ["StableLmForCausalLM"], "attention_dropout": 0.0,
         "hidden_act": "silu", "hidden_dropout": 0.0, "initializer_range": 0.3,
         "layer_norm_eps": 1e-05, "max_position_embeddings": 4096, "model_type": "stablelm",
         "partial_rotary_factor": 0.25, "qk_layernorm": True, "rope_theta": 10000,
         "tie_word_embeddings": False, "torch_dtype": "float32",
         "transformers_version": "4.40.0", "use_cache": True, "use_parallel_residual": True,
         "use_qkv_bias": False, **checks.TINY}
  saved = checks.hub_saved(tmp_path, hub)
  checks.check_float32(saved, "stablelm 2 12b hub config")
  checks.check_generate(saved)


@pytest.mark.parametrize("changes, match", [
    ({"head_dim": 16}, "head_dim"),
    ({"num_attention_heads": 5, "num_key_value_heads": 5}, "num_attention_heads"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_parallel_residual": "yes"}, "use_parallel_residual"),
    ({"use_qkv_bias": 1}, "use_qkv_bias"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"stablelm_new_feature": 1}, "stablelm_new_feature"),
])
def test_hostile_configs_are_refused(saved, tmp_path, changes, match, monkeypatch):
  folder = checks.edited(saved["stablelm"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)
