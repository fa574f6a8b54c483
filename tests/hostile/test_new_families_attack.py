"""An outside review of round 5's state-space and latent families: each
family's real Hub ``config.json`` (every field kept, the sizes shrunk), a
random model of it built by transformers, loaded by pz_persist.

What these cases found (each a config transformers reads and pz_persist
refused, or read differently):

- Kimi-Linear-48B-A3B writes ``head_dim`` as ``hidden_size /
  num_attention_heads`` (72), a field transformers' Kimi-Linear never reads
  (its latent attention has no RoPE); it was refused as not DeepSeek-V3's
  derived ``qk_rope_head_dim``.
- Nemotron-H configs written by transformers 4.x spell ``layers_block_type``
  with the older ``mamba`` / ``attention``, which transformers 5 remaps.
- Jamba-v0.1's first ``config.json`` (for AI21's remote code) holds
  ``n_ctx`` and ``calc_logits_for_entire_prompt``, which change no logit;
  exported with ``like`` a folder leaving the layer pattern to JambaConfig's
  defaults, another (equivalent) period was written.
- Gemma 3n's activation sparsity cutoff used XLA's float32 erfinv, 2 ulps
  from torch's icdf at 0.95: on the Hub's ten-layer pattern the logits were
  7.9e-5 from transformers' float32 (4.1e-5 now; transformers' own float32
  is 2.2e-5 from float64). And `hf_family_harness.hub_saved` built its
  reference in the config's bfloat16 before casting, so Gemma's embedding
  scales stayed rounded (0.015 on the logits).
"""

from __future__ import annotations

import hypothesis
import numpy as np
import pytest
import torch
import transformers
from hypothesis import strategies as st
from pretrained import hf_family_harness as harness

import pz_persist as pzp
from pz_persist import errors
from pz_persist.nn import altup

_KIMI_48B = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "first_k_dense_replace": 1,
    "head_dim": 72, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64,
    "kv_lora_rank": 8, "linear_attn_config": {
        "full_attn_layers": [4], "head_dim": 8, "kda_layers": [1, 2, 3], "num_heads": 4,
        "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "moe_intermediate_size": 16,
    "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 4, "num_expert_group": 1, "num_experts": 8, "num_experts_per_token": 2,
    "num_hidden_layers": 4, "num_key_value_heads": 4, "num_nextn_predict_layers": 0,
    "num_shared_experts": 1, "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "use_cache": True, "use_grouped_topk": True, "v_head_dim": 8, "vocab_size": 64,
    "dtype": "bfloat16"}
"""moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json, shrunk (its
``head_dim`` 72 kept: 2304 / 32)."""

_NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
    "attention_head_dim": 8, "head_dim": 8, "chunk_size": 128, "conv_kernel": 4, "expand": 2,
    "hidden_size": 32, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 8,
    "mamba_hidden_act": "silu", "mamba_num_heads": 8, "mlp_hidden_act": "relu2", "n_groups": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_logits_to_keep": 1,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "rescale_prenorm_residual": True,
    "residual_in_fp32": False, "ssm_state_size": 8, "tie_word_embeddings": False,
    "time_step_limit": [0.0, float("inf")], "use_bias": False, "use_conv_bias": True,
    "intermediate_size": 64, "vocab_size": 64}
"""nvidia/NVIDIA-Nemotron-Nano-9B-v2's config.json, shrunk (the layers given
below)."""

_JAMBA_V01 = {
    "architectures": ["JambaForCausalLM"], "model_type": "jamba", "attn_layer_offset": 4,
    "attn_layer_period": 8, "bos_token_id": 1, "eos_token_id": 2, "expert_layer_offset": 1,
    "expert_layer_period": 2, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64,
    "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_state": 8, "mamba_dt_rank": 4,
    "mamba_expand": 2, "mamba_proj_bias": False, "max_position_embeddings": 262144,
    "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
    "num_hidden_layers": 8, "num_key_value_heads": 2, "pad_token_id": 0, "rms_norm_eps": 1e-06,
    "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
    "use_mamba_kernels": True, "vocab_size": 64, "n_ctx": 262144,
    "calc_logits_for_entire_prompt": False}
