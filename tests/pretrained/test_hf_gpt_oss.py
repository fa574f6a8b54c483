"""gpt-oss through `load_hf` and `export_hf`, against transformers' own
GptOss on tiny random models (no downloads): dense, and with its experts
stored in MXFP4 as the Hub holds them (the quantised folder is built here,
with `quantized_mxfp4.quantize`; transformers' ``Mxfp4Config(dequantize=True)``
reads it on CPU and is the reference).

Each feature is shown to bind: switched off in the reference (sinks,
windows, the SwiGLU clamp, the router bias), transformers' logits move far
beyond the tolerance, so a loader ignoring it would fail the match.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import warnings

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from conftest import REPO
from conftest import run_python

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.pretrained import errors
from pz_persist.pretrained.hf import quantized_mxfp4

_SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "head_dim": 8, "pad_token_id": 0}

CASES = {
    # Grouped-query attention, layer 0 through a 3-token window (shorter than
    # the sequences), top 2 of 4 experts, transformers' default YaRN RoPE.
    "gpt_oss": {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 3},
    # Plain multi-head attention without biases, full attention only, a tight
    # clamp (which binds on these weights), top 1 of 3 experts, no RoPE scaling.
    "gpt_oss_plain": {"num_key_value_heads": 4, "num_local_experts": 3, "num_experts_per_tok": 1,
                      "attention_bias": False, "layer_types": ["full_attention"] * 2,
                      "swiglu_limit": 1.0, "swiglu_alpha": 1.2,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}},
}


def _hf_model(case: str) -> transformers.GptOssForCausalLM:
  torch.manual_seed(0)
  config = transformers.GptOssConfig(**dict(_SIZES, **CASES[case]))
  return checks.randomized(transformers.GptOssForCausalLM(config).float())


_UNQUANTIZED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                "lm_head"]
"""The Hub's ``modules_to_not_convert`` (openai/gpt-oss-20b)."""


def quantize_folder(folder, target) -> None:
  """``folder``'s copy with the experts' matrices stored in MXFP4 and the
  Hub's ``quantization_config``."""
  shutil.copytree(folder, target)
  stored = safetensors.numpy.load_file(folder / "model.safetensors")
  out = {}
  for name, value in stored.items():
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
      out[name + "_blocks"], out[name + "_scales"] = quantized_mxfp4.quantize(value)
    else:
      out[name] = value
  safetensors.numpy.save_file(out, target / "model.safetensors", metadata={"format": "pt"})
  config = json.loads((folder / "config.json").read_text())
  config["quantization_config"] = {"modules_to_not_convert": _UNQUANTIZED, "quant_method": "mxfp4"}
  (target / "config.json").write_text(json.dumps(config))


