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

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist.nn import latent_attention as mla
from pz_persist.nn import sparse_attention as dsa
from pz_persist.pretrained.hf.building import latent_decoder

_SIZES = {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
          "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
          "qk_rope_head_dim": 8, "qk_nope_head_dim": 10, "v_head_dim": 12,
          "n_routed_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 128,
          "q_lora_rank": 24}

# Many indexer heads: a token's score is exactly 0 when every head's relu
# clips it, and with few heads such ties land on the top-k boundary, where
# torch's topk order is unspecified (pz_persist keeps the earliest).
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


def test_kv_cache_matches_transformers_cache(saved):
  """Decoding token by token (after a 3-token prompt, so past ``index_topk``
  tokens) reads the indexer keys back from the cache: the same logits as
  the forward pass and as transformers fed through its own cache."""
  model = pzp.pretrained.load_hf(saved["deepseek_v32"].folder)
  harness.check_kv_cache(model)
  harness.check_kv_cache_like_transformers(model, saved["deepseek_v32"].hf_model)


def test_greedy_generation_matches_generate(saved):
  harness.check_generate(saved["deepseek_v32"], steps=10, prompt=4)


def test_the_cache_holds_the_latent_and_the_indexer_key(saved):
  """Each layer's cached array is ``kv_lora_rank + qk_rope_head_dim +
  index_head_dim`` wide: the indexer's keys are cached, not recomputed."""
  model = pzp.pretrained.load_hf(saved["deepseek_v32"].folder)
  assert model.metadata.projection_dim == 16 + 8 + 16
  sampler = pzp.pretrained.sampling.kv_caching_lm(model, cache_len=12, batch_axes={"batch": 1})
  caches = pz.select(sampler).at_instances_of(pz.nn.KVCachingAttention).get_sequence()
  assert len(caches) == 3
  for layer in caches:
    keys, _ = layer.kv_cache.value
    assert keys.named_shape["projection"] == 40


def test_save_model_round_trip(saved, tmp_path):
  harness.check_save_model(saved["deepseek_v32"], tmp_path)


@pytest.mark.parametrize("name", list(CASES))
def test_export_gives_back_the_folder(saved, tmp_path, name):
  harness.check_export(saved[name], tmp_path, "deepseek_v32",
                       same_fields=("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                                    "index_topk", "index_head_dim", "index_n_heads",
                                    "mlp_layer_types", "layer_types", "n_group", "topk_group",
                                    "routed_scaling_factor"))


# --- the indexer binds ---------------------------------------------------------


def test_the_indexer_binds_in_transformers(saved):
  """With ``index_topk`` past the sequences' length transformers attends to
  every token (the indexer bypassed): its logits move far."""
  for name in CASES:
    harness.check_feature_binds(saved[name], CASES[name], index_topk=64)


def test_the_indexer_binds_in_penzai(saved):
  """The loaded model with each `SparseAttentionLogits` keeping every token
  (the indexer bypassed: every visible token attended) is far from
  transformers."""
  model = pzp.pretrained.load_hf(saved["deepseek_v32"].folder)
  dense = (pz.select(model).at_instances_of(dsa.SparseAttentionLogits)
           .apply(lambda sparse: dataclasses.replace(sparse, top_k=64)))
  changed = harness.check_penzai_edit_binds(dense, saved["deepseek_v32"].reference)
  print(f"indexer bypassed in Penzai: logits change by {changed:.3g}")


def test_the_correction_bias_binds(saved):
  harness.check_modules_bind(saved["deepseek_v32"], CASES["deepseek_v32"],
                             "the routing correction bias", harness.zero_correction_biases)


