"""Gemma 3 through `load_hf` and `export_hf`: ``gemma3_text`` and the text
model of ``gemma3`` multimodal folders, against transformers on tiny random
models (no downloads).

Each Gemma 3 feature is shown to bind: switched off in the reference (query
/key norms, the local RoPE base, linear scaling of the global layers, the
window, the final soft cap), transformers' logits move far beyond the
tolerance, so a loader that ignored it would fail the float32 match.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pretrained.test_hf_qwen3 import without_query_key_norms
from pz_persist.nn.scaled_rope import ApplyScaledRoPE
from pz_persist.pretrained import errors

_TEXT = {
    "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "vocab_size": 64, "intermediate_size": 64, "query_pre_attn_scalar": 8,
    "sliding_window": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0},
    },
}

GEMMA_3_1B_IT_CONFIG = {
    # The Hub's config.json of google/gemma-3-1b-it (written by transformers 4.50:
    # rope_theta / rope_local_base_freq / sliding_window_pattern, no layer_types),
    # with only the sizes shrunk: 7 layers make layers 0-4 and 6 local, 5 global;
    # a 4-token window (512 on the Hub) binds on short sequences.
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 8,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 32, "initializer_range": 0.02,
    "intermediate_size": 64, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 7, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 4, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 256,
}


def write_gemma_3_1b_it(folder) -> transformers.Gemma3ForCausalLM:
  """A tiny random google/gemma-3-1b-it folder: transformers' safetensors and
  the Hub's own config.json (`GEMMA_3_1B_IT_CONFIG`)."""
  torch.manual_seed(0)
  config = transformers.Gemma3TextConfig(**GEMMA_3_1B_IT_CONFIG)
  model = checks.randomized(transformers.Gemma3ForCausalLM(config), norm_center=0.0)
  model.save_pretrained(folder, safe_serialization=True)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(GEMMA_3_1B_IT_CONFIG, f)
  return model


CASES = {
    # Local and global layers, a 3-token window, linear scaling on the global layer.
    "gemma3_text": _TEXT,
    # Multi-query attention, a final soft cap, no scaling, the default layer pattern (6).
    "gemma3_text_mqa_caps": dict(
        _TEXT, num_key_value_heads=1, layer_types=None, num_hidden_layers=2,
        final_logit_softcapping=3.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
}


def _text_model(case: str) -> transformers.Gemma3ForCausalLM:
  torch.manual_seed(0)
  kwargs = {k: v for k, v in CASES[case].items() if v is not None}
  return checks.randomized(
      transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kwargs)), norm_center=0.0)


