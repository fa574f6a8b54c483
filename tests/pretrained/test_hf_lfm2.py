"""LiquidAI LFM2 (``lfm2``) through `load_hf` and `export_hf`, against
transformers on tiny random models (no downloads).

The short double-gated convolutions are `pz_persist.nn.short_conv.ShortConv`
layers; KV-cache sampling goes through `kv_caching_lm`, which carries their
last inputs. Each feature LFM2 adds is shown to bind: taken out of
transformers' model, its logits move far beyond the tolerance.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
import treescope
from penzai import pz
from penzai.models.transformer import sampling_mode
from penzai.toolshed import lora

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist import errors
from pz_persist.nn.short_conv import ShortConv

CASES = {
    # Convolutions around one attention layer, grouped-query attention, tied
    # embeddings (the default), the default width adjustment (64 -> 256).
    "hybrid": harness.Case(transformers.Lfm2Config, transformers.Lfm2ForCausalLM, {
        "num_hidden_layers": 3, "num_key_value_heads": 2,
        "layer_types": ["conv", "full_attention", "conv"]}),
    # Older configs' full_attn_idxs, biases everywhere in the convolutions, a
    # 4-tap kernel, one key/value head, untied head, a multiplier and a
    # smaller multiple (64 -> 42 -> 63 -> 64).
    "biased": harness.Case(transformers.Lfm2Config, transformers.Lfm2ForCausalLM, {
        "num_hidden_layers": 3, "num_key_value_heads": 1, "full_attn_idxs": [2],
        "conv_bias": True, "conv_L_cache": 4, "tie_word_embeddings": False,
        "block_ffn_dim_multiplier": 1.5, "block_multiple_of": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}),
}

LFM2_HUB_CONFIG = {
    # The shape of the Hub's LFM2 config.json (LiquidAI/LFM2-350M), sizes shrunk:
    # LiquidAI's own field names next to transformers' (block_ff_dim in place
    # of intermediate_size, theta, num_heads, init scales...).
    "architectures": ["Lfm2ForCausalLM"], "block_auto_adjust_ff_dim": True, "block_dim": 32,
    "block_ff_dim": 96, "block_ffn_dim_multiplier": 1.0, "block_mlp_init_scale": 1.0,
    "block_multiple_of": 16, "block_norm_eps": 1e-05, "block_out_init_scale": 1.0,
    "block_use_swiglu": True, "block_use_xavier_init": True, "bos_token_id": 1,
    "conv_L_cache": 3, "conv_bias": False, "conv_dim": 32, "conv_dim_out": 32,
    "conv_use_xavier_init": True, "eos_token_id": 7, "full_attn_idxs": [1, 3],
    "hidden_size": 32, "initializer_range": 0.02, "max_position_embeddings": 128000,
    "model_type": "lfm2", "norm_eps": 1e-05, "num_attention_heads": 4, "num_heads": 4,
    "num_hidden_layers": 4, "num_key_value_heads": 2, "pad_token_id": 0,
    "rope_theta": 1000000.0, "theta": 1000000.0, "tie_embedding": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.54.0.dev0", "use_cache": True,
    "use_pos_enc": True, "vocab_size": 64,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return harness.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  harness.check_float32(saved[case], case)


def test_hub_config_loads_as_transformers_reads_it(tmp_path):
  hub = harness.hub_saved(tmp_path, LFM2_HUB_CONFIG)
  assert hub.hf_model.model.layers[0].feed_forward.w1.out_features == 64  # 96 * 2/3.
  harness.check_float32(hub, "hub")


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  harness.check_bfloat16(saved["hybrid"], "hybrid")


@pytest.mark.parametrize("case", ["hybrid", pytest.param("biased", marks=pytest.mark.slow)])
def test_kv_cache_sampling_matches_forward_pass_and_transformers_cache(saved, case):
  """A 3-token prompt, then one token per call: the convolutions carry their
  last inputs (`kv_caching_lm`), the attention its keys and values; the
  logits are the forward pass's, and transformers' fed the same way."""
  model = pzp.pretrained.load_hf(saved[case].folder)
  harness.check_kv_cache(model)
  harness.check_kv_cache_sampling(model)


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_matches_generate(saved, case):
  harness.check_generate(saved[case])


def test_penzai_sampling_mode_without_the_state_is_refused(saved):
  """``KVCachingTransformerLM.from_uncached`` converts only attention layers:
  the convolutions refuse to run there rather than forget the past."""
  model = pzp.pretrained.load_hf(saved["hybrid"].folder)
  sampler = sampling_mode.KVCachingTransformerLM.from_uncached(
      model, cache_len=10, batch_axes={"batch": 3}, pad_id=-1)
  with pytest.raises(errors.ArgumentError, match="kv_caching_lm"):
    sampler(pz.nx.wrap(jnp.asarray(harness.SEQUENCES[:, :3]), "batch", "seq"))


@pytest.mark.parametrize("case", CASES)
def test_save_model_round_trip(saved, tmp_path, case):
  harness.check_save_model(saved[case], tmp_path)


@pytest.mark.slow
def test_cli_export_from_native(saved, tmp_path):
  harness.check_cli_export_from_native(saved["biased"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_gives_back_the_folder(saved, tmp_path, case):
  """With ``like`` (the same transformers config, exactly the logits) and
  from the model alone (its convolutions say LFM2)."""
  harness.check_export(saved[case], tmp_path, "lfm2",
                       same_fields=("layer_types", "tie_word_embeddings", "conv_bias",
                                    "conv_L_cache"))


def test_hub_folder_exports_back(tmp_path):
  """The Hub's spelling (block_ff_dim, tie_embedding) is written as
  transformers reads it, and the folder reloads there with the same logits."""
  hub = harness.hub_saved(tmp_path, LFM2_HUB_CONFIG)
  model = pzp.pretrained.load_hf(hub.folder)
  written = harness.check_export_model(model, hub.folder, tmp_path / "out")
  assert written["intermediate_size"] == 96 and written["block_multiple_of"] == 16
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  np.testing.assert_array_equal(harness.reference_logits(theirs), hub.reference)


def test_bfloat16_export_is_bit_exact(tmp_path):
  harness.check_bfloat16_export(CASES["biased"], tmp_path)


def _swap_gates(model):
  """The input gate's rows and the output gate's swapped in every ``in_proj``."""
  with torch.no_grad():
    for layer in model.model.layers:
      if hasattr(layer, "conv"):
        w = layer.conv.in_proj.weight
        hidden = w.shape[1]
        w.copy_(torch.cat([w[hidden:2 * hidden], w[:hidden], w[2 * hidden:]]))


def _reverse_taps(model):
  with torch.no_grad():
    for layer in model.model.layers:
      if hasattr(layer, "conv"):
        layer.conv.conv.weight.copy_(layer.conv.conv.weight.flip(-1))


def _no_query_key_norms(model):
  for layer in model.model.layers:
    if hasattr(layer, "self_attn"):
      layer.self_attn.q_layernorm = torch.nn.Identity()
      layer.self_attn.k_layernorm = torch.nn.Identity()


@pytest.mark.parametrize("what,edit", [
    ("the gates' order in in_proj", _swap_gates),
    ("the kernel's tap order", _reverse_taps),
    ("the query/key norms", _no_query_key_norms),
    ("the final embedding_norm", lambda m: setattr(m.model, "embedding_norm",
                                                   torch.nn.Identity())),
])
def test_features_bind(saved, what, edit):
  harness.check_modules_bind(saved["hybrid"], CASES["hybrid"], what, edit)


def test_config_features_bind(saved):
  """The width adjustment and the layer placement: another value, other logits
  (a loader ignoring them would fail the float32 test)."""
  harness.check_feature_binds(saved["biased"], CASES["biased"],
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6})
  with pytest.raises(RuntimeError):  # The MLP's width: the weights no longer fit.
    transformers.Lfm2ForCausalLM(CASES["biased"].config(block_multiple_of=256)).load_state_dict(
        saved["biased"].hf_model.state_dict())


_HOSTILE = [
    ({"layer_types": ["conv", "sliding_attention", "conv"]}, "layer_types"),
    ({"layer_types": ["conv", "full_attention"]}, "layer_types"),
    ({"full_attn_idxs": [0]}, "full_attn_idxs"),  # Disagrees with layer_types.
    ({"layer_types": None, "full_attn_idxs": [1, 7]}, "full_attn_idxs"),
    ({"layer_types": None, "full_attn_idxs": [1, 1]}, "full_attn_idxs"),
    ({"layer_types": None, "full_attn_idxs": [-1]}, "full_attn_idxs"),
    ({"block_dim": 64}, "block_dim"),
    ({"conv_dim": 16}, "conv_dim"),
    ({"num_heads": 8}, "num_heads"),
    ({"theta": 10.0}, "theta"),
    ({"block_norm_eps": 1e-6}, "block_norm_eps"),
    ({"use_pos_enc": False}, "use_pos_enc"),
    ({"block_use_swiglu": False}, "block_use_swiglu"),
    ({"conv_L_cache": 0}, "conv_L_cache"),
    ({"conv_L_cache": 2.5}, "conv_L_cache"),
    ({"block_multiple_of": 0}, "block_multiple_of"),
    ({"block_ffn_dim_multiplier": -1.0}, "block_ffn_dim_multiplier"),
    ({"intermediate_size": 1}, "intermediate_size"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
     "rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                          "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"conv_mixer": "hyena"}, "conv_mixer"),
]


@pytest.mark.parametrize("changes,match", _HOSTILE)
def test_hostile_configs_are_refused_before_a_tensor_is_read(saved, tmp_path, monkeypatch,
                                                             changes, match):
  folder = harness.edited(saved["hybrid"].folder, tmp_path, **{
      k: harness.DELETE if v is None else v for k, v in changes.items()})
  harness.check_refused_before_building(folder, match, monkeypatch)


def test_a_stored_kernel_of_another_size_is_refused(saved, tmp_path):
  """config.json's conv_L_cache against the tensors: refused, naming the tensor."""
  folder = harness.edited(saved["hybrid"].folder, tmp_path, conv_L_cache=5)
  with pytest.raises(errors.PzPersistError, match="conv.conv.weight"):
    pzp.pretrained.load_hf(folder)


