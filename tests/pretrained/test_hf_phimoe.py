"""Phi-3.5-MoE (``model_type`` ``phimoe``) through `load_hf` and
`export_hf`, against transformers, with the checks of `hf_family_harness`:
float32 logits, KV-cache sampling and greedy generation against
``generate``, export back, each feature binding (sparsemixer routing and its
``router_jitter_noise`` gap, LayerNorm biases, ``lm_head_bias``, Phi-3.5-MoE's
longrope and its mscales), hostile configs.

The longrope cases shrink the original context to 6 positions, so the
ten-token test sequences cross it (the largest position 9: ``long_mscale``)
and their first six tokens stay within it (``short_mscale``)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.nn import mixture_of_experts as moe
from pz_persist.nn.longrope import ApplyLongRoPE

LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 1.9, 2.6],
            "long_factor": [1.0, 2.5, 6.0, 11.0], "short_mscale": 1.1, "long_mscale": 1.4,
            "original_max_position_embeddings": 6}
"""Phi-3.5-MoE's RoPE dict, shrunk (four pairs per head, an original context
of six positions), its mscales made distinct."""

SHORT = checks.SEQUENCES[:, :6]
"""The test tokens that stay within the longrope cases' original context."""


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
    # Phi-3.5-MoE's longrope with distinct mscales (the Hub's are equal), its
    # original context shrunk to 6 positions, as transformers 5 writes it.
    "phimoe_longrope": _case(attention_bias=True, lm_head_bias=True, max_position_embeddings=64,
                             rope_parameters=LONGROPE),
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


@pytest.mark.parametrize("case", ["phimoe", "phimoe_longrope"])
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved, case):
  checks.check_bfloat16(saved[case], case)


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
    # Beyond the original context, cos and sin are scaled by long_mscale...
    ("phimoe_longrope", {"rope_parameters": dict(LONGROPE, long_mscale=1.1)}),
    # ... and divided by the short factors (no RoPE scaling at all differs).
    ("phimoe_longrope", {"rope_parameters": dict(LONGROPE, short_factor=[1.0] * 4)}),
    ("phimoe_longrope", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
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
    "auto_map": {"AutoConfig": "configuration_phimoe.PhiMoEConfig",
                 "AutoModelForCausalLM": "modeling_phimoe.PhiMoEForCausalLM"},
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_dropout": 0.0,
    "hidden_size": 32,
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
  """The Hub's config with its RoPE scaling dropped (the unscaled base)."""
  hub = {k: v for k, v in _PHI_3_5_MOE.items()
         if k not in ("rope_scaling", "original_max_position_embeddings")}
  checks.check_float32(checks.hub_saved(tmp_path, hub), "Phi-3.5-MoE (no longrope)")


def _hub_longrope(**changes) -> dict:
  """The Hub's config, its longrope kept, its original context shrunk to 6
  positions (in the dict and at the top level, as the Hub has both)."""
  hub = json.loads(json.dumps(_PHI_3_5_MOE))
  hub["original_max_position_embeddings"] = 6
  hub["rope_scaling"].update(original_max_position_embeddings=6, **changes)
  return hub


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
  return checks.hub_saved(tmp_path_factory.mktemp("hub_longrope"), _hub_longrope())


def test_the_hubs_longrope_matches_transformers_below_and_above_the_original_context(hub):
  """The Hub's own rope_scaling (``type``: ``longrope``, equal mscales):
  the whole sequences (positions 0-9, past the original context of 6) and
  their first six tokens (within it)."""
  model = pzp.pretrained.load_hf(hub.folder)
  assert pz.select(model).at_instances_of(ApplyLongRoPE).count() == 4  # Queries, keys; 2 layers.
  above = checks.float32_error(hub.folder, hub.reference)
  below_reference = checks.reference_logits(hub.hf_model, SHORT)
  np.testing.assert_allclose(checks.penzai_logits(model, SHORT), below_reference,
                             **checks.TOLERANCE)
  below = float(np.abs(checks.penzai_logits(model, SHORT) - below_reference).max())
  print(f"Phi-3.5-MoE (Hub longrope) float32 max |error|: above {above:.3g}, below {below:.3g}")


def test_the_hubs_longrope_generates_as_transformers_across_the_original_context(hub):
  """Greedy KV-cache generation from a 3-token prompt for 8 steps (sequence
  lengths 3 to 11, crossing 6) picks ``generate``'s tokens, token for token."""
  checks.check_generate(hub, steps=8, prompt=3)


def test_the_hubs_longrope_round_trips_through_export(hub, tmp_path):
  """Exported alone, the model's config holds the Hub's longrope (both
  factor lists, both mscales, the original context) and transformers
  computes exactly the Hub folder's logits from it."""
  out = tmp_path / "out"
  pzp.export_hf(pzp.pretrained.load_hf(hub.folder), out)
  written, original = checks.config(out), checks.config(hub.folder)
  rope = written["rope_parameters"]
  for key in ("short_factor", "long_factor", "short_mscale", "long_mscale",
              "original_max_position_embeddings"):
    assert rope[key] == original["rope_scaling"][key], key
  assert (rope["rope_type"], rope["rope_theta"]) == ("longrope", original["rope_theta"])
  assert written["original_max_position_embeddings"] == 6
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, pad_token_id=0).eval()
  np.testing.assert_array_equal(checks.reference_logits(reloaded), hub.reference)
  np.testing.assert_array_equal(checks.reference_logits(reloaded, SHORT),
                                checks.reference_logits(hub.hf_model, SHORT))


