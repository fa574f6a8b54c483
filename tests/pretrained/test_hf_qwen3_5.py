"""Qwen3.5 / 3.6 text models through `load_hf` and `export_hf`:
``qwen3_5_text`` and the text model of ``qwen3_5`` multimodal folders, against
transformers on tiny random models (no downloads).

The gated DeltaNet layers (`pz_persist.nn.gated_delta_net`)
are matched against transformers' chunked kernel (what it runs on whole
sequences); KV-cache sampling goes through `kv_caching_lm`, which carries
their convolution and recurrent state. Each feature Qwen3.5 adds is shown to
bind: taken out (in transformers' config, or from the loaded model), the
logits move far beyond the tolerance.

The models' weights are drawn with a standard deviation of 0.2 (the other
families' tests use 0.3): the DeltaNet's output norm divides by the RMS of
each head's output, which for random weights can be small, so float32
rounding is amplified; at 0.3, transformers' own chunked and recurrent
kernels already differ by 2.4e-5 on these sequences (measured), and
``load_hf``'s logits are 8.5e-5 from the chunked kernel's, 5.8e-5 from a
float64 run of transformers (whose kernel still computes the decay in
float32): rounding, not a different function.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from penzai import pz
from penzai.models.transformer import sampling_mode

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist import errors
from pz_persist.nn import mixture_of_experts as moe
from pz_persist.nn.gated_delta_net import GatedDeltaNet
from pz_persist.pretrained.sampling import kv_caching_lm

_COMMON = {"hidden_size": 32, "num_attention_heads": 4, "vocab_size": 64, "intermediate_size": 64,
           "pad_token_id": 0, "linear_key_head_dim": 8, "linear_value_head_dim": 8}

CASES = {
    # transformers' default layer pattern (three linear-attention layers, then a
    # full one), grouped-query attention, two value heads per key head,
    # untied head, the default partial rotary factor 0.25 (4 of 16 entries).
    "hybrid": {"num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 16,
               "linear_num_key_heads": 2, "linear_num_value_heads": 4,
               "linear_conv_kernel_dim": 4},
    # Full attention first, tied embeddings, as many key/value heads as heads,
    # one value head per key head, a 3-tap convolution, half the head rotated.
    "tied": {"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"],
             "num_key_value_heads": 4, "head_dim": 8, "tie_word_embeddings": True,
             "linear_num_key_heads": 2, "linear_num_value_heads": 2,
             "linear_conv_kernel_dim": 3,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                 "partial_rotary_factor": 0.5}},
}

QWEN3_5_HUB_CONFIG = {
    # The shape of the Hub's Qwen3.5 / 3.6 config.json (a qwen3_5 folder:
    # text_config with mrope sections, the MTP head's fields, mamba_ssm_dtype,
    # attn_output_gate; a vision_config), with the sizes shrunk.
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "image_token_id": 60, "video_token_id": 61, "vision_start_token_id": 62,
    "vision_end_token_id": 63, "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "bos_token_id": None, "dtype": "bfloat16", "eos_token_id": 2, "full_attention_interval": 2,
        "head_dim": 16, "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
        "intermediate_size": 64,
        "layer_types": ["linear_attention", "full_attention", "linear_attention",
                        "full_attention"],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_value_head_dim": 8, "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144, "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
        "pad_token_id": 0, "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [1, 1, 0],
                            "rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 64,
    },
    "vision_config": {
        "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
        "out_hidden_size": 32, "num_position_embeddings": 16, "model_type": "qwen3_5",
        "deepstack_visual_indexes": [],
    },
}


def randomized(model: torch.nn.Module, scale: float = 0.2) -> torch.nn.Module:
  """``model`` with every parameter redrawn: the ``1 + w`` norms' ``w``
  around zero, the DeltaNet output norm's weight (which multiplies as
  stored) around one."""
  generator = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for name, param in model.named_parameters():
      center = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
      param.copy_(torch.randn(param.shape, generator=generator) * scale + center)
  return model.eval()


def _text_model(case: str, **changes) -> transformers.Qwen3_5ForCausalLM:
  torch.manual_seed(0)
  config = transformers.Qwen3_5TextConfig(**{**_COMMON, **CASES[case], **changes})
  return randomized(transformers.Qwen3_5ForCausalLM(config))


def _write_hub_folder(folder) -> transformers.Qwen3_5ForConditionalGeneration:
  folder.mkdir(exist_ok=True)
  (folder / "config.json").write_text(json.dumps(QWEN3_5_HUB_CONFIG))
  torch.manual_seed(0)
  model = randomized(transformers.Qwen3_5ForConditionalGeneration(
      transformers.AutoConfig.from_pretrained(folder)).float())
  model.save_pretrained(folder, safe_serialization=True)
  (folder / "config.json").write_text(json.dumps(QWEN3_5_HUB_CONFIG))  # The Hub's, as it is.
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  result = {}
  for case in CASES:
    model = _text_model(case)
    folder = tmp_path_factory.mktemp(case)
    model.save_pretrained(folder, safe_serialization=True)
    result[case] = harness.Saved(folder, model, harness.reference_logits(model))
  folder = tmp_path_factory.mktemp("hub") / "qwen3_5"
  model = _write_hub_folder(folder)
  result["hub"] = harness.Saved(folder, model, harness.reference_logits(model))
  return result


@pytest.mark.parametrize("case", ["hybrid", pytest.param("tied", marks=pytest.mark.slow), "hub"])
def test_float32_logits_match_transformers(saved, case):
  harness.check_float32(saved[case], case)


def test_multimodal_folder_gives_the_text_model_and_reports_the_rest(saved, caplog):
  with caplog.at_level(logging.WARNING, logger="pz_persist.pretrained.hf"):
    model = pzp.pretrained.load_hf(saved["hub"].folder)
  assert "model.visual.*" in caplog.text and "not read" in caplog.text
  assert len(pz.select(model).at_instances_of(GatedDeltaNet).get_sequence()) == 2


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  harness.check_bfloat16(saved["hybrid"], "hybrid")


def _sampled(model, tokens=harness.SEQUENCES, prompt: int = 3) -> np.ndarray:
  sampler = harness.sampling_jitted(kv_caching_lm(  # pylint: disable=protected-access
      model, cache_len=tokens.shape[1], batch_axes={"batch": tokens.shape[0]}, pad_id=-1))
  steps = [sampler(pz.nx.wrap(jnp.asarray(tokens[:, :prompt]), "batch", "seq"))]
  for i in range(prompt, tokens.shape[1]):
    steps.append(sampler(pz.nx.wrap(jnp.asarray(tokens[:, i:i + 1]), "batch", "seq")))
  return np.concatenate(
      [np.asarray(s.untag("batch", "seq", "vocabulary").unwrap(), np.float32) for s in steps], 1)


@pytest.mark.parametrize("case", ["hybrid", pytest.param("tied", marks=pytest.mark.slow)])
def test_kv_cache_sampling_matches_a_forward_pass(saved, case):
  """A 3-token prompt, then one token per call: the DeltaNet layers carry
  their convolution inputs and recurrent state from call to call
  (`kv_caching_lm`), the attention layers their keys and values."""
  model = pzp.pretrained.load_hf(saved[case].folder)
  full = harness.penzai_logits(model)
  cached = _sampled(model)
  print(f"{case}: KV-cache sampling vs forward pass, max abs difference"
        f" {np.abs(cached - full).max():.3g}")
  np.testing.assert_allclose(cached, full, **harness.TOLERANCE)


def test_penzai_sampling_mode_without_the_state_is_refused(saved):
  """``KVCachingTransformerLM.from_uncached`` converts only attention layers:
  the DeltaNet layers refuse to run there rather than forget the past."""
  model = pzp.pretrained.load_hf(saved["hybrid"].folder)
  sampler = sampling_mode.KVCachingTransformerLM.from_uncached(
      model, cache_len=10, batch_axes={"batch": 3}, pad_id=-1)
  with pytest.raises(errors.ArgumentError, match="kv_caching_lm"):
    sampler(pz.nx.wrap(jnp.asarray(harness.SEQUENCES[:, :3]), "batch", "seq"))


@pytest.mark.slow
def test_save_model_round_trip_and_cli_export(saved, tmp_path):
  harness.check_save_model(saved["hybrid"], tmp_path)
  harness.check_cli_export_from_native(saved["tied"], tmp_path / "cli")


@pytest.mark.parametrize("case", ["hybrid", pytest.param("tied", marks=pytest.mark.slow)])
def test_export_gives_back_the_folder(saved, tmp_path, case):
  """With ``like`` and from the model alone (its DeltaNet layers say Qwen3.5)."""
  harness.check_export(saved[case], tmp_path, "qwen3_5_text",
                       same_fields=("layer_types", "tie_word_embeddings", "rope_parameters"))


def test_multimodal_text_model_exports_as_qwen3_5_text(saved, tmp_path):
  """The text model of a ``qwen3_5`` folder is written as ``qwen3_5_text``
  (its tensors renamed), which transformers reads with the same logits."""
  hub = saved["hub"]
  model = pzp.pretrained.load_hf(hub.folder)
  pzp.export_hf(model, tmp_path / "like", like=hub.folder)
  config = harness.config(tmp_path / "like")
  assert (config["model_type"], config["architectures"]) == ("qwen3_5_text",
                                                            ["Qwen3_5ForCausalLM"])
  assert config["rope_parameters"]["mrope_section"] == [1, 1, 0]
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "like").eval()
  np.testing.assert_allclose(harness.reference_logits(theirs), hub.reference,
                             **harness.TOLERANCE)
  written, original = harness.tensors(tmp_path / "like"), harness.tensors(hub.folder)
  for name, value in written.items():
    source = name if name == "lm_head.weight" else name.replace("model.",
                                                                "model.language_model.", 1)
    assert value.tobytes() == original[source].tobytes(), name


def _differs(model, reference) -> float:
  changed = float(np.abs(harness.penzai_logits(model) - reference).max())
  assert changed > 100 * harness.TOLERANCE["atol"]
  return changed


def test_each_feature_binds(saved):
  """Taken out of the loaded model, each feature moves the logits far from
  transformers': the attention's output gate, the DeltaNet's convolution
  (made the identity), the partial rotary fraction (in transformers' config)."""
  hybrid = saved["hybrid"]
  model = pzp.pretrained.load_hf(hybrid.folder)
  ungated = pz.select(model).at_instances_of(pz.nn.BranchAndMultiplyTogether).where(
      lambda b: isinstance(b.branches[0], pz.nn.Attention)).apply(lambda b: b.branches[0])
  print(f"without the attention output gate: {_differs(ungated, hybrid.reference):.3g}")

  def identity_conv(layer: GatedDeltaNet) -> GatedDeltaNet:
    def unit(param):
      taps = param.value.named_shape["conv_taps"]
      unit_kernel = pz.nx.nmap(lambda w: jnp.zeros_like(w).at[-1].set(1.0))(
          param.value.untag("conv_taps")).tag("conv_taps")
      assert unit_kernel.named_shape["conv_taps"] == taps
      return pz.Parameter(value=unit_kernel, label=param.label)
    return dataclasses.replace(layer, query_conv=unit(layer.query_conv),
                               key_conv=unit(layer.key_conv), value_conv=unit(layer.value_conv))

  unconvolved = pz.select(model).at_instances_of(GatedDeltaNet).apply(identity_conv)
  print(f"without the DeltaNet convolution: {_differs(unconvolved, hybrid.reference):.3g}")
  harness.check_feature_binds(
      hybrid, harness.Case(transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM,
                           {**_COMMON, **CASES["hybrid"]}),
      rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                       "partial_rotary_factor": 1.0})


