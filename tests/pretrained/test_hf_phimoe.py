"""Phi-3.5-MoE (``model_type`` ``phimoe``) through `load_hf` and
`export_hf`, against transformers, with the checks of `hf_family_harness`:
float32 logits, KV-cache sampling and greedy generation against
``generate``, export back, each feature binding (sparsemixer routing and its
``router_jitter_noise`` gap, LayerNorm biases, ``lm_head_bias``), hostile
configs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.nn import mixture_of_experts as moe


def _case(**fields) -> checks.Case:
  return checks.Case(transformers.PhimoeConfig, transformers.PhimoeForCausalLM,
                     {"num_local_experts": 4, "bos_token_id": 1, "eos_token_id": 2,
                      "num_key_value_heads": 2, **fields})


CASES = {
    # Phi-3.5-MoE's biases (attention, lm_head), a wide sparsemixer gap (0.3:
    # the second expert's weight often shares its softmax).
    "phimoe": _case(attention_bias=True, lm_head_bias=True, router_jitter_noise=0.3),
    # transformers' defaults: gap 0.01, no biases; a 3-token window, 5 experts.
    "phimoe_window": _case(num_local_experts=5, sliding_window=3),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


def test_kv_cache_sampling_matches_the_forward_pass(saved):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved["phimoe_window"].folder))


@pytest.mark.parametrize("case", CASES)
def test_greedy_kv_cache_generation_matches_transformers_generate(saved, case):
  checks.check_generate(saved[case], steps=8)


def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["phimoe"], "phimoe")


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["phimoe"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "phimoe", same_fields=(
      "num_local_experts", "num_experts_per_tok", "intermediate_size", "router_jitter_noise",
      "attention_bias", "lm_head_bias", "sliding_window", "rms_norm_eps"))


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  checks.check_cli_export_from_native(saved["phimoe"], tmp_path)


@pytest.mark.parametrize("case, off", [
    ("phimoe", {"router_jitter_noise": 0.01}),
    ("phimoe_window", {"router_jitter_noise": 0.3}),
    ("phimoe_window", {"sliding_window": None}),
])
def test_each_feature_binds(saved, case, off):
  checks.check_feature_binds(saved[case], CASES[case], **off)


@pytest.mark.parametrize("case", CASES)
def test_sparsemixer_binds(saved, case):
  """Routed as Mixtral (softmax over all, top 2 renormalised) instead, our
  model is far from transformers' logits."""
  model = pzp.pretrained.load_hf(saved[case].folder)
  as_mixtral = (pz.select(model).at_instances_of(moe.TopKRouter)
                .apply(lambda r: dataclasses.replace(r, score="softmax", normalize=True)))
  changed = float(np.abs(checks.penzai_logits(as_mixtral) - saved[case].reference).max())
  print(f"softmax top-2 routing: logits change by {changed:.3g}")
  assert changed > 100 * checks.TOLERANCE["atol"]


@pytest.mark.parametrize("what", ["norm biases", "lm_head bias"])
def test_the_biases_bind(saved, what):
  def zeroed(model):
    with torch.no_grad():
      if what == "lm_head bias":
        model.lm_head.bias.zero_()
        return
      for name, param in model.named_parameters():
        if "norm" in name and name.endswith(".bias"):
          param.zero_()
  checks.check_modules_bind(saved["phimoe"], CASES["phimoe"], what, zeroed)


_PHI_3_5_MOE = {  # microsoft/Phi-3.5-MoE-instruct's config.json, sizes shrunk.
    "architectures": ["PhiMoEForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 32,
    "initializer_range": 0.02, "input_jitter_noise": 0.01, "intermediate_size": 16,
    "lm_head_bias": True, "max_position_embeddings": 131072, "model_type": "phimoe",
    "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "num_local_experts": 4, "original_max_position_embeddings": 4096,
    "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_scaling": {
        "long_factor": [1.0, 1.5, 2.0, 3.0], "long_mscale": 1.243163121016122,
        "original_max_position_embeddings": 4096, "short_factor": [1.0, 1.0, 1.1, 1.2],
        "short_mscale": 1.243163121016122, "type": "longrope"},
    "rope_theta": 10000.0, "router_aux_loss_coef": 0.0, "router_jitter_noise": 0.01,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.3", "use_cache": True, "vocab_size": 64}


def test_hub_config_without_its_longrope(tmp_path):
  """The Hub's config with its RoPE scaling dropped (positions within the
  original context compute with the short factors; the unscaled base here)."""
  hub = {k: v for k, v in _PHI_3_5_MOE.items()
         if k not in ("rope_scaling", "original_max_position_embeddings")}
  checks.check_float32(checks.hub_saved(tmp_path, hub), "Phi-3.5-MoE (no longrope)")


def test_the_hubs_longrope_is_refused_by_name(tmp_path):
  saved = checks.hub_saved(tmp_path, {k: v for k, v in _PHI_3_5_MOE.items()
                                      if k not in ("rope_scaling",
                                                   "original_max_position_embeddings")})
  folder = checks.edited(saved.folder, tmp_path, rope_scaling=_PHI_3_5_MOE["rope_scaling"])
  with pytest.raises(pzp.errors.UnsupportedConfigError, match="rope"):
    pzp.pretrained.load_hf(folder)


@pytest.mark.parametrize("changes, match", [
    ({"num_local_experts": 10**9}, "num_local_experts"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok"),
    ({"num_experts_per_tok": 3}, "num_experts_per_tok"),
    ({"router_jitter_noise": -0.1}, "router_jitter_noise"),
    ({"router_jitter_noise": "0.01"}, "router_jitter_noise"),
    ({"lm_head_bias": "yes"}, "lm_head_bias"),
    ({"attention_bias": 1}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"phimoe_new_feature": 1}, "phimoe_new_feature"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, changes, match,
                                                              monkeypatch):
  folder = checks.edited(saved["phimoe"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)
