"""Gemma 3n through `load_hf` and `export_hf`: ``gemma3n_text`` (AltUp,
Laurel, per-layer inputs, shared keys and values, activation sparsity,
per-layer MLP widths, sliding and full layers, soft cap) and the text model
of ``gemma3n`` multimodal folders, against transformers on tiny random
models (no downloads).

Each feature is shown to bind: switched off in the reference, the logits
move far beyond the tolerance, so a loader that ignored it would fail the
float32 match.
"""

from __future__ import annotations

import copy
import json
import logging

import numpy as np
import pytest
import torch
import transformers
from penzai import pz
from safetensors.numpy import save_file

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist import errors
from pz_persist.nn import altup
from pz_persist.nn import kv_sharing
from pz_persist.nn import per_layer_inputs

_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
         "full_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
CASES = {
    # E2B / E4B in small: three streams, the last two layers reusing keys and
    # values, sparse first MLPs of their own widths, a per-layer table
    # smaller than the vocabulary (SEQUENCES hold tokens 48-63 outside it).
    "gemma3n_text": {
        "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "vocab_size": 64, "vocab_size_per_layer_input": 48, "hidden_size_per_layer_input": 4,
        "intermediate_size": [64, 64, 32, 32], "sliding_window": 3, "layer_types": _TYPES,
        "num_kv_shared_layers": 2, "laurel_rank": 4, "altup_num_inputs": 3,
        "activation_sparsity_pattern": [0.95, 0.5, 0.0, 0.0], "rope_parameters": _ROPE,
        "final_logit_softcapping": 30.0},
    # Another active stream, no output scale, no sharing, one width.
    "gemma3n_text_plain": {
        "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 8, "vocab_size": 64, "vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 4,
        "intermediate_size": 48, "sliding_window": 4, "layer_types": _TYPES[:3], "num_kv_shared_layers": 0,
        "laurel_rank": 2, "altup_num_inputs": 2, "altup_active_idx": 1, "altup_correct_scale": False,
        "activation_sparsity_pattern": [0.0, 0.9, 0.0], "rope_parameters": _ROPE,
        "final_logit_softcapping": 5.0},
}


def _text_model(case: str) -> transformers.Gemma3nForCausalLM:
  torch.manual_seed(0)
  return checks.randomized(transformers.Gemma3nForCausalLM(
      transformers.Gemma3nTextConfig(**CASES[case])), seed=1)


def _multimodal_folder(text_folder, target):
  """A ``gemma3n`` folder (no timm here to build the MobileNet tower): the
  text model's tensors under ``model.language_model.`` beside stand-ins for
  the vision and audio towers and their embedders."""
  target.mkdir()
  tensors = {"model.language_model." + name.removeprefix("model."): value
             for name, value in checks.tensors(text_folder).items()}
  for name in ("model.vision_tower.timm_model.conv_stem.weight",
               "model.audio_tower.subsample_conv_projection.input_proj_linear.weight",
               "model.embed_vision.embedding.weight", "model.embed_audio.embedding.weight"):
    tensors[name] = np.ones((2, 2), np.float32)
  save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
  text = checks.config(text_folder)
  config = {"model_type": "gemma3n", "architectures": ["Gemma3nForConditionalGeneration"],
            "text_config": text, "vision_config": {"model_type": "gemma3n_vision"},
            "audio_config": {"model_type": "gemma3n_audio"}, "boi_token_id": 60,
            "eoi_token_id": 61, "image_token_id": 62, "boa_token_id": 58, "eoa_token_id": 59,
            "audio_token_id": 63, "vision_soft_tokens_per_image": 4,
            "audio_soft_tokens_per_image": 4, "tie_word_embeddings": True}
  (target / "config.json").write_text(json.dumps(config))
  return target


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """``{case: Saved}``, with ``gemma3n`` the first case's multimodal folder."""
  result = {}
  for case in CASES:
    model = _text_model(case)
    folder = tmp_path_factory.mktemp(case)
    model.save_pretrained(folder, safe_serialization=True)
    result[case] = checks.Saved(folder, model, checks.reference_logits(model))
  text = result["gemma3n_text"]
  result["gemma3n"] = checks.Saved(
      _multimodal_folder(text.folder, tmp_path_factory.mktemp("mm") / "gemma3n"),
      text.hf_model, text.reference)
  return result