def test_mrope_sections_change_nothing_for_text(saved, tmp_path):
  """The multimodal RoPE sections only split frequencies between image
  positions: for text, transformers' logits are the same whatever they
  are, so accepting them is right."""
  hub = saved["hub"]
  raw = json.loads((hub.folder / "config.json").read_text())
  raw["text_config"]["rope_parameters"]["mrope_section"] = [0, 1, 1]
  other = tmp_path / "other"
  other.mkdir()
  for item in hub.folder.iterdir():
    (other / item.name).write_bytes(item.read_bytes())
  (other / "config.json").write_text(json.dumps(raw))
  theirs = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(other).eval()
  np.testing.assert_array_equal(harness.reference_logits(theirs), hub.reference)


@pytest.mark.parametrize("changes, match", [
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention",
                      "full_attention"]}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attn_output_gate": False}, "attn_output_gate"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.1}}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "mrope_section": "11"}}, "mrope_section"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"num_experts": 4}, "num_experts"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  folder = harness.edited(saved["hybrid"].folder, tmp_path, **changes)
  harness.check_refused_before_building(folder, match, monkeypatch)


@pytest.mark.parametrize("changes, match", [
    ({"text_config": {**QWEN3_5_HUB_CONFIG["text_config"], "model_type": "qwen3_next"}},
     "model_type"),
    ({"text_config": "qwen3_5_text"}, "text_config"),
    ({"text_config": {**QWEN3_5_HUB_CONFIG["text_config"], "hidden_act": "relu"}},
     "hidden_act"),
])
def test_hostile_multimodal_configs_are_refused(saved, tmp_path, monkeypatch, changes, match):
  folder = harness.edited(saved["hub"].folder, tmp_path, **changes)
  harness.check_refused_before_building(folder, match, monkeypatch)


