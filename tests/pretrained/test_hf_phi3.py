"""Phi-3 / Phi-4 / Phi-4-mini (``model_type`` ``phi3``) through `load_hf`
and `export_hf`, against transformers, with the checks of `hf_family_harness`."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy
import transformers
import treescope
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.pretrained import errors
from pz_persist.nn.longrope import ApplyLongRoPE
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import stored_layout


def _case(**fields):
  return checks.Case(transformers.Phi3Config, transformers.Phi3ForCausalLM, fields)


def _factors(n: int, seed: int) -> list[float]:
  return [round(float(x), 4) for x in np.random.default_rng(seed).uniform(1.0, 6.0, n)]


CASES = {
    # Phi-3-mini / Phi-4 style: no scaling, grouped-query attention (the
    # fused qkv rows are 32 query, 16 key, 16 value), a window on every layer.
    "phi3": _case(num_key_value_heads=2, sliding_window=3),
    # Phi-3-128k style: longrope (original context 4 < the 8 test tokens,
    # so the long factors are used; factor from max_position_embeddings).
    "phi3_longrope": _case(max_position_embeddings=64, original_max_position_embeddings=4,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                            "short_factor": _factors(4, 0),
                                            "long_factor": _factors(4, 1)}),
    # Half of each head rotated, unscaled (Penzai's ApplyRoPEToSubset).
    "phi3_partial": _case(num_key_value_heads=1, partial_rotary_factor=0.5),
    # Phi-4-mini style: longrope on 3/4 of each head, tied embeddings, GQA.
    "phi4_mini": _case(hidden_size=64, num_key_value_heads=2, tie_word_embeddings=True,
                       max_position_embeddings=64, original_max_position_embeddings=16,
                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                        "partial_rotary_factor": 0.75,
                                        "short_factor": _factors(6, 2),
                                        "long_factor": _factors(6, 3)}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


@pytest.mark.parametrize("case", ["phi3_longrope"])
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved, case):
  checks.check_bfloat16(saved[case], case)


@pytest.mark.parametrize("case", [
    "phi3", pytest.param("phi4_mini", marks=pytest.mark.slow)])
def test_kv_cache_sampling_matches_the_forward_pass(saved, case):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved[case].folder))


def test_kv_cache_sampling_past_the_original_context_matches_transformers(saved):
  """Positions 3 to 7 cross longrope's original context (4): the prompt's
  keys are cached with the short factors' rotation and later ones with the
  long factors', in transformers' cache as in Penzai's."""
  case = saved["phi3_longrope"]
  checks.check_kv_cache_like_transformers(pzp.pretrained.load_hf(case.folder), case.hf_model)


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["phi4_mini"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "phi3" if case != "phi3" else None,
                      same_fields=("sliding_window", "tie_word_embeddings", "rope_parameters",
                                   *(("original_max_position_embeddings",)
                                     if "longrope" in str(CASES[case].fields) else ())))


def test_phi3_without_longrope_is_mistral_without_like(saved, tmp_path):
  """Phi-3 without longrope or partial rotary computes what Mistral's layout
  does: the model alone says Mistral (separate projections), and
  transformers' Mistral computes the same logits from the export."""
  model = pzp.pretrained.load_hf(saved["phi3"].folder)
  pzp.export_hf(model, tmp_path / "alone")
  assert checks.config(tmp_path / "alone")["model_type"] == "mistral"
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "alone", pad_token_id=0)
  np.testing.assert_allclose(checks.reference_logits(hf.eval()), saved["phi3"].reference,
                             atol=1e-5, rtol=1e-5)


def test_longrope_binds(saved):
  """The long factors (the test tokens run past the original context), the
  short ones, the attention factor and the partial rotary fraction each
  change transformers' logits."""
  case, params = CASES["phi3_longrope"], CASES["phi3_longrope"].fields["rope_parameters"]
  checks.check_feature_binds(saved["phi3_longrope"], case,
                             rope_parameters=dict(params, long_factor=[1.0] * 4))
  checks.check_feature_binds(saved["phi3_longrope"], case, rope_parameters=dict(
      params, attention_factor=1.0))
  checks.check_feature_binds(saved["phi3_longrope"], case, rope_parameters={
      "rope_type": "default", "rope_theta": 10000.0})
  mini, params = CASES["phi4_mini"], CASES["phi4_mini"].fields["rope_parameters"]
  checks.check_feature_binds(saved["phi4_mini"], mini,
                             rope_parameters=dict(params, partial_rotary_factor=1.0,
                                                  short_factor=[1.0] * 8, long_factor=[1.0] * 8))


def test_window_binds(saved):
  checks.check_feature_binds(saved["phi3"], CASES["phi3"], sliding_window=None)