def _multimodal_model() -> transformers.Gemma3ForConditionalGeneration:
  torch.manual_seed(0)
  vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           image_size=28, patch_size=14)
  config = transformers.Gemma3Config(
      text_config=transformers.Gemma3TextConfig(**_TEXT).to_dict(),
      vision_config=vision.to_dict(), mm_tokens_per_image=4)
  return checks.randomized(transformers.Gemma3ForConditionalGeneration(config), norm_center=0.0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """``{case: (folder, transformers model, reference float32 logits)}``."""
  result = {}
  for case in [*CASES, "gemma3"]:
    model = _multimodal_model() if case == "gemma3" else _text_model(case)
    folder = tmp_path_factory.mktemp(case)
    model.save_pretrained(folder, safe_serialization=True)
    result[case] = (folder, model, checks.reference_logits(model))
  return result


@pytest.mark.parametrize("case", [*CASES, "gemma3"])
def test_float32_logits_match_transformers(saved, case):
  folder, _, reference = saved[case]
  print(f"{case}: float32 max abs error {checks.float32_error(folder, reference):.2g}")


def test_the_hubs_gemma_3_1b_it_config(tmp_path):
  """transformers 4's spelling of Gemma 3's config (as on the Hub), read as
  transformers 5 reads it: the same logits, window and RoPE bases included."""
  write_gemma_3_1b_it(tmp_path / "gemma-3-1b-it")
  reference = _reference_of(tmp_path / "gemma-3-1b-it")
  error = checks.float32_error(tmp_path / "gemma-3-1b-it", reference)
  print(f"google/gemma-3-1b-it's config: float32 max abs error {error:.2g}")
  model = pzp.pretrained.load_hf(tmp_path / "gemma-3-1b-it")  # (The pretrained guide samples from it.)
  config = checks.check_export_model(model, tmp_path / "gemma-3-1b-it", tmp_path / "out")
  assert config["layer_types"].count("full_attention") == 1
  assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000


def test_multimodal_folder_gives_the_text_model_and_reports_the_vision_tower(saved, caplog):
  folder, _, _ = saved["gemma3"]
  with caplog.at_level(logging.WARNING, logger="pz_persist.pretrained.hf"):
    model = pzp.pretrained.load_hf(folder)
  assert "tensors of the vision tower and projector" in caplog.text
  assert "vision_tower.*" in caplog.text and "multi_modal_projector.*" in caplog.text
  text = pzp.pretrained.load_hf(saved["gemma3_text"][0])
  assert ({p.label for p in pz.unbind_params(model)[1]}
          == {p.label for p in pz.unbind_params(text)[1]})


def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  folder, _, reference = saved["gemma3_text"]
  ours, theirs = checks.bfloat16_errors(folder, transformers.Gemma3ForCausalLM, reference)
  print(f"gemma3_text bfloat16: ours {ours:.3g}, transformers' {theirs:.3g}")


def test_kv_cache_sampling_matches_a_forward_pass(saved):
  model = pzp.pretrained.load_hf(saved["gemma3_text"][0])
  assert len(list(_scaled(model))) == 2  # Query and key of the one global layer.
  checks.check_kv_cache_sampling(model)


def _scaled(model):
  return pz.select(model).at_instances_of(ApplyScaledRoPE).get_sequence()


def test_save_model_round_trip(saved, tmp_path):
  folder, _, reference = saved["gemma3_text"]
  checks.check_save_model_round_trip(pzp.pretrained.load_hf(folder), tmp_path / "native",
                                     reference)


@pytest.mark.parametrize("case", list(CASES))
def test_export_gives_back_the_folder(saved, tmp_path, case):
  """With ``like`` and without (the structure says Gemma 3)."""
  folder = saved[case][0]
  model = pzp.pretrained.load_hf(folder)
  checks.check_export_model(model, folder, tmp_path / "like")
  checks.check_export_model(model, folder, tmp_path / "alone", like=False)


def test_multimodal_text_model_exports_as_gemma3_text(saved, tmp_path):
  """The text model of a ``gemma3`` folder is written as ``gemma3_text``
  (the tensors of the text model, renamed), which transformers reads with
  the same logits."""
  folder, _, reference = saved["gemma3"]
  model = pzp.pretrained.load_hf(folder)
  pzp.export_hf(model, tmp_path / "text")
  config = json.loads((tmp_path / "text" / "config.json").read_text())
  assert (config["model_type"], config["architectures"]) == ("gemma3_text", ["Gemma3ForCausalLM"])
  pzp.export_hf(model, tmp_path / "like", like=folder)  # Like the multimodal folder: its text_config.
  liked = json.loads((tmp_path / "like" / "config.json").read_text())
  # The model alone knows no pad id (written null); like= gives text_config's ids.
  assert config.pop("pad_token_id") is None and liked["pad_token_id"] is not None
  assert {key: liked[key] for key in config} == config  # Plus text_config's token ids...
  assert liked["bos_token_id"] == 2
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()
  np.testing.assert_allclose(checks.reference_logits(theirs), reference, **checks.TOLERANCE)
  written, original = checks.tensors(tmp_path / "text"), checks.tensors(folder)
  for name, value in written.items():
    assert value.tobytes() == original["language_model." + name].tobytes(), name


def _reference_of(folder) -> np.ndarray:
  return checks.reference_logits(
      transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())


@pytest.mark.parametrize("feature, changes", [
    ("local RoPE base", {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0}}}),
    ("linear scaling", {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}),
    ("window", {"layer_types": ["full_attention"] * 3}),
])
def test_each_feature_binds(saved, tmp_path, feature, changes):
  """The same weights with the feature off: transformers' logits move far
  beyond the tolerance, and load_hf follows them."""
  folder, _, reference = saved["gemma3_text"]
  edited = checks.edited(folder, tmp_path, **changes)
  changed = _reference_of(edited)
  assert np.abs(changed - reference).max() > 100 * checks.TOLERANCE["atol"], feature
  checks.float32_error(edited, changed)


def test_query_key_norms_and_final_cap_bind(saved):
  _, model, reference = saved["gemma3_text_mqa_caps"]
  unnormed = checks.reference_logits(without_query_key_norms(model))
  assert np.abs(unnormed - reference).max() > 100 * checks.TOLERANCE["atol"]
  assert np.abs(reference).max() <= 3.0  # The final soft cap, 3, is in force.


@pytest.mark.parametrize("changes, match", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10.0}}, "rope_parameters"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                          "full_attention": {"rope_type": "default"}}}, "rope_type"),
    ({"rope_theta": 10.0}, "rope_theta"),  # Besides rope_parameters.
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    # transformers' Gemma 3 ignores it: neither applied nor ignored silently here.
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"altup_num_inputs": 4}, "altup_num_inputs"),  # A Gemma 3n field.
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  from penzai.models.transformer.variants import llamalike_common  # pylint: disable=import-outside-toplevel

  def never(*args, **kwargs):
    raise AssertionError("the skeleton was built before the config was refused")

  monkeypatch.setattr(llamalike_common, "build_llamalike_transformer", never)
  folder = checks.edited(saved["gemma3_text"][0], tmp_path, **changes)
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)


def test_sizes_left_out_take_transformers_defaults(saved, tmp_path):
  """The Hub's ``gemma3`` folders leave ``vocab_size`` (and more) out of
  ``text_config``: transformers' default (262208) applies, and is checked
  against the weights (here 64 rows) before anything is built."""
  folder, _, _ = saved["gemma3"]
  config = json.loads((folder / "config.json").read_text())
  del config["text_config"]["vocab_size"]
  edited = checks.edited(folder, tmp_path, text_config=config["text_config"])
  with pytest.raises(errors.SafetensorsFormatError, match=r"expected \(262208, 32\)"):
    pzp.pretrained.load_hf(edited)


@pytest.mark.parametrize("changes, match", [
    ({"text_config": checks.DELETE}, "text_config"),
    ({"vision_soft_tokens_per_image": 4}, "vision_soft_tokens_per_image"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
])
def test_hostile_multimodal_configs_are_refused(saved, tmp_path, changes, match):
  folder = checks.edited(saved["gemma3"][0], tmp_path, **changes)
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)
