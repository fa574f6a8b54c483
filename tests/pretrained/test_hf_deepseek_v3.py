"""DeepSeek-V3 through `load_hf` and `export_hf`, against transformers' own
DeepseekV3ForCausalLM on tiny random models (no downloads).

What it adds, each shown to bind (switched off in the reference, the logits
move far beyond the tolerance): multi-head latent attention (low-rank query
and key/value latents, the decoupled interleaved RoPE, yarn's mscale in the
softmax scale), dense first layers then group-limited sigmoid routing with
a correction bias, shared experts and a routed scaling factor; FP8
block-scaled weights dequantised on load.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist import errors
from pz_persist.pretrained.hf import quantized_fp8
from pz_persist.pretrained.hf.building import latent_decoder

_SIZES = {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
          "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
          "qk_rope_head_dim": 8, "qk_nope_head_dim": 10, "v_head_dim": 12,
          "n_routed_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 128}

CASES = {
    # Low-rank queries, interleaved RoPE, one dense layer then two MoE layers
    # routed within the best 2 of 4 groups, renormalised and scaled.
    "deepseek_v3": harness.Case(transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                                {**_SIZES, "num_hidden_layers": 3, "q_lora_rank": 24,
                                 "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
                                 "n_shared_experts": 1, "routed_scaling_factor": 2.5}),
    # One query projection, RoPE in halves, yarn with mscale != mscale_all_dim,
    # no renormalisation, two shared experts, no groups.
    "deepseek_v3_plain": harness.Case(
        transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
        {**_SIZES, "num_hidden_layers": 2, "q_lora_rank": None, "rope_interleave": False,
         "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "n_shared_experts": 2,
         "norm_topk_prob": False, "routed_scaling_factor": 1.5,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32, "mscale": 0.9,
                             "mscale_all_dim": 0.7}}),
}


def _make(case: harness.Case, **changes):
  """The case's model, its routers' correction biases drawn too (a buffer,
  which `harness.randomized` leaves at zero)."""
  model = case.make(**changes)
  generator = torch.Generator().manual_seed(2)
  with torch.no_grad():
    for name, buffer in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.5)
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  result = {}
  for name, case in CASES.items():
    model = _make(case)
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder, safe_serialization=True)
    result[name] = harness.Saved(folder, model, harness.reference_logits(model))
  return result


@pytest.mark.parametrize("name", list(CASES))
def test_float32_logits_match_transformers(saved, name):
  harness.check_float32(saved[name], name)


def test_kv_cache_sampling_matches_a_forward_pass(saved):
  harness.check_kv_cache(pzp.pretrained.load_hf(saved["deepseek_v3"].folder))


def test_save_model_round_trip(saved, tmp_path):
  harness.check_save_model(saved["deepseek_v3"], tmp_path)


@pytest.mark.parametrize("name", list(CASES))
def test_export_gives_back_the_folder(saved, tmp_path, name):
  harness.check_export(saved[name], tmp_path, "deepseek_v3",
                       same_fields=("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                                    "first_k_dense_replace", "n_group", "topk_group",
                                    "routed_scaling_factor", "norm_topk_prob", "rope_interleave"))


def test_latent_axes_are_named(saved):
  """The latents and experts are named axes (treescope shows them,
  `AxisRules` can place them)."""
  model = pzp.pretrained.load_hf(saved["deepseek_v3"].folder)
  axes = {label: dict(value.named_shape) for label, value in harness.params(model).items()}
  assert axes["transformer/block_0/attention/q_a.weights"] == {"embedding": 32, "q_latent": 24}
  assert axes["transformer/block_0/attention/key_up.weights"] == {
      "kv_latent": 16, "heads": 4, "projection": 10}
  assert axes["transformer/block_0/attention/value_up.weights"] == {
      "kv_latent": 16, "heads": 4, "projection": 12}
  assert axes["transformer/block_1/mlp/experts/gate.weights"] == {
      "experts": 8, "embedding": 32, "neurons": 16}


# --- each feature binds -------------------------------------------------------


def _changed(saved_case: harness.Saved, case: harness.Case, edit=None, **config) -> float:
  model = case.model_cls(case.config(**config))
  model.load_state_dict(saved_case.hf_model.state_dict())
  if edit is not None:
    edit(model)
  changed = float(np.abs(harness.reference_logits(model.eval()) - saved_case.reference).max())
  assert changed > 100 * harness.TOLERANCE["atol"], changed
  return changed


def _zero_correction_bias(model):
  with torch.no_grad():
    for name, buffer in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        buffer.zero_()


@pytest.mark.parametrize("what, edit, config", [
    ("interleaved rope", None, {"rope_interleave": False}),
    ("group-limited routing", None, {"n_group": 1, "topk_group": 1}),
    ("routed scaling", None, {"routed_scaling_factor": 1.0}),
    ("renormalised weights", None, {"norm_topk_prob": False}),
    ("correction bias", _zero_correction_bias, {}),
])
def test_features_bind(saved, what, edit, config):
  print(f"without {what}: logits change by"
        f" {_changed(saved['deepseek_v3'], CASES['deepseek_v3'], edit, **config):.3g}")


def test_yarn_mscale_binds(saved):
  rope = dict(CASES["deepseek_v3_plain"].fields["rope_parameters"])
  rope.pop("mscale_all_dim")
  print(f"without mscale_all_dim: logits change by"
        f" {_changed(saved['deepseek_v3_plain'], CASES['deepseek_v3_plain'], rope_parameters=rope):.3g}")


# --- FP8 block-scaled weights -------------------------------------------------

_BLOCK = (8, 16)  # Rows, columns: smaller than the matrices, not dividing all of them.


def _quantized_folder(saved_case: harness.Saved, target, **replaced):
  """``saved_case``'s folder with every matrix but the embeddings, router and
  head stored as DeepSeek's FP8 (float8_e4m3fn plus a float32
  ``weight_scale_inv`` per block); returns the folder and the dequantised
  tensors (NumPy's own arithmetic, the reference)."""
  stored = harness.tensors(saved_case.folder)
  out, dense = {}, {}
  for name, value in stored.items():
    quantize = (value.ndim == 2 and name.endswith("proj.weight")) or "_proj_with_mqa" in name
    if not quantize:
      out[name] = dense[name] = value
      continue
    rows, cols = -(-value.shape[0] // _BLOCK[0]), -(-value.shape[1] // _BLOCK[1])
    padded = np.zeros((rows * _BLOCK[0], cols * _BLOCK[1]), np.float32)
    padded[:value.shape[0], :value.shape[1]] = value
    blocks = np.abs(padded.reshape(rows, _BLOCK[0], cols, _BLOCK[1])).max(axis=(1, 3))
    scale = (np.maximum(blocks, 1e-12) / 448.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, _BLOCK[0], 0), _BLOCK[1], 1)[:value.shape[0], :value.shape[1]]
    fp8 = (value / full).astype(ml_dtypes.float8_e4m3fn)
    out[name], out[name + "_scale_inv"] = fp8, scale
    dense[name] = fp8.astype(np.float32) * full
  target.mkdir()
  out.update(replaced)
  safetensors.numpy.save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
  config = harness.config(saved_case.folder)
  config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                   "quant_method": "fp8", "weight_block_size": list(_BLOCK)}
  (target / "config.json").write_text(json.dumps(config))
  return target, dense