def test_the_delta_rule_scan_matches_transformers_recurrent_kernel():
  """The layer's recurrence against transformers'
  ``torch_recurrent_gated_delta_rule`` on random inputs (float32): the same
  recurrence, so rounding apart, the same numbers."""
  from transformers.models.qwen3_5 import modeling_qwen3_5  # pylint: disable=import-outside-toplevel
  config = transformers.Qwen3_5TextConfig(**{**_COMMON, **CASES["hybrid"]})
  torch.manual_seed(0)
  reference = randomized(modeling_qwen3_5.Qwen3_5GatedDeltaNet(config, layer_idx=0))
  inputs = np.random.RandomState(0).randn(2, 12, 32).astype(np.float32)
  with torch.no_grad():
    expected = reference(torch.tensor(inputs)).numpy()
  ours = _layer_from_torch(reference)(pz.nx.wrap(jnp.asarray(inputs), "batch", "seq", "embedding"))
  got = np.asarray(ours.untag("batch", "seq", "embedding").unwrap())
  print(f"one DeltaNet layer: max abs error {np.abs(got - expected).max():.3g}")
  np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def _layer_from_torch(layer) -> GatedDeltaNet:
  """The `GatedDeltaNet` holding a transformers layer's parameters (as
  load_hf would: the fused tensors split by rows)."""
  nk, nv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
  hidden = layer.hidden_size
  qkv = layer.in_proj_qkv.weight.detach().numpy()
  conv = layer.conv1d.weight.detach().numpy()[:, 0]
  rows = {"query": (0, nk * dk), "key": (nk * dk, 2 * nk * dk),
          "value": (2 * nk * dk, 2 * nk * dk + nv * dv)}
  shapes = {"query": (nk, dk), "key": (nk, dk), "value": (nv, dv)}
  axes = {"query": ("key_heads", "key_projection"), "key": ("key_heads", "key_projection"),
          "value": ("value_heads", "value_projection")}
  values = {}
  for name, (start, stop) in rows.items():
    values[f"{name}.weights"] = pz.nx.wrap(qkv[start:stop].reshape(*shapes[name], hidden)).tag(
        *axes[name], "embedding")
    values[f"{name}_conv"] = pz.nx.wrap(conv[start:stop].reshape(*shapes[name], -1)).tag(
        *axes[name], "conv_taps")
  values["output_gate.weights"] = pz.nx.wrap(
      layer.in_proj_z.weight.detach().numpy().reshape(nv, dv, hidden)).tag(
          "value_heads", "value_projection", "embedding")
  values["write_strength.weights"] = pz.nx.wrap(layer.in_proj_b.weight.detach().numpy()).tag(
      "value_heads", "embedding")
  values["decay_input.weights"] = pz.nx.wrap(layer.in_proj_a.weight.detach().numpy()).tag(
      "value_heads", "embedding")
  values["log_decay_rate"] = pz.nx.wrap(layer.A_log.detach().numpy()).tag("value_heads")
  values["decay_bias"] = pz.nx.wrap(layer.dt_bias.detach().numpy()).tag("value_heads")
  values["norm_scale"] = pz.nx.wrap(layer.norm.weight.detach().numpy()).tag("value_projection")
  values["output.weights"] = pz.nx.wrap(
      layer.out_proj.weight.detach().numpy().reshape(hidden, nv, dv)).tag(
          "embedding", "value_heads", "value_projection")
  skeleton = GatedDeltaNet.from_config("delta", embedding=hidden, key_heads=nk, value_heads=nv,
                                       key_projection=dk, value_projection=dv,
                                       conv_taps=layer.conv_kernel_size,
                                       norm_epsilon=layer.layer_norm_epsilon)
  return pz.bind_variables(skeleton, [pz.Parameter(value=jax.tree_util.tree_map(jnp.asarray, v),
                                                   label=f"delta/{k}")
                                      for k, v in values.items()])