def _mxfp4_reference(folder) -> transformers.GptOssForCausalLM:
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return transformers.GptOssForCausalLM.from_pretrained(
        folder, quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """``{case: (folder, transformers model, reference float32 logits)}``,
  with ``mxfp4``: the first case's folder quantised."""
  result = {}
  for case in CASES:
    model = _hf_model(case)
    folder = tmp_path_factory.mktemp(case)
    model.save_pretrained(folder, safe_serialization=True)
    result[case] = (folder, model, checks.reference_logits(model))
  quantized = tmp_path_factory.mktemp("mxfp4") / "folder"
  quantize_folder(result["gpt_oss"][0], quantized)
  reference = _mxfp4_reference(quantized)
  result["mxfp4"] = (quantized, reference, checks.reference_logits(reference))
  return result


def _load(folder, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", errors.DequantizedWeightsWarning)
    return pzp.pretrained.load_hf(folder, **kwargs)


@pytest.mark.parametrize("case", [*CASES, "mxfp4"])
def test_float32_logits_match_transformers(saved, case):
  folder, _, reference = saved[case]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", errors.DequantizedWeightsWarning)
    print(f"{case}: float32 max abs error {checks.float32_error(folder, reference):.2g}")


def test_mxfp4_load_says_what_it_dequantised(saved):
  with pytest.warns(errors.DequantizedWeightsWarning, match=r"4 tensors.*MXFP4.*float32"):
    pzp.pretrained.load_hf(saved["mxfp4"][0])


def test_mxfp4_dequantisation_is_transformers_bit_for_bit(saved):
  """The experts' weights as transformers dequantises them (``Mxfp4Config(
  dequantize=True)``), exactly."""
  folder, reference, _ = saved["mxfp4"]
  model = _load(folder)
  params = {p.label: np.asarray(p.value.unwrap(*p.value.named_shape)) for p in
            __import__("penzai").pz.unbind_params(model)[1]}
  theirs = reference.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()
  gate = params["transformer/block_1/moe/experts/gate.weights"]
  np.testing.assert_array_equal(gate, theirs[..., ::2])
  down = params["transformer/block_1/moe/experts/down.weights"]
  np.testing.assert_array_equal(down, reference.model.layers[1].mlp.experts.down_proj.detach())


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  folder, _, reference = saved["gpt_oss"]
  ours, theirs = checks.bfloat16_errors(folder, transformers.GptOssForCausalLM, reference)
  print(f"gpt_oss bfloat16: ours {ours:.3g}, transformers' {theirs:.3g}")


@pytest.mark.parametrize("case", ["gpt_oss", pytest.param("mxfp4", marks=pytest.mark.slow)])
def test_kv_cache_sampling_matches_a_forward_pass(saved, case):
  checks.check_kv_cache_sampling(_load(saved[case][0]))


def test_save_model_round_trip(saved, tmp_path):
  folder, _, reference = saved["gpt_oss"]
  checks.check_save_model_round_trip(_load(folder), tmp_path / "native", reference)


@pytest.mark.parametrize("case", list(CASES))
def test_export_gives_back_the_folder(saved, tmp_path, case):
  """With ``like`` and without (the structure says gpt-oss)."""
  folder = saved[case][0]
  model = _load(folder)
  checks.check_export_model(model, folder, tmp_path / "like")
  config = checks.check_export_model(model, folder, tmp_path / "alone", like=False)
  assert config["num_experts_per_tok"] == CASES[case]["num_experts_per_tok"]


def test_mxfp4_exports_dequantised(saved, tmp_path):
  """A quantised folder exports dense, without ``quantization_config``, and
  says so; transformers computes the quantised folder's logits from it."""
  folder, _, reference = saved["mxfp4"]
  model = _load(folder)
  with pytest.warns(errors.DequantizedWeightsWarning, match="quantization_config"):
    pzp.export_hf(model, tmp_path / "out", like=folder)
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert "quantization_config" not in config
  names = checks.tensors(tmp_path / "out")
  assert "model.layers.0.mlp.experts.gate_up_proj" in names
  assert not [n for n in names if n.endswith(("_blocks", "_scales"))]
  theirs = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "out").eval()
  np.testing.assert_allclose(checks.reference_logits(theirs), reference, **checks.TOLERANCE)


GPT_OSS_20B_CONFIG = {
    # The Hub's config.json of openai/gpt-oss-20b (transformers 4.55: rope_theta and
    # rope_scaling, experts_per_token, initial_context_length, MXFP4), sizes shrunk.
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 2, "head_dim": 8, "hidden_act": "silu",
    "hidden_size": 32, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 32, "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 4,
    "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "num_local_experts": 4, "output_router_logits": False, "pad_token_id": 0,
    "quantization_config": {"modules_to_not_convert": _UNQUANTIZED, "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 3,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0",
    "use_cache": True, "vocab_size": 64,
}


def test_the_hubs_gpt_oss_config(saved, tmp_path):
  folder = tmp_path / "hub"
  shutil.copytree(saved["mxfp4"][0], folder)
  (folder / "config.json").write_text(json.dumps(GPT_OSS_20B_CONFIG))
  reference = checks.reference_logits(_mxfp4_reference(folder))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", errors.DequantizedWeightsWarning)
    print(f"openai/gpt-oss-20b's config: float32 max abs error"
          f" {checks.float32_error(folder, reference):.2g}")


def _edited_model(model, edit):
  model = copy.deepcopy(model)
  with torch.no_grad():
    for layer in model.model.layers:
      edit(layer)
  return model


@pytest.mark.parametrize("feature, edit", [
    ("sinks", lambda layer: layer.self_attn.sinks.fill_(-1e4)),
    ("router bias", lambda layer: layer.mlp.router.bias.zero_()),
    ("expert biases", lambda layer: layer.mlp.experts.gate_up_proj_bias.zero_()),
])
def test_features_bind(saved, feature, edit):
  _, model, reference = saved["gpt_oss"]
  changed = checks.reference_logits(_edited_model(model, edit))
  assert np.abs(changed - reference).max() > 100 * checks.TOLERANCE["atol"], feature


def test_clamp_binds(saved):
  _, model, reference = saved["gpt_oss_plain"]

  def unclamped(layer):
    layer.mlp.experts.limit = 1e9
  changed = checks.reference_logits(_edited_model(model, unclamped))
  assert np.abs(changed - reference).max() > 100 * checks.TOLERANCE["atol"]


def test_window_binds(saved, tmp_path):
  folder, _, reference = saved["gpt_oss"]
  unwindowed = checks.edited(folder, tmp_path, layer_types=["full_attention"] * 2)
  global_reference = checks.reference_logits(
      transformers.GptOssForCausalLM.from_pretrained(unwindowed).eval())
  assert np.abs(global_reference - reference).max() > 100 * checks.TOLERANCE["atol"]


@pytest.mark.parametrize("changes, match", [
    ({"quantization_config": {"quant_method": "fp8"}}, "quant_method"),
    ({"quantization_config": {"quant_method": "mxfp4", "group_size": 64}}, "group_size"),
    ({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": "all"}},
     "modules_to_not_convert"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_local_experts": 0}, "num_local_experts"),
    ({"experts_per_token": 3}, "experts_per_token"),
    ({"swiglu_limit": -1}, "swiglu_limit"),
    ({"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  from penzai.models.transformer.variants import llamalike_common  # pylint: disable=import-outside-toplevel

  def never(*args, **kwargs):
    raise AssertionError("the skeleton was built before the config was refused")

  monkeypatch.setattr(llamalike_common, "build_llamalike_transformer", never)
  folder = checks.edited(saved["gpt_oss"][0], tmp_path, **changes)
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)


@pytest.mark.parametrize("tamper, match", [
    (lambda t: t.pop("model.layers.1.mlp.experts.down_proj_scales"), "down_proj_scales"),
    (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj_blocks": np.zeros(
        (4, 64, 1, 8), np.uint8)}), "gate_up_proj_blocks"),
    (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj_scales": np.zeros(
        (4, 64, 1), np.float32)}), "gate_up_proj_scales"),
])
def test_damaged_mxfp4_storage_is_refused_before_anything_is_read(saved, tmp_path, monkeypatch,
                                                                  tamper, match):
  folder = tmp_path / "damaged"
  shutil.copytree(saved["mxfp4"][0], folder)
  stored = safetensors.numpy.load_file(folder / "model.safetensors")
  tamper(stored)
  safetensors.numpy.save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
  monkeypatch.setattr(quantized_mxfp4, "dequantize", None)  # Never reached.
  with pytest.raises(errors.SafetensorsFormatError, match=match):
    pzp.pretrained.load_hf(folder)


def test_mxfp4_matches_a_numpy_reference_of_the_format():
  """Each FP4 code and scale byte decoded as the OCP MX spec defines them:
  ``(-1)**s * 2**(e - 1) * (1 + m / 2)`` (``e`` > 0), ``(-1)**s * m / 2``
  (``e`` = 0), times ``2**(scale - 127)``; low nibble first."""
  rng = np.random.default_rng(0)
  blocks = rng.integers(0, 256, (2, 3, 2, 16), dtype=np.uint8)
  scales = rng.integers(120, 135, (2, 3, 2), dtype=np.uint8)

  def fp4(code: int) -> float:
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa / 2 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude

  expected = np.zeros((2, 3, 64), np.float32)
  for e, r, g, b in np.ndindex(blocks.shape):
    byte, scale = int(blocks[e, r, g, b]), 2.0 ** (int(scales[e, r, g]) - 127)
    expected[e, r, g * 32 + 2 * b] = fp4(byte & 15) * scale
    expected[e, r, g * 32 + 2 * b + 1] = fp4(byte >> 4) * scale
  got = quantized_mxfp4.dequantize(blocks, scales, "test")
  np.testing.assert_array_equal(got, expected.transpose(0, 2, 1))


def test_mxfp4_scale_out_of_range_is_refused():
  with pytest.raises(errors.SafetensorsFormatError, match="255, E8M0.s NaN"):
    quantized_mxfp4.dequantize(np.zeros((1, 1, 1, 16), np.uint8), np.full((1, 1, 1), 255,
                                                                          np.uint8), "here")


@pytest.mark.slow
def test_experts_shard_over_a_mesh_axis(saved, tmp_path):
  """``AxisRules`` puts ``experts`` on a mesh axis of two (host) devices: each
  device holds half of every expert parameter (the MXFP4-decoded ones too),
  the sinks follow the heads, and the logits are the unsharded ones."""
  folder, _, reference = saved["mxfp4"]
  out = run_python(f"""
      import warnings
      import jax, numpy as np
      import pz_persist as pzp
      from penzai import pz
      from pretrained import hf_family_harness as checks
      warnings.simplefilter("ignore")
      mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
      model = pzp.pretrained.load_hf({str(folder)!r}, sharding=pzp.AxisRules(
          mesh, {{"experts": "x", "head_groups": "x"}}))
      params = {{p.label: p.value for p in pz.unbind_params(model)[1]}}
      for label in ("transformer/block_0/moe/experts/gate.weights",
                    "transformer/block_1/moe/router.weights",
                    "transformer/block_0/attention/softmax.sinks"):
        shards = params[label].data_array.addressable_shards
        print(label, len({{s.device for s in shards}}), shards[0].data.shape)
      np.save({str(tmp_path / "sharded.npy")!r}, checks.penzai_logits(model))
      """, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])}, timeout=300)
  assert "gate.weights 2 (2, 32, 32)" in out, out
  assert "router.weights 2 (2, 32)" in out, out
  assert "softmax.sinks 2 (1, 2)" in out, out
  np.testing.assert_allclose(np.load(tmp_path / "sharded.npy"), reference, **checks.TOLERANCE)