def test_fp8_weights_are_dequantised_on_load(saved, tmp_path):
  """Each parameter is NumPy's dequantisation bit for bit, and the logits
  are transformers' with those dequantised weights (within 1e-4)."""
  case = saved["deepseek_v3"]
  folder, dense = _quantized_folder(case, tmp_path / "fp8")
  model = pzp.pretrained.load_hf(folder, dtype=np.float32)
  reference = pzp.pretrained.load_hf(case.folder)
  values = harness.params(model)
  assert values.keys() == harness.params(reference).keys()
  q_b = values["transformer/block_0/attention/query.weights"].unwrap(
      "heads", "projection", "q_latent").reshape(4 * 18, 24)
  np.testing.assert_array_equal(np.asarray(q_b),
                                dense["model.layers.0.self_attn.q_b_proj.weight"])
  # transformers with the same dequantised weights: the original folder
  # with each quantised matrix replaced by NumPy's dequantisation.
  (tmp_path / "dense").mkdir()
  safetensors.numpy.save_file({k: v.astype(np.float32) for k, v in dense.items()},
                              str(tmp_path / "dense" / "model.safetensors"),
                              metadata={"format": "pt"})
  (tmp_path / "dense" / "config.json").write_bytes((case.folder / "config.json").read_bytes())
  hf = CASES["deepseek_v3"].model_cls.from_pretrained(tmp_path / "dense").eval()
  want = harness.reference_logits(hf)
  got = harness.penzai_logits(model)
  np.testing.assert_allclose(got, want, **harness.TOLERANCE)
  print(f"fp8 folder: float32 max abs error {np.abs(got - want).max():.3g};"
        f" dequantisation moved the logits by {np.abs(want - case.reference).max():.3g}")