@pytest.mark.parametrize("case", [*CASES, "gemma3n"])
def test_float32_logits_match_transformers(saved, case):
  print(f"{case}: float32 max abs error"
        f" {checks.float32_error(saved[case].folder, saved[case].reference):.2g}")


@pytest.mark.parametrize("case", [
    "gemma3n_text", pytest.param("gemma3n_text_plain", marks=pytest.mark.slow)])
def test_generation_matches_transformers_generate(saved, case):
  """Greedy KV-cache sampling through `kv_caching_lm` picks transformers'
  tokens (past the window, the shared layers reading the producers')."""
  checks.check_generate(saved[case], steps=8)


@pytest.mark.slow
def test_kv_cache_sampling_matches_a_forward_pass(saved):
  checks.check_kv_cache_sampling(pzp.pretrained.load_hf(saved["gemma3n_text"].folder))


def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  saved_case = saved["gemma3n_text"]
  ours, theirs = checks.bfloat16_errors(saved_case.folder, transformers.Gemma3nForCausalLM,
                                        saved_case.reference)
  print(f"gemma3n_text bfloat16: ours {ours:.3g}, transformers' {theirs:.3g}")


def test_save_model_round_trip(saved, tmp_path):
  case = saved["gemma3n_text"]
  checks.check_save_model_round_trip(pzp.pretrained.load_hf(case.folder), tmp_path / "saved",
                                     case.reference)


@pytest.mark.parametrize("case", list(CASES))
def test_export_gives_back_the_folder(saved, tmp_path, case):
  """With ``like`` and without (the structure says Gemma 3n)."""
  folder = saved[case].folder
  model = pzp.pretrained.load_hf(folder)
  checks.check_export_model(model, folder, tmp_path / "like")
  checks.check_export_model(model, folder, tmp_path / "alone", like=False)


def test_multimodal_folder_gives_the_text_model_and_reports_the_towers(saved, caplog, tmp_path):
  """The towers are not read (the load says which); the export is the text
  model alone, as ``gemma3n_text``, bit for bit, and transformers reads it."""
  folder, reference = saved["gemma3n"].folder, saved["gemma3n"].reference
  with caplog.at_level(logging.WARNING, logger="pz_persist.pretrained.hf"):
    model = pzp.pretrained.load_hf(folder)
  assert "vision and audio towers" in caplog.text
  for tower in ("model.vision_tower.*", "model.audio_tower.*", "model.embed_vision.*",
                "model.embed_audio.*"):
    assert tower in caplog.text
  pzp.export_hf(model, tmp_path / "text", like=folder)
  config = json.loads((tmp_path / "text" / "config.json").read_text())
  assert (config["model_type"], config["architectures"]) == ("gemma3n_text",
                                                             ["Gemma3nForCausalLM"])
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()
  np.testing.assert_allclose(checks.reference_logits(theirs), reference, **checks.TOLERANCE)
  written, original = checks.tensors(tmp_path / "text"), checks.tensors(folder)
  assert len(written) == len([n for n in original if n.startswith("model.language_model.")])
  for name, value in written.items():
    assert value.tobytes() == original["model.language_model." + name.removeprefix("model.")
                                       ].tobytes(), name


def test_the_layers_are_there(saved):
  model = pzp.pretrained.load_hf(saved["gemma3n_text"].folder)
  layers = pz.select(model).at_instances_of(altup.AltUpLayer).get_sequence()
  assert len(layers) == 4 and {layer.active for layer in layers} == {0}
  assert pz.select(model).at_instances_of(altup.LaurelResidual).count() == 4
  assert [t.sparsity for t in pz.select(model).at_instances_of(altup.GaussianTopK)
          .get_sequence()] == [0.95, 0.5]
  assert len(pz.select(model).at_instances_of(altup.AltUpExpand).get().projections) == 2
  assert pz.select(model).at_instances_of(kv_sharing.SharedKV).count() == 4
  assert pz.select(model).at_instances_of(per_layer_inputs.PerLayerInputsInTable).count() == 1
  prediction = layers[0].prediction.weights.value
  assert prediction.named_shape == {altup.ROUTER_AXIS: 3, altup.STREAMS_AXIS: 3,
                                    altup.SOURCE_AXIS: 3}