def test_short_conv_is_shown_by_treescope_and_survives_lora(saved, tmp_path):
  """The layer renders under its name; LoRA adapters on its projections
  (Penzai's ``loraify_linears_in_selection``) start as the identity edit,
  then change the logits once trained, and the adapted model saves and
  loads back."""
  model = pzp.pretrained.load_hf(saved["hybrid"].folder)
  text = treescope.render_to_text(pz.select(model).at_instances_of(ShortConv).get_sequence()[0])
  assert "ShortConv" in text and "input_gate" in text and "kernel" in text
  convs = pz.select(model).at_instances_of(ShortConv)
  adapted = lora.loraify_linears_in_selection(
      convs.at(lambda conv: (conv.input_gate, conv.output), multiple=True), rank=2,
      init_base_rng=jax.random.key(0))
  params = harness.params(adapted)
  assert sum("lora" in label.lower() for label in params) == 8  # 2 layers x 2 projections x A, B.
  before = harness.penzai_logits(model)
  np.testing.assert_allclose(harness.penzai_logits(adapted), before, atol=1e-6)
  adapted = pz.select(adapted).at_instances_of(pz.Parameter).where(
      lambda p: "lora" in p.label.lower()).apply(
          lambda p: pz.Parameter(value=p.value + 0.1, label=p.label))
  changed = harness.penzai_logits(adapted)
  assert np.abs(changed - before).max() > 1e-2
  harness.check_save_model_round_trip(adapted, tmp_path / "lora", changed)


