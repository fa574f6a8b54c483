"""Gemma and Gemma 2 Hugging Face folders through `load_hf`.

Reference logits come from transformers' own ``GemmaForCausalLM`` and
``Gemma2ForCausalLM`` (torch, CPU) on tiny random models saved with
``save_pretrained``. Every parameter is random, norm weights included
(transformers initializes Gemma's norm weights to zero, i.e. a scale of
one, which would hide a norm computed as ``x * w`` instead of
``x * (1 + w)``, so they are redrawn). The models exercise what differs from
Llama: head_dim (16) is not hidden_size / heads (8); Gemma has one key/value
head (MQA), Gemma 2 grouped heads; Gemma 2 has a sliding window (3) shorter
than the test sequence (8), ``query_pre_attn_scalar`` (24) other than
head_dim, and soft caps (attention 2.0, final 3.0) small enough to bind.

Tolerances are those of tests/pretrained/test_hf.py: float32 logits within
1e-4 of transformers' (absolute and relative; measured under 1e-5); bfloat16
loads as close to the float32 logits as transformers' own bfloat16 run,
within a factor of two (plus 0.05 absolute on the maximum, 0.01 on the
mean).

Slow-only (``pytest -m slow``): the bfloat16 check of Gemma 1. Its bfloat16
path (`OffsetScale` adds the one in float32, then casts; the same loader and
cast) is the Gemma 2 case's, which runs by default, as does Gemma 1 in
float32; the default suite keeps one case per family and per code path.
"""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
import treescope
from penzai import pz
from penzai.models.transformer import sampling_mode

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pretrained.test_hf import TOKENS
from pz_persist import errors
from pz_persist.nn.offset_scale import OffsetScale

_SIZES = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
    vocab_size=64, intermediate_size=64, initializer_range=0.3,
)
_GEMMA2 = dict(
    sliding_window=3, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
    final_logit_softcapping=3.0, attn_implementation="eager",
)
_MODELS = {
    "gemma": lambda: transformers.GemmaForCausalLM(
        transformers.GemmaConfig(num_key_value_heads=1, **_SIZES)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(num_key_value_heads=2, **_SIZES, **_GEMMA2)),
    # Three layers, global first, and no head grouping ("heads" axis).
    "gemma2_layer_types": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        num_key_value_heads=4, **{**_SIZES, "num_hidden_layers": 3}, **_GEMMA2,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"])),
}


def _hf_model(name: str):
  """A tiny transformers model with every parameter random, in eval mode."""
  torch.manual_seed(0)
  model = _MODELS[name]()
  with torch.no_grad():
    for param_name, param in model.named_parameters():
      if "norm" in param_name:
        param.copy_(torch.randn_like(param) * 0.5)
  return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """``{name: (folder, transformers model, reference float32 logits)}``."""
  result = {}
  for name in _MODELS:
    model = _hf_model(name)
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder, safe_serialization=True)
    result[name] = (folder, model, harness.reference_logits(model, TOKENS))
  return result


@pytest.fixture(scope="module")
def loaded(saved):
  """``{name: the float32 Penzai model}``, loaded once per module."""
  return {name: pzp.pretrained.load_hf(folder) for name, (folder, _, _) in saved.items()}


@pytest.mark.parametrize("name", list(_MODELS))
def test_float32_logits_match_transformers(saved, loaded, name):
  _, _, reference = saved[name]
  logits = harness.penzai_logits(loaded[name], TOKENS)
  assert np.abs(reference).max() > 0.5  # Logits of order one: a meaningful check.
  np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=1e-4)
  print(f"{name} float32 max abs diff: {np.abs(logits - reference).max():.3g}")


def test_gemma2_soft_caps_and_window_bind(saved):
  """The Gemma 2 model is one where each Gemma 2 setting changes the logits,
  so the comparison above would catch a loader that ignored it."""
  folder, model, reference = saved["gemma2"]
  for field, value in [("final_logit_softcapping", None), ("attn_logit_softcapping", None),
                       ("sliding_window", 64), ("query_pre_attn_scalar", 16)]:
    config = transformers.Gemma2Config.from_pretrained(folder, **{field: value})
    changed = transformers.Gemma2ForCausalLM.from_pretrained(folder, config=config).eval()
    assert np.abs(harness.reference_logits(changed, TOKENS) - reference).max() > 0.01, field


