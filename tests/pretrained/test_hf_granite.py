"""Granite 3 (``model_type`` ``granite``) through `load_hf` and `export_hf`,
against transformers, with the checks of `hf_family_harness`."""

from __future__ import annotations

import pytest
import transformers
import treescope
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.nn.constant_scale import ConstantScale
from pz_persist.pretrained import errors

_SCALES = {"embedding_multiplier": 2.5, "residual_multiplier": 0.6, "attention_multiplier": 0.2,
               "logits_scaling": 1.7}

CASES = {
    "granite": checks.Case(transformers.GraniteConfig, transformers.GraniteForCausalLM,
                           dict(num_key_value_heads=2, **_SCALES)),
    # Multi-head, tied embeddings, Llama's biases, a multiplier with 17 digits.
    "granite_tied_bias": checks.Case(transformers.GraniteConfig, transformers.GraniteForCausalLM,
                                     dict(_SCALES, tie_word_embeddings=True, attention_bias=True,
                                          mlp_bias=True, attention_multiplier=0.08838834764831845)),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["granite"], "granite")


def test_kv_cache_sampling_matches_the_forward_pass(saved):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved["granite"].folder))


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["granite_tied_bias"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "granite", same_fields=(*_SCALES, "attention_bias",
                                                                    "tie_word_embeddings"))


@pytest.mark.parametrize("field", list(_SCALES))
def test_each_multiplier_binds(saved, field):
  checks.check_feature_binds(saved["granite"], CASES["granite"], **{field: 1.0})


def test_the_constants_are_layers_holding_the_config_numbers(saved):
  model = pzp.pretrained.load_hf(saved["granite_tied_bias"].folder)
  scales = [layer.by for layer in pz.select(model).at_instances_of(ConstantScale).get_sequence()]
  # Embedding, per block: query, two residual branches; logits.
  assert scales[0] == 2.5 and scales[-1] == 1.7
  assert 0.08838834764831845 in scales and scales.count(0.6) == 4


@pytest.mark.parametrize("changes, match", [
    ({"embedding_multiplier": -1.0}, "embedding_multiplier"),
    ({"logits_scaling": 0}, "logits_scaling"),
    ({"residual_multiplier": "0.2"}, "residual_multiplier"),
    ({"attention_multiplier": True}, "attention_multiplier"),
    ({"attention_multiplier": float("inf")}, "attention_multiplier"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"granite_new_feature": 1}, "granite_new_feature"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, changes, match,
                                                              monkeypatch):
  folder = checks.edited(saved["granite"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)


_GRANITE_33_2B = {  # ibm-granite/granite-3.3-2b-instruct, shrunk.
    "architectures": ["GraniteForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attention_multiplier": 0.015625, "embedding_multiplier": 12.0, "hidden_act": "silu",
    "initializer_range": 0.02, "logits_scaling": 8.0, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "granite", "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.49.0",
    "use_cache": True, **checks.TINY}


def test_hub_config(tmp_path):
  checks.check_float32(checks.hub_saved(tmp_path, _GRANITE_33_2B), "granite-3.3-2b")


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  checks.check_cli_export_from_native(saved["granite_tied_bias"], tmp_path)


def test_a_granite_model_without_its_query_scale_is_refused(saved, tmp_path):
  """Its query scaling swapped back to Penzai's: named, nothing written."""
  model = pzp.pretrained.load_hf(saved["granite"].folder)
  edited = (pz.select(model).at_instances_of(pz.nn.Attention).at(lambda a: a.input_to_query)
            .at_instances_of(ConstantScale).apply(lambda s: pz.nn.ConstantRescale(by=s.by)))
  with pytest.raises(errors.ExportError, match="ConstantScale in the query projection"):
    pzp.export_hf(edited, tmp_path / "out")
  assert not (tmp_path / "out").exists()


def test_constant_scale_renders_in_treescope(saved):
  text = treescope.render_to_text(pzp.pretrained.load_hf(saved["granite"].folder))
  assert "ConstantScale(by=2.5" in text and "divide=True" in text
