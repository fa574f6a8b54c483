"""Qwen3-Next (``qwen3_next``) through `load_hf` and `export_hf`, against
transformers on tiny random models (no downloads).

Qwen3.5-MoE's layers (tests/pretrained/test_hf_qwen3_5.py covers the
DeltaNet and the gated attention) with the DeltaNet's projections fused per
key head, ``norm_topk_prob`` and dense layers among the experts. Weights are
drawn as Qwen3.5's test draws them (standard deviation 0.2; its docstring
says why).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pretrained import test_hf_qwen3_5
from pz_persist import errors
from pz_persist.nn import mixture_of_experts as moe
from pz_persist.nn.gated_delta_net import GatedDeltaNet

_COMMON = {"hidden_size": 32, "num_attention_heads": 4, "vocab_size": 64, "pad_token_id": 0,
           "intermediate_size": 48, "num_key_value_heads": 2, "head_dim": 16,
           "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
           "shared_expert_intermediate_size": 24}

CASES = {
    # The default layer pattern (three DeltaNet layers, then attention), layer
    # 1 dense (mlp_only_layers), two value heads per key head, key heads
    # wider than value heads (in_proj_qkvz's parts of different sizes).
    "sparse": {"num_hidden_layers": 4, "mlp_only_layers": [1], "linear_num_key_heads": 2,
               "linear_num_value_heads": 4, "linear_key_head_dim": 8,
               "linear_value_head_dim": 4},
    # Experts every second layer, no renormalisation, tied, one value head
    # per key head, a 3-tap convolution, attention first.
    "stepped": {"num_hidden_layers": 2, "decoder_sparse_step": 2, "norm_topk_prob": False,
                "tie_word_embeddings": True, "layer_types": ["full_attention", "linear_attention"],
                "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
                "linear_value_head_dim": 8, "linear_conv_kernel_dim": 3},
}


def _model(case: str, **changes) -> transformers.Qwen3NextForCausalLM:
  torch.manual_seed(0)
  config = transformers.Qwen3NextConfig(**{**_COMMON, **CASES[case], **changes})
  return test_hf_qwen3_5.randomized(transformers.Qwen3NextForCausalLM(config))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  result = {}
  for case in CASES:
    model = _model(case)
    folder = tmp_path_factory.mktemp(case)
    model.save_pretrained(folder, safe_serialization=True)
    result[case] = harness.Saved(folder, model, harness.reference_logits(model))
  return result


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  harness.check_float32(saved[case], case)


def test_layers_are_what_the_config_says(saved):
  model = pzp.pretrained.load_hf(saved["sparse"].folder)
  assert len(pz.select(model).at_instances_of(GatedDeltaNet).get_sequence()) == 3
  found = pz.select(model).at_instances_of(moe.MixtureOfExperts).get_sequence()
  assert len(found) == 3 and all(layer.shared_gate is not None for layer in found)


def test_kv_cache_sampling_matches_a_forward_pass(saved):
  harness.check_kv_cache(pzp.pretrained.load_hf(saved["sparse"].folder))


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_matches_generate(saved, case):
  harness.check_generate(saved[case])


def test_save_model_round_trip(saved, tmp_path):
  harness.check_save_model(saved["sparse"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_gives_back_the_folder(saved, tmp_path, case):
  """With ``like``, and from the model alone (a dense layer among the
  experts, or a router that does not renormalise, says Qwen3-Next)."""
  harness.check_export(saved[case], tmp_path, "qwen3_next",
                       same_fields=("layer_types", "tie_word_embeddings", "norm_topk_prob"))


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  harness.check_bfloat16(saved["sparse"], "sparse")


def _qwen3_5_order(model):
  """Each ``in_proj_qkvz`` rearranged as Qwen3.5 would store it (all queries,
  all keys, all values, all gates), the layout a loader ignoring the per-key-
  head grouping would read."""
  with torch.no_grad():
    for layer in model.model.layers:
      if hasattr(layer, "linear_attn"):
        attn = layer.linear_attn
        w = attn.in_proj_qkvz.weight
        k, dk, dv = attn.num_k_heads, attn.head_k_dim, attn.head_v_dim
        g = attn.num_v_heads // k
        grouped = w.view(k, 2 * dk + 2 * g * dv, -1)
        parts = torch.split(grouped, [dk, dk, g * dv, g * dv], dim=1)
        w.copy_(torch.cat([p.reshape(-1, w.shape[1]) for p in parts]))


@pytest.mark.parametrize("what,edit", [
    ("the per-key-head grouping of in_proj_qkvz", _qwen3_5_order),
    ("the shared expert's gate", lambda m: [
        layer.mlp.shared_expert_gate.weight.data.fill_(-30.0)
        for layer in m.model.layers if hasattr(layer.mlp, "shared_expert_gate")]),
])
def test_features_bind(saved, what, edit):
  case = harness.Case(transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                      {**_COMMON, **CASES["sparse"]})
  harness.check_modules_bind(saved["sparse"], case, what, edit)


def test_norm_topk_prob_binds(saved):
  case = harness.Case(transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                      {**_COMMON, **CASES["sparse"]})
  model = case.model_cls(case.config(norm_topk_prob=False))
  model.load_state_dict(saved["sparse"].hf_model.state_dict())
  changed = float(np.abs(harness.reference_logits(model.eval()) - saved["sparse"].reference).max())
  assert changed > 100 * harness.TOLERANCE["atol"], changed


_HOSTILE = [
    ({"mlp_only_layers": [4]}, "mlp_only_layers"),
    ({"mlp_only_layers": [1, 1]}, "mlp_only_layers"),
    ({"mlp_only_layers": "1"}, "mlp_only_layers"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"num_experts": 5}, "num_experts"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
]


@pytest.mark.parametrize("changes,match", _HOSTILE)
def test_hostile_configs_are_refused(saved, tmp_path, changes, match):
  folder = harness.edited(saved["sparse"].folder, tmp_path, **changes)
  with pytest.raises(errors.PzPersistError, match=match):
    pzp.pretrained.load_hf(folder)
