"""Falcon (``model_type`` ``falcon``) through `load_hf` and `export_hf`, against
transformers, with the checks of `hf_family_harness`."""

from __future__ import annotations

import math

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
import torch
import transformers
from penzai.models.transformer.variants import llamalike_common

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.pretrained.hf import plan
from pz_persist.pretrained.hf.families import falcon


def _falcon_config(intermediate_size: int, **fields):
  """transformers' FalconConfig from the harness's sizes (Falcon names the
  MLP's width ``ffn_hidden_size``; an ``intermediate_size`` would be an
  unknown field)."""
  return transformers.FalconConfig(ffn_hidden_size=intermediate_size, **fields)


def _case(**fields) -> checks.Case:
  return checks.Case(_falcon_config, transformers.FalconForCausalLM, fields)


CASES = {
    # Falcon 7B's layout: multi-query, parallel on one LayerNorm, no biases, tied head.
    "falcon_7b": _case(),
    # Falcon 40B / 180B's: grouped key/value heads, two LayerNorms, an untied head.
    "falcon_40b": _case(new_decoder_architecture=True, num_kv_heads=2,
                        tie_word_embeddings=False),
    # Falcon 2 11B's: grouped, one LayerNorm, another base wavelength and MLP width.
    "falcon_11b": _case(new_decoder_architecture=True, num_kv_heads=2,
                        num_ln_in_parallel_attn=1, rope_theta=500_042.0,
                        intermediate_size=48),
    # The older multi-head layout, sequential, with biases and a tanh GELU.
    "falcon_sequential": _case(multi_query=False, parallel_attn=False, bias=True,
                               activation="gelu_pytorch_tanh", layer_norm_epsilon=0.05),
    # Grouped attention with biases and a scaled RoPE (linear).
    "falcon_scaled": _case(new_decoder_architecture=True, num_kv_heads=1, bias=True,
                           rope_parameters={"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 10_000.0}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


@pytest.mark.parametrize("case", ["falcon_7b", "falcon_40b", "falcon_sequential"])
def test_kv_cache_sampling_matches_the_forward_pass(saved, case):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved[case].folder))


@pytest.mark.parametrize("case", CASES)
def test_greedy_kv_cache_generation_matches_transformers_generate(saved, case):
  checks.check_generate(saved[case], steps=8)


def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["falcon_40b"], "falcon_40b")


def test_a_bfloat16_folder_exports_bit_for_bit(tmp_path):
  checks.check_bfloat16_export(CASES["falcon_11b"], tmp_path)


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["falcon_40b"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  # A sequential Falcon is also StarCoder2's structure, which detection asks first
  # (see test_a_sequential_falcon_exports_alone_as_the_same_model).
  checks.check_export(saved[case], tmp_path, None if case == "falcon_sequential" else "falcon",
                      same_fields=(
      "new_decoder_architecture", "parallel_attn", "bias", "activation",
      "tie_word_embeddings", "ffn_hidden_size", "layer_norm_epsilon", "rope_parameters"))


def test_a_sequential_falcon_exports_alone_as_the_same_model(saved, tmp_path):
  """Without ``like``, a sequential Falcon (LayerNorms, one key/value head,
  a plain MLP) is written as StarCoder2, whose structure it has; transformers
  reads that folder with exactly the same logits. ``like=`` keeps Falcon."""
  pzp.export_hf(pzp.pretrained.load_hf(saved["falcon_sequential"].folder), tmp_path / "alone")
  assert checks.config(tmp_path / "alone")["model_type"] == "starcoder2"
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "alone").eval()
  np.testing.assert_allclose(checks.reference_logits(theirs),
                             saved["falcon_sequential"].reference, **checks.TOLERANCE)