def test_full_attention_only_and_conv_only_models_export(saved, tmp_path):
  """Every layer one kind: the written layer_types says so."""
  for name, types in (("attention", ["full_attention"] * 2), ("conv", ["conv"] * 2)):
    case = harness.Case(transformers.Lfm2Config, transformers.Lfm2ForCausalLM,
                        {"layer_types": types, "num_key_value_heads": 2})
    model = case.make()
    folder = tmp_path / name
    model.save_pretrained(folder, safe_serialization=True)
    loaded = pzp.pretrained.load_hf(folder)
    with torch.no_grad():  # (transformers' cache needs an attention layer to count tokens.)
      want = model(torch.tensor(harness.SEQUENCES), use_cache=False).logits.numpy()
    np.testing.assert_allclose(harness.penzai_logits(loaded), want, **harness.TOLERANCE)
    pzp.export_hf(loaded, tmp_path / f"{name}_out")
    written = json.loads((tmp_path / f"{name}_out" / "config.json").read_text())
    assert written["layer_types"] == types
    assert "full_attn_idxs" not in written  # (transformers derives nothing from it then.)


def test_a_new_short_conv_inserted_samples_saves_and_loads(saved, tmp_path):
  """Surgery: a freshly initialised `ShortConv` (``init_base_rng``) added as
  a residual branch after the first convolution changes the logits, is
  carried by `kv_caching_lm` like the loaded ones (sampling gives the
  forward pass), and survives ``save_model`` / ``load_model``."""
  model = pzp.pretrained.load_hf(saved["hybrid"].folder)
  new = ShortConv.from_config("inserted", embedding=32, conv_taps=2, bias=True,
                              init_base_rng=jax.random.key(1))
  edited = pz.select(model).at_instances_of(ShortConv).pick_nth_selected(0).apply(
      lambda conv: pz.nn.Sequential([conv, pz.nn.Residual(new)]))
  assert len(pz.select(edited).at_instances_of(ShortConv).get_sequence()) == 3
  logits = harness.penzai_logits(edited)
  assert np.abs(logits - harness.penzai_logits(model)).max() > 1e-2
  harness.check_kv_cache(edited)
  harness.check_save_model_round_trip(edited, tmp_path / "inserted", logits)
