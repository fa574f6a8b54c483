"""Llama 4's text model through `load_hf` and `export_hf`, against
transformers' own ``Llama4ForCausalLM`` (``llama4_text``) and the text model of
``Llama4ForConditionalGeneration`` (``llama4``), on tiny random models (no
downloads).

The cases reach every layer kind: chunked attention (chunks of 4, shorter
than the sequences), NoPE layers with temperature tuning (a ``floor_scale``
of 2 so that it changes positions within ten tokens), interleaved RoPE with
and without ``llama3`` scaling, L2 query/key norms, mixture-of-experts layers
(top 1 and top 2, sigmoid scaling the expert input, a shared expert) between
dense ones. Each feature is shown to bind: switched off in the reference,
transformers' logits move far beyond the tolerance.
"""

from __future__ import annotations

import copy
import json
import logging

import numpy as np
import pytest
import torch
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist import errors

_SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 16,
          "intermediate_size_mlp": 24, "num_attention_heads": 4, "head_dim": 8,
          "pad_token_id": 0, "attention_chunk_size": 4, "floor_scale": 2, "attn_scale": 0.5}

CASES = {
    # Two layers reaching every kind: layer 0 dense, chunked, with RoPE and
    # query/key norms; layer 1 with experts (top 2 of 4, step 2), NoPE,
    # global, temperature-tuned.
    "llama4_text": {"num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 4,
                    "num_experts_per_tok": 2, "interleave_moe_layer_step": 2,
                    "no_rope_layers": [1, 0]},
    # Scout's shape: every layer MoE (top 1), llama3-scaled RoPE, NoPE from
    # no_rope_layer_interval, no query/key norms, multi-head attention.
    "llama4_scout": {"num_hidden_layers": 2, "num_key_value_heads": 4, "num_local_experts": 3,
                     "num_experts_per_tok": 1, "no_rope_layer_interval": 2, "use_qk_norm": False,
                     "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                         "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8}},
}


def _hf_model(case: str) -> transformers.Llama4ForCausalLM:
  torch.manual_seed(0)
  config = transformers.Llama4TextConfig(**dict(_SIZES, **CASES[case]))
  return checks.randomized(transformers.Llama4ForCausalLM(config))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """``{case: (folder, transformers model, reference float32 logits)}``,
  with ``llama4``: a multimodal folder whose text model is the first case's."""
  result = {}
  for case in CASES:
    model = _hf_model(case)
    folder = tmp_path_factory.mktemp(case)
    model.save_pretrained(folder, safe_serialization=True)
    result[case] = (folder, model, checks.reference_logits(model))
  torch.manual_seed(0)
  vision = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "intermediate_size": 16, "image_size": 28, "patch_size": 14,
            "vision_output_dim": 16, "projector_input_dim": 16, "projector_output_dim": 32}
  config = transformers.Llama4Config(text_config=dict(_SIZES, **CASES["llama4_text"]),
                                     vision_config=vision)
  multimodal = checks.randomized(transformers.Llama4ForConditionalGeneration(config))
  folder = tmp_path_factory.mktemp("llama4")
  multimodal.save_pretrained(folder, safe_serialization=True)
  # transformers' Llama4ForConditionalGeneration fails on text alone (its
  # output lacks image_outputs); its language_model is the text model.
  text = multimodal.language_model
  result["llama4"] = (folder, text, checks.reference_logits(text))
  return result


@pytest.mark.parametrize("case", [*CASES, "llama4"])
def test_float32_logits_match_transformers(saved, case):
  folder, _, reference = saved[case]
  print(f"{case}: float32 max abs error {checks.float32_error(folder, reference):.2g}")


def test_multimodal_folder_says_what_it_left_unread(saved, caplog):
  with caplog.at_level(logging.WARNING, "pz_persist.pretrained.hf"):
    pzp.pretrained.load_hf(saved["llama4"][0])
  assert "vision tower" in caplog.text and "vision_model.*" in caplog.text


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  folder, _, reference = saved["llama4_text"]
  ours, theirs = checks.bfloat16_errors(folder, transformers.Llama4ForCausalLM, reference)
  print(f"llama4_text bfloat16: ours {ours:.3g}, transformers' {theirs:.3g}")


