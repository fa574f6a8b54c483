"""GLM-5 (``glm_moe_dsa``) through `load_hf` and `export_hf`, against
transformers' own GlmMoeDsaForCausalLM on tiny random models (no
downloads).

GLM-5 is DeepSeek-V3.2's layout (latent attention, DeepSeek's experts,
DeepSeek Sparse Attention's lightning indexer) with the indexer's RoPE
interleaved and with layers that run no indexer of their own: those
``indexer_types`` marks ``"shared"`` attend to the tokens the last earlier
``"full"`` layer chose. The sequences (ten tokens) are longer than
``index_topk``, so every choice matters; each difference is shown to bind
(the logits move far when Penzai's model drops it), the shared layers'
caches hold the latent alone, and KV-cache decoding and greedy generation
match transformers token for token.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist.nn import kv_sharing
from pz_persist.nn import latent_attention as mla
from pz_persist.nn import sparse_attention as dsa
from pz_persist.pretrained.hf.building import latent_decoder

_SIZES = {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
          "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
          "qk_rope_head_dim": 8, "qk_nope_head_dim": 10, "v_head_dim": 12,
          "n_routed_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 128,
          "q_lora_rank": 24}

_KINDS = ["full", "shared", "shared", "full"]

# Many indexer heads, as DeepSeek-V3.2's test: ties of scores clipped to 0 on
# the top-k boundary are ordered differently by torch.
CASES = {
    # One dense layer then three MoE layers routed within the best 2 of 4
    # groups; layers 1 and 2 reuse layer 0's choice of 4 tokens, layer 3
    # chooses its own; an indexer of 16 heads of 16 (8 rotated).
    "glm_moe_dsa": harness.Case(
        transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM,
        {**_SIZES, "num_hidden_layers": 4, "first_k_dense_replace": 1, "n_group": 4,
         "topk_group": 2, "routed_scaling_factor": 2.5, "index_topk": 4, "index_head_dim": 16,
         "index_n_heads": 16, "indexer_types": _KINDS}),
    # Every layer its own indexer (transformers' default schedule), dense
    # layers where mlp_layer_types says, no groups, an indexer of 12 heads
    # rotated whole keeping 6 tokens, yarn RoPE.
    "glm_moe_dsa_full": harness.Case(
        transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM,
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


def test_kv_cache_matches_the_forward_pass(saved):
  """Decoding token by token (after a 3-token prompt, so past ``index_topk``
  tokens) through `kv_caching_lm` reads the indexer keys back from the full
  layers' caches and passes their choice to the shared layers: the forward
  pass's logits. (Penzai's own ``from_uncached`` sizes every cache alike,
  for the full layers' width: GLM-5 with shared layers needs
  `kv_caching_lm`, as Gemma 4 does.)"""
  harness.check_kv_cache(pzp.pretrained.load_hf(saved["glm_moe_dsa"].folder))


def test_kv_cache_matches_transformers_cache(saved):
  """Without shared layers Penzai's own sampler works too, and gives the
  logits transformers gives through its cache."""
  model = pzp.pretrained.load_hf(saved["glm_moe_dsa_full"].folder)
  harness.check_kv_cache_like_transformers(model, saved["glm_moe_dsa_full"].hf_model)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_generation_matches_generate(saved, name):
  harness.check_generate(saved[name], steps=10, prompt=4)


def test_the_shared_layers_cache_the_latent_alone(saved):
  """A full layer's cache holds ``kv_lora_rank + qk_rope_head_dim +
  index_head_dim`` numbers per token, a shared layer's (no indexer) the
  latent alone, as transformers' cache does; the shared layers have no
  indexer weights."""
  model = pzp.pretrained.load_hf(saved["glm_moe_dsa"].folder)
  sampler = pzp.pretrained.sampling.kv_caching_lm(model, cache_len=12, batch_axes={"batch": 1})
  caches = pz.select(sampler).at_instances_of(pz.nn.KVCachingAttention).get_sequence()
  widths = [layer.kv_cache.value[0].named_shape["projection"] for layer in caches]
  assert widths == [40 if kind == "full" else 24 for kind in _KINDS]
  assert len(pz.select(model).at_instances_of(dsa.IndexedQuery).get_sequence()) == 2
  assert not any("indexer" in name for name in harness.tensors(saved["glm_moe_dsa"].folder)
                 if name.startswith(("model.layers.1.", "model.layers.2.")))


def test_save_model_round_trip(saved, tmp_path):
  harness.check_save_model(saved["glm_moe_dsa"], tmp_path)


@pytest.mark.parametrize("name", list(CASES))
def test_export_gives_back_the_folder(saved, tmp_path, name):
  harness.check_export(saved[name], tmp_path, "glm_moe_dsa",
                       same_fields=("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                                    "index_topk", "index_head_dim", "index_n_heads",
                                    "mlp_layer_types", "layer_types", "indexer_types",
                                    "n_group", "topk_group", "routed_scaling_factor"))


@pytest.mark.parametrize("name", list(CASES))
def test_written_as_deepseek_v32_is_refused(saved, tmp_path, name):
  """DeepSeek-V3.2 differs only in the indexer's RoPE and shares no
  choices: asked to write a GLM-5 model as one, export refuses (the model
  is not the layout that config would load) rather than write a different
  model."""
  model = pzp.pretrained.load_hf(saved[name].folder)
  like = {**harness.config(saved[name].folder), "model_type": "deepseek_v32"}
  del like["indexer_types"]
  with pytest.raises(pzp.errors.PzPersistError, match="deepseek_v32"):
    pzp.export_hf(model, tmp_path / "out", like=like)


# --- what transformers derives indexer_types from --------------------------------------


@pytest.mark.parametrize("changes", [
    {"index_topk_pattern": "FSSF"},
    {"index_topk_pattern": _KINDS},
    # Layer i is full when max(i - offset + 1, 0) % freq == 0: 0 and 3 here.
    {"index_topk_freq": 3, "index_skip_topk_offset": 1},
])
def test_indexer_types_derived_as_transformers_derives_them(saved, tmp_path, changes):
  """Without ``indexer_types``, the pattern or the schedule that gives the
  same layers gives the same model (and transformers' config agrees)."""
  case = saved["glm_moe_dsa"]
  assert transformers.GlmMoeDsaConfig(
      num_hidden_layers=4, **changes).indexer_types == _KINDS
  folder = harness.edited(case.folder, tmp_path, indexer_types=harness.DELETE, **changes)
  np.testing.assert_allclose(harness.penzai_logits(pzp.pretrained.load_hf(folder)),
                             case.reference, **harness.TOLERANCE)


def test_indexer_types_wins_over_the_pattern_and_the_schedule(saved, tmp_path):
  """As in transformers' config, ``indexer_types`` given, the others are not
  read (a pattern for another layer count, a schedule that would make the
  first layer shared)."""
  changes = {"index_topk_pattern": "FS", "index_topk_freq": 2, "index_skip_topk_offset": 0}
  assert transformers.GlmMoeDsaConfig(
      num_hidden_layers=4, indexer_types=_KINDS, **changes).indexer_types == _KINDS
  folder = harness.edited(saved["glm_moe_dsa"].folder, tmp_path, **changes)
  np.testing.assert_allclose(harness.penzai_logits(pzp.pretrained.load_hf(folder)),
                             saved["glm_moe_dsa"].reference, **harness.TOLERANCE)


def test_the_default_schedule_runs_every_indexer(saved, tmp_path):
  folder = harness.edited(saved["glm_moe_dsa_full"].folder, tmp_path,
                          indexer_types=harness.DELETE)
  model = pzp.pretrained.load_hf(folder)
  assert len(pz.select(model).at_instances_of(dsa.IndexedQuery).get_sequence()) == 3
  assert not pz.select(model).at_instances_of(dsa.SharedChoiceLogits).get_sequence()


# --- each difference binds -------------------------------------------------------------


def test_the_indexer_binds_in_transformers(saved):
  """With ``index_topk`` past the sequences' length transformers attends to
  every token (the indexers and the choices they share bypassed)."""
  for name in CASES:
    harness.check_feature_binds(saved[name], CASES[name], index_topk=64)


def test_the_shared_choice_binds(saved):
  """The shared layers attending to every token instead of the earlier
  layer's choice move the logits far."""
  model = pzp.pretrained.load_hf(saved["glm_moe_dsa"].folder)
  edited = (pz.select(model).at_instances_of(dsa.SharedChoiceLogits)
            .apply(lambda shared: shared.logits))
  changed = harness.check_penzai_edit_binds(edited, saved["glm_moe_dsa"].reference)
  print(f"shared choice dropped: logits change by {changed:.3g}")


@pytest.mark.parametrize("name", list(CASES))
def test_the_interleaved_indexer_rope_binds(saved, name):
  """The indexer's RoPE in halves (DeepSeek-V3.2's) instead of interleaved
  moves the logits far."""
  model = pzp.pretrained.load_hf(saved[name].folder)
  halves = (pz.select(model).at_instances_of(dsa.IndexedQuery | dsa.AppendIndexKey)
            .at_instances_of(mla.Deinterleave).apply(lambda _: pz.nn.Identity()))
  changed = harness.check_penzai_edit_binds(halves, saved[name].reference)
  print(f"{name}: indexer RoPE in halves: logits change by {changed:.3g}")


def test_the_correction_bias_binds(saved):
  harness.check_modules_bind(saved["glm_moe_dsa"], CASES["glm_moe_dsa"],
                             "the routing correction bias", harness.zero_correction_biases)


def test_a_shared_layer_outside_the_mailbox_says_why():
  layer = dsa.SharedChoiceLogits(logits=mla.Pick(0), masked_out_value=jnp.array(-1.0))
  with pytest.raises(ValueError, match="SharesKV"):
    layer((pz.nx.zeros({"seq": 2, "kv_seq": 2}), None))
  with pytest.raises(ValueError, match="index_top_k"):
    kv_sharing.SharesKV(layer)((pz.nx.zeros({"seq": 2, "kv_seq": 2}), None))


# --- refused ---------------------------------------------------------------------


@pytest.mark.parametrize("changes, match", [
    ({"indexer_types": ["shared", "full", "full", "full"]}, "indexer_types"),
    ({"indexer_types": ["full", "shared", "full"]}, "indexer_types"),
    ({"indexer_types": ["full", "skip", "full", "full"]}, "indexer_types"),
    ({"indexer_types": harness.DELETE, "index_topk_pattern": "SFFF"}, "index_topk_pattern"),
    ({"indexer_types": harness.DELETE, "index_topk_pattern": "FXFF"}, "index_topk_pattern"),
    ({"indexer_types": harness.DELETE, "index_topk_pattern": "FF"}, "index_topk_pattern"),
    ({"indexer_types": harness.DELETE, "index_skip_topk_offset": 0, "index_topk_freq": 2},
     "index_skip_topk_offset"),
    ({"indexer_types": harness.DELETE, "index_topk_freq": "2"}, "index_topk_freq"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"layer_types": ["indexed_attention"] * 3 + ["full_attention"]}, "layer_types"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ({"index_head_dim": 4}, "index_head_dim"),
    ({"index_topk": 0}, "index_topk"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"attention_bias": True}, "attention_bias"),
    ({"some_new_field": 1}, "some_new_field"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  folder = harness.edited(saved["glm_moe_dsa"].folder, tmp_path, **changes)

  def no_build(*args, **kwargs):
    raise AssertionError("a skeleton was built before the config was refused")

  monkeypatch.setattr(latent_decoder, "latent_attention", no_build)
  with pytest.raises(pzp.errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)


def test_indexer_weights_of_a_shared_layer_are_left_unread_as_transformers_leaves_them(
    saved, tmp_path, caplog):
  """A folder whose config marks a layer with indexer weights ``"shared"``:
  transformers builds that layer without an indexer and leaves its stored
  one unread (an unexpected key); pz_persist gives its logits, and says it
  left them (declared in the plan, so not refused as unread)."""
  folder = harness.edited(saved["glm_moe_dsa"].folder, tmp_path,
                          indexer_types=["full", "shared", "shared", "shared"])
  theirs = harness.reference_logits(transformers.GlmMoeDsaForCausalLM.from_pretrained(folder))
  with caplog.at_level(logging.WARNING, "pz_persist.pretrained.hf"):
    model = pzp.pretrained.load_hf(folder)
  said = " ".join(record.getMessage() for record in caplog.records)
  assert "5 tensors of the indexers of layers marked shared" in said
  np.testing.assert_allclose(harness.penzai_logits(model), theirs, **harness.TOLERANCE)
  assert np.abs(theirs - saved["glm_moe_dsa"].reference).max() > 100 * harness.TOLERANCE["atol"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved, name):
  harness.check_bfloat16(saved[name], name)


@pytest.mark.parametrize("layer_class", ["SharedChoiceLogits", "PublishingSparseAttentionLogits"])
def test_surgery_around_the_shared_choice(saved, layer_class, tmp_path):
  harness.check_surgery_around(saved["glm_moe_dsa"], getattr(dsa, layer_class), tmp_path)