def _moved(saved_case, edit) -> float:
  edited = copy.deepcopy(saved_case.hf_model)
  edit(edited)
  with torch.no_grad():  # No cache: it expects the layers that share to hold none.
    logits = edited(torch.tensor(checks.SEQUENCES), use_cache=False).logits.numpy()
  return float(np.abs(logits - saved_case.reference).max())


def test_each_module_binds(saved):
  """Switched off inside transformers' model, each moves the logits."""

  def no_laurel(m):
    for layer in m.model.layers:
      layer.laurel.linear_right.weight.data.zero_()

  def no_prediction(m):
    for layer in m.model.layers:
      layer.altup.prediction_coefs.weight.data.zero_()

  def no_correction(m):
    for layer in m.model.layers:
      layer.altup.correction_coefs.weight.data.zero_()

  def output_scale(m):
    for layer in m.model.layers:
      layer.altup.correct_output_scale.data.fill_(1.0)

  def no_extra_streams(m):
    for projection in m.model.altup_unembed_projections:
      projection.weight.data.zero_()

  def no_sparsity(m):
    for layer in m.model.layers:
      layer.mlp.activation_sparsity = 0.0

  def no_per_layer_table(m):
    m.model.embed_tokens_per_layer.weight.data.zero_()

  def no_value_norm(m):
    for layer in m.model.layers:
      if hasattr(layer.self_attn, "v_norm"):
        layer.self_attn.v_norm = torch.nn.Identity()

  def own_keys(m):
    """The sharing layers compute keys and values from their own input, with
    the producing layer's projections and norms."""
    types = m.config.layer_types
    for i, layer in enumerate(m.model.layers):
      attn = layer.self_attn
      if attn.is_kv_shared_layer:
        source = max(j for j in range(i) if types[j] == types[i]
                     and not m.model.layers[j].self_attn.is_kv_shared_layer)
        producer = m.model.layers[source].self_attn
        attn.is_kv_shared_layer = False
        for name in ("k_proj", "v_proj", "k_norm", "v_norm"):
          setattr(attn, name, getattr(producer, name))

  for edit in (no_laurel, no_prediction, no_correction, output_scale, no_extra_streams,
               no_sparsity, no_per_layer_table, no_value_norm, own_keys):
    change = _moved(saved["gemma3n_text"], edit)
    print(f"{edit.__name__}: logits change by {change:.3g}")
    assert change > 100 * checks.TOLERANCE["atol"], edit.__name__


def test_tokens_outside_the_per_layer_table_look_up_row_zero(saved):
  """With Gemma 4's `PerLayerInputs` (an index past the table clamped to its
  last row) the logits of SEQUENCES, which hold such tokens, move."""
  case = saved["gemma3n_text"]
  model = pzp.pretrained.load_hf(case.folder)
  clamped = pz.select(model).at_instances_of(per_layer_inputs.PerLayerInputsInTable).apply(
      lambda p: per_layer_inputs.PerLayerInputs(
          table=p.table, projection=p.projection, norm=p.norm, table_scale=p.table_scale,
          projection_scale=p.projection_scale))
  change = np.abs(checks.penzai_logits(clamped) - case.reference).max()
  assert change > 100 * checks.TOLERANCE["atol"]


@pytest.mark.parametrize("changes", [
    {"sliding_window": 100}, {"final_logit_softcapping": 1.0},
    {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 100.0}}},
    {"activation_sparsity_pattern": [0.0, 0.5, 0.0, 0.0]},
    {"altup_correct_scale": False},
])
def test_each_config_feature_binds(saved, tmp_path, changes):
  """The same weights with the feature changed: transformers' logits move
  far beyond the tolerance, and load_hf follows them."""
  case = saved["gemma3n_text"]
  edited = checks.edited(case.folder, tmp_path, **changes)
  theirs = transformers.AutoModelForCausalLM.from_pretrained(edited, dtype=torch.float32).eval()
  changed = checks.reference_logits(theirs)
  assert np.abs(changed - case.reference).max() > 100 * checks.TOLERANCE["atol"]
  checks.float32_error(edited, changed)