@pytest.mark.parametrize("case, off", [
    ("falcon_7b", {"multi_query": False}),  # Fails to load: the fused projection's size.
    ("falcon_40b", {"num_kv_heads": 1}),
    ("falcon_40b", {"num_ln_in_parallel_attn": 1}),
    ("falcon_11b", {"num_ln_in_parallel_attn": 2}),
    ("falcon_11b", {"rope_theta": 10_000.0}),
    ("falcon_sequential", {"parallel_attn": True}),
    ("falcon_sequential", {"activation": "relu"}),
    ("falcon_sequential", {"layer_norm_epsilon": 1e-5}),
    ("falcon_scaled", {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}}),
])
def test_each_feature_binds(saved, case, off):
  """Each feature switched off in transformers' config (the same weights)
  moves its logits, or leaves weights unused or missing: a loader ignoring
  it would fail the float32 check."""
  try:
    checks.check_feature_binds(saved[case], CASES[case], **off)
  except RuntimeError as e:  # load_state_dict: the tensors no longer fit.
    assert "size mismatch" in str(e) or "Missing key" in str(e) or "Unexpected key" in str(e)


def test_the_biases_and_the_norms_bind(saved):
  """The biases and each LayerNorm zeroed in transformers move its logits."""
  def no_biases(model):
    with torch.no_grad():
      for name, param in model.named_parameters():
        if name.endswith("query_key_value.bias"):
          param.zero_()
  checks.check_modules_bind(saved["falcon_sequential"], CASES["falcon_sequential"],
                            "the fused projection's bias", no_biases)

  def no_mlp_norm(model):
    with torch.no_grad():
      model.transformer.h[0].ln_mlp.weight.fill_(1.0)
  checks.check_modules_bind(saved["falcon_40b"], CASES["falcon_40b"], "ln_mlp's weight",
                            no_mlp_norm)


def test_grouped_heads_read_their_own_group(saved, tmp_path):
  """The same tensors read as one key/value head per two query heads in
  the other order (groups swapped) give other logits: the fused rows'
  grouping is what the float32 check verifies."""
  model = CASES["falcon_40b"].model_cls(CASES["falcon_40b"].config())
  state = saved["falcon_40b"].hf_model.state_dict()
  for name in list(state):
    if name.endswith("query_key_value.weight"):
      rows = state[name].reshape(2, -1, state[name].shape[-1])
      state[name] = rows.flip(0).reshape(state[name].shape)
  model.load_state_dict(state)
  changed = float(np.abs(checks.reference_logits(model.eval())
                         - saved["falcon_40b"].reference).max())
  assert changed > 100 * checks.TOLERANCE["atol"]


@pytest.mark.parametrize("changes, match", [
    ({"alibi": True}, "alibi"),
    ({"new_decoder_architecture": True, "parallel_attn": False}, "parallel_attn"),
    ({"num_ln_in_parallel_attn": 2}, "num_ln_in_parallel_attn"),
    ({"num_ln_in_parallel_attn": 3}, "num_ln_in_parallel_attn"),
    ({"multi_query": False, "num_kv_heads": 2}, "num_kv_heads"),
    ({"new_decoder_architecture": True, "num_kv_heads": 3}, "num_kv_heads"),
    ({"activation": "quick_gelu"}, "activation"),
    ({"bias": "yes"}, "bias"),
    ({"ffn_hidden_size": 64.0}, "ffn_hidden_size"),
    ({"num_attention_heads": 5}, "num_attention_heads"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"apply_residual_connection_post_layernorm": True},
     "apply_residual_connection_post_layernorm"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"n_embed": 32}, "n_embed"),
    ({"falcon_new_feature": 1}, "falcon_new_feature"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, changes, match,
                                                              monkeypatch):
  folder = checks.edited(saved["falcon_7b"].folder, tmp_path, **changes)

  def no_build(*args, **kwargs):
    raise AssertionError("a skeleton was built before the config was refused")

  monkeypatch.setattr(falcon, "build_falcon", no_build)
  checks.check_refused_before_building(folder, match, monkeypatch)


