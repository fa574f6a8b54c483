"""Qwen2 / Qwen2.5, Llama with ``attention_bias`` / ``mlp_bias``, and the tanh
GELUs (``gelu_fast``) through `load_hf`, against transformers.

Every parameter of the tiny transformers models is redrawn at random (norm
scales around one, biases nonzero), so a bias left out or put on the wrong
axis changes the logits. Tolerances are those of test_hf.py: float32 within
1e-4 absolute and relative (measured: ~5e-6; ~2e-5 with ``gelu_fast``, whose
constant 0.7978845608 is √(2/π) rounded); bfloat16 within twice transformers'
own bfloat16 error.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pretrained.test_hf import _COMMON
from pretrained.test_hf import TOKENS
from pz_persist.pretrained import errors

TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}

CASES = {
    # Grouped-query attention; layer 1 attends through a 3-token window
    # (shorter than the 8-token test sequence), layer 0 globally.
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {
        "num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}),
    # Multi-query attention (no head axis on key/value biases), tied embeddings.
    "qwen2_mqa_tied": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {
        "num_key_value_heads": 1, "tie_word_embeddings": True}),
    "llama_attention_bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {
        "num_key_value_heads": 2, "attention_bias": True}),
    # Multi-head attention (a "heads" axis), MLP biases, a tanh-GELU gate.
    "llama_mlp_bias_gelu_fast": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {
        "num_key_value_heads": 4, "mlp_bias": True, "hidden_act": "gelu_fast"}),
}


def _randomized(model):
  """``model`` with every parameter redrawn: biases nonzero, norms near one."""
  generator = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = torch.randn(param.shape, generator=generator) * 0.3
      param.copy_(noise + (1.0 if "norm" in name else 0.0))
  return model.eval()


def _hf_model(case: str):
  config_cls, model_cls, overrides = CASES[case]
  torch.manual_seed(0)
  return _randomized(model_cls(config_cls(**dict(_COMMON, **overrides))))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """``{case: (folder, transformers model, reference float32 logits)}``."""
  result = {}
  for case in CASES:
    model = _hf_model(case)
    folder = tmp_path_factory.mktemp(case)
    model.save_pretrained(folder, safe_serialization=True)
    result[case] = (folder, model, harness.reference_logits(model, TOKENS))
  return result


@pytest.mark.parametrize("case", list(CASES))
def test_float32_logits_match_transformers(saved, case):
  folder, _, reference = saved[case]
  logits = harness.penzai_logits(pzp.pretrained.load_hf(folder), TOKENS)
  assert np.abs(reference).max() > 0.5  # Logits of order one: a meaningful check.
  np.testing.assert_allclose(logits, reference, **TOLERANCE)


def test_qwen2_sliding_window_is_applied(saved, tmp_path):
  """The same weights with the window switched off give other logits (so the
  match above depends on the window), and match transformers again."""
  folder, model, reference = saved["qwen2"]
  unwindowed = harness.edited(folder, tmp_path, use_sliding_window=False,
                            layer_types=harness.DELETE)
  logits = harness.penzai_logits(pzp.pretrained.load_hf(unwindowed), TOKENS)
  global_reference = harness.reference_logits(
      transformers.Qwen2ForCausalLM.from_pretrained(unwindowed).eval(), TOKENS)
  assert np.abs(global_reference - reference).max() > 0.1
  np.testing.assert_allclose(logits, global_reference, **TOLERANCE)


@pytest.mark.parametrize("case", ["qwen2", "llama_attention_bias"])
def test_bfloat16_load_is_as_close_as_transformers_bfloat16(saved, case):
  folder, model, reference = saved[case]
  hf_bf16 = harness.reference_logits(
      type(model).from_pretrained(folder, dtype=torch.bfloat16), TOKENS)
  loaded = pzp.pretrained.load_hf(folder, dtype=jnp.bfloat16)
  assert {p.value.dtype for p in pz.unbind_params(loaded)[1]} == {jnp.dtype(jnp.bfloat16)}
  ours = np.abs(harness.penzai_logits(loaded, TOKENS) - reference)
  theirs = np.abs(hf_bf16 - reference)
  assert ours.max() <= 2 * theirs.max() + 0.05
  assert ours.mean() <= 2 * theirs.mean() + 0.01


def test_bias_labels_axes_and_values(saved):
  """The documented mapping: ``<projection>_bias.bias`` after each biased
  projection, with that projection's output axes, holding the HF tensor."""
  _, qwen, _ = saved["qwen2"]
  params = harness.params(pzp.pretrained.load_hf(saved["qwen2"][0]))
  attention = qwen.model.layers[1].self_attn
  expected = {
      "query_bias": ({"head_groups": 2, "query_heads": 2, "projection": 8}, attention.q_proj),
      "key_bias": ({"head_groups": 2, "projection": 8}, attention.k_proj),
      "value_bias": ({"head_groups": 2, "projection": 8}, attention.v_proj),
  }
  for name, (axes, linear) in expected.items():
    value = params[f"transformer/block_1/attention/{name}.bias"]
    assert dict(value.named_shape) == axes, name
    flat = np.asarray(value.unwrap(*axes)).reshape(-1)
    np.testing.assert_array_equal(flat, linear.bias.detach().numpy(), err_msg=name)
  assert not [label for label in params if "output_bias" in label or "mlp/" in label
              and label.endswith("_bias.bias")]  # Qwen2: no o_proj or MLP biases.

  llama = harness.params(pzp.pretrained.load_hf(saved["llama_attention_bias"][0]))
  assert dict(llama["transformer/block_0/attention/output_bias.bias"].named_shape) == {
      "embedding": 32}
  mlp = harness.params(pzp.pretrained.load_hf(saved["llama_mlp_bias_gelu_fast"][0]))
  assert dict(mlp["transformer/block_0/attention/query.weights"].named_shape)["heads"] == 4
  for name, size in (("gating_linear", {"neurons": 64}), ("value_linear", {"neurons": 64}),
                     ("out_linear", {"embedding": 32})):
    assert dict(mlp[f"transformer/block_1/mlp/{name}_bias.bias"].named_shape) == size, name

  mqa = harness.params(pzp.pretrained.load_hf(saved["qwen2_mqa_tied"][0]))
  assert dict(mqa["transformer/block_0/attention/key_bias.bias"].named_shape) == {"projection": 8}
  assert dict(mqa["transformer/block_0/attention/query_bias.bias"].named_shape) == {
      "query_heads": 4, "projection": 8}


