"""ERNIE 4.5 MoE (``model_type`` ``ernie4_5_moe``) against transformers, with
the checks of `hf_family_harness`: experts from ``moe_layer_start_index``
every ``moe_layer_interval`` layers, softmax routing chosen with
``e_score_correction_bias``, shared experts, adjacent-pair RoPE."""

from __future__ import annotations

import pytest
import torch
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.pretrained.hf.building import moe as moe_building


def _case(**fields):
  return checks.Case(transformers.Ernie4_5_MoeConfig, transformers.Ernie4_5_MoeForCausalLM,
                     dict({"num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 4,
                           "moe_intermediate_size": 16, "moe_num_experts": 4, "moe_k": 2,
                           "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
                           "moe_layer_interval": 1}, **fields))


CASES = {
    # Layer 0 dense, 1-3 experts (the Hub's start index 1).
    "ernie4_5_moe": _case(),
    # Experts on layers 1 and 3 only, one shared expert, untied head.
    "ernie4_5_moe_interval": _case(moe_layer_interval=2, moe_num_shared_experts=1,
                                   tie_word_embeddings=False),
}


def _with_correction_bias(model):
  """A correction bias large enough to change which experts are chosen."""
  torch.manual_seed(2)
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith("e_score_correction_bias"):
        param.copy_(torch.randn(param.shape) * 0.5)
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  result = {}
  for name, case in CASES.items():
    model = _with_correction_bias(case.make())
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder, safe_serialization=True)
    result[name] = checks.Saved(folder, model, checks.reference_logits(model))
  return result


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


@pytest.mark.parametrize("case", CASES)
def test_kv_cache_and_greedy_generation_match_transformers(saved, case):
  checks.check_cached_decoding(saved[case])


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "ernie4_5_moe", same_fields=(
      "moe_layer_start_index", "moe_layer_interval", "moe_num_shared_experts"))


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["ernie4_5_moe"], tmp_path)


def _zero_correction_bias(model):
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith("e_score_correction_bias"):
        param.zero_()


def _no_shared_experts(model):
  for layer in model.model.layers:
    if hasattr(layer.mlp, "shared_experts"):
      layer.mlp.shared_experts = None


@pytest.mark.parametrize("what, edit", [
    ("the correction bias", _zero_correction_bias),
    ("the shared experts", _no_shared_experts),
])
def test_each_feature_binds(saved, what, edit):
  checks.check_modules_bind(saved["ernie4_5_moe"], CASES["ernie4_5_moe"], what, edit)


@pytest.mark.parametrize("case, placed", [
    ("ernie4_5_moe", [False, True, True, True]),
    ("ernie4_5_moe_interval", [False, True, False, True]),
])
def test_experts_are_placed_as_transformers_places_them(saved, case, placed):
  """Start index and interval bind: the blocks with experts are transformers'
  (a loader taking every layer from 0 would look for experts the folder
  lacks, or drop the dense MLP of layer 0)."""
  assert [hasattr(layer.mlp, "experts") for layer in saved[case].hf_model.model.layers] == placed
  found = moe_building.mixtures(pzp.pretrained.load_hf(saved[case].folder))
  assert [layer is not None for layer in found] == placed


@pytest.mark.parametrize("changes, match", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"moe_num_experts": 10**9}, "moe_num_experts.*holds experts 0..3"),
    ({"moe_k": 5}, "moe_k"),
    ({"moe_layer_interval": 0}, "moe_layer_interval"),
    ({"moe_norm_min": 0.5}, "moe_norm_min"),
    ({"moe_layer_end_index": -2}, "moe_layer_end_index must be"),
    ({"use_bias": True}, "use_bias"),
])
def test_hostile_configs_are_refused_before_building(saved, tmp_path, monkeypatch, changes,
                                                     match):
  checks.check_refused_before_building(
      checks.edited(saved["ernie4_5_moe"].folder, tmp_path, **changes), match, monkeypatch)
