"""The language model of vision-language folders whose text model a family
reads: Qwen2-VL / Qwen2.5-VL (Qwen2's), Qwen3-VL (Qwen3's), Mistral 3
(Mistral's, Ministral 3's), through `load_hf` and `export_hf`, against the
text-only path of transformers' ``...ForConditionalGeneration`` classes.

Multimodal RoPE with the equal temporal/height/width positions transformers
gives a text-only input is ordinary RoPE: the float32 logits match with the
sections and Qwen3-VL's interleaved layout as the Hub has them, and with
other sections (which change nothing at text positions); the KV cache and
greedy generation match ``generate`` token for token. The vision tower is
not read, and the load says so.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist import errors
from pz_persist.pretrained.hf import families

_TEXT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 64, "intermediate_size": 64, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2}
_QWEN_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                "out_hidden_size": 32}


def _vl(config_cls, text: dict, vision: dict, **folder):
  def make(**changes):
    return config_cls(text_config={**_TEXT, **text, **changes}, vision_config=vision, **folder)
  return make


CASES = {
    # Sections [1, 1, 2] cover half of the 8-dimension heads; untied head.
    "qwen2_5_vl": (_vl(transformers.Qwen2_5_VLConfig, {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 2]}},
        _QWEN_VISION), transformers.Qwen2_5_VLForConditionalGeneration),
    "qwen2_vl_tied": (_vl(transformers.Qwen2VLConfig, {
        "rope_parameters": {"type": "mrope", "rope_theta": 1e4, "mrope_section": [2, 1, 1]}},
        {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2},
        tie_word_embeddings=True), transformers.Qwen2VLForConditionalGeneration),
    "qwen3_vl": (_vl(transformers.Qwen3VLConfig, {
        "head_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                           "mrope_section": [1, 1, 2], "mrope_interleaved": True}},
        {**_QWEN_VISION, "deepstack_visual_indexes": [0]}),
        transformers.Qwen3VLForConditionalGeneration),
    "mistral3": (_vl(transformers.Mistral3Config, {
        "model_type": "mistral", "head_dim": 8, "sliding_window": 3, "tie_word_embeddings": False},
        {"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8},
        tie_word_embeddings=False), transformers.Mistral3ForConditionalGeneration),
    # Ministral 3 (2512): a ministral3 text model (yarn RoPE, position-dependent
    # query scaling) with the folder's default tied head.
    "mistral3_ministral3": (_vl(transformers.Mistral3Config, {
        "model_type": "ministral3", "head_dim": 8, "max_position_embeddings": 16,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                            "original_max_position_embeddings": 4, "llama_4_scaling_beta": 0.5}},
        {"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8}),
        transformers.Mistral3ForConditionalGeneration),
}
_WRITTEN_AS = {"qwen2_5_vl": "qwen2", "qwen2_vl_tied": "qwen2", "qwen3_vl": "qwen3",
               "mistral3": "mistral", "mistral3_ministral3": "ministral3"}


def _make(case: str, **changes):
  config, model_cls = CASES[case]
  torch.manual_seed(0)
  return checks.randomized(model_cls(config(**changes)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  result = {}
  for case in CASES:
    model = _make(case)
    folder = tmp_path_factory.mktemp(case)
    model.save_pretrained(folder, safe_serialization=True)
    result[case] = checks.Saved(folder, model, checks.reference_logits(model))
  return result


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_the_text_only_path(saved, case, caplog):
  with caplog.at_level(logging.WARNING, "pz_persist.pretrained.hf"):
    error = checks.float32_error(saved[case].folder, saved[case].reference)
  print(f"{case} float32 max abs error: {error:.3g}")
  said = " ".join(r.getMessage() for r in caplog.records)
  assert "are not read" in said and "vision tower and projector" in said


@pytest.mark.parametrize("case", ["qwen2_5_vl", "qwen3_vl", "mistral3", "mistral3_ministral3"])
def test_kv_cache_and_greedy_generation_match_generate(saved, case):
  """The text-only path of the VL class's ``generate`` (its multimodal
  positions computed by transformers' ``get_rope_index``)."""
  model = pzp.pretrained.load_hf(saved[case].folder)
  checks.check_kv_cache(model)
  checks.check_generate(saved[case], steps=6)


