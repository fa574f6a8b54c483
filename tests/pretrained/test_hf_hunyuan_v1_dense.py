"""Hunyuan dense (``model_type`` ``hunyuan_v1_dense``) against transformers,
with the checks of `hf_family_harness`: query/key norms after RoPE, and
``dynamic`` RoPE with ``alpha`` read as the fixed base transformers computes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks

_ALPHA = {"rope_type": "dynamic", "rope_theta": 10_000.0, "alpha": 1000.0, "factor": 1.0}


def _case(**fields):
  return checks.Case(transformers.HunYuanDenseV1Config, transformers.HunYuanDenseV1ForCausalLM,
                     dict({"num_key_value_heads": 2, "head_dim": 8}, **fields))


CASES = {
    "hunyuan_v1_dense": _case(),
    # Hunyuan-7B's RoPE (dynamic with alpha), attention biases, tied head.
    "hunyuan_v1_dense_alpha": _case(attention_bias=True, tie_word_embeddings=True,
                                    rope_parameters=_ALPHA),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


@pytest.mark.parametrize("case", CASES)
def test_kv_cache_and_greedy_generation_match_transformers(saved, case):
  checks.check_cached_decoding(saved[case])


def test_export_hf_round_trip(saved, tmp_path):
  checks.check_export(saved["hunyuan_v1_dense"], tmp_path, "hunyuan_v1_dense",
                      same_fields=("attention_bias", "tie_word_embeddings"))


def test_export_of_alpha_rope_writes_its_base(saved, tmp_path):
  """The fixed base ``alpha`` gives is written as a plain RoPE of that base:
  transformers reads the same model (its logits within float32 rounding)."""
  source = saved["hunyuan_v1_dense_alpha"]
  pzp.export_hf(pzp.pretrained.load_hf(source.folder), tmp_path / "out", like=source.folder)
  checks.assert_same_tensors(checks.tensors(tmp_path / "out"), checks.tensors(source.folder))
  written = checks.config(tmp_path / "out")
  assert written["rope_parameters"]["rope_type"] == "default"
  assert written["rope_parameters"]["rope_theta"] == pytest.approx(10_000.0 * 1000.0 ** (8 / 6))
  np.testing.assert_allclose(checks.reference_logits(
      transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()),
      source.reference, **checks.TOLERANCE)


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["hunyuan_v1_dense_alpha"], tmp_path)


def test_alpha_binds(saved):
  checks.check_feature_binds(saved["hunyuan_v1_dense_alpha"], CASES["hunyuan_v1_dense_alpha"],
                             rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})


def _norms_before_rope(model):
  """Each query/key norm moved before its RoPE (Qwen3's order)."""
  def swap(part):
    layers = list(part.sublayers)
    norm = next(i for i, layer in enumerate(layers) if isinstance(layer, pz.nn.RMSLayerNorm))
    layers[norm - 1], layers[norm] = layers[norm], layers[norm - 1]
    return dataclasses.replace(part, sublayers=layers)
  return pz.select(model).at_instances_of(pz.nn.Attention).apply(
      lambda a: dataclasses.replace(a, input_to_query=swap(a.input_to_query),
                                    input_to_key=swap(a.input_to_key)))


def test_norms_after_rope_bind(saved):
  """The same weights with the norms before RoPE move the logits beyond the
  tolerance; the norms themselves too (transformers without them)."""
  source = saved["hunyuan_v1_dense"]
  before = checks.penzai_logits(_norms_before_rope(pzp.pretrained.load_hf(source.folder)))
  assert np.abs(before - source.reference).max() > 100 * checks.TOLERANCE["atol"]

  def no_norms(model):
    import torch  # pylint: disable=import-outside-toplevel
    for layer in model.model.layers:
      layer.self_attn.query_layernorm = torch.nn.Identity()
      layer.self_attn.key_layernorm = torch.nn.Identity()
  checks.check_modules_bind(source, CASES["hunyuan_v1_dense"], "the query/key norms", no_norms)


@pytest.mark.parametrize("changes, match", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"rope_parameters": {**_ALPHA, "rope_type": "linear"}}, "alpha is read with rope type"),
    ({"rope_parameters": {**_ALPHA, "alpha": -1.0}}, "alpha must be a positive"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_hostile_configs_are_refused_before_building(saved, tmp_path, monkeypatch, changes,
                                                     match):
  checks.check_refused_before_building(
      checks.edited(saved["hunyuan_v1_dense_alpha"].folder, tmp_path, **changes), match,
      monkeypatch)
