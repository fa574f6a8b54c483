"""Scaled RoPE (``rope_scaling``: llama3, linear, dynamic, yarn) through `load_hf`.

Reference logits come from transformers itself, on tiny random Llama and
Mistral models whose every rope parameter is drawn at random, with
``original_max_position_embeddings`` (for dynamic: ``max_position_embeddings``)
of 4 or 5, shorter than the 8-token test sequence, so the scaling changes the
logits (each test model checks that it does: the same weights with Penzai's
unscaled ``ApplyRoPE`` are far off the reference).

Tolerances, as in test_hf.py: float32 loads match transformers to 1e-4
(absolute and relative; measured differences are ~1e-6); bfloat16 loads are
as close to the float32 logits as transformers' own bfloat16 run, within a
factor of two (plus 0.05 on the maximum, 0.01 on the mean). KV-cache
sampling in Penzai's ``sampling_mode``, token by token, matches
transformers' greedy ``generate`` (same tokens, each step's logits within
1e-4) up to position 10, past the original context.

Slow-only (``pytest -m slow``): the bfloat16 and KV-cache checks of yarn.
llama3 runs both by default through the same code (`ApplyScaledRoPE` with
frequencies fixed at load, cast and called the same way at every position;
yarn differs only in those frequencies and its attention factor, which
yarn's float32 cases check against transformers); dynamic, whose base grows
with the position, keeps its KV-cache case. The default suite keeps one
case per family and per code path.
"""

from __future__ import annotations

import json

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
from pretrained.test_hf import _hf_model
from pz_persist import errors
from pz_persist.nn.scaled_rope import ApplyScaledRoPE

ATOL = RTOL = 1e-4


HEAD_DIM = 16


def _rope_parameters(rope_type: str, seed: int, **fixed) -> dict:
  """A rope dict of ``rope_type`` with every parameter drawn at random.

  With a 4- or 5-token original context, llama3's ``low_freq_factor`` /
  ``high_freq_factor`` and yarn's ``beta_fast`` / ``beta_slow`` are drawn so
  that each branch of the formulas is taken: some frequencies kept, some
  divided, some blended (llama3's smooth band, yarn's ramp).
  """
  rng = np.random.default_rng(seed)
  theta = float(rng.uniform(20, 2000))
  params = {"rope_type": rope_type, "rope_theta": theta, "factor": float(rng.uniform(2, 12))}
  original = int(rng.integers(4, 6))
  half = HEAD_DIM // 2
  if rope_type == "llama3":
    # Wavelength k is 2 pi theta^(k / half): keep k = 0, blend k = 1..3 or 4, divide the rest.
    wavelengths = 2 * np.pi * theta ** (np.arange(half) / half)
    high_wavelength = np.exp(rng.uniform(*np.log(wavelengths[[0, 1]])))
    low_wavelength = np.exp(rng.uniform(*np.log(wavelengths[[3, 5]])))
    params.update(low_freq_factor=float(original / low_wavelength),
                  high_freq_factor=float(original / high_wavelength),
                  original_max_position_embeddings=original)
  elif rope_type == "yarn":
    # The ramp runs from dimension c(beta_fast) to c(beta_slow), where
    # c(beta) = HEAD_DIM ln(original / (2 pi beta)) / (2 ln theta).
    def beta(dimension: float) -> float:
      return float(original / (2 * np.pi) * np.exp(-2 * dimension * np.log(theta) / HEAD_DIM))

    params.update(original_max_position_embeddings=original,
                  beta_fast=beta(rng.uniform(0.5, 2.5)), beta_slow=beta(rng.uniform(4.5, 6.5)))
  params.update(fixed)
  return params


# name: (family, rope parameters, other config fields)
CASES = {
    "llama3": ("llama", _rope_parameters("llama3", 1), {}),
    "linear": ("llama", _rope_parameters("linear", 2), {}),
    "dynamic": ("llama", _rope_parameters("dynamic", 3), {"max_position_embeddings": 4}),
    "yarn": ("llama", _rope_parameters("yarn", 4, attention_factor=0.83, truncate=False), {}),
    "yarn_mscale": ("llama", _rope_parameters("yarn", 5, mscale=0.9, mscale_all_dim=0.6), {}),
    "yarn_defaults": ("llama", {"rope_type": "yarn", "factor": 5.5,
                                "original_max_position_embeddings": 4}, {}),
    # factor null: transformers uses max_position_embeddings / original (64 / 4).
    "yarn_factor_null": ("llama", {"rope_type": "yarn", "factor": None,
                                   "original_max_position_embeddings": 4}, {}),
    "mistral_llama3": ("mistral", _rope_parameters("llama3", 6), {}),
}


