"""OLMoE (``model_type`` ``olmoe``) through `load_hf` and `export_hf`,
against transformers, with the checks of `hf_family_harness`: float32
logits, bfloat16, KV-cache sampling and greedy generation against
``generate``, export back, each feature binding (query/key norms over every
head, ``clip_qkv``, top-k without renormalisation by default), hostile
configs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers
import treescope
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.nn.clip_values import ClipValues


def _case(**fields) -> checks.Case:
  return checks.Case(transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
                     {"num_experts": 4, "num_experts_per_tok": 2, "eos_token_id": 2, **fields})


CASES = {
    # OLMoE-1B-7B's routing (top 2 of 4, not renormalised), clip_qkv 1.5,
    # biases on every projection, two key/value heads.
    "olmoe": _case(clip_qkv=1.5, attention_bias=True, num_key_value_heads=2),
    # Renormalised top 3 of 4, no clipping, one key/value head, a tied head.
    "olmoe_norm": _case(norm_topk_prob=True, num_experts_per_tok=3, num_key_value_heads=1,
                        tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


def test_kv_cache_sampling_matches_the_forward_pass(saved):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved["olmoe"].folder))


@pytest.mark.parametrize("case", CASES)
def test_greedy_kv_cache_generation_matches_transformers_generate(saved, case):
  checks.check_generate(saved[case], steps=8)


def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["olmoe"], "olmoe")


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["olmoe"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "olmoe", same_fields=(
      "num_experts", "num_experts_per_tok", "intermediate_size", "norm_topk_prob", "clip_qkv",
      "attention_bias", "tie_word_embeddings", "num_key_value_heads"))


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  checks.check_cli_export_from_native(saved["olmoe"], tmp_path)


@pytest.mark.parametrize("case, off", [
    ("olmoe", {"clip_qkv": None}),
    ("olmoe", {"clip_qkv": 3.0}),
    ("olmoe", {"norm_topk_prob": True}),
    ("olmoe_norm", {"norm_topk_prob": False}),
])
def test_each_feature_binds(saved, case, off):
  checks.check_feature_binds(saved[case], CASES[case], **off)


@pytest.mark.parametrize("norm", ["q_norm", "k_norm"])
def test_the_query_key_norms_bind(saved, norm):
  def without(model):
    for layer in model.model.layers:
      setattr(layer.self_attn, norm, torch.nn.Identity())
  checks.check_modules_bind(saved["olmoe"], CASES["olmoe"], norm, without)


def test_the_norms_span_every_head_and_the_clip_is_shown(saved):
  """The query norm is over every head's dimensions (one RMS over the whole
  projection, not one per head); treescope shows the clip."""
  model = pzp.pretrained.load_hf(saved["olmoe"].folder)
  norm = pz.select(model).at_instances_of(pz.nn.RMSLayerNorm).get_sequence()[1]
  assert set(norm.sublayers[0].across) == {"head_groups", "query_heads", "projection"}
  per_head = (pz.select(model).at_instances_of(pz.nn.RMSStandardize)
              .where(lambda layer: "query_heads" in layer.across or "head_groups" in layer.across)
              .apply(lambda layer: dataclasses.replace(layer, across=("projection",))))
  changed = float(np.abs(checks.penzai_logits(per_head) - saved["olmoe"].reference).max())
  print(f"norms per head: logits change by {changed:.3g}")
  assert changed > 100 * checks.TOLERANCE["atol"]
  assert len(pz.select(model).at_instances_of(ClipValues).get_sequence()) == 3 * 2
  assert "ClipValues" in treescope.render_to_text(model)


_OLMOE_1B_7B = {  # allenai/OLMoE-1B-7B-0924's config.json, sizes shrunk.
    "architectures": ["OlmoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "clip_qkv": None, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 32,
    "initializer_range": 0.02, "intermediate_size": 16, "max_position_embeddings": 4096,
    "model_type": "olmoe", "norm_topk_prob": False, "num_attention_heads": 4, "num_experts": 8,
    "num_experts_per_tok": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
    "output_router_logits": False, "pad_token_id": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0",
    "use_cache": True, "vocab_size": 64}


def test_hub_config(tmp_path):
  checks.check_float32(checks.hub_saved(tmp_path, _OLMOE_1B_7B), "OLMoE-1B-7B")


@pytest.mark.parametrize("changes, match", [
    ({"num_experts": 10**9}, "num_experts"),
    ({"num_experts": 3, "num_local_experts": 4}, "num_experts, num_local_experts"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"clip_qkv": 0}, "clip_qkv"),
    ({"clip_qkv": -1.0}, "clip_qkv"),
    ({"clip_qkv": True}, "clip_qkv"),
    ({"clip_qkv": "8"}, "clip_qkv"),
    ({"head_dim": 16}, "head_dim"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"sliding_window": 4}, "sliding_window"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"olmoe_new_feature": 1}, "olmoe_new_feature"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, changes, match,
                                                              monkeypatch):
  folder = checks.edited(saved["olmoe"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)


def test_surgery_lora_and_a_layer_inserted_after_the_clip(saved, tmp_path):
  """Issue 40 §3: `ClipValues` is a Penzai layer others can edit around.
  LoRA on the attention projections whose outputs it clips (zero-initialised:
  nothing changes), a layer inserted after each clip (the logits move), and
  ``save_model`` bringing the edited model back exactly."""
  import jax
  from penzai.toolshed import lora

  model = pzp.pretrained.load_hf(saved["olmoe"].folder)
  reference = checks.penzai_logits(model)
  adapted = lora.loraify_linears_in_selection(
      pz.select(model).at_instances_of(pz.nn.Linear).where(
          lambda layer: "attention/query" in str(layer.weights.label)),
      rank=2, init_base_rng=jax.random.key(3))
  assert pz.select(adapted).at_instances_of(lora.LowRankAdapter).count() >= 1
  np.testing.assert_allclose(checks.penzai_logits(adapted), reference, atol=1e-6)
  clips = pz.select(adapted).at_instances_of(ClipValues)
  assert clips.count() >= 3
  inserted = clips.apply(lambda clip: pz.nn.Sequential([clip, pz.nn.ConstantRescale(by=0.5)]))
  assert float(np.abs(checks.penzai_logits(inserted) - reference).max()) > 1e-3
  checks.check_save_model_round_trip(inserted, tmp_path / "edited",
                                     checks.penzai_logits(inserted))
