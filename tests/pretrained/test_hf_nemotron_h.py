"""Nemotron-H (one mixer per layer: Mamba-2, attention without positions, or
a squared-ReLU MLP) through `load_hf` and `export_hf`, against transformers
on tiny random models (no downloads)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest
import transformers
from penzai import pz
from penzai.models.transformer import model_parts

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist import errors
from pz_persist.nn.mamba2 import Mamba2
from pz_persist.pretrained.sampling import kv_caching_lm

_MAMBA = {"mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 8,
          "conv_kernel": 4, "chunk_size": 4, "num_key_value_heads": 2, "head_dim": 8}

CASES = {
    # Every mixer kind (transformers writes the pattern as layers_block_type), two
    # groups of B / C and of the gated norm, grouped-query attention, chunks
    # shorter than the sequences.
    "hybrid": harness.Case(transformers.NemotronHConfig, transformers.NemotronHForCausalLM, {
        **_MAMBA, "hybrid_override_pattern": "M*-M-"}),
    # transformers 5's spelling (layers_block_type), attention first, one
    # group, no convolution bias, a 3-tap convolution, tied embeddings, a time
    # step clipped below at 0.5 (transformers' mixers clip at time_step_min),
    # tie_word_embeddings (which transformers' Nemotron-H ignores), a wider attention head than hidden_size / heads.
    "attention_first": harness.Case(
        transformers.NemotronHConfig, transformers.NemotronHForCausalLM, {
            **_MAMBA, "layers_block_type": ["full_attention", "linear_attention", "mlp"],
            "n_groups": 1, "use_conv_bias": False, "conv_kernel": 3, "chunk_size": 128,
            "tie_word_embeddings": True, "time_step_min": 0.5, "head_dim": 16,
            "num_key_value_heads": 1}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return harness.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", ["hybrid", "attention_first"])
def test_float32_logits_match_transformers(saved, case):
  harness.check_float32(saved[case], case)


def test_the_hubs_spelling_loads_the_same(saved, tmp_path):
  """The Hub's configs give ``hybrid_override_pattern`` and
  ``num_hidden_layers`` (and fields transformers 5 no longer reads)."""
  folder = harness.edited(saved["hybrid"].folder, tmp_path, layers_block_type=harness.DELETE,
                          hybrid_override_pattern="M*-M-", num_hidden_layers=5,
                          rms_norm_eps=1e-5, time_step_rank=8, attention_head_dim=8)
  print("Hub spelling:", harness.float32_error(folder, saved["hybrid"].reference))


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  harness.check_bfloat16(saved["hybrid"], "hybrid")


def test_kv_cache_sampling_matches_a_forward_pass(saved):
  """A 3-token prompt, then one token per call: the mixers carry their
  convolution inputs and state, the attention its keys and values."""
  harness.check_kv_cache(pzp.pretrained.load_hf(saved["hybrid"].folder))


def test_greedy_generation_matches_transformers_generate(saved):
  """Token for token (and logit for logit) what ``generate`` picks with
  transformers' own cache (convolution, recurrent and key/value states)."""
  harness.check_generate(saved["hybrid"], steps=10, prompt=4)


def test_export_gives_back_the_folder(saved, tmp_path):
  """With ``like`` and from the model alone (one residual per block, no
  RoPE: Nemotron-H)."""
  harness.check_export(saved["attention_first"], tmp_path, "nemotron_h",
                       same_fields=("layers_block_type", "n_groups",
                                    "use_conv_bias", "conv_kernel", "time_step_min",
                                    "head_dim", "num_key_value_heads"))


@pytest.mark.slow
def test_export_with_like_of_the_hub_spelling(saved, tmp_path):
  harness.check_export(saved["hybrid"], tmp_path, None)


@pytest.mark.slow
def test_save_model_round_trip_and_cli_export(saved, tmp_path):
  harness.check_save_model(saved["hybrid"], tmp_path)
  harness.check_cli_export_from_native(saved["attention_first"], tmp_path / "cli")