def test_the_hubs_spelling_of_rope_and_its_extra_fields(saved, tmp_path):
  """The Hub's configs say ``rope_theta`` / ``rope_local_base_freq`` and
  carry ``query_pre_attn_scalar`` and ``altup_lr_multiplier``, which
  transformers does not read: the same model."""
  case = saved["gemma3n_text"]
  edited = checks.edited(case.folder, tmp_path, rope_parameters=checks.DELETE,
                         rope_theta=10_000.0, rope_local_base_freq=100.0, rope_scaling=None,
                         query_pre_attn_scalar=8, altup_lr_multiplier=1.0,
                         altup_coef_clip=120.0)
  checks.float32_error(edited, case.reference)


@pytest.mark.parametrize("changes, match", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                          "full_attention": {"rope_type": "default"}}}, "rope_type"),
    ({"rope_parameters": {"global": {"rope_type": "default"}}}, "rope_parameters"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                "partial_rotary_factor": 0.5}}},
     "partial_rotary_factor"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention",
                      "full_attention"]}, "layer_types"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"intermediate_size": [64, 64]}, "intermediate_size"),
    ({"intermediate_size": [64, 64, 0, 32]}, "intermediate_size"),
    ({"activation_sparsity_pattern": [0.5]}, "activation_sparsity_pattern"),
    ({"activation_sparsity_pattern": [1.0, 0.0, 0.0, 0.0]}, "activation_sparsity_pattern"),
    ({"activation_sparsity_pattern": 0.5}, "activation_sparsity_pattern"),
    ({"altup_active_idx": 3}, "altup_active_idx"),
    ({"altup_num_inputs": 0}, "altup_num_inputs"),
    ({"hidden_size_per_layer_input": 0}, "hidden_size_per_layer_input"),
    ({"attention_bias": True}, "attention_bias"),
    ({"final_logit_softcapping": None}, "final_logit_softcapping"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"num_kv_shared_layers": 4}, "num_kv_shared_layers"),
    ({"num_kv_shared_layers": 3}, "num_kv_shared_layers"),  # No full layer left to share.
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"use_bidirectional_attention": "vision"}, "use_bidirectional_attention"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  from penzai.models.transformer.variants import llamalike_common  # pylint: disable=import-outside-toplevel

  def never(*args, **kwargs):
    raise AssertionError("the skeleton was built before the config was refused")

  monkeypatch.setattr(llamalike_common, "build_llamalike_block", never)
  folder = checks.edited(saved["gemma3n_text"].folder, tmp_path, **changes)
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)


@pytest.mark.parametrize("changes, match", [
    ({"text_config": checks.DELETE}, "text_config"),
    ({"vision_soft_tokens_per_image": -1}, "vision_soft_tokens_per_image"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ({"unknown_field": 4}, "unknown_field"),
    ({"text_config": {"model_type": "gemma3_text"}}, "model_type"),
])
def test_hostile_multimodal_configs_are_refused(saved, tmp_path, changes, match):
  folder = checks.edited(saved["gemma3n"].folder, tmp_path, **changes)
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)


def test_unused_key_value_tensors_of_sharing_layers_are_not_read(saved, tmp_path):
  """Checkpoints may keep ``k_proj`` / ``v_proj`` / ``k_norm`` in the layers
  that reuse an earlier layer's keys and values; transformers ignores them
  on load, and so does `load_hf` (the same logits, whatever they hold)."""
  case = saved["gemma3n_text"]
  tensors = checks.tensors(case.folder)
  for i in (2, 3):
    for name, shape in (("k_proj", (16, 32)), ("v_proj", (16, 32)), ("k_norm", (8,))):
      tensors[f"model.layers.{i}.self_attn.{name}.weight"] = np.full(shape, 7.0, np.float32)
  edited = checks.edited(case.folder, tmp_path)
  save_file(tensors, str(edited / "model.safetensors"), metadata={"format": "pt"})
  theirs = transformers.AutoModelForCausalLM.from_pretrained(edited).eval()
  np.testing.assert_array_equal(checks.reference_logits(theirs), case.reference)
  checks.float32_error(edited, case.reference)


@pytest.mark.parametrize("layer_class", ["AltUpLayer", "LaurelResidual"])
def test_surgery_around_altup_and_laurel(saved, layer_class, tmp_path):
  from pz_persist.nn import altup

  checks.check_surgery_around(saved["gemma3n_text"], getattr(altup, layer_class), tmp_path)