# --- the mixture-of-experts variant (qwen3_5_moe_text) -------------------------

_MOE = {**{k: v for k, v in _COMMON.items() if k != "intermediate_size"},
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24}


@pytest.fixture(scope="module")
def moe_saved(tmp_path_factory):
  torch.manual_seed(0)
  model = randomized(transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**_MOE)))
  folder = tmp_path_factory.mktemp("moe")
  model.save_pretrained(folder, safe_serialization=True)
  return harness.Saved(folder, model, harness.reference_logits(model))


def test_moe_float32_logits_and_save_model(moe_saved, tmp_path):
  harness.check_float32(moe_saved, "qwen3_5_moe_text")
  model = pzp.pretrained.load_hf(moe_saved.folder)
  assert len(pz.select(model).at_instances_of(moe.MixtureOfExperts).get_sequence()) == 2
  harness.check_save_model(moe_saved, tmp_path)


@pytest.mark.slow
def test_moe_kv_cache_sampling_matches_a_forward_pass(moe_saved):
  model = pzp.pretrained.load_hf(moe_saved.folder)
  np.testing.assert_allclose(_sampled(model), harness.penzai_logits(model), **harness.TOLERANCE)


def test_moe_export_gives_back_the_folder(moe_saved, tmp_path):
  """The per-expert tensors written back bit for bit, with ``like`` and from
  the model alone; transformers reads the same class and config. (Its logits
  from the written folder differ from those of the original folder by up to
  5e-7 although tensors and config are the same: compared within 1e-5.)"""
  model = pzp.pretrained.load_hf(moe_saved.folder)
  for like in (moe_saved.folder, None):
    out = tmp_path / ("like" if like else "alone")
    pzp.export_hf(model, out, like=like)
    harness.assert_same_tensors(harness.tensors(out), harness.tensors(moe_saved.folder))
    assert harness.config(out)["model_type"] == "qwen3_5_moe_text"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs) is transformers.Qwen3_5MoeForCausalLM
    np.testing.assert_allclose(harness.reference_logits(theirs), moe_saved.reference,
                               atol=1e-5, rtol=1e-5)