def test_kv_cache_fed_token_by_token_matches_transformers_cache(saved):
  """Without generate's recomputation at the crossing (Penzai's sampler
  from_uncached, transformers' model called with its cache), the keys cached
  within the original context keep short_mscale, on both sides."""
  checks.check_kv_cache_like_transformers(
      pzp.pretrained.load_hf(saved["phimoe_longrope"].folder), saved["phimoe_longrope"].hf_model)


def test_the_mscales_bind_where_transformers_applies_them(saved):
  """Our layer's mscales, each swapped for the other's value, move our logits
  exactly where transformers' do: short_mscale within the original context
  (not beyond), long_mscale beyond (not within); and transformers never
  applies long_factor (changing it changes nothing), nor do we."""
  model = pzp.pretrained.load_hf(saved["phimoe_longrope"].folder)
  full, short = saved["phimoe_longrope"].reference, checks.reference_logits(
      saved["phimoe_longrope"].hf_model, SHORT)
  np.testing.assert_allclose(checks.penzai_logits(model, SHORT), short, **checks.TOLERANCE)

  def swapped(**fields):
    return pz.select(model).at_instances_of(ApplyLongRoPE).apply(
        lambda layer: dataclasses.replace(layer, **fields))

  same_short = swapped(attention_factor=LONGROPE["long_mscale"])
  assert np.abs(checks.penzai_logits(same_short, SHORT) - short).max() > 100 * 1e-4
  np.testing.assert_allclose(checks.penzai_logits(same_short), full, **checks.TOLERANCE)
  same_long = swapped(long_attention_factor=LONGROPE["short_mscale"])
  assert np.abs(checks.penzai_logits(same_long) - full).max() > 100 * 1e-4
  np.testing.assert_allclose(checks.penzai_logits(same_long, SHORT), short, **checks.TOLERANCE)
  # Phi-3's longrope (long factors beyond the original context) is not it.
  as_phi3 = pz.select(model).at_instances_of(ApplyLongRoPE).apply(_as_phi3)
  assert np.abs(checks.penzai_logits(as_phi3) - full).max() > 100 * 1e-4
  other_long = dict(LONGROPE, long_factor=[1.0] * 4)
  hf = CASES["phimoe_longrope"].model_cls(CASES["phimoe_longrope"].config(
      rope_parameters=other_long))
  hf.load_state_dict(saved["phimoe_longrope"].hf_model.state_dict())
  np.testing.assert_array_equal(checks.reference_logits(hf.eval()), full)


def test_a_longrope_model_of_the_wrong_kind_is_not_exported_as_the_other(saved, tmp_path):
  """Phi-3's longrope (long factors beyond) on Phi-3.5-MoE's experts, and
  Phi-3.5-MoE's on a model exported as Phi-3, are refused by name."""
  model = pzp.pretrained.load_hf(saved["phimoe_longrope"].folder)
  as_phi3 = pz.select(model).at_instances_of(ApplyLongRoPE).apply(_as_phi3)
  with pytest.raises(pzp.pretrained.errors.ExportError, match="short ones"):
    pzp.export_hf(as_phi3, tmp_path / "a")


def _as_phi3(layer: ApplyLongRoPE) -> ApplyLongRoPE:
  """Phi-3's `ApplyLongRoPE` with ``layer``'s fields (long factors beyond
  the original context, one attention factor)."""
  return ApplyLongRoPE(**{field.name: getattr(layer, field.name)
                          for field in dataclasses.fields(ApplyLongRoPE)})