def test_fp8_export_writes_the_dequantised_weights(saved, tmp_path):
  folder, dense = _quantized_folder(saved["deepseek_v3"], tmp_path / "fp8")
  out = pzp.export_hf(pzp.pretrained.load_hf(folder, dtype=np.float32), tmp_path / "out",
                      like=folder)
  written = harness.tensors(out)
  assert not any(name.endswith("_scale_inv") for name in written)
  assert "quantization_config" not in harness.config(out)
  for name, value in dense.items():
    np.testing.assert_array_equal(written[name], value.astype(np.float32), err_msg=name)


def test_fp8_dequantise_matches_numpy():
  rng = np.random.default_rng(0)
  weight = rng.normal(size=(20, 33)).astype(ml_dtypes.float8_e4m3fn)
  scale = rng.uniform(0.5, 2, size=(3, 3)).astype(np.float32)
  got = quantized_fp8.dequantize(weight, scale, (8, 16))
  for i in range(20):
    for j in range(33):
      assert got[i, j] == np.float32(weight[i, j]) * scale[i // 8, j // 16]


@pytest.mark.parametrize("quantization, match", [
    ({"quant_method": "awq", "weight_block_size": [128, 128]}, "quant_method"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": 128}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "activation_scheme"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "group_size": 4}, "group_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "e8m0fnu"}, "scale_fmt"),
])
def test_quantization_configs_are_refused(saved, tmp_path, monkeypatch, quantization, match):
  folder = harness.edited(saved["deepseek_v3"].folder, tmp_path, quantization_config=quantization)
  _refused_before_building(folder, match, monkeypatch)


def test_fp8_scale_of_the_wrong_shape_is_refused_before_reading(saved, tmp_path):
  name = "model.layers.0.self_attn.q_b_proj.weight_scale_inv"
  folder, _ = _quantized_folder(saved["deepseek_v3"], tmp_path / "fp8",
                                **{name: np.ones((1, 1), np.float32)})
  with pytest.raises(errors.PzPersistError, match="weight_scale_inv.*expected float32"):
    pzp.pretrained.load_hf(folder)


def test_fp8_folder_loads_in_its_other_tensors_dtype(saved, tmp_path):
  """Without ``dtype``, an FP8 folder loads in the dtype of its unquantised
  tensors (the Hub's: bfloat16; here float32), never float8."""
  folder, _ = _quantized_folder(saved["deepseek_v3"], tmp_path / "fp8")
  model = pzp.pretrained.load_hf(folder)
  assert {value.dtype for value in harness.params(model).values()} == {np.dtype(np.float32)}


# --- hostile configs ----------------------------------------------------------


def _refused_before_building(folder, match, monkeypatch):
  def no_build(*args, **kwargs):
    raise AssertionError("a skeleton was built before the config was refused")

  monkeypatch.setattr(latent_decoder, "latent_attention", no_build)
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)