def test_moe_shared_expert_gate_binds(moe_saved):
  model = pzp.pretrained.load_hf(moe_saved.folder)
  ungated = pz.select(model).at_instances_of(moe.MixtureOfExperts).apply(
      lambda layer: dataclasses.replace(layer, shared_gate=None))
  print(f"without the shared expert's gate: {_differs(ungated, moe_saved.reference):.3g}")
  unshared = pz.select(model).at_instances_of(moe.MixtureOfExperts).apply(
      lambda layer: dataclasses.replace(layer, shared=None, shared_gate=None))
  print(f"without the shared expert: {_differs(unshared, moe_saved.reference):.3g}")


@pytest.mark.parametrize("changes, match", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_experts": 10**9}, "num_experts"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
])
def test_moe_hostile_configs_are_refused_before_anything_is_built(moe_saved, tmp_path,
                                                                  monkeypatch, changes, match):
  folder = harness.edited(moe_saved.folder, tmp_path, **changes)
  harness.check_refused_before_building(folder, match, monkeypatch)


@pytest.mark.slow
def test_moe_multimodal_folder_gives_and_exports_the_text_model(tmp_path):
  """A ``qwen3_5_moe`` folder's text model (experts under
  ``model.language_model.``): transformers' logits, written back as
  ``qwen3_5_moe_text`` with the same tensors renamed."""
  config = transformers.Qwen3_5MoeConfig(text_config=dict(_MOE), vision_config={
      "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
      "out_hidden_size": 32, "num_position_embeddings": 16})
  torch.manual_seed(0)
  hf_model = randomized(transformers.Qwen3_5MoeForConditionalGeneration(config))
  hf_model.save_pretrained(tmp_path / "mm", safe_serialization=True)
  saved = harness.Saved(tmp_path / "mm", hf_model, harness.reference_logits(hf_model))
  harness.check_float32(saved, "qwen3_5_moe (multimodal)")
  pzp.export_hf(pzp.pretrained.load_hf(saved.folder), tmp_path / "text", like=saved.folder)
  assert harness.config(tmp_path / "text")["model_type"] == "qwen3_5_moe_text"
  written, original = harness.tensors(tmp_path / "text"), harness.tensors(saved.folder)
  for name, value in written.items():
    source = name if name == "lm_head.weight" else name.replace("model.",
                                                                "model.language_model.", 1)
    assert value.tobytes() == original[source].tobytes(), name
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()
  np.testing.assert_allclose(harness.reference_logits(theirs), saved.reference,
                             **harness.TOLERANCE)