@pytest.mark.parametrize("name", [
    pytest.param("gemma", marks=pytest.mark.slow),  # Same bfloat16 path as gemma2 (docstring).
    "gemma2",
])
def test_bfloat16_load_is_as_close_as_transformers_bfloat16(saved, name):
  """bfloat16 weights and activations: compared with the float32 logits, the
  Penzai model must be about as far off as transformers' own bfloat16 run."""
  folder, model, reference = saved[name]
  hf_bf16 = harness.reference_logits(
      type(model).from_pretrained(folder, dtype=torch.bfloat16), TOKENS)
  penzai_model = pzp.pretrained.load_hf(folder, dtype=jnp.bfloat16)
  params = pz.unbind_params(penzai_model)[1]
  assert {p.value.dtype for p in params} == {jnp.dtype(jnp.bfloat16)}
  logits = harness.penzai_logits(penzai_model, TOKENS)
  ours, theirs = np.abs(logits - reference), np.abs(hf_bf16 - reference)
  print(
      f"{name} bfloat16 vs float32: max {ours.max():.3g} mean {ours.mean():.3g}"
      f" (transformers bfloat16: max {theirs.max():.3g} mean {theirs.mean():.3g})"
  )
  assert ours.max() <= 2 * theirs.max() + 0.05
  assert ours.mean() <= 2 * theirs.mean() + 0.01


def test_norms_hold_the_checkpoint_weights_exactly(saved, tmp_path):
  """Each norm is an `OffsetScale` holding Hugging Face's own weight (not
  ``1 + w``), bit for bit, also in bfloat16; and the embedding is tied."""
  folder, model, _ = saved["gemma2"]
  model.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
  model.float()
  penzai_model = pzp.pretrained.load_hf(tmp_path)
  params = {p.label: p.value for p in pz.unbind_params(penzai_model)[1]}
  state = model.state_dict()
  for label, source in [
      ("transformer/final_norm/scale.weights", "model.norm.weight"),
      ("transformer/block_1/post_attention_norm/scale.weights",
       "model.layers.1.post_attention_layernorm.weight"),
      ("transformer/block_0/pre_ffw_norm/scale.weights",
       "model.layers.0.pre_feedforward_layernorm.weight"),
  ]:
    want = state[source].to(torch.bfloat16).float().numpy()
    got = np.asarray(params[label].unwrap("embedding").astype(jnp.float32))
    np.testing.assert_array_equal(got, want)
  norms = pz.select(penzai_model).at_instances_of(pz.nn.RMSLayerNorm).get_sequence()
  assert len(norms) == 4 * 2 + 1
  assert all(isinstance(norm.sublayers[1], OffsetScale) for norm in norms)
  assert not any(label.startswith("transformer/lm_head") for label in params)
  assert "OffsetScale" in treescope.render_to_text(penzai_model)


def test_kv_cache_sampling_matches_full_sequence(saved, loaded):
  """Penzai's KV-cache sampling mode (a prompt, then one token at a time past
  the sliding window) gives transformers' logits. (No padding token: TOKENS holds 0,
  Penzai's default ``pad_id``.)"""
  _, _, reference = saved["gemma2"]
  sampler = harness.sampling_jitted(sampling_mode.KVCachingTransformerLM.from_uncached(
      loaded["gemma2"], cache_len=TOKENS.shape[1], batch_axes={"batch": TOKENS.shape[0]},
      pad_id=-1))
  steps = []
  for start, stop in [(0, 4), (4, 5), (5, 6), (6, 7), (7, 8)]:  # A prompt, then one by one.
    step = sampler(pz.nx.wrap(jnp.asarray(TOKENS[:, start:stop]), "batch", "seq"))
    steps.append(np.asarray(step.untag("batch", "seq", "vocabulary").unwrap()))
  np.testing.assert_allclose(np.concatenate(steps, axis=1), reference, atol=1e-4, rtol=1e-4)


def test_save_model_load_model_round_trip(saved, loaded, tmp_path):
  pzp.save_model(tmp_path / "ckpt", loaded["gemma2"])
  restored = pzp.load_model(tmp_path / "ckpt")
  assert any(isinstance(layer, OffsetScale) for layer in
             pz.select(restored).at_instances_of(OffsetScale).get_sequence())
  np.testing.assert_array_equal(harness.penzai_logits(restored, TOKENS),
                                harness.penzai_logits(loaded["gemma2"], TOKENS))