def _model(name: str):
  family, rope_parameters, extra = CASES[name]
  config = dict({"head_dim": HEAD_DIM, "max_position_embeddings": 64}, **extra)
  return _hf_model(family, rope_parameters=dict(rope_parameters), **config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """``{case: (folder, reference float32 logits)}``, saved once per module
  (logits from a fresh model: transformers' dynamic RoPE keeps state)."""
  result = {}
  for name in CASES:
    model = _model(name)
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder, safe_serialization=True)
    result[name] = (folder, harness.reference_logits(model, TOKENS))
  return result


@pytest.fixture(scope="module")
def loaded(saved):
  return {name: pzp.pretrained.load_hf(folder) for name, (folder, _) in saved.items()}


def _unscaled(model):
  """``model`` with Penzai's unscaled RoPE in place of the scaled one."""
  return pz.select(model).at_instances_of(ApplyScaledRoPE).apply(
      lambda layer: pz.nn.ApplyRoPE(
          embedding_axis=layer.embedding_axis,
          max_wavelength=layer.max_wavelength,
          positions_input_name=layer.positions_input_name,
      )
  )


@pytest.mark.parametrize("name", list(CASES))
def test_float32_logits_match_transformers(saved, loaded, name):
  _, reference = saved[name]
  model = loaded[name]
  layers = pz.select(model).at_instances_of(ApplyScaledRoPE).get_sequence()
  assert len(layers) == 4 and not pz.select(model).at_instances_of(pz.nn.ApplyRoPE).get_sequence()
  logits = harness.penzai_logits(model, TOKENS)
  assert np.abs(reference).max() > 0.5  # Logits of order one: a meaningful check.
  np.testing.assert_allclose(logits, reference, atol=ATOL, rtol=RTOL)
  # The scaling matters: ignoring it would fail the comparison above.
  assert np.abs(harness.penzai_logits(_unscaled(model), TOKENS) - reference).max() > 100 * ATOL
  print(f"{name} float32 max abs diff: {np.abs(logits - reference).max():.3g}")


@pytest.mark.parametrize("name", ["llama3", pytest.param("yarn", marks=pytest.mark.slow)])
def test_bfloat16_load_is_as_close_as_transformers_bfloat16(saved, name):
  folder, reference = saved[name]
  hf_bf16 = harness.reference_logits(
      transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval(),
      TOKENS)
  logits = harness.penzai_logits(pzp.pretrained.load_hf(folder, dtype=jnp.bfloat16), TOKENS)
  ours, theirs = np.abs(logits - reference), np.abs(hf_bf16 - reference)
  print(f"{name} bfloat16 vs float32: max {ours.max():.3g} mean {ours.mean():.3g}"
        f" (transformers bfloat16: max {theirs.max():.3g} mean {theirs.mean():.3g})")
  assert ours.max() <= 2 * theirs.max() + 0.05
  assert ours.mean() <= 2 * theirs.mean() + 0.01