@pytest.mark.slow
def test_delta_net_heads_shard_by_axis_name(saved):
  """`pz_persist.AxisRules` puts the DeltaNet's ``value_heads`` and
  ``key_heads`` on mesh axes (8 CPU devices); the sharded model computes
  what the unsharded one does."""
  assert jax.device_count() == 8
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("keys", "values"))
  rules = pzp.AxisRules(mesh, {"key_heads": "keys", "value_heads": "values"})
  folder = saved["hybrid"].folder
  sharded = pzp.pretrained.load_hf(folder, sharding=rules)
  found = 0
  for param in pz.unbind_params(sharded)[1]:
    axes = tuple(param.value.named_axes)
    spec = param.value.data_array.sharding.spec
    for axis, mesh_axis in (("key_heads", "keys"), ("value_heads", "values")):
      if axis in axes:
        found += 1
        assert spec[axes.index(axis)] == mesh_axis, param.label
  assert found == 3 * (4 + 8)  # Three DeltaNet layers: 4 key-head and 8 value-head parameters.
  tokens = pz.nx.wrap(jnp.asarray(harness.SEQUENCES), "batch", "seq")
  logits = jax.jit(lambda m, t: m(t))(pz.freeze_params(sharded), tokens)
  np.testing.assert_allclose(np.asarray(logits.untag("batch", "seq", "vocabulary").unwrap()),
                             saved["hybrid"].reference, **harness.TOLERANCE)


def test_top_level_rope_fields_of_older_configs(saved, tmp_path):
  """``rope_theta``, ``partial_rotary_factor`` and the mrope fields at the
  top level, without ``rope_parameters`` (as some Hub configs have them):
  read as transformers reads them."""
  folder = harness.edited(saved["hybrid"].folder, tmp_path,
                        rope_theta=1e5, partial_rotary_factor=0.5, mrope_section=[1, 1, 0],
                        mrope_interleaved=True)
  raw = harness.config(folder)
  raw.pop("rope_parameters", None)
  (folder / "config.json").write_text(json.dumps(raw))
  theirs = transformers.Qwen3_5ForCausalLM.from_pretrained(folder).eval()
  assert theirs.config.rope_parameters["partial_rotary_factor"] == 0.5
  harness.check_float32(harness.Saved(folder, theirs, harness.reference_logits(theirs)),
                        "top-level rope fields")
