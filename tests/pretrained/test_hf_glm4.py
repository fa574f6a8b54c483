"""GLM-4-0414 (``glm4``) through `load_hf` and `export_hf`, against
transformers' own Glm4ForCausalLM on tiny random models (no downloads).

GLM-4-0414 is Llama's layout with norms after the attention and the MLP
beside those before, a fused ``gate_up_proj``, RoPE on interleaved pairs of
the first half of each head and query/key/value biases; each addition is
shown to bind (transformers without it, or pz_persist's model without it,
leaves the tolerance far behind).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from penzai import pz
from penzai.models.transformer import model_parts

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist.nn import latent_attention as mla

_SIZES = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2}

CASES = {
    # transformers' defaults: half of each head rotated, q/k/v biases.
    "glm4": harness.Case(transformers.Glm4Config, transformers.Glm4ForCausalLM, dict(_SIZES)),
    # No biases, a quarter of each head rotated, one key/value head.
    "glm4_quarter": harness.Case(
        transformers.Glm4Config, transformers.Glm4ForCausalLM,
        {**_SIZES, "num_key_value_heads": 1, "attention_bias": False,
         "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                             "partial_rotary_factor": 0.25}}),
    # Every entry rotated.
    "glm4_full": harness.Case(
        transformers.Glm4Config, transformers.Glm4ForCausalLM,
        {**_SIZES, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 1.0}}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return harness.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_float32_logits_match_transformers(saved, name):
  harness.check_float32(saved[name], name)


def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  harness.check_bfloat16(saved["glm4"], "glm4")


@pytest.mark.parametrize("name", ["glm4", "glm4_quarter"])
def test_kv_cache_matches_transformers_cache(saved, name):
  model = pzp.pretrained.load_hf(saved[name].folder)
  harness.check_kv_cache(model)
  harness.check_kv_cache_like_transformers(model, saved[name].hf_model)


def test_greedy_generation_matches_generate(saved):
  harness.check_generate(saved["glm4"])


def test_save_model_round_trip(saved, tmp_path):
  harness.check_save_model(saved["glm4"], tmp_path)


@pytest.mark.parametrize("name", list(CASES))
def test_export_gives_back_the_folder(saved, tmp_path, name):
  harness.check_export(saved[name], tmp_path, "glm4",
                       same_fields=("attention_bias", "head_dim", "num_key_value_heads"))


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  harness.check_cli_export_from_native(saved["glm4"], tmp_path)


@pytest.mark.parametrize("what, config", [
    ("partial rotary (all rotated)", {"rope_parameters": {"rope_type": "default",
                                                         "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 1.0}}),
])
def test_config_features_bind(saved, what, config):
  del what
  harness.check_feature_binds(saved["glm4"], CASES["glm4"], **config)


def _identity_post_norms(model):
  for layer in model.model.layers:
    layer.post_self_attn_layernorm = torch.nn.Identity()
    layer.post_mlp_layernorm = torch.nn.Identity()


def _no_biases(model):
  with torch.no_grad():
    for layer in model.model.layers:
      for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
        proj.bias.zero_()


@pytest.mark.parametrize("what, edit", [("the norms after each branch", _identity_post_norms),
                                        ("the query/key/value biases", _no_biases)])
def test_modules_bind(saved, what, edit):
  harness.check_modules_bind(saved["glm4"], CASES["glm4"], what, edit)


def _halves(parts: mla.ApplyToParts) -> mla.ApplyToParts:
  """The rotated part turned by halves, as Llama does, not by pairs."""
  turn = parts.parts[0]
  return dataclasses.replace(parts, parts=[pz.nn.Sequential(turn.sublayers[1:]),
                                           *parts.parts[1:]])


def _swapped_gate_up(model):
  """The MLP's gate and up projections each holding the other's rows."""

  def swap(ffw: model_parts.TransformerFeedForward) -> model_parts.TransformerFeedForward:
    linears = pz.select(ffw).at_instances_of(pz.nn.Linear)
    gate, value = linears.get_sequence()[:2]
    other = {gate.weights.label: value.weights, value.weights.label: gate.weights}
    return linears.apply(lambda linear: dataclasses.replace(
        linear, weights=other.get(linear.weights.label, linear.weights)))

  return pz.select(model).at_instances_of(model_parts.TransformerFeedForward).apply(swap)


@pytest.mark.parametrize("what", ["pairs", "gate_up"])
def test_read_layouts_bind(saved, what):
  """pz_persist's model reading the rotary pairs as halves, or the fused
  tensor's halves the other way round, misses transformers' logits by far
  more than the tolerance: the layouts read are the ones that bind."""
  model = pzp.pretrained.load_hf(saved["glm4"].folder)
  if what == "pairs":
    model = pz.select(model).at_instances_of(mla.ApplyToParts).apply(_halves)
  else:
    model = _swapped_gate_up(model)
  changed = float(np.abs(harness.penzai_logits(model) - saved["glm4"].reference).max())
  print(f"{what} read otherwise: logits off by {changed:.3g}")
  assert changed > 100 * harness.TOLERANCE["atol"]


GLM_4_9B_0414_CONFIG = {
    # The Hub's config.json of THUDM/GLM-4-9B-0414 (transformers 4.51: top-level
    # partial_rotary_factor and rope_theta), its sizes shrunk.
    "architectures": ["Glm4ForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": [1, 2], "head_dim": 16, "hidden_act": "silu", "hidden_size": 32,
    "initializer_range": 0.02, "intermediate_size": 48, "max_position_embeddings": 32768,
    "model_type": "glm4", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pad_token_id": 0, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.3", "use_cache": True,
    "vocab_size": 64,
}


def test_the_hubs_glm_4_9b_0414_config(tmp_path):
  saved = harness.hub_saved(tmp_path, GLM_4_9B_0414_CONFIG)
  harness.check_float32(saved, "GLM-4-9B-0414 hub")
  pzp.export_hf(pzp.pretrained.load_hf(saved.folder), tmp_path / "out", like=saved.folder)
  harness.assert_same_tensors(harness.tensors(tmp_path / "out"), harness.tensors(saved.folder))


@pytest.mark.parametrize("changes, match", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"partial_rotary_factor": 0.25}, "partial_rotary_factor"),  # Besides rope_parameters' 0.5.
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.3125}}, "partial_rotary_factor"),  # 5 of 16.
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 2.0}}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                          "original_max_position_embeddings": 16}}, "rope_type"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
    ({"attention_bias": "yes"}, "attention_bias"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  folder = harness.edited(saved["glm4"].folder, tmp_path, **changes)
  harness.check_refused_before_building(folder, match, monkeypatch)