@pytest.mark.parametrize("case", ["llama4_text", pytest.param("llama4_scout",
                                                              marks=pytest.mark.slow)])
def test_kv_cache_sampling_matches_a_forward_pass(saved, case):
  """Past several chunk boundaries, with temperature tuning changing with
  the position: the chunked mask and the tuning see the cache's positions."""
  checks.check_kv_cache_sampling(pzp.pretrained.load_hf(saved[case][0]))


def test_save_model_round_trip(saved, tmp_path):
  folder, _, reference = saved["llama4_text"]
  checks.check_save_model_round_trip(pzp.pretrained.load_hf(folder), tmp_path / "native",
                                     reference)


@pytest.mark.parametrize("case", list(CASES))
def test_export_gives_back_the_folder(saved, tmp_path, case):
  """With ``like`` and without (the structure says Llama 4)."""
  folder = saved[case][0]
  model = pzp.pretrained.load_hf(folder)
  checks.check_export_model(model, folder, tmp_path / "like")
  config = checks.check_export_model(model, folder, tmp_path / "alone", like=False)
  original = json.loads((folder / "config.json").read_text())
  for field in ("moe_layers", "no_rope_layers", "layer_types", "use_qk_norm"):
    assert config[field] == original[field], field


def test_multimodal_exports_its_text_model(saved, tmp_path):
  folder, _, reference = saved["llama4"]
  pzp.export_hf(pzp.pretrained.load_hf(folder), tmp_path / "text", like=folder)
  config = json.loads((tmp_path / "text" / "config.json").read_text())
  assert config["model_type"] == "llama4_text"
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()
  np.testing.assert_allclose(checks.reference_logits(theirs), reference, **checks.TOLERANCE)


SCOUT_TEXT_CONFIG = {
    # The text_config of meta-llama/Llama-4-Scout-17B-16E's config.json
    # (transformers 4.51: attn_temperature_tuning 4, for_llm_compressor,
    # rope_theta and rope_scaling, every layer MoE), sizes shrunk to 2 layers.
    "attention_bias": False, "attention_chunk_size": 4, "attention_dropout": 0.0,
    "attn_scale": 0.5, "attn_temperature_tuning": 4, "bos_token_id": 200000,
    "eos_token_id": [200001, 200007, 200008], "floor_scale": 2, "for_llm_compressor": False,
    "head_dim": 8, "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
    "interleave_moe_layer_step": 1, "intermediate_size": 16, "intermediate_size_mlp": 24,
    "max_position_embeddings": 262144, "model_type": "llama4_text", "moe_layers": [0, 1],
    "no_rope_layers": [1, 0], "num_attention_heads": 4, "num_experts_per_tok": 1,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 3,
    "output_router_logits": False, "pad_token_id": 0, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8, "rope_type": "llama3"},
    "rope_theta": 500000.0, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
    "torch_dtype": "bfloat16", "use_cache": True, "use_qk_norm": True, "vocab_size": 64,
}


def test_the_hubs_scout_config(tmp_path):
  """transformers 5 refuses the Hub's ``attn_temperature_tuning: 4`` (it
  wants a bool; transformers 4.51, which wrote it, took any true value): the
  reference is built with ``true``, the folder keeps the Hub's config."""
  torch.manual_seed(0)
  fields = {k: v for k, v in SCOUT_TEXT_CONFIG.items()
            if k not in ("for_llm_compressor", "model_type", "torch_dtype")}
  model = checks.randomized(transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
      **dict(fields, attn_temperature_tuning=True))))
  model.save_pretrained(tmp_path, safe_serialization=True)
  reference = checks.reference_logits(model)
  (tmp_path / "config.json").write_text(json.dumps(
      dict(SCOUT_TEXT_CONFIG, architectures=["Llama4ForCausalLM"])))
  print(f"meta-llama/Llama-4-Scout-17B-16E's text config: float32 max abs error"
        f" {checks.float32_error(tmp_path, reference):.2g}")


