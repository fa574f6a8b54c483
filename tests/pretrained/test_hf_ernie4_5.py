"""ERNIE 4.5 dense (``model_type`` ``ernie4_5``) against transformers, with
the checks of `hf_family_harness`: RoPE on adjacent pairs, ``use_bias`` on
every projection."""

from __future__ import annotations

import pytest
import torch
import transformers
from penzai import pz
from transformers.models.ernie4_5 import modeling_ernie4_5
from transformers.models.llama import modeling_llama

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.nn.llama4_attention import ApplyInterleavedRoPE


def _case(**fields):
  return checks.Case(transformers.Ernie4_5Config, transformers.Ernie4_5ForCausalLM,
                     dict({"num_key_value_heads": 2, "head_dim": 8}, **fields))


CASES = {
    "ernie4_5": _case(),  # Tied, as ERNIE 4.5 0.3B.
    # Biases everywhere, untied head, yarn-scaled RoPE.
    "ernie4_5_biases": _case(use_bias=True, tie_word_embeddings=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 500_000.0, "factor": 4.0,
        "original_max_position_embeddings": 4}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


def test_every_block_rotates_adjacent_pairs(saved):
  model = pzp.pretrained.load_hf(saved["ernie4_5"].folder)
  assert len(pz.select(model).at_instances_of(ApplyInterleavedRoPE).get_sequence()) == 4


@pytest.mark.parametrize("case", CASES)
def test_kv_cache_and_greedy_generation_match_transformers(saved, case):
  checks.check_cached_decoding(saved[case])


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "ernie4_5",
                      same_fields=("use_bias", "tie_word_embeddings", "head_dim"))


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["ernie4_5_biases"], tmp_path)


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["ernie4_5"], "ernie4_5")


def test_adjacent_pairs_bind(saved, monkeypatch):
  """With Llama's rotation of halves, transformers' logits move beyond the
  tolerance: a loader rotating halves would fail the float32 check."""
  monkeypatch.setattr(modeling_ernie4_5, "apply_rotary_pos_emb",
                      modeling_llama.apply_rotary_pos_emb)
  checks.check_modules_bind(saved["ernie4_5"], CASES["ernie4_5"], "adjacent-pair RoPE",
                            lambda model: None)


def test_use_bias_binds(saved):
  checks.check_modules_bind(saved["ernie4_5_biases"], CASES["ernie4_5_biases"],
                            "the biases", _zero_biases)


def _zero_biases(model):
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith(".bias"):
        param.zero_()


@pytest.mark.parametrize("changes, match", [
    ({"use_bias": "yes"}, "use_bias must be true or false"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "relu"}, "hidden_act"),
])
def test_hostile_configs_are_refused_before_building(saved, tmp_path, monkeypatch, changes,
                                                     match):
  checks.check_refused_before_building(
      checks.edited(saved["ernie4_5_biases"].folder, tmp_path, **changes), match, monkeypatch)