def test_a_fused_projection_of_the_wrong_size_is_refused(saved, tmp_path):
  """multi_query flipped: the stored projection no longer fits; refused, named."""
  folder = checks.edited(saved["falcon_7b"].folder, tmp_path, multi_query=False)
  with pytest.raises(pzp.errors.PzPersistError, match="query_key_value"):
    pzp.pretrained.load_hf(folder)


_FALCON_7B = {  # tiiuae/falcon-7b, shrunk.
    "alibi": False, "apply_residual_connection_post_layernorm": False,
    "architectures": ["FalconForCausalLM"], "attention_dropout": 0.0, "bias": False,
    "bos_token_id": 11, "eos_token_id": 11, "hidden_dropout": 0.0, "hidden_size": 32,
    "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "falcon",
    "multi_query": True, "new_decoder_architecture": False, "num_attention_heads": 4,
    "num_hidden_layers": 2, "parallel_attn": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.27.4", "use_cache": True, "vocab_size": 64}

_FALCON_11B = {  # tiiuae/falcon-11B, shrunk.
    "activation": "gelu", "alibi": False, "architectures": ["FalconForCausalLM"],
    "attention_dropout": 0.0, "bias": False, "bos_token_id": 11, "eos_token_id": 11,
    "ffn_hidden_size": 64, "hidden_dropout": 0.0, "hidden_size": 32, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "max_position_embeddings": 8192, "model_type": "falcon",
    "multi_query": True, "new_decoder_architecture": True, "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_kv_heads": 2, "num_ln_in_parallel_attn": 1,
    "parallel_attn": True, "rope_scaling": None, "rope_theta": 500042.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.39.2",
    "use_cache": True, "vocab_size": 64}


@pytest.mark.parametrize("hub", [_FALCON_7B, _FALCON_11B], ids=["falcon-7b", "falcon-11B"])
def test_hub_config(tmp_path, hub):
  checks.check_float32(checks.hub_saved(tmp_path, hub), hub["architectures"][0])


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  checks.check_cli_export_from_native(saved["falcon_40b"], tmp_path)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(groups=st.integers(1, 4), per=st.integers(1, 4), head_dim=st.integers(1, 4),
                  hidden=st.integers(1, 3), bias=st.booleans())
def test_the_fused_projection_comes_back_whole(groups, per, head_dim, hidden, bias):
  """For generated group counts and sizes, the query, key and value read from
  a fused tensor (`plan.penzai_layout`) are put back (`plan.stored_layout`)
  as exactly that tensor, and each is the rows transformers' ``_split_heads``
  gives it."""
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=groups, query_head_multiplier=per, embedding_dim=hidden,
      projection_dim=head_dim, mlp_hidden_dim=1, num_decoder_blocks=1, vocab_size=1,
      mlp_variant="swiglu", tie_embedder_and_logits=False)
  specs = [spec for spec in falcon._block_specs("b/", "h.", config, falcon.ONE_NORM, bias)  # pylint: disable=protected-access
           if "query_key_value" in spec.source]
  for source in {spec.source for spec in specs}:
    mine = [spec for spec in specs if spec.source == source]
    stored = np.arange(math.prod(mine[0].file_shape), dtype=np.float32).reshape(
        mine[0].file_shape)
    values = [plan.penzai_layout(spec, stored) for spec in mine]
    np.testing.assert_array_equal(plan.stored_layout(mine, values), stored)
    rows = stored.reshape(groups, per + 2, head_dim, -1)  # transformers' view of the rows.
    by_label = dict(zip((spec.label for spec in mine), values))
    query = next(v for label, v in by_label.items() if "/query" in label)
    key = next(v for label, v in by_label.items() if "/key" in label)
    np.testing.assert_array_equal(query.reshape(-1), rows[:, :per].reshape(-1))
    np.testing.assert_array_equal(key.reshape(-1), rows[:, per].reshape(-1))