@pytest.mark.parametrize("case", ["qwen2", "llama_mlp_bias_gelu_fast"])
def test_save_model_round_trip(saved, tmp_path, case):
  folder, _, reference = saved[case]
  model = pzp.pretrained.load_hf(folder)
  pzp.save_model(tmp_path / "native", model)
  restored = pzp.load_model(tmp_path / "native")
  before, after = harness.params(model), harness.params(restored)
  assert before.keys() == after.keys()
  for label, value in before.items():
    np.testing.assert_array_equal(np.asarray(after[label].data_array),
                                  np.asarray(value.data_array), err_msg=label)
  np.testing.assert_allclose(harness.penzai_logits(restored, TOKENS), reference, **TOLERANCE)


def test_gpt_neox_gelu_fast_is_the_tanh_gelu(tmp_path):
  """``gelu_fast`` is the tanh approximation: transformers' exact ``gelu``
  gives logits further apart than the tolerance, so mapping ``gelu_fast`` to
  the exact GELU (or anything else) would fail here."""
  torch.manual_seed(0)
  model = _randomized(transformers.GPTNeoXForCausalLM(
      transformers.GPTNeoXConfig(hidden_act="gelu_fast", **_COMMON)))
  model.save_pretrained(tmp_path, safe_serialization=True)
  reference = harness.reference_logits(model, TOKENS)
  logits = harness.penzai_logits(pzp.pretrained.load_hf(tmp_path), TOKENS)
  np.testing.assert_allclose(logits, reference, **TOLERANCE)
  exact = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(hidden_act="gelu", **_COMMON))
  exact.load_state_dict(model.state_dict())
  wrong = np.abs(harness.reference_logits(exact.eval(), TOKENS) - reference).max()
  ours = np.abs(logits - reference).max()
  print(f"gelu_fast: ours {ours:.3g}, the exact GELU's {wrong:.3g}")
  assert ours < wrong / 10  # As far from the exact GELU's logits as float32 allows.


@pytest.mark.parametrize("changes, match", [
    ({"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": False},
     "layer_types.*no window"),
    ({"layer_types": ["full_attention"]}, "layer_types.*2 entries"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
    ({"use_mrope": True}, "use_mrope"),
    ({"max_window_layers": -1}, "max_window_layers"),
    ({"attention_bias": False}, "attention_bias"),  # Qwen2Config has no such field.
])
def test_qwen2_configs_transformers_would_not_run_as_written_are_refused(
    saved, tmp_path, changes, match):
  folder = harness.edited(saved["qwen2"][0], tmp_path, **changes)
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)


def test_qwen2_config_of_transformers_4_loads(saved, tmp_path):
  """Configs written before ``layer_types`` existed (Qwen2.5 on the Hub):
  ``max_window_layers`` decides, ``use_mrope: false`` is accepted."""
  folder, _, reference = saved["qwen2"]
  config = json.loads((folder / "config.json").read_text())
  old = harness.edited(folder, tmp_path, layer_types=harness.DELETE, use_mrope=False,
                     rope_parameters=harness.DELETE,
                     rope_theta=config["rope_parameters"]["rope_theta"])
  np.testing.assert_allclose(harness.penzai_logits(pzp.pretrained.load_hf(old), TOKENS), reference,
                             **TOLERANCE)


def test_missing_bias_tensor_is_named(saved, tmp_path):
  folder = tmp_path / "nobias"
  folder.mkdir()
  source = saved["llama_attention_bias"][0]
  (folder / "config.json").write_text((source / "config.json").read_text())
  tensors = safetensors.numpy.load_file(source / "model.safetensors")
  del tensors["model.layers.1.self_attn.o_proj.bias"]
  safetensors.numpy.save_file(tensors, folder / "model.safetensors")
  with pytest.raises(errors.SafetensorsFormatError,
                     match="o_proj.bias.*block_1/attention/output_bias.bias"):
    pzp.pretrained.load_hf(folder)

