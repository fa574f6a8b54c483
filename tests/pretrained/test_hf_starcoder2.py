"""StarCoder2 (``model_type`` ``starcoder2``) through `load_hf` and
`export_hf`, against transformers, with the checks of `hf_family_harness`."""

from __future__ import annotations

import pytest
import torch
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as checks


def _case(**fields) -> checks.Case:
  return checks.Case(transformers.Starcoder2Config, transformers.Starcoder2ForCausalLM, fields)


CASES = {
    # transformers' defaults: biases everywhere, 2 key/value heads, a tied
    # head, the tanh GELU, global attention.
    "starcoder2": _case(),
    # A 3-token window on every layer (shorter than the sequences), no
    # biases, one key/value head, wider heads (head_dim), exact GELU, an
    # untied head, a larger epsilon.
    "starcoder2_window": _case(sliding_window=3, use_bias=False, num_key_value_heads=1,
                               head_dim=16, hidden_act="gelu", tie_word_embeddings=False,
                               norm_epsilon=1e-2),
}

_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
           "num_hidden_layers", "head_dim", "use_bias", "sliding_window", "norm_epsilon",
           "tie_word_embeddings")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["starcoder2"], "starcoder2")


@pytest.mark.parametrize("case", CASES)
def test_kv_cache_matches_the_forward_pass_and_transformers_cache(saved, case):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved[case].folder))
  checks.check_kv_cache_like_transformers(pzp.pretrained.load_hf(saved[case].folder),
                                          saved[case].hf_model)


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_matches_generate(saved, case):
  checks.check_generate(saved[case])


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["starcoder2_window"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "starcoder2", same_fields=_FIELDS)


def test_sliding_window_binds(saved):
  checks.check_feature_binds(saved["starcoder2_window"], CASES["starcoder2_window"],
                             sliding_window=None)


@pytest.mark.parametrize("module", ["q_proj", "o_proj", "c_fc", "c_proj"])
def test_each_bias_binds(saved, module):
  def zeroed(model):
    with torch.no_grad():
      for name, param in model.named_parameters():
        if name.endswith(f"{module}.bias"):
          param.zero_()
  checks.check_modules_bind(saved["starcoder2"], CASES["starcoder2"], f"{module} bias", zeroed)


def test_sequential_blocks_bind(saved):
  """The same weights in a parallel block (both branches reading the first
  LayerNorm) give other logits: the MLP reads the attention's output."""
  def parallel(model):
    for layer in model.model.layers:
      def forward(hidden_states, layer=layer, **kwargs):
        normed = layer.input_layernorm(hidden_states)
        attn, _ = layer.self_attn(hidden_states=normed, **kwargs)
        return hidden_states + attn + layer.mlp(layer.post_attention_layernorm(hidden_states))
      layer.forward = forward
  checks.check_modules_bind(saved["starcoder2"], CASES["starcoder2"], "sequential blocks",
                            parallel)


def test_epsilon_and_activation_bind(saved):
  checks.check_feature_binds(saved["starcoder2_window"], CASES["starcoder2_window"],
                             norm_epsilon=1e-5)
  checks.check_feature_binds(saved["starcoder2_window"], CASES["starcoder2_window"],
                             hidden_act="relu")


def test_the_hubs_config_loads(tmp_path):
  """StarCoder2-15B's own ``config.json`` (sizes shrunk): the fields the
  Hub's folders carry from before transformers' StarCoder2 (``mlp_type``,
  ``norm_type``, ``rms_norm_eps``), which transformers does not read, are
  accepted; a 4096-token window, ``rope_theta`` 100000."""
  hub = {"architectures": ["Starcoder2ForCausalLM"], "attention_dropout": 0.0,
         "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu_pytorch_tanh",
         "initializer_range": 0.3, "max_position_embeddings": 16384, "mlp_type": "default",
         "model_type": "starcoder2", "norm_epsilon": 1e-05, "norm_type": "layer_norm",
         "rms_norm_eps": 1e-05, "rope_theta": 100000, "sliding_window": 4096,
         "tie_word_embeddings": False, "torch_dtype": "float32",
         "transformers_version": "4.37.0.dev0", "use_bias": True, "use_cache": True,
         **checks.TINY}
  saved = checks.hub_saved(tmp_path, hub)
  checks.check_float32(saved, "starcoder2 hub config")


@pytest.mark.parametrize("changes, match", [
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_type"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"use_bias": "yes"}, "use_bias"),
    ({"hidden_act": "quick_gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"norm_epsilon": -1.0}, "norm_epsilon"),
    ({"layer_norm_eps": 1e-5}, "layer_norm_eps"),
    ({"starcoder2_new_feature": 1}, "starcoder2_new_feature"),
])
def test_hostile_configs_are_refused(saved, tmp_path, changes, match, monkeypatch):
  folder = checks.edited(saved["starcoder2"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)