@pytest.mark.parametrize("case", CASES)
def test_exported_as_the_text_model(saved, tmp_path, case):
  """``export_hf`` with ``like=`` the folder writes the text model (its
  ``model_type`` the text family's), whose transformers class computes the
  folder's text-only logits exactly; without ``like``, the same type."""
  model = pzp.pretrained.load_hf(saved[case].folder)
  pzp.export_hf(model, tmp_path / "like", like=saved[case].folder)
  written = checks.config(tmp_path / "like")
  assert written["model_type"] == _WRITTEN_AS[case]
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "like").eval()
  np.testing.assert_allclose(checks.reference_logits(exported), saved[case].reference,
                             atol=1e-5, rtol=1e-5)
  pzp.export_hf(model, tmp_path / "alone")
  assert checks.config(tmp_path / "alone")["model_type"] == _WRITTEN_AS[case]


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["qwen3_vl"], tmp_path)


@pytest.mark.parametrize("case,rope", [
    ("qwen2_5_vl", {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 0, 2]}),
    ("qwen3_vl", {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2, 0],
                  "mrope_interleaved": True}),
])
def test_other_sections_change_nothing_at_text_positions(saved, tmp_path, case, rope):
  """transformers' text-only logits with other sections are the same (the
  reduction to ordinary RoPE), and so are ours."""
  model = _make(case, rope_parameters=rope)
  model.load_state_dict(saved[case].hf_model.state_dict())
  np.testing.assert_allclose(checks.reference_logits(model), saved[case].reference,
                             atol=1e-5, rtol=1e-5)
  raw = checks.config(saved[case].folder)
  raw["text_config"]["rope_parameters"] = rope
  folder = checks.edited(saved[case].folder, tmp_path, text_config=raw["text_config"])
  checks.float32_error(folder, saved[case].reference)


@pytest.mark.parametrize("case,changes", [
    ("qwen2_5_vl", {"rope_parameters": {"rope_theta": 1e6, "mrope_section": [1, 1, 2]}}),
    ("qwen3_vl", {"rms_norm_eps": 0.5}),
    ("mistral3", {"sliding_window": None}),
])
def test_features_bind(saved, case, changes):
  """A text field changed in transformers' config changes its logits (so
  a loader ignoring it would fail the float32 check)."""
  model = _make(case, **changes)
  model.load_state_dict(saved[case].hf_model.state_dict())
  changed = np.abs(checks.reference_logits(model) - saved[case].reference).max()
  assert changed > 100 * checks.TOLERANCE["atol"]


def test_flat_hub_config_is_read(saved, tmp_path):
  """The Hub's older Qwen2.5-VL files keep the text fields at the top level
  (no ``text_config``; ``rope_scaling`` of type ``mrope``)."""
  raw = checks.config(saved["qwen2_5_vl"].folder)
  text = raw.pop("text_config")
  text.pop("model_type")
  params = text.pop("rope_parameters")
  flat = {**raw, **text, "rope_theta": params["rope_theta"],
          "rope_scaling": {"type": "mrope", "mrope_section": params["mrope_section"]}}
  folder = tmp_path / "flat"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps(flat))
  for name in (saved["qwen2_5_vl"].folder).iterdir():
    if name.suffix == ".safetensors":
      (folder / name.name).write_bytes(name.read_bytes())
  checks.float32_error(folder, saved["qwen2_5_vl"].reference)
  flat["hidden_size"] = 48
  flat["text_config"] = {"hidden_size": 32}
  (folder / "config.json").write_text(json.dumps(flat))
  with pytest.raises(errors.UnsupportedConfigError, match="hidden_size"):
    pzp.pretrained.load_hf(folder)


_HOSTILE = [
    ("qwen2_5_vl", {"mrope_section": [1, 1, 1]}, "mrope_section"),  # Not half a head.
    ("qwen2_5_vl", {"mrope_section": [1, 1]}, "mrope_section"),
    ("qwen2_5_vl", {"mrope_interleaved": True}, "mrope_interleaved"),
    ("qwen3_vl", {"mrope_section": "112"}, "mrope_section"),
    ("qwen3_vl", {"mrope_interleaved": False}, "mrope_interleaved"),
]