@pytest.mark.parametrize("changes, match", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"num_nextn_predict_layers": 10**9, "num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"n_routed_experts": 10**9, "n_group": 1, "topk_group": 1}, "n_routed_experts"),
    ({"n_routed_experts": 16}, "n_routed_experts.*experts 0..7"),
    ({"q_lora_rank": 0}, "q_lora_rank"),
    ({"kv_lora_rank": "16"}, "kv_lora_rank"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"qk_head_dim": 99}, "qk_head_dim"),
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"attention_bias": True}, "attention_bias"),
    ({"n_group": 3}, "n_group"),
    ({"n_group": 8}, "n_group"),  # Groups of one expert: no best two.
    ({"topk_group": 5}, "topk_group"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace"),
    ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 4.0,
                          "original_max_position_embeddings": 32}}, "rope_theta"),
    ({"some_new_field": 1}, "some_new_field"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  folder = harness.edited(saved["deepseek_v3"].folder, tmp_path, **changes)
  if "rope_theta" in match:  # Refused by the RoPE check, once the skeleton is built.
    with pytest.raises(errors.UnsupportedConfigError, match=match):
      pzp.pretrained.load_hf(folder)
    return
  _refused_before_building(folder, match, monkeypatch)


def test_multi_token_prediction_layers_are_left_unread(saved, tmp_path):
  """The Hub's DeepSeek-V3 holds an MTP layer (``model.layers.61``) past
  ``num_hidden_layers``: not part of the causal LM, not read."""
  case = saved["deepseek_v3"]
  stored = harness.tensors(case.folder)
  extra = {name.replace("model.layers.2.", "model.layers.3."): value
           for name, value in stored.items() if name.startswith("model.layers.2.")}
  target = tmp_path / "mtp"
  target.mkdir()
  safetensors.numpy.save_file({**stored, **extra}, str(target / "model.safetensors"),
                              metadata={"format": "pt"})
  (target / "config.json").write_text(json.dumps(
      {**harness.config(case.folder), "num_nextn_predict_layers": 1}))
  np.testing.assert_allclose(harness.penzai_logits(pzp.pretrained.load_hf(target)),
                             case.reference, **harness.TOLERANCE)
  (target / "config.json").write_text(json.dumps(
      {**harness.config(case.folder), "num_nextn_predict_layers": 0}))
  with pytest.raises(errors.UnsupportedConfigError, match="num_hidden_layers"):
    pzp.pretrained.load_hf(target)


DEEPSEEK_V3_CONFIG = {
    # The Hub's config.json of deepseek-ai/DeepSeek-V3 (transformers 4.33 style:
    # rope_theta and a legacy yarn rope_scaling, remote-code fields), its sizes
    # shrunk and its quantization_config left out (the FP8 tests have it).
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1,
    "ep_size": 1, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 32,
    "initializer_range": 0.02, "intermediate_size": 48, "kv_lora_rank": 16,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 16,
    "moe_layer_freq": 1, "n_group": 4, "n_routed_experts": 8, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 2,
    "num_hidden_layers": 2, "num_key_value_heads": 4, "num_nextn_predict_layers": 1,
    "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
                                            "mscale": 1.0, "mscale_all_dim": 1.0,
                                            "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 2, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True,
    "v_head_dim": 8, "vocab_size": 64, "pad_token_id": 0,
}


def test_the_hubs_deepseek_v3_config(tmp_path):
  saved = harness.hub_saved(tmp_path, DEEPSEEK_V3_CONFIG)
  print(f"deepseek-ai/DeepSeek-V3's config: float32 max abs error"
        f" {harness.check_float32(saved, 'DeepSeek-V3 hub'):.3g}")
  pzp.export_hf(pzp.pretrained.load_hf(saved.folder), tmp_path / "out", like=saved.folder)
  harness.assert_same_tensors(harness.tensors(tmp_path / "out"), harness.tensors(saved.folder))


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  """A bfloat16 load is, on average, as far from the float32 logits as
  transformers' own bfloat16 run (within a factor of two plus 0.01, as
  `harness.check_bfloat16`). Not the maximum: where two experts nearly tie,
  bfloat16 rounding in earlier layers decides the choice, differently in the
  two implementations, and a token that changed experts moves by O(1) (here
  1.66 against transformers' 0.38; the MoE layer alone, fed the same
  bfloat16 input, is closer to float32 than transformers': 0.088 against
  0.17)."""
  case = saved["deepseek_v3"]
  hf_bf16 = harness.reference_logits(type(case.hf_model).from_pretrained(
      case.folder, dtype=torch.bfloat16))
  model = pzp.pretrained.load_hf(case.folder, dtype=jnp.bfloat16)
  ours = np.abs(harness.penzai_logits(model) - case.reference)
  theirs = np.abs(hf_bf16 - case.reference)
  print(f"bfloat16 vs float32: max {ours.max():.3g} mean {ours.mean():.3g}"
        f" (transformers bfloat16: max {theirs.max():.3g} mean {theirs.mean():.3g})")
  assert ours.mean() <= 2 * theirs.mean() + 0.01


def test_axis_rules_place_heads_latents_and_experts(saved):
  """``AxisRules`` shard the latent attention by ``heads`` and the experts by
  ``experts``; the sharded model computes the same logits."""
  import jax  # pylint: disable=import-outside-toplevel
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
  rules = pzp.AxisRules(mesh, {"heads": "model", "experts": "data", "q_latent": "data"})
  model = pzp.pretrained.load_hf(saved["deepseek_v3"].folder, sharding=rules)
  params = harness.params(model)
  key_up = params["transformer/block_0/attention/key_up.weights"]
  assert "model" in key_up.data_array.sharding.spec
  experts = params["transformer/block_1/mlp/experts/gate.weights"]
  assert "data" in experts.data_array.sharding.spec
  np.testing.assert_allclose(harness.penzai_logits(model), saved["deepseek_v3"].reference,
                             **harness.TOLERANCE)


def test_deepseek_v2_is_refused_saying_why(tmp_path):
  folder = tmp_path / "v2"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps({"model_type": "deepseek_v2"}))
  safetensors.numpy.save_file({}, str(folder / "model.safetensors"))
  with pytest.raises(errors.UnsupportedConfigError, match="DeepSeek-V2.*router"):
    pzp.pretrained.load_hf(folder)


def test_cli_export_from_a_saved_model(saved, tmp_path):
  """The latent-attention and expert layers survive ``save_model`` /
  ``load_model`` (allow-listed), and ``pz-persist export hf`` writes the
  original tensors from that checkpoint alone."""
  harness.check_cli_export_from_native(saved["deepseek_v3"], tmp_path)