def test_null_soft_caps_mean_off(saved, tmp_path):
  """An explicit null turns a soft cap off, as in transformers (an absent
  field takes transformers' default instead)."""
  folder = tmp_path / "off"
  shutil.copytree(saved["gemma2"][0], folder)
  config = json.loads((folder / "config.json").read_text())
  config.update(final_logit_softcapping=None, attn_logit_softcapping=None)
  (folder / "config.json").write_text(json.dumps(config))
  reference = harness.reference_logits(
      transformers.Gemma2ForCausalLM.from_pretrained(folder).eval(), TOKENS)
  np.testing.assert_allclose(harness.penzai_logits(pzp.pretrained.load_hf(folder), TOKENS),
                             reference,
                             atol=1e-4, rtol=1e-4)


# Fields of the config.json files on the Hub (google/gemma-2b, google/gemma-2-9b,
# written by transformers 4.38 / 4.42) that transformers 5 no longer writes.
_HUB_FIELDS = {
    "gemma": {"hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh",
              "rope_theta": 10000.0, "rope_scaling": None, "torch_dtype": "float32",
              "transformers_version": "4.38.0.dev0"},
    "gemma2": {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
               "rope_theta": 10000.0, "sliding_window_size": 3, "cache_implementation": "hybrid",
               "torch_dtype": "float32", "transformers_version": "4.42.0.dev0"},
}


@pytest.mark.parametrize("name", ["gemma", "gemma2"])
def test_hub_style_configs_load(saved, tmp_path, name):
  """The Hub's Gemma configs (legacy ``hidden_act: "gelu"``, which transformers
  reads as the tanh GELU, ``rope_theta``, Gemma 2's ``sliding_window_size``)
  give the same model."""
  folder = tmp_path / "hub"
  shutil.copytree(saved[name][0], folder)
  config = json.loads((folder / "config.json").read_text())
  for field in ("rope_parameters", "layer_types", "use_bidirectional_attention", "dtype"):
    config.pop(field, None)
  config.update(_HUB_FIELDS[name])
  (folder / "config.json").write_text(json.dumps(config))
  np.testing.assert_allclose(harness.penzai_logits(pzp.pretrained.load_hf(folder), TOKENS),
                             saved[name][2],
                             atol=1e-4, rtol=1e-4)


def test_offset_scale_adds_the_one_in_float32():
  """``x * (1 + w)`` with the sum and product in float32, rounded once to
  the input's dtype (transformers' ``Gemma2RMSNorm``), not in bfloat16."""
  w = jnp.asarray([0.0123, -0.3, 2.5e-3, 7.0], jnp.bfloat16)
  x = jnp.asarray([1.7, -3.1, 250.0, 0.33], jnp.bfloat16)
  layer = OffsetScale(weights=pz.Parameter(value=pz.nx.wrap(w, "embedding"), label="s.weights"))
  got = layer(pz.nx.wrap(x, "embedding")).unwrap("embedding")
  want = (np.asarray(x, np.float32) * (1 + np.asarray(w, np.float32))).astype(jnp.bfloat16)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(np.float32))
  in_bfloat16 = x * (jnp.bfloat16(1) + w)
  assert not np.array_equal(np.asarray(in_bfloat16, np.float32), want.astype(np.float32))


@pytest.mark.parametrize(
    "name, field, value",
    [
        ("gemma", "hidden_act", "silu"),
        ("gemma", "hidden_activation", "gelu"),  # Exact GELU (transformers 4.x reads it).
        ("gemma", "attn_logit_softcapping", 50.0),  # Gemma 1 has no soft caps.
        ("gemma2", "hidden_activation", "relu"),
        ("gemma2", "use_bidirectional_attention", True),
        ("gemma2", "tie_word_embeddings", False),
        ("gemma2", "layer_types", ["sliding_attention"]),
        ("gemma2", "layer_types", ["sliding_attention", "chunked_attention"]),
        ("gemma2", "sliding_window_size", 7),
        ("gemma2", "sliding_window", None),  # With sliding layers: transformers fails too.
        ("gemma2", "query_pre_attn_scalar", "256"),  # Invalid values, too.
        ("gemma2", "attn_logit_softcapping", -1.0),
        ("gemma2", "layer_types", "sliding_attention"),
        ("gemma2", "some_new_feature", 3),
    ],
)
def test_config_fields_that_change_the_math_are_refused(saved, tmp_path, name, field, value):
  folder = harness.edited(saved[name][0], tmp_path, **{field: value})
  with pytest.raises(errors.UnsupportedConfigError, match=field):
    pzp.pretrained.load_hf(folder)