def _without(model, edit):
  model = copy.deepcopy(model)
  with torch.no_grad():
    for layer in model.model.layers:
      edit(layer)
  return model


def _no_shared(layer):
  if layer.is_moe_layer:
    layer.feed_forward.shared_expert.down_proj.weight.zero_()


@pytest.mark.parametrize("feature, edit", [
    ("query/key norms", lambda layer: hasattr(layer.self_attn, "qk_norm") and setattr(
        layer.self_attn, "qk_norm", torch.nn.Identity())),
    ("temperature tuning", lambda layer: setattr(layer.self_attn, "attn_temperature_tuning",
                                                 False)),
    ("shared expert", _no_shared),
])
def test_features_bind(saved, feature, edit):
  _, model, reference = saved["llama4_text"]
  changed = checks.reference_logits(_without(model, edit))
  assert np.abs(changed - reference).max() > 100 * checks.TOLERANCE["atol"], feature


def test_chunks_bind(saved, tmp_path):
  folder, _, reference = saved["llama4_text"]
  unchunked = checks.edited(folder, tmp_path, layer_types=["full_attention"] * 2)
  changed = checks.reference_logits(
      transformers.Llama4ForCausalLM.from_pretrained(unchunked).eval())
  assert np.abs(changed - reference).max() > 100 * checks.TOLERANCE["atol"]


def test_interleaved_rope_binds(saved):
  """Rotating halves (Penzai's and Llama's convention) instead of pairs
  gives other logits: transformers' Llama 4 pairs adjacent dimensions."""
  from transformers.models.llama import modeling_llama  # pylint: disable=import-outside-toplevel
  from transformers.models.llama4 import modeling_llama4  # pylint: disable=import-outside-toplevel
  _, model, reference = saved["llama4_text"]

  def halves(xq, xk, freqs_cis):
    cos = freqs_cis.real.repeat(1, 1, 2)[:, :, None, :]
    sin = freqs_cis.imag.repeat(1, 1, 2)[:, :, None, :]
    return (xq * cos + modeling_llama.rotate_half(xq) * sin,
            xk * cos + modeling_llama.rotate_half(xk) * sin)

  original = modeling_llama4.apply_rotary_emb
  modeling_llama4.apply_rotary_emb = halves
  try:
    changed = checks.reference_logits(model)
  finally:
    modeling_llama4.apply_rotary_emb = original
  assert np.abs(changed - reference).max() > 100 * checks.TOLERANCE["atol"]


@pytest.mark.parametrize("changes, match", [
    ({"attention_bias": True}, "attention_bias"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"moe_layers": [7]}, "moe_layers"),
    ({"no_rope_layers": [1]}, "no_rope_layers"),
    ({"no_rope_layers": [1, 2]}, "no_rope_layers"),
    ({"layer_types": ["sliding_attention"] * 2}, "layer_types"),
    ({"attention_chunk_size": None}, "attention_chunk_size"),
    ({"floor_scale": 0}, "floor_scale"),
    ({"intermediate_size_mlp": "24"}, "intermediate_size_mlp"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"num_local_experts": 0}, "num_local_experts"),
    ({"use_qk_norm": "yes"}, "use_qk_norm"),
    ({"attn_temperature_tuning": -1}, "attn_temperature_tuning"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  from penzai.models.transformer.variants import llamalike_common  # pylint: disable=import-outside-toplevel

  def never(*args, **kwargs):
    raise AssertionError("the skeleton was built before the config was refused")

  monkeypatch.setattr(llamalike_common, "build_llamalike_transformer", never)
  folder = checks.edited(saved["llama4_text"][0], tmp_path, **changes)
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)
