"""OLMo 2 and OLMo 3 (``model_type`` ``olmo2``, ``olmo3``) through `load_hf`
and `export_hf`, against transformers, with the checks of `family_checks`."""

from __future__ import annotations

import pytest
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import family_checks as checks
from pz_persist import errors

CASES = {
    # Grouped-query attention: the key norm spans 2 heads, the query norm 4.
    "olmo2": checks.Case(transformers.Olmo2Config, transformers.Olmo2ForCausalLM,
                         dict(num_key_value_heads=2)),
    # Multi-head (a "heads" axis), biases on every projection, tied embeddings.
    "olmo2_bias_tied": checks.Case(transformers.Olmo2Config, transformers.Olmo2ForCausalLM,
                                   dict(attention_bias=True, tie_word_embeddings=True)),
    # Multi-query: the key norm has no head axis.
    "olmo2_mqa": checks.Case(transformers.Olmo2Config, transformers.Olmo2ForCausalLM,
                             dict(num_key_value_heads=1)),
}
OLMO2 = ("olmo2", "olmo2_bias_tied", "olmo2_mqa")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


@pytest.mark.parametrize("case", ["olmo2"])
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved, case):
  checks.check_bfloat16(saved[case], case)


@pytest.mark.parametrize("case", ["olmo2"])
def test_kv_cache_sampling_matches_the_forward_pass(saved, case):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved[case].folder))


@pytest.mark.parametrize("case", ["olmo2_bias_tied"])
def test_save_model_round_trip(saved, tmp_path, case):
  checks.check_save_model(saved[case], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  model_type = case.split("_")[0]
  checks.check_export(saved[case], tmp_path, model_type,
                      same_fields=("attention_bias", "tie_word_embeddings", "layer_types",
                                   "sliding_window", "rope_parameters"))


def _identity(*names: str):
  def edit(model):
    for layer in model.model.layers:
      for name in names:
        owner, _, attr = name.rpartition(".")
        setattr(layer.get_submodule(owner) if owner else layer, attr, torch.nn.Identity())
  return edit


@pytest.mark.parametrize("what", ["self_attn.q_norm", "self_attn.k_norm",
                                  "post_attention_layernorm", "post_feedforward_layernorm"])
def test_each_norm_binds(saved, what):
  checks.check_modules_bind(saved["olmo2"], CASES["olmo2"], what, _identity(what))


def test_norm_labels_and_axes(saved):
  params = {p.label: p.value for p in pz.unbind_params(
      pzp.pretrained.load_hf(saved["olmo2"].folder))[1]}
  assert dict(params["transformer/block_1/attention/query_norm/scale.weights"].named_shape) == {
      "head_groups": 2, "query_heads": 2, "projection": 8}
  assert dict(params["transformer/block_1/attention/key_norm/scale.weights"].named_shape) == {
      "head_groups": 2, "projection": 8}
  assert "transformer/block_0/post_ffw_norm/scale.weights" in params
  assert not [label for label in params if "pre_" in label]


@pytest.mark.parametrize("changes, match", [
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"olmo_new_feature": 1}, "olmo_new_feature"),
])
def test_hostile_olmo2_configs_are_refused(saved, tmp_path, changes, match):
  folder = checks.edited(saved["olmo2"].folder, tmp_path, **changes)
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)
