"""LiquidAI LFM2-MoE (``lfm2_moe``) through `load_hf` and `export_hf`, against
transformers on tiny random models (no downloads).

LFM2's layers (tests/pretrained/test_hf_lfm2.py covers the convolutions)
with a sigmoid-routed mixture of experts after the first
``num_dense_layers``: each routing feature (the expert bias, used for
choosing only; ``norm_topk_prob``; ``routed_scaling_factor``) is shown to
bind. transformers keeps ``expert_bias`` as a buffer, left at zero by the
harness's draw of the parameters: the tests draw it too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist import errors
from pz_persist.nn import mixture_of_experts as moe

_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}

CASES = {
    # One dense layer, then experts under conv and attention layers; the
    # expert bias on, top-k renormalised, scaled.
    "routed": harness.Case(transformers.Lfm2MoeConfig, transformers.Lfm2MoeForCausalLM, {
        **_MOE, "num_hidden_layers": 4, "num_key_value_heads": 2, "num_dense_layers": 1,
        "layer_types": ["conv", "full_attention", "conv", "conv"],
        "routed_scaling_factor": 1.5}),
    # No dense layer, no expert bias, no renormalisation, untied, biased convolutions.
    "plain": harness.Case(transformers.Lfm2MoeConfig, transformers.Lfm2MoeForCausalLM, {
        **_MOE, "num_hidden_layers": 2, "num_key_value_heads": 1, "num_dense_layers": 0,
        "layer_types": ["full_attention", "conv"], "use_expert_bias": False,
        "norm_topk_prob": False, "tie_word_embeddings": False, "conv_bias": True}),
}


def _with_expert_bias(model: torch.nn.Module) -> torch.nn.Module:
  """``model`` with every ``expert_bias`` buffer drawn (large enough to
  change which experts are chosen)."""
  generator = torch.Generator().manual_seed(2)
  with torch.no_grad():
    for name, buffer in model.named_buffers():
      if name.endswith("expert_bias"):
        buffer.copy_(torch.randn(buffer.shape, generator=generator))
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  result = {}
  for name, case in CASES.items():
    model = _with_expert_bias(case.make())
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder, safe_serialization=True)
    result[name] = harness.Saved(folder, model, harness.reference_logits(model))
  return result


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  harness.check_float32(saved[case], case)


def test_layers_are_dense_then_mixtures(saved):
  model = pzp.pretrained.load_hf(saved["routed"].folder)
  found = pz.select(model).at_instances_of(moe.MixtureOfExperts).get_sequence()
  assert len(found) == 3
  assert all(layer.router.score == "sigmoid" and layer.router.selection_bias is not None
             for layer in found)


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  harness.check_bfloat16(saved["routed"], "routed")


def test_kv_cache_sampling_matches_forward_pass(saved):
  model = pzp.pretrained.load_hf(saved["routed"].folder)
  harness.check_kv_cache(model)


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_matches_generate(saved, case):
  harness.check_generate(saved[case])


def test_save_model_round_trip(saved, tmp_path):
  harness.check_save_model(saved["routed"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_gives_back_the_folder(saved, tmp_path, case):
  harness.check_export(saved[case], tmp_path, "lfm2_moe",
                       same_fields=("layer_types", "num_dense_layers", "use_expert_bias",
                                    "norm_topk_prob", "routed_scaling_factor"))


@pytest.mark.slow
def test_bfloat16_export_is_bit_exact(tmp_path):
  harness.check_bfloat16_export(CASES["routed"], tmp_path)


@pytest.mark.parametrize("off", [{"norm_topk_prob": False}, {"routed_scaling_factor": 1.0},
                                 {"use_expert_bias": False}])
def test_routing_features_bind(saved, off):
  case = CASES["routed"]
  model = case.model_cls(case.config(**off))
  model.load_state_dict(saved["routed"].hf_model.state_dict(), strict=False)
  changed = float(np.abs(harness.reference_logits(model.eval()) - saved["routed"].reference).max())
  print(f"without {off}: logits change by {changed:.3g}")
  assert changed > 100 * harness.TOLERANCE["atol"]


def test_expert_bias_binds(saved):
  harness.check_modules_bind(saved["routed"], CASES["routed"], "the expert bias", lambda m: [
      layer.feed_forward.expert_bias.zero_() for layer in m.model.layers[1:]])


_HOSTILE = [
    ({"num_experts": 5}, "num_experts"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"layer_types": None}, "layer_types"),
    ({"num_experts": 0}, "num_experts"),
    ({"routed_scaling_factor": -1.0}, "routed_scaling_factor"),
    ({"num_dense_layers": -1}, "num_dense_layers"),
    ({"use_expert_bias": "yes"}, "use_expert_bias"),
    ({"block_auto_adjust_ff_dim": True}, "block_auto_adjust_ff_dim"),
]


@pytest.mark.parametrize("changes,match", _HOSTILE)
def test_hostile_configs_are_refused(saved, tmp_path, monkeypatch, changes, match):
  folder = harness.edited(saved["routed"].folder, tmp_path, **{
      k: harness.DELETE if v is None else v for k, v in changes.items()})
  with pytest.raises(errors.PzPersistError, match=match):
    pzp.pretrained.load_hf(folder)