@pytest.mark.parametrize("case,rope,match", _HOSTILE)
def test_hostile_rope_refused_before_building(saved, tmp_path, monkeypatch, case, rope, match):
  raw = checks.config(saved[case].folder)
  raw["text_config"]["rope_parameters"] = {**raw["text_config"]["rope_parameters"], **rope}
  folder = checks.edited(saved[case].folder, tmp_path, text_config=raw["text_config"])
  checks.check_refused_before_building(folder, match, monkeypatch)


@pytest.mark.parametrize("case,text,match", [
    ("qwen3_vl", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3_vl", {"model_type": "qwen3"}, "model_type"),
    ("mistral3", {"model_type": "llama"}, "model_type"),
    ("qwen2_5_vl", {"num_hidden_layers": 10**9}, "num_hidden_layers|layers"),
    ("qwen2_5_vl", {"deepstack": 1}, "deepstack"),
])
def test_hostile_text_config_refused_before_building(saved, tmp_path, monkeypatch, case, text,
                                                     match):
  raw = checks.config(saved[case].folder)
  folder = checks.edited(saved[case].folder, tmp_path, text_config={**raw["text_config"], **text})
  checks.check_refused_before_building(folder, match, monkeypatch)


def test_a_folder_field_nobody_reads_is_refused(saved, tmp_path, monkeypatch):
  folder = checks.edited(saved["mistral3"].folder, tmp_path, new_projector=True)
  checks.check_refused_before_building(folder, "new_projector", monkeypatch)


def test_two_copies_of_the_text_model_are_refused(saved, tmp_path):
  """Tensors under both ``model.layers.`` and ``model.language_model.layers.``:
  which is meant is unclear, so nothing is guessed."""
  src = saved["qwen2_5_vl"].folder
  tensors = checks.tensors(src)
  tensors.update({name.replace("model.", "model.language_model.", 1): value
                  for name, value in tensors.items() if name.startswith("model.layers.")})
  folder = checks.edited(src, tmp_path)
  for name in folder.iterdir():
    if name.suffix == ".safetensors":
      name.unlink()
  import safetensors.numpy  # pylint: disable=import-outside-toplevel
  safetensors.numpy.save_file(tensors, folder / "model.safetensors")
  with pytest.raises(errors.UnsupportedConfigError, match="exactly one of"):
    pzp.pretrained.load_hf(folder)


_TEXT_CLASSES = {"qwen2_vl": (transformers.Qwen2VLTextConfig, transformers.Qwen2VLConfig),
                 "qwen2_5_vl": (transformers.Qwen2_5_VLTextConfig, transformers.Qwen2_5_VLConfig),
                 "qwen3_vl": (transformers.Qwen3VLTextConfig, transformers.Qwen3VLConfig)}


@pytest.mark.parametrize("model_type", sorted(_TEXT_CLASSES))
def test_defaults_are_the_text_config_class(model_type):
  """Each default of a Qwen-VL row is its text config class's (or says why);
  ``tie_word_embeddings`` is the folder class's (transformers 5 reads it there)."""
  text_cls, folder_cls = _TEXT_CLASSES[model_type]
  config, folder = text_cls(), folder_cls()
  declared = families.MODEL_TYPES[model_type]
  for field, ours in declared.defaults.items():
    if field in declared.defaults_why:
      continue
    if field == "tie_word_embeddings":
      theirs = folder.tie_word_embeddings
    elif field in ("rope_theta", "partial_rotary_factor"):
      theirs = config.rope_parameters.get(field, 1.0)
    else:
      theirs = getattr(config, field)
    assert theirs == ours, (model_type, field, ours, theirs)


def test_sizes_alone_load_as_transformers_reads_them(tmp_path):
  """A Qwen2.5-VL text_config of sizes only (and its sections): the text
  model's class's defaults (epsilon 1e-5, theta 1e6), as transformers."""
  text = {k: _TEXT[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "vocab_size", "intermediate_size",
                                "pad_token_id")}
  text["rope_parameters"] = {"mrope_section": [1, 1, 2]}
  torch.manual_seed(0)
  model = checks.randomized(transformers.Qwen2_5_VLForConditionalGeneration(
      transformers.Qwen2_5_VLConfig(text_config=text, vision_config=_QWEN_VISION)))
  model.save_pretrained(tmp_path / "m")
  raw = checks.config(tmp_path / "m")
  raw["text_config"] = {**text, "model_type": "qwen2_5_vl_text"}
  (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
  checks.float32_error(tmp_path / "m", checks.reference_logits(model))
