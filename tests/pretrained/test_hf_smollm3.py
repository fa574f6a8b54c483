"""SmolLM3 (``model_type`` ``smollm3``) through `load_hf` and `export_hf`,
against transformers, with the checks of `hf_family_harness`."""

from __future__ import annotations

import pytest
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.nn.scaled_rope import ApplyScaledRoPE


def _case(**fields):
  return checks.Case(transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, fields)


CASES = {
    # Layer 1 without RoPE; tied embeddings (SmolLM3's default).
    "smollm3": _case(num_key_value_heads=2, no_rope_layers=[1, 0]),
    # Windows on the layers without RoPE (transformers' layer_types from
    # no_rope_layers), untied, Llama's biases.
    "smollm3_window": _case(num_hidden_layers=3, no_rope_layers=[0, 1, 0], use_sliding_window=True,
                            sliding_window=3, tie_word_embeddings=False, attention_bias=True),
    # The default pattern (every 4th layer without RoPE) with a scaled RoPE.
    "smollm3_interval_yarn": _case(num_hidden_layers=4, num_key_value_heads=1, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 4}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["smollm3_window"], "smollm3_window")


@pytest.mark.parametrize("case", [
    "smollm3_window", pytest.param("smollm3_interval_yarn", marks=pytest.mark.slow)])
def test_kv_cache_sampling_matches_the_forward_pass(saved, case):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved[case].folder))


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["smollm3_interval_yarn"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "smollm3",
                      same_fields=("no_rope_layers", "layer_types", "tie_word_embeddings",
                                   "attention_bias", "rope_parameters"))


def test_layers_without_rope_bind(saved):
  checks.check_feature_binds(saved["smollm3"], CASES["smollm3"], no_rope_layers=[1, 1])


def test_windows_bind(saved):
  checks.check_feature_binds(saved["smollm3_window"], CASES["smollm3_window"],
                             use_sliding_window=False, layer_types=None)


def test_rope_layers_where_no_rope_layers_says(saved):
  model = pzp.pretrained.load_hf(saved["smollm3_interval_yarn"].folder)
  blocks = pz.select(model).at_instances_of(pz.nn.Residual).get_sequence()[::2]
  assert [len(pz.select(b).at_instances_of(ApplyScaledRoPE).get_sequence()) for b in blocks] == [
      2, 2, 2, 0]


def test_smollm3_defaults_apply_to_absent_fields(saved, tmp_path):
  """No ``rope_parameters`` and no ``tie_word_embeddings``: transformers'
  SmolLM3 defaults (base 2,000,000, tied), not Llama's."""
  folder = checks.edited(saved["smollm3"].folder, tmp_path, rope_parameters=checks.DELETE,
                         tie_word_embeddings=checks.DELETE)
  hf = transformers.SmolLM3ForCausalLM.from_pretrained(folder).eval()
  assert hf.config.rope_parameters["rope_theta"] == 2_000_000.0
  checks.check_float32(checks.Saved(folder, hf, checks.reference_logits(hf)), "defaults")


@pytest.mark.parametrize("changes, match", [
    ({"no_rope_layers": [1]}, "no_rope_layers"),
    ({"no_rope_layers": [1, 2]}, "no_rope_layers"),
    ({"no_rope_layers": [1.0, 0.0]}, "no_rope_layers"),
    ({"no_rope_layer_interval": 0}, "no_rope_layer_interval"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
    ({"num_hidden_layers": 10**9, "no_rope_layers": checks.DELETE}, "num_hidden_layers"),
    ({"smollm_new_feature": 1}, "smollm_new_feature"),
])
def test_hostile_configs_are_refused(saved, tmp_path, changes, match, monkeypatch):
  folder = checks.edited(saved["smollm3"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)


_SMOLLM3_3B = {  # HuggingFaceTB/SmolLM3-3B, shrunk to 4 layers.
    "architectures": ["SmolLM3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "initializer_range": 0.02, "layer_types": ["full_attention"] * 4,
    "max_position_embeddings": 65536, "max_window_layers": 28, "mlp_bias": False,
    "model_type": "smollm3", "no_rope_layer_interval": 4, "no_rope_layers": [1, 1, 1, 0],
    "pretraining_tp": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 5000000.0,
    "sliding_window": None, "torch_dtype": "bfloat16", "transformers_version": "4.54.0.dev0",
    "use_cache": False, "use_sliding_window": False, **checks.TINY, "num_hidden_layers": 4}


def test_hub_config(tmp_path):
  checks.check_float32(checks.hub_saved(tmp_path, _SMOLLM3_3B), "SmolLM3-3B")


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  checks.check_cli_export_from_native(saved["smollm3"], tmp_path)