"""ai21labs/Jamba-v0.1's first config.json, shrunk (attention on layer 4 of
8, experts on the odd layers)."""


def _matches_transformers(saved: harness.Saved) -> float:
  """float32 logits within the harness's tolerance of transformers'; returns
  the largest difference."""
  return harness.float32_error(saved.folder, saved.reference)


def test_kimi_linear_hub_head_dim_is_read_as_transformers_reads_it(tmp_path):
  """transformers' Kimi-Linear reads neither ``head_dim`` nor
  ``qk_head_dim``: any value loads the same model."""
  saved = harness.hub_saved(tmp_path, _KIMI_48B)
  print("Kimi-Linear-48B shrunk, float32:", _matches_transformers(saved))
  odd = harness.edited(saved.folder, tmp_path, head_dim=5, qk_head_dim=7)
  assert harness.float32_error(odd, saved.reference) < 1e-4


def test_a_head_dim_deepseek_reads_is_still_refused(tmp_path):
  """DeepSeek-V3's RoPE sizes itself from ``head_dim`` when a file gives one:
  one other than ``qk_rope_head_dim`` stays refused, naming the field."""
  case = harness.Case(transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, {
      "num_hidden_layers": 1, "kv_lora_rank": 8, "q_lora_rank": None, "qk_nope_head_dim": 8,
      "qk_rope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 1,
      "num_key_value_heads": 4})
  folder = tmp_path / "src"
  case.make().save_pretrained(folder, safe_serialization=True)
  with pytest.raises(errors.UnsupportedConfigError, match="head_dim"):
    pzp.pretrained.load_hf(harness.edited(folder, tmp_path, head_dim=72))


@pytest.mark.parametrize("spelling", [
    {"hybrid_override_pattern": "M-M*-E"},
    {"layers_block_type": ["mamba", "mlp", "mamba", "attention", "mlp", "moe"]},
    {"layers_block_type": ["linear_attention", "mlp", "mamba", "full_attention", "mlp", "moe"]},
])
def test_nemotron_h_older_layer_type_names_load(tmp_path, spelling):
  """``layers_block_type`` in transformers 4.x's names (``mamba``,
  ``attention``), mixed or not with 5's, gives the pattern's model."""
  saved = harness.hub_saved(tmp_path, {
      **_NEMOTRON_H, **spelling, "num_hidden_layers": 6, "n_routed_experts": 4,
      "num_experts_per_tok": 2, "moe_intermediate_size": 16,
      "moe_shared_expert_intermediate_size": 24, "n_group": 1, "topk_group": 1})
  print(spelling, "float32:", _matches_transformers(saved))


@pytest.mark.parametrize("layer_types", [["mamba", "attn"], ["mamba", 3], []])
def test_nemotron_h_unknown_layer_type_names_are_refused(tmp_path, layer_types):
  saved = harness.hub_saved(tmp_path, {**_NEMOTRON_H, "hybrid_override_pattern": "M*",
                                       "num_hidden_layers": 2})
  folder = harness.edited(saved.folder, tmp_path, hybrid_override_pattern=harness.DELETE,
                          layers_block_type=layer_types)
  with pytest.raises(errors.UnsupportedConfigError, match="layers_block_type"):
    pzp.pretrained.load_hf(folder)


@pytest.mark.slow
def test_jamba_v01_first_config_loads_and_generates(tmp_path):
  """Jamba-v0.1's remote-code fields change nothing; its 8-layer pattern
  matches transformers and greedy generation from a one-token prompt
  (float32 rounding over 8 layers of random weights: see the guide)."""
  saved = harness.hub_saved(tmp_path, _JAMBA_V01)
  error = float(np.abs(harness.penzai_logits(pzp.pretrained.load_hf(saved.folder))
                       - saved.reference).max())
  print("Jamba-v0.1 shrunk, float32:", error)
  assert error < 5e-4
  harness.check_generate(saved, steps=10, prompt=1)


