"""Command R (``model_type`` ``cohere``) through `load_hf` and `export_hf`,
against transformers, with the checks of `hf_family_harness`."""

from __future__ import annotations

import pytest
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as checks


def _case(**fields) -> checks.Case:
  return checks.Case(transformers.CohereConfig, transformers.CohereForCausalLM,
                     {"num_key_value_heads": 2, "logit_scale": 0.5, **fields})


CASES = {
    # Command R's layout: interleaved RoPE in every layer, tied head.
    "cohere": _case(),
    # Command R+'s: per-head query/key LayerNorms; with attention biases, untied.
    "cohere_qk_norm": _case(use_qk_norm=True, attention_bias=True, tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


@pytest.mark.parametrize("case", CASES)
def test_greedy_kv_cache_generation_matches_transformers_generate(saved, case):
  checks.check_generate(saved[case], steps=8)


def test_kv_cache_sampling_matches_the_forward_pass(saved):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved["cohere_qk_norm"].folder))


def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["cohere_qk_norm"], "cohere_qk_norm")


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["cohere_qk_norm"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "cohere", same_fields=(
      "logit_scale", "use_qk_norm", "attention_bias", "tie_word_embeddings",
      "num_key_value_heads"))


@pytest.mark.parametrize("case, off", [
    ("cohere", {"logit_scale": 1.0}),
    ("cohere", {"rope_theta": 10_000.0}),
    ("cohere_qk_norm", {"use_qk_norm": False}),
])
def test_each_feature_binds(saved, case, off):
  try:
    checks.check_feature_binds(saved[case], CASES[case], **off)
  except RuntimeError as e:  # load_state_dict: q_norm / k_norm left unused.
    assert "Unexpected key" in str(e)


def test_the_head_norms_bind(saved):
  """The query norm's per-head weight set to one in transformers moves its logits."""
  def flat(model):
    import torch  # pylint: disable=import-outside-toplevel
    with torch.no_grad():
      model.model.layers[0].self_attn.q_norm.weight.fill_(1.0)
  checks.check_modules_bind(saved["cohere_qk_norm"], CASES["cohere_qk_norm"], "q_norm", flat)


@pytest.mark.parametrize("changes, match", [
    ({"use_qk_norm": 1}, "use_qk_norm"),
    ({"rms_norm_eps": 1e-6}, "rms_norm_eps"),
    ({"logit_scale": -1}, "logit_scale"),
    ({"layer_types": ["sliding_attention"] * 2}, "layer_types"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, changes, match,
                                                              monkeypatch):
  folder = checks.edited(saved["cohere"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  checks.check_cli_export_from_native(saved["cohere_qk_norm"], tmp_path)


@pytest.mark.slow
def test_one_key_value_head_with_head_norms(tmp_path_factory, tmp_path):
  """Multi-query attention (the key norm's weight has one head, kept without
  a head axis) with use_qk_norm: float32, generation and export."""
  case = _case(num_key_value_heads=1, use_qk_norm=True)
  saved = checks.saved_cases(tmp_path_factory, {"cohere_mqa": case})["cohere_mqa"]
  checks.check_float32(saved, "cohere_mqa")
  checks.check_generate(saved, steps=8)
  checks.check_export(saved, tmp_path, "cohere", same_fields=("use_qk_norm",))