def test_fused_tensors_split_by_rows(saved):
  """The query/key/value rows of ``qkv_proj`` land in Penzai's projections."""
  folder, hf = saved["phi3"].folder, saved["phi3"].hf_model
  params = {p.label: p.value for p in pz.unbind_params(pzp.pretrained.load_hf(folder))[1]}
  qkv = hf.model.layers[1].self_attn.qkv_proj.weight.detach().numpy()
  key = params["transformer/block_1/attention/key.weights"]
  np.testing.assert_array_equal(
      np.asarray(key.unwrap("head_groups", "projection", "embedding")).reshape(16, 32),
      qkv[32:48])
  gate_up = hf.model.layers[0].mlp.gate_up_proj.weight.detach().numpy()
  np.testing.assert_array_equal(
      np.asarray(params["transformer/block_0/mlp/value_linear.weights"].unwrap(
          "neurons", "embedding")), gate_up[64:])
  layers = pz.select(pzp.pretrained.load_hf(saved["phi4_mini"].folder)).at_instances_of(
      ApplyLongRoPE).get_sequence()
  assert layers and {layer.rotary_dim for layer in layers} == {12}


@pytest.mark.parametrize("changes, match", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 3,
                          "long_factor": [1.0] * 4}}, "short_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 4,
                          "long_factor": [1.0, 1.0, 1.0, -2.0]}}, "long_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 4,
                          "long_factor": ["1"] * 4}}, "long_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 4,
                          "long_factor": [1.0] * 4, "original_max_position_embeddings": 8}},
     "original_max_position_embeddings"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 4,
                          "long_factor": [1.0] * 4, "beta_fast": 3}}, "beta_fast"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    ({"attention_bias": True}, "attention_bias"),
    ({"resid_pdrop": 2}, "resid_pdrop"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"phi_new_feature": 1}, "phi_new_feature"),
])
def test_hostile_configs_are_refused(saved, tmp_path, changes, match, monkeypatch):
  folder = checks.edited(saved["phi3_longrope"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)


def test_fused_tensor_of_the_wrong_size_is_refused_before_reading(saved, tmp_path):
  """A ``qkv_proj`` with a row too few: named, with the size the config
  calls for, before anything is read."""
  folder = checks.edited(saved["phi3"].folder, tmp_path)
  tensors = safetensors.numpy.load_file(folder / "model.safetensors")
  tensors["model.layers.1.self_attn.qkv_proj.weight"] = tensors[
      "model.layers.1.self_attn.qkv_proj.weight"][:-1]
  safetensors.numpy.save_file(tensors, folder / "model.safetensors")
  with pytest.raises(errors.SafetensorsFormatError, match=r"qkv_proj.*\(63, 32\).*\(64, 32\)"):
    pzp.pretrained.load_hf(folder)


_PHI3_MINI_4K = {  # microsoft/Phi-3-mini-4k-instruct, shrunk.
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                 "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
    "embd_pdrop": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
    "max_position_embeddings": 4096, "model_type": "phi3", "original_max_position_embeddings": 4096,
    "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.2", "use_cache": True, **checks.TINY}

_PHI4_MINI = {  # microsoft/Phi-4-mini-instruct, shrunk (head_dim 16: 12 rotated).
    **_PHI3_MINI_4K, "hidden_size": 64, "full_attn_mod": 1, "interpolate_factor": 1,
    "lm_head_bias": False, "mlp_bias": False, "partial_rotary_factor": 0.75,
    "max_position_embeddings": 131072, "rope_theta": 10000.0, "sliding_window": 262144,
    "tie_word_embeddings": True,
    "rope_scaling": {"long_factor": _factors(6, 4), "short_factor": _factors(6, 5),
                     "type": "longrope"}}


@pytest.mark.parametrize("name, hub", [("Phi-3-mini-4k", _PHI3_MINI_4K),
                                       ("Phi-4-mini", _PHI4_MINI)])
def test_hub_configs(tmp_path, name, hub):
  saved = checks.hub_saved(tmp_path, hub)
  checks.check_float32(saved, name)


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  checks.check_cli_export_from_native(saved["phi4_mini"], tmp_path)


def test_bfloat16_export_is_bit_for_bit(tmp_path):
  checks.check_bfloat16_export(CASES["phi4_mini"], tmp_path)


def test_row_ranges_must_tile_the_fused_tensor():
  """Export stacks each projection's rows back into the fused tensor; ranges
  that overlap or leave a gap describe no tensor and are refused."""
  def spec(label, rows):
    return TensorSpec(label, "qkv", (rows[1] - rows[0], 2), ("a", "b"), stored=(6, 2), rows=rows)
  values = [np.full((2, 2), i, np.float32) for i in range(3)]
  tiled = [spec("q", (0, 2)), spec("k", (2, 4)), spec("v", (4, 6))]
  np.testing.assert_array_equal(stored_layout(tiled[::-1], values[::-1]),
                                np.repeat(np.arange(3, dtype=np.float32), 4).reshape(6, 2))
  for rows in [((0, 2), (1, 3), (4, 6)), ((0, 2), (2, 4), (5, 7))]:
    with pytest.raises(ValueError, match="do not cover its 6 rows"):
      stored_layout([spec(n, r) for n, r in zip("qkv", rows)], values)


def test_the_added_layers_render_in_treescope(saved):
  text = treescope.render_to_text(pzp.pretrained.load_hf(saved["phi4_mini"].folder))
  assert "ApplyLongRoPE(" in text and "rotary_dim=12" in text