def test_sparse_logits_keep_the_top_k_visible_tokens():
  """Unit check of the layer: of the visible (causal) tokens, the ``top_k``
  best-scored are kept, ties to the earliest; with ``top_k`` or fewer
  visible, every one; a future token (scored ``-inf`` by the causal mask)
  never displaces a visible one, and stays masked by the logits' own mask."""
  scores = jnp.array([[9.0, 9.0, 9.0, 9.0], [1.0, 3.0, 9.0, 9.0],
                      [2.0, 2.0, 2.0, 9.0], [5.0, -1.0, 4.0, 6.0]])
  index = pz.nx.wrap(scores, "seq", "kv_seq")
  layer = dsa.SparseAttentionLogits(
      logits=pz.nn.Sequential([mla.Pick(0),
                               pz.nn.ApplyCausalAttentionMask(masked_out_value=jnp.array(-2.0))]),
      index_scores=pz.nn.Sequential([
          mla.Pick(0),  # The index query is the scores above.
          pz.nn.ApplyCausalAttentionMask(masked_out_value=jnp.array(-jnp.inf))]),
      key_size=1, top_k=2, masked_out_value=jnp.array(-1.0))
  query = (pz.nx.zeros({"seq": 4, "kv_seq": 4}), index)
  cached = pz.nx.zeros({"seq": 4, "projection": 2})
  out = layer((query, cached), token_positions=pz.nx.arange("seq", 4))
  np.testing.assert_array_equal(np.asarray(out.untag("seq", "kv_seq").unwrap()),
                                # Future tokens are masked (-2 by the causal mask where the
                                # indexer's choice fell on them, -1 where it did not).
                                [[0, -2, -1, -1], [0, 0, -1, -1], [0, 0, -1, -1],
                                 [0, -1, -1, 0]])
  # top_k at least the tokens: the logits as they are.
  whole = dataclasses.replace(layer, top_k=4)((query, cached),
                                              token_positions=pz.nx.arange("seq", 4))
  assert int((whole.unwrap("seq", "kv_seq") == -1).sum()) == 0


# --- refused ---------------------------------------------------------------------


@pytest.mark.parametrize("changes, match", [
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"layer_types": ["indexed_attention", "full_attention", "indexed_attention"]},
     "layer_types"),
    ({"layer_types": ["indexed_attention"]}, "layer_types"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ({"index_head_dim": 4}, "index_head_dim"),
    ({"index_head_dim": 0}, "index_head_dim"),
    ({"index_topk": 0}, "index_topk"),
    ({"index_topk": "4"}, "index_topk"),
    ({"index_n_heads": -1}, "index_n_heads"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"attention_bias": True}, "attention_bias"),
    ({"some_new_field": 1}, "some_new_field"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  folder = harness.edited(saved["deepseek_v32"].folder, tmp_path, **changes)

  def no_build(*args, **kwargs):
    raise AssertionError("a skeleton was built before the config was refused")

  monkeypatch.setattr(latent_decoder, "latent_attention", no_build)
  with pytest.raises(pzp.errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)


@pytest.mark.parametrize("changes", [{"index_n_heads": 10**9}, {"index_head_dim": 10**9},
                                     {"index_n_heads": 8}])
def test_indexer_sizes_the_weights_disagree_with_are_refused(saved, tmp_path, changes):
  """Indexer sizes are checked against the stored tensors' shapes (from the
  safetensors headers) before any tensor is read or allocated."""
  folder = harness.edited(saved["deepseek_v32"].folder, tmp_path, **changes)
  with pytest.raises(pzp.errors.PzPersistError, match="indexer.wq_b"):
    pzp.pretrained.load_hf(folder)


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  """A bfloat16 load is, on average, as far from the float32 logits as
  transformers' own bfloat16 run (as DeepSeek-V3's test: the mean, since
  bfloat16 rounding can flip an expert's or a token's choice, differently in
  the two implementations)."""
  case = saved["deepseek_v32"]
  hf_bf16 = harness.reference_logits(type(case.hf_model).from_pretrained(
      case.folder, dtype=torch.bfloat16))
  model = pzp.pretrained.load_hf(case.folder, dtype=jnp.bfloat16)
  ours = np.abs(harness.penzai_logits(model) - case.reference)
  theirs = np.abs(hf_bf16 - case.reference)
  print(f"bfloat16 vs float32: max {ours.max():.3g} mean {ours.mean():.3g}"
        f" (transformers bfloat16: max {theirs.max():.3g} mean {theirs.mean():.3g})")
  assert ours.mean() <= 2 * theirs.mean() + 0.01


@pytest.mark.parametrize("layer_class", ["SparseAttentionLogits", "IndexedQuery"])
def test_surgery_around_the_indexer(saved, layer_class, tmp_path):
  from pz_persist.nn import sparse_attention

  harness.check_surgery_around(saved["deepseek_v32"], getattr(sparse_attention, layer_class),
                               tmp_path)
