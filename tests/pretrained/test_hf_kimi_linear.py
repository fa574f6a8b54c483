"""Kimi-Linear (``kimi_linear``) through `load_hf` and `export_hf`, against
transformers on tiny random models (no downloads): Kimi Delta Attention
layers (per-channel decay, sigmoid-gated norm, state carried by the sampler)
beside NoPE latent attention, dense and DeepSeek-style expert MLPs."""

from __future__ import annotations

import hypothesis
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hypothesis import strategies as st
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist import errors
from pz_persist.nn import latent_attention as mla
from pz_persist.nn import mixture_of_experts as moe
from pz_persist.nn.gated_delta_net import CachingGatedDeltaNet
from pz_persist.nn.kimi_delta_attention import CachingKimiDeltaAttention
from pz_persist.nn.kimi_delta_attention import KimiDeltaAttention

_COMMON = {"hidden_size": 32, "vocab_size": 64, "pad_token_id": 0, "bos_token_id": 1,
           "eos_token_id": 2, "intermediate_size": 48, "moe_intermediate_size": 16,
           "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
           "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
           "num_local_experts": 4, "num_experts_per_tok": 2, "linear_head_dim": 8,
           "linear_num_heads": 4, "q_lora_rank": None}

CASES = {
    # KDA, latent attention, KDA; the first layer dense (transformers' default).
    "mixed": harness.Case(transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM,
                          {**_COMMON, "num_hidden_layers": 3,
                           "layer_types": ["linear_attention", "full_attention",
                                           "linear_attention"]}),
    # The default layer pattern (layer 4 full), a low-rank query, two
    # expert groups, no renormalisation, a 3-tap convolution, tied.
    "grouped": harness.Case(transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM,
                            {**_COMMON, "num_hidden_layers": 5, "q_lora_rank": 12,
                             "n_group": 2, "topk_group": 1, "norm_topk_prob": False,
                             "linear_conv_kernel_dim": 3, "tie_word_embeddings": True,
                             "mlp_layer_types": ["sparse", "dense", "sparse", "sparse", "dense"]}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return harness.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  print(case, harness.check_float32(saved[case], case))


def test_layers_are_what_the_config_says(saved):
  model = pzp.pretrained.load_hf(saved["grouped"].folder)
  assert len(pz.select(model).at_instances_of(KimiDeltaAttention).get_sequence()) == 4
  assert len(pz.select(model).at_instances_of(mla.LatentAttentionLogits).get_sequence()) == 1
  assert len(pz.select(model).at_instances_of(moe.MixtureOfExperts).get_sequence()) == 3


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_matches_generate(saved, case):
  harness.check_generate(saved[case])


def test_kv_cache_sampling_matches_a_forward_pass(saved):
  harness.check_kv_cache(pzp.pretrained.load_hf(saved["mixed"].folder))


def test_save_model_round_trip(saved, tmp_path):
  harness.check_save_model(saved["mixed"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_gives_back_the_folder(saved, tmp_path, case):
  """(``tie_word_embeddings`` is kept from ``like`` only: transformers'
  Kimi-Linear never ties its head, so the model cannot say.)"""
  harness.check_export(saved[case], tmp_path, "kimi_linear",
                       same_fields=("layer_types", "mlp_layer_types", "moe_renormalize",
                                    "linear_conv_kernel_dim", "num_expert_group", "q_lora_rank"))


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  harness.check_bfloat16(saved["mixed"], "mixed")


def _scaled(name: str, factor: float):
  def edit(model):
    with torch.no_grad():
      for layer_name, param in model.named_parameters():
        if layer_name.endswith(name):
          param.mul_(factor)
  return edit


@pytest.mark.parametrize("what,edit", [
    # Per-channel decay: dt_bias differing within a head.
    ("the per-channel decay bias", lambda m: [
        layer.self_attn.forget_gate.dt_bias.data.copy_(torch.linspace(-4, 4, 32))
        for layer in m.model.layers if hasattr(layer.self_attn, "forget_gate")]),
    ("the decay rate A_log", _scaled("A_log", 3.0)),
    ("the output gate", _scaled("g_b_proj.weight", 4.0)),
    ("the write strength", _scaled("b_proj.weight", 4.0)),
    ("the short convolutions", _scaled("conv1d.weight", -1.0)),
    ("the routing bias", lambda m: [
        layer.mlp.gate.e_score_correction_bias.data.copy_(torch.tensor([5.0, -5.0, 5.0, -5.0]))
        for layer in m.model.layers if hasattr(layer.mlp, "gate")]),
])
def test_features_bind(saved, what, edit):
  print(what, harness.check_modules_bind(saved["mixed"], CASES["mixed"], what, edit))


def test_the_kda_layer_is_its_own_sampling_form(saved):
  """`kv_caching_lm` wraps each KDA layer once, in its own class."""
  sampler = pzp.pretrained.kv_caching_lm(pzp.pretrained.load_hf(saved["mixed"].folder),
                                         cache_len=8, batch_axes={"batch": 1})
  assert len(pz.select(sampler).at_instances_of(CachingKimiDeltaAttention).get_sequence()) == 2
  assert not pz.select(sampler).at_instances_of(CachingGatedDeltaNet).get_sequence()


_HOSTILE = [
    ({"layer_types": ["linear_attention"] * 2}, "layer_types"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"mlp_layer_types": ["dense"]}, "mlp_layer_types"),
    ({"num_experts": 5}, "n_routed_experts"),
    ({"num_experts_per_token": 5}, "num_experts_per_tok"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"linear_attn_config": {"num_heads": 4, "gate_low_rank": 3}}, "gate_low_rank"),
    ({"layer_types": None, "linear_attn_config": {"full_attn_layers": [2, 9],
                                                  "kda_layers": [1, 3]}}, "full_attn_layers"),
    ({"layer_types": None, "linear_attn_config": {"full_attn_layers": [2],
                                                  "kda_layers": [1]}}, "full_attn_layers"),
    ({"linear_attn_config": {"head_dim": -1}}, "linear_head_dim"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
]


@pytest.mark.parametrize("changes,match", _HOSTILE)
def test_hostile_configs_are_refused(saved, tmp_path, changes, match):
  folder = harness.edited(saved["mixed"].folder, tmp_path, **changes)
  with pytest.raises(errors.PzPersistError, match=match):
    pzp.pretrained.load_hf(folder)


def test_the_hub_layer_lists_are_read(saved, tmp_path):
  """``linear_attn_config``'s 1-indexed lists (the Hub's spelling) give the
  same model as ``layer_types``."""
  folder = harness.edited(saved["mixed"].folder, tmp_path, layer_types=None,
                          linear_attn_config={"full_attn_layers": [2], "kda_layers": [1, 3],
                                              "head_dim": 8, "num_heads": 4,
                                              "short_conv_kernel_size": 4})
  got = harness.penzai_logits(pzp.pretrained.load_hf(folder))
  np.testing.assert_allclose(got, saved["mixed"].reference, **harness.TOLERANCE)


@pytest.fixture(scope="module")
def kda_layer(saved):
  model = pzp.pretrained.load_hf(saved["mixed"].folder)
  return pz.select(model).at_instances_of(KimiDeltaAttention).get_sequence()[0]


@pytest.mark.slow  # Each new piece length compiles anew (minutes on two busy cores).
@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(cuts=st.lists(st.integers(1, 11), max_size=4, unique=True), seed=st.integers(0, 99))
def test_kda_in_pieces_is_kda_whole(kda_layer, cuts, seed):
  """The sampling form fed a sequence in any pieces gives the whole call's
  outputs (the state carries the convolutions' and the recurrence's past)."""
  x = pz.nx.wrap(jnp.asarray(np.random.default_rng(seed).normal(size=(2, 12, 32)),
                             jnp.float32), "batch", "seq", "embedding")
  whole = kda_layer(x).untag("batch", "seq", "embedding").unwrap()
  cached = CachingKimiDeltaAttention.from_uncached(kda_layer, {"batch": 2}, label="state")
  bounds = [0, *sorted(cuts), 12]
  pieces = [cached(x[{"seq": pz.slice[a:b]}]).untag("batch", "seq", "embedding").unwrap()
            for a, b in zip(bounds, bounds[1:])]
  np.testing.assert_allclose(np.concatenate(pieces, 1), whole, atol=1e-5, rtol=1e-5)


def test_surgery_lora_an_inserted_layer_and_sampling_around_kimi_delta_attention(saved, tmp_path):
  """Issue 40 §3: `KimiDeltaAttention` is a Penzai layer others can edit.
  LoRA on its query and output projections (zero-initialised: nothing
  changes), a layer inserted after it (the logits move), the edited model
  sampled with `kv_caching_lm` (each layer becomes a
  `CachingKimiDeltaAttention`, not a plain DeltaNet's form), and
  ``save_model`` bringing the edit back exactly."""
  import jax
  from penzai.toolshed import lora

  from pz_persist.pretrained import kv_caching_lm

  model = pzp.pretrained.load_hf(saved["mixed"].folder)
  reference = harness.penzai_logits(model)
  adapted = lora.loraify_linears_in_selection(
      pz.select(model).at_instances_of(KimiDeltaAttention).at(
          lambda layer: (layer.query, layer.output), multiple=True),
      rank=2, init_base_rng=jax.random.key(3))
  layers = pz.select(adapted).at_instances_of(KimiDeltaAttention).count()
  assert layers and pz.select(adapted).at_instances_of(lora.LowRankAdapter).count() == 2 * layers
  np.testing.assert_allclose(harness.penzai_logits(adapted), reference, atol=1e-5)
  inserted = pz.select(adapted).at_instances_of(KimiDeltaAttention).apply(
      lambda layer: pz.nn.Sequential([layer, pz.nn.ConstantRescale(by=0.5)]))
  assert float(np.abs(harness.penzai_logits(inserted) - reference).max()) > 1e-2
  sampler = kv_caching_lm(inserted, cache_len=8, batch_axes={"batch": 1})
  assert pz.select(sampler).at_instances_of(CachingKimiDeltaAttention).count() == layers
  assert not pz.select(sampler).at_instances_of(CachingGatedDeltaNet).where(
      lambda cached: type(cached) is CachingGatedDeltaNet).count()  # pylint: disable=unidiomatic-typecheck
  harness.check_save_model_round_trip(inserted, tmp_path / "edited",
                                      harness.penzai_logits(inserted))