def test_transformers_4_style_config_loads_the_same(saved, tmp_path):
  """``rope_scaling`` with the legacy ``type`` key and a top-level
  ``rope_theta``, as transformers < 5 writes it."""
  folder, reference = saved["llama3"]
  scaling = dict(CASES["llama3"][1])
  theta = scaling.pop("rope_theta")
  scaling["type"] = scaling.pop("rope_type")
  edited = harness.edited(folder, tmp_path, rope_parameters=harness.DELETE,
                          rope_scaling=scaling, rope_theta=theta)
  logits = harness.penzai_logits(pzp.pretrained.load_hf(edited), TOKENS)
  np.testing.assert_allclose(logits, reference, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", list(CASES))
def test_config_fields_give_back_the_checkpoint_rope(saved, loaded, name):
  """What an exporter writes from the layer alone (`config_fields`) makes
  transformers build the same rope parameters as the checkpoint's."""
  layer = pz.select(loaded[name]).at_instances_of(ApplyScaledRoPE).get_sequence()[0]
  config = json.loads((saved[name][0] / "config.json").read_text())
  original = transformers.AutoConfig.from_pretrained(saved[name][0]).rope_parameters
  for key in ("rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings"):
    config.pop(key, None)
  config.update(layer.config_fields())
  rebuilt = transformers.AutoConfig.for_model(**config).rope_parameters
  if name == "dynamic":
    assert layer.config_fields()["max_position_embeddings"] == 4
  if name == "yarn_factor_null":
    assert original["factor"] is None and layer.factor == 16.0
    original = dict(original, factor=16.0)  # Written resolved: the same math.
  assert {k: v for k, v in rebuilt.items() if k != "type"} == {
      k: v for k, v in original.items() if k != "type"}


def _greedy_penzai(model, prompt: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
  """Greedy decoding in Penzai's KV-cache sampling mode, one token per call
  after the prompt: (generated tokens, each step's logits)."""
  batch = prompt.shape[0]
  sampler = harness.sampling_jitted(sampling_mode.KVCachingTransformerLM.from_uncached(
      model, cache_len=prompt.shape[1] + steps, batch_axes={"batch": batch}, pad_id=-1
  ))
  tokens = pz.nx.wrap(jnp.asarray(prompt), "batch", "seq")
  generated, logits = [], []
  for _ in range(steps):
    out = sampler(tokens).untag("batch", "seq", "vocabulary").unwrap()[:, -1]
    logits.append(np.asarray(out, np.float32))
    generated.append(np.argmax(logits[-1], axis=-1))
    tokens = pz.nx.wrap(jnp.asarray(generated[-1])[:, None], "batch", "seq")
  return np.stack(generated, 1), np.stack(logits, 1)


@pytest.mark.parametrize("name", ["llama3", "dynamic", pytest.param("yarn", marks=pytest.mark.slow)])
def test_kv_cache_sampling_matches_transformers_generate(saved, loaded, name):
  """Token by token past ``original_max_position_embeddings`` (positions 3
  to 10); for dynamic, each step's base grows with the position in both."""
  folder, _ = saved[name]
  prompt, steps = TOKENS[:, :3], 8
  hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
  hf.generation_config.eos_token_id = None
  with torch.no_grad():
    out = hf.generate(torch.tensor(prompt), max_new_tokens=steps, do_sample=False,
                      output_logits=True, return_dict_in_generate=True, pad_token_id=0)
  hf_tokens = out.sequences[:, prompt.shape[1]:].numpy()
  hf_logits = torch.stack(out.logits, 1).float().numpy()
  tokens, logits = _greedy_penzai(loaded[name], prompt, steps)
  np.testing.assert_allclose(logits, hf_logits, atol=ATOL, rtol=RTOL)
  np.testing.assert_array_equal(tokens, hf_tokens)


def test_save_model_round_trip(loaded, saved, tmp_path):
  model = loaded["yarn"]
  pzp.save_model(tmp_path / "ckpt", model)  # Allow-listed by default.
  restored = pzp.load_model(tmp_path / "ckpt")
  layers = pz.select(restored).at_instances_of(ApplyScaledRoPE).get_sequence()
  assert layers == pz.select(model).at_instances_of(ApplyScaledRoPE).get_sequence()
  np.testing.assert_array_equal(harness.penzai_logits(restored, TOKENS),
                                harness.penzai_logits(model, TOKENS))
  text = treescope.render_to_text(restored)
  assert "ApplyScaledRoPE(" in text and "rope_type='yarn'" in text


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 4}


@pytest.mark.parametrize(
    "field, changes",
    [
        ("rope_parameters.original_max_position_embeddings",
         {"rope_parameters": dict(_LLAMA3, original_max_position_embeddings=4.5)}),
        ("rope_parameters.factor", {"rope_parameters": dict(_LLAMA3, factor=-2.0)}),
        ("rope_parameters.factor", {"rope_parameters": dict(_LLAMA3, factor="8")}),
        ("rope_parameters.factor", {"rope_parameters": dict(_LLAMA3, factor=True)}),
        ("rope_parameters.low_freq_factor", {"rope_parameters": dict(_LLAMA3, low_freq_factor=0)}),
        ("rope_parameters.high_freq_factor", {"rope_parameters": dict(_LLAMA3, high_freq_factor=0.5)}),
        ("rope_scaling.low_freq_factor",
         {"rope_scaling": {k: v for k, v in _LLAMA3.items() if k != "low_freq_factor"},
          "rope_parameters": harness.DELETE}),
        ("rope_scaling.finetuned",
         {"rope_scaling": {"type": "linear", "factor": 2.0, "finetuned": True},
          "rope_parameters": harness.DELETE}),
        ("rope_parameters.rope_type", {"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}),
        ("rope_parameters.rope_type", {"rope_parameters": {"rope_type": 3, "factor": 2.0}}),
        ("rope_parameters.type", {"rope_parameters": dict(_LLAMA3, type="linear")}),
        ("rope_parameters.factor", {"rope_parameters": {"rope_type": "linear"}}),
        ("rope_parameters.truncate",
         {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "truncate": "yes"}}),
        ("rope_parameters.beta_fast",
         {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "beta_fast": 0}}),
        ("rope_parameters.attention_factor",
         {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "attention_factor": [1.0]}}),
        ("rope_parameters.original_max_position_embeddings",
         {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                              "original_max_position_embeddings": 4}}),
        ("max_position_embeddings",
         {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0},
          "max_position_embeddings": 0}),
        ("rope_scaling", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("rope_theta", {"rope_parameters": dict(_LLAMA3, rope_theta=1e4), "rope_theta": 5e5}),
        ("rope_parameters.partial_rotary_factor",
         {"rope_parameters": dict(_LLAMA3, partial_rotary_factor=2.0)}),
    ],
)
def test_malformed_rope_dicts_are_refused(saved, tmp_path, field, changes):
  folder = harness.edited(saved["llama3"][0], tmp_path, **changes)
  with pytest.raises(errors.UnsupportedConfigError) as info:
    pzp.pretrained.load_hf(folder)
  assert field in str(info.value)