def test_jamba_export_keeps_the_pattern_fields_like_leaves_out(tmp_path):
  """A Jamba folder leaving the layer pattern to JambaConfig's defaults
  (attention on layer 4 of every 8, experts on the odd layers): the export
  with ``like`` writes those very fields (it wrote period 5, the smallest
  that fits 8 layers: the same model, another config), and transformers
  reads the same config and logits back."""
  pattern = ("attn_layer_period", "attn_layer_offset", "expert_layer_period",
             "expert_layer_offset")
  saved = harness.hub_saved(tmp_path, {k: v for k, v in _JAMBA_V01.items()
                                       if k not in pattern and k not in ("n_ctx",
                                       "calc_logits_for_entire_prompt")})
  out = tmp_path / "out"
  pzp.export_hf(pzp.pretrained.load_hf(saved.folder), out, like=saved.folder)
  written = harness.config(out)
  assert [written[k] for k in pattern] == [8, 4, 2, 1]
  np.testing.assert_array_equal(harness.reference_logits(
      transformers.AutoModelForCausalLM.from_pretrained(out).eval()), saved.reference)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(sparsity=st.floats(1e-4, 1 - 1e-4))
def test_gaussian_top_k_cutoff_is_torch_icdf_bit_for_bit(sparsity):
  """Gemma 3n's activation sparsity multiplier equals torch's float32
  ``Normal(0, 1).icdf`` exactly (XLA's float32 erfinv was 2 ulps off at
  0.95, the Hub's value)."""
  want = torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(sparsity, dtype=torch.float32))
  assert float(altup._std_multiplier(sparsity)) == want.item()


_GEMMA3N_E2B = {
    "architectures": ["Gemma3nForCausalLM"], "model_type": "gemma3n_text",
    "activation_sparsity_pattern": [0.95] * 3 + [0.0] * 7, "altup_active_idx": 0,
    "altup_coef_clip": 120.0, "altup_correct_scale": True, "altup_lr_multiplier": 1.0,
    "altup_num_inputs": 4, "final_logit_softcapping": 30.0, "head_dim": 8,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 32, "hidden_size_per_layer_input": 4,
    "intermediate_size": [64] * 10, "laurel_rank": 4,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 2,
    "num_attention_heads": 4, "num_hidden_layers": 10, "num_key_value_heads": 2,
    "num_kv_shared_layers": 4, "query_pre_attn_scalar": 8, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": 3, "torch_dtype": "bfloat16", "vocab_size": 64,
    "vocab_size_per_layer_input": 48, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
"""google/gemma-3n-E2B's text config, shrunk: its 4 sliding + 1 full layer
pattern twice, sparse first layers, the last layers sharing keys and values,
written in transformers 4.53's spelling (``rope_local_base_freq``) and
saying bfloat16 (see `hf_family_harness.hub_saved`)."""


@pytest.mark.slow
def test_gemma3n_e2b_pattern_matches_transformers_and_generate(tmp_path):
  saved = harness.hub_saved(tmp_path, _GEMMA3N_E2B)
  print("Gemma 3n E2B shrunk, float32:", _matches_transformers(saved))
  harness.check_generate(saved, steps=12, prompt=1)


def test_a_null_time_step_limit_transformers_cannot_run_is_refused(tmp_path):
  """Falcon-H1 (as Bamba and Granite 4's hybrids) clamps the time step by
  ``time_step_limit``; transformers fails on a null one, so it is refused
  (before any tensor is read), where it was read as no limit."""
  falcon = {"model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"],
            "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 64,
            "mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_d_state": 8,
            "mamba_chunk_size": 16, "pad_token_id": 0}
  saved = harness.hub_saved(tmp_path, falcon)
  folder = harness.edited(saved.folder, tmp_path, time_step_limit=None)
  with pytest.raises(errors.UnsupportedConfigError, match="time_step_limit"):
    pzp.pretrained.load_hf(folder)
  with pytest.raises(TypeError):  # transformers' own failure, so the refusal loses nothing.
    harness.reference_logits(transformers.AutoModelForCausalLM.from_pretrained(folder))