def test_each_feature_binds(saved):
  """Each piece moves the logits far from transformers' when taken out of
  the loaded model: the squared ReLU (plain ReLU instead), RoPE added to the
  attention, the mixers' ``D`` skip; in transformers (same weights), the
  gated norm's groups, the time step's lower clip (``time_step_min``) and
  the per-layer norm (made the identity)."""
  hybrid = saved["hybrid"]
  model = pzp.pretrained.load_hf(hybrid.folder)
  print("plain ReLU:", harness.check_penzai_edit_binds(
      pz.select(model).at_instances_of(pz.nn.Elementwise).where(
          lambda e: e.fn is jnp.square).remove_from_parent(), hybrid.reference))
  print("with RoPE:", harness.check_penzai_edit_binds(
      pz.select(model).at_instances_of(pz.nn.Attention).apply(
          lambda a: dataclasses.replace(a, input_to_key=pz.nn.Sequential([
              a.input_to_key, pz.nn.ApplyRoPE(
                  embedding_axis="projection", max_wavelength=10_000.0,
                  positions_input_name="token_positions")]))),
      hybrid.reference))
  print("without D:", harness.check_penzai_edit_binds(pz.select(model).at_instances_of(Mamba2).apply(
      lambda m: dataclasses.replace(m, skip=pz.Parameter(
          value=pz.nx.nmap(jnp.zeros_like)(m.skip.value), label=m.skip.label))),
      hybrid.reference))
  assert len(pz.select(model).at_instances_of(model_parts.TransformerBlock).get_sequence()) == 5
  harness.check_modules_bind(hybrid, CASES["hybrid"], "the gated norm's groups",
                             lambda hf: [setattr(layer.mixer.norm, "group_size", 64)
                                         for layer in hf.model.layers
                                         if layer.block_type == "linear_attention"])
  harness.check_modules_bind(hybrid, CASES["hybrid"], "the layer norms",
                             lambda hf: [layer.norm.weight.data.fill_(1.0)
                                         for layer in hf.model.layers])
  clipped = saved["attention_first"]
  harness.check_feature_binds(clipped, CASES["attention_first"], time_step_min=1e-4)


def test_penzai_blocks_hold_one_residual_each(saved):
  model = pzp.pretrained.load_hf(saved["hybrid"].folder)
  for block in pz.select(model).at_instances_of(model_parts.TransformerBlock).get_sequence():
    assert len(block.sublayers) == 1 and isinstance(block.sublayers[0], pz.nn.Residual)
  assert not pz.select(model).at_instances_of(pz.nn.ApplyRoPE).count()
  sampler = kv_caching_lm(model, cache_len=8, batch_axes={"batch": 1})
  assert sampler is not None


@pytest.mark.parametrize("changes, match", [
    # A pattern whose length is not the layer count (transformers only warns).
    ({"num_hidden_layers": 4}, "num_hidden_layers"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"layers_block_type": harness.DELETE, "hybrid_override_pattern": "M*-M"},
     "num_hidden_layers"),  # Four layers in the pattern, five in the weights.
    ({"hybrid_override_pattern": "M*-MM"}, "hybrid_override_pattern"),
    ({"layers_block_type": harness.DELETE}, "hybrid_override_pattern"),
    ({"hybrid_override_pattern": "M*X"}, "hybrid_override_pattern"),
    ({"layers_block_type": []}, "layers_block_type"),
    ({"mamba_num_heads": 3}, "n_groups"),
    ({"n_groups": 3}, "n_groups"),
    ({"use_bias": True}, "use_bias"),
    ({"mamba_proj_bias": True}, "mamba_proj_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"sliding_window": 4}, "sliding_window"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
    ({"mamba_ssm_cache_dtype": "bfloat16"}, "mamba_ssm_cache_dtype"),
    ({"conv_kernel": 0}, "conv_kernel"),
    ({"time_step_min": -1.0}, "time_step_min"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters"),
    ({"mamba_n_groups": 2}, "mamba_n_groups"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  folder = harness.edited(saved["hybrid"].folder, tmp_path, **changes)
  harness.check_refused_before_building(folder, match, monkeypatch)


def test_a_folder_without_its_head_is_refused(saved, tmp_path):
  """transformers never ties Nemotron-H's head, even under
  ``tie_word_embeddings``: without ``lm_head.weight`` it would draw one."""
  import safetensors.numpy  # pylint: disable=import-outside-toplevel
  folder = harness.edited(saved["attention_first"].folder, tmp_path)
  weights = harness.tensors(folder)
  del weights["lm_head.weight"]
  for name in folder.iterdir():
    if name.suffix == ".safetensors" or name.name.endswith(".index.json"):
      name.unlink()
  safetensors.numpy.save_file(weights, folder / "model.safetensors")
  with pytest.raises(errors.UnsupportedConfigError, match="lm_head"):
    pzp.pretrained.load_hf(folder)


def test_a_wrongly_sized_fused_projection_is_refused(saved, tmp_path):
  """``ssm_state_size`` that does not fit ``in_proj``'s stored rows is
  refused from the safetensors header, before a tensor is read."""
  folder = harness.edited(saved["hybrid"].folder, tmp_path, ssm_state_size=4)
  with pytest.raises(errors.PzPersistError, match="in_proj"):
    pzp.pretrained.load_hf(folder)


def test_a_model_without_mixers_exports_alone(tmp_path_factory, tmp_path):
  """Attention and MLP layers only (transformers cannot run a Nemotron-H
  without attention: its cache asks an attention layer for the length):
  the mixers' fields are the defaults, and transformers loads what is
  written."""
  case = harness.Case(transformers.NemotronHConfig, transformers.NemotronHForCausalLM, {
      **_MAMBA, "hybrid_override_pattern": "*-*"})
  saved = harness.saved_cases(tmp_path_factory, {"plain": case})
  harness.check_export(saved["plain"], tmp_path, "nemotron_h",
                       same_fields=("layers_block_type", "num_attention_heads",
                                    "num_key_value_heads", "head_dim", "intermediate_size"))