def test_gpt_neox_refuses_scaling(tmp_path):
  model = _hf_model("gpt_neox")
  model.save_pretrained(tmp_path / "neox", safe_serialization=True)
  folder = harness.edited(tmp_path / "neox", tmp_path,
                        rope_parameters={"rope_type": "linear", "factor": 2.0})
  with pytest.raises(errors.UnsupportedConfigError, match="rope_type"):
    pzp.pretrained.load_hf(folder)


@pytest.mark.parametrize("fields, named", [
    ({"rope_type": "longrope", "factor": 2.0}, "rope_type"),
    ({"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 4,
      "high_freq_factor": 4.0}, "low_freq_factor"),
    ({"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings"),
])
def test_layer_with_unusable_fields_says_which(fields, named):
  """A layer built by hand, or from a forged checkpoint (load_model rebuilds
  layers without their ``__init__``), fails on its first call naming the
  field, instead of computing something else."""
  layer = ApplyScaledRoPE(embedding_axis="projection", max_wavelength=1e4,
                          positions_input_name="positions", **fields)
  x = pz.nx.wrap(jnp.ones((3, 8)), "seq", "projection")
  with pytest.raises(errors.UnsupportedConfigError, match=f"ApplyScaledRoPE.{named}"):
    layer(x, positions=pz.nx.arange("seq", 3))


# meta-llama/Llama-3.2-1B's config.json as the Hub ships it (transformers 4.45
# style: rope_scaling plus a top-level rope_theta), sizes shrunk.
LLAMA_3_2_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000 % 64, "eos_token_id": 128001 % 64, "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.3,
    "intermediate_size": 64, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 64,
}


def test_llama_3_2_hub_config_loads(tmp_path):
  """The pretrained guide's example checkpoint: every field of the Hub's config.json
  is understood, and the logits are transformers' (the default theta of
  500000 and factor 32 scale the lowest frequencies even at 8 tokens)."""
  torch.manual_seed(0)
  config = transformers.LlamaConfig(**LLAMA_3_2_CONFIG)
  model = transformers.LlamaForCausalLM(config).eval()
  model.save_pretrained(tmp_path, safe_serialization=True)
  (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_2_CONFIG))
  loaded = pzp.pretrained.load_hf(tmp_path)
  reference = harness.reference_logits(model, TOKENS)
  np.testing.assert_allclose(harness.penzai_logits(loaded, TOKENS), reference, atol=ATOL, rtol=RTOL)
  assert np.abs(harness.penzai_logits(_unscaled(loaded), TOKENS) - reference).max() > 100 * ATOL