def test_the_longrope_model_survives_save_model_and_the_cli_export(saved, tmp_path):
  checks.check_save_model(saved["phimoe_longrope"], tmp_path / "a")
  checks.check_cli_export_from_native(saved["phimoe_longrope"], tmp_path / "b")


_HUB_ROPE = _PHI_3_5_MOE["rope_scaling"]


@pytest.mark.parametrize("rope, match", [
    (dict(_HUB_ROPE, type="su"), "rope_type"),
    (dict(_HUB_ROPE, type="yarn"), "rope_type"),
    (dict(_HUB_ROPE, type="longrope", rope_type="default"), "rope_type"),
    (dict(_HUB_ROPE, short_factor=[1.0, 1.0, 1.0]), "short_factor"),
    (dict(_HUB_ROPE, long_factor=[1.0, 1.0, 1.0, 1.0, 1.0]), "long_factor"),
    (dict(_HUB_ROPE, short_factor=[1.0, 0.0, 1.0, 1.0]), "short_factor"),
    (dict(_HUB_ROPE, long_factor=[1.0, -2.0, 1.0, 1.0]), "long_factor"),
    (dict(_HUB_ROPE, short_factor=[1.0, "2", 1.0, 1.0]), "short_factor"),
    (dict(_HUB_ROPE, long_factor=[1.0, True, 1.0, 1.0]), "long_factor"),
    (dict(_HUB_ROPE, short_factor=1.0), "short_factor"),
    (dict(_HUB_ROPE, long_factor=[1.0, float("nan"), 1.0, 1.0]), "long_factor"),
    (dict(_HUB_ROPE, short_factor=[1.0, float("inf"), 1.0, 1.0]), "short_factor"),
    ({k: v for k, v in _HUB_ROPE.items() if k != "short_mscale"}, "short_mscale"),
    ({k: v for k, v in _HUB_ROPE.items() if k != "long_mscale"}, "long_mscale"),
    ({k: v for k, v in _HUB_ROPE.items() if k != "long_factor"}, "long_factor"),
    (dict(_HUB_ROPE, short_mscale="1.2"), "short_mscale"),
    (dict(_HUB_ROPE, long_mscale=-1.2), "long_mscale"),
    (dict(_HUB_ROPE, long_mscale=0), "long_mscale"),
    (dict(_HUB_ROPE, short_mscale=float("nan")), "short_mscale"),
    (dict(_HUB_ROPE, long_mscale=float("inf")), "long_mscale"),
    (dict(_HUB_ROPE, short_mscale=True), "short_mscale"),
    (dict(_HUB_ROPE, factor=32.0), "factor"),
    (dict(_HUB_ROPE, attention_factor=1.2), "attention_factor"),
    (dict(_HUB_ROPE, mscale=1.2), "mscale"),
    (dict(_HUB_ROPE, partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(_HUB_ROPE, original_max_position_embeddings=2048), "original_max_position_embeddings"),
    (dict(_HUB_ROPE, original_max_position_embeddings=0), "original_max_position_embeddings"),
    (dict(_HUB_ROPE, original_max_position_embeddings=6.5), "original_max_position_embeddings"),
    (dict(_HUB_ROPE, rope_theta=500000.0), "rope_theta"),
    ([1, 2], "rope_scaling"),
])
def test_hostile_rope_scaling_is_refused_before_a_tensor_is_read(hub, tmp_path, rope, match,
                                                                 monkeypatch):
  """Each refused by name before a skeleton is built, so before a tensor is
  read (the original context is the Hub's 4096 here, at both places)."""
  folder = checks.edited(hub.folder, tmp_path, rope_scaling=rope,
                         original_max_position_embeddings=4096)
  checks.check_refused_before_building(folder, match, monkeypatch)


@pytest.mark.parametrize("changes, match", [
    # transformers uses the dict's; the top-level one contradicting it is refused.
    ({"original_max_position_embeddings": 8}, "original_max_position_embeddings"),
    # Both dicts, saying different things.
    ({"rope_parameters": dict(_HUB_ROPE, original_max_position_embeddings=6, long_mscale=2.0)},
     "rope_scaling"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_hostile_fields_beside_the_longrope_are_refused(hub, tmp_path, changes, match,
                                                        monkeypatch):
  folder = checks.edited(hub.folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)


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
