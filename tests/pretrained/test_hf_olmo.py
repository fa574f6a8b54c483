"""OLMo 2 and OLMo 3 (``model_type`` ``olmo2``, ``olmo3``) through `load_hf`
and `export_hf`, against transformers, with the checks of `hf_family_harness`."""

from __future__ import annotations

import pytest
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks

CASES = {
    # Grouped-query attention: the key norm spans 2 heads, the query norm 4.
    "olmo2": checks.Case(transformers.Olmo2Config, transformers.Olmo2ForCausalLM,
                         {"num_key_value_heads": 2}),
    # Multi-head (a "heads" axis), biases on every projection, tied embeddings.
    "olmo2_bias_tied": checks.Case(transformers.Olmo2Config, transformers.Olmo2ForCausalLM,
                                   {"attention_bias": True, "tie_word_embeddings": True}),
    # Multi-query: the key norm has no head axis.
    "olmo2_mqa": checks.Case(transformers.Olmo2Config, transformers.Olmo2ForCausalLM,
                             {"num_key_value_heads": 1}),
    # Layer 0 slides through a 3-token window, layer 1 attends globally
    # with YaRN; each layer type has its own base.
    "olmo3": checks.Case(transformers.Olmo3Config, transformers.Olmo3ForCausalLM, {
        "num_key_value_heads": 2, "sliding_window": 3,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                               "original_max_position_embeddings": 4}}}),
    # transformers' defaults: every fourth layer global, base 500,000.
    "olmo3_default_types": checks.Case(transformers.Olmo3Config, transformers.Olmo3ForCausalLM,
                                       {"num_hidden_layers": 4, "sliding_window": 2}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


@pytest.mark.parametrize("case", [
    "olmo2", pytest.param("olmo3", marks=pytest.mark.slow)])
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved, case):
  checks.check_bfloat16(saved[case], case)


@pytest.mark.parametrize("case", [
    "olmo2", pytest.param("olmo3_default_types", marks=pytest.mark.slow)])
def test_kv_cache_sampling_matches_the_forward_pass(saved, case):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved[case].folder))


@pytest.mark.parametrize("case", ["olmo2_bias_tied", "olmo3"])
def test_save_model_round_trip(saved, tmp_path, case):
  checks.check_save_model(saved[case], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  model_type = case.split("_")[0]
  checks.check_export(saved[case], tmp_path, model_type,
                      same_fields=("attention_bias", "tie_word_embeddings", "layer_types",
                                   "sliding_window", "rope_parameters"))


def _identity(*names: str):
  def edit(model):
    for layer in model.model.layers:
      for name in names:
        owner, _, attr = name.rpartition(".")
        setattr(layer.get_submodule(owner) if owner else layer, attr, torch.nn.Identity())
  return edit


@pytest.mark.parametrize("what", ["self_attn.q_norm", "self_attn.k_norm",
                                  "post_attention_layernorm", "post_feedforward_layernorm"])
def test_each_norm_binds(saved, what):
  checks.check_modules_bind(saved["olmo2"], CASES["olmo2"], what, _identity(what))


def test_norm_labels_and_axes(saved):
  params = {p.label: p.value for p in pz.unbind_params(
      pzp.pretrained.load_hf(saved["olmo2"].folder))[1]}
  assert dict(params["transformer/block_1/attention/query_norm/scale.weights"].named_shape) == {
      "head_groups": 2, "query_heads": 2, "projection": 8}
  assert dict(params["transformer/block_1/attention/key_norm/scale.weights"].named_shape) == {
      "head_groups": 2, "projection": 8}
  assert "transformer/block_0/post_ffw_norm/scale.weights" in params
  assert not [label for label in params if "pre_" in label]


@pytest.mark.parametrize("changes, match", [
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"olmo_new_feature": 1}, "olmo_new_feature"),
])
def test_hostile_olmo2_configs_are_refused(saved, tmp_path, changes, match, monkeypatch):
  folder = checks.edited(saved["olmo2"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)


def test_olmo3_kv_cache_with_yarn_matches_transformers(saved):
  case = saved["olmo3"]
  checks.check_kv_cache_like_transformers(pzp.pretrained.load_hf(case.folder), case.hf_model)


def test_olmo3_windows_and_per_type_rope_bind(saved):
  case, params = CASES["olmo3"], CASES["olmo3"].fields["rope_parameters"]
  checks.check_feature_binds(saved["olmo3"], case,
                             layer_types=["full_attention", "full_attention"])
  checks.check_feature_binds(saved["olmo3"], case, rope_parameters=dict(
      params, full_attention={"rope_type": "default", "rope_theta": 500000.0}))
  checks.check_feature_binds(saved["olmo3"], case, rope_parameters=dict(
      params, sliding_attention={"rope_type": "default", "rope_theta": 500000.0}))


def test_olmo3_config_of_transformers_4_loads(saved, tmp_path):
  """As the Hub's OLMo 3 configs: ``rope_theta`` and
  ``rope_scaling`` (YaRN) for the full-attention layers only (transformers
  gives the sliding ones the default base)."""
  yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4,
          "attention_factor": 1.2, "beta_fast": 32, "beta_slow": 1}
  folder = checks.edited(saved["olmo2"].folder, tmp_path, model_type="olmo3",
                         architectures=["Olmo3ForCausalLM"], rope_parameters=checks.DELETE,
                         rope_theta=20000.0, rope_scaling=yarn, sliding_window=3,
                         layer_types=["sliding_attention", "full_attention"])
  hf = transformers.Olmo3ForCausalLM.from_pretrained(folder).eval()
  assert hf.config.rope_parameters["full_attention"]["rope_type"] == "yarn"
  checks.check_float32(checks.Saved(folder, hf, checks.reference_logits(hf)), "olmo3 legacy")


@pytest.mark.parametrize("changes, match", [
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"sliding_window": None}, "sliding_window.*null"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters"),
    ({"rope_parameters": {"full_attention": {"rope_type": "longrope"}}}, "rope_type"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": -1}}},
     "rope_theta"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_hostile_olmo3_configs_are_refused(saved, tmp_path, changes, match, monkeypatch):
  folder = checks.edited(saved["olmo3"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)


_OLMO2_7B = {  # allenai/OLMo-2-1124-7B, shrunk.
    "architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 4096,
    "model_type": "olmo2", "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 500000,
    "tie_word_embeddings": False, "torch_dtype": "float32",
    "transformers_version": "4.47.0.dev0", "use_cache": True, **checks.TINY}

_OLMO3_7B = {  # allenai/Olmo-3-7B-Instruct, shrunk to 4 layers (one global).
    **_OLMO2_7B, "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3",
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "max_position_embeddings": 65536,
    "rope_scaling": {"attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1,
                     "factor": 8.0, "original_max_position_embeddings": 4, "rope_type": "yarn"},
    "sliding_window": 3, "num_hidden_layers": 4, "transformers_version": "4.57.0"}


@pytest.mark.parametrize("name, hub", [("OLMo-2-1124-7B", _OLMO2_7B),
                                       ("Olmo-3-7B", _OLMO3_7B)])
def test_hub_configs(tmp_path, name, hub):
  checks.check_float32(checks.hub_saved(tmp_path, hub), name)


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  checks.check_cli_export_from_native(saved["olmo3"], tmp_path)


def test_bfloat16_export_is_bit_for_bit(tmp_path):
  checks.check_bfloat16_export(CASES["olmo2"], tmp_path)
