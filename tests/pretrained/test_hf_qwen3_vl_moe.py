"""The language model of Qwen3-VL-MoE folders (``qwen3_vl_moe``:
Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B) through `load_hf` and `export_hf`,
against the text-only path of transformers'
``Qwen3VLMoeForConditionalGeneration``.

Its experts are fused (``mlp.experts.gate_up_proj``, ``down_proj``): the
Hub's files store them transposed, ``save_pretrained`` in memory's layout,
and transformers reads each by its shape; both folders are checked here, as
is a square ``gate_up_proj`` (whose shape cannot tell, which transformers
reads as stored). The model is exported as ``qwen3_moe``, whose
transformers class and `load_hf` give the same logits.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.pretrained import errors
from pz_persist.pretrained.hf import families

_TEXT = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 64, "intermediate_size": 48, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "head_dim": 8, "moe_intermediate_size": 8,
         "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1],
         "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                             "mrope_section": [1, 1, 2], "mrope_interleaved": True}}
"""Three layers, the middle one dense (``mlp_only_layers``); experts of 8
neurons, so neither fused tensor is square."""
_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
           "out_hidden_size": 32, "deepstack_visual_indexes": [0]}


def _make(**changes):
  torch.manual_seed(0)
  config = transformers.Qwen3VLMoeConfig(text_config={**_TEXT, **changes},
                                         vision_config=_VISION)
  return checks.randomized(transformers.Qwen3VLMoeForConditionalGeneration(config))


def _hub_layout(folder, tmp_path, name="hub"):
  """A copy of ``folder`` with the fused experts stored as the Hub's files
  store them: transposed (``[experts, hidden, 2 * neurons]``,
  ``[experts, neurons, hidden]``)."""
  (tmp_path / name).mkdir()
  target = checks.edited(folder, tmp_path / name)
  tensors = checks.tensors(folder)
  for file in target.iterdir():
    if file.suffix == ".safetensors":
      file.unlink()
  safetensors.numpy.save_file(
      {name: np.ascontiguousarray(np.swapaxes(value, 1, 2))
       if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else value
       for name, value in tensors.items()}, target / "model.safetensors")
  return target


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  model = _make()
  folder = tmp_path_factory.mktemp("qwen3_vl_moe")
  model.save_pretrained(folder, safe_serialization=True)
  in_memory = checks.Saved(folder, model, checks.reference_logits(model))
  hub = _hub_layout(folder, tmp_path_factory.mktemp("hub"))
  hub_model = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(hub).eval()
  return {"saved": in_memory, "hub": checks.Saved(hub, hub_model, in_memory.reference)}


def test_the_layouts_are_the_hubs_and_save_pretrained_s(saved):
  """The Hub's transposed layout and the saved one hold the same model for
  transformers (so the float32 checks below cover both)."""
  stored = checks.tensors(saved["hub"].folder)
  name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
  assert stored[name].shape == (4, 32, 16)
  assert checks.tensors(saved["saved"].folder)[name].shape == (4, 16, 32)
  np.testing.assert_array_equal(checks.reference_logits(saved["hub"].hf_model),
                                saved["saved"].reference)


@pytest.mark.parametrize("layout", ["saved", "hub"])
def test_float32_logits_match_the_text_only_path(saved, layout, caplog):
  with caplog.at_level(logging.WARNING, "pz_persist.pretrained.hf"):
    error = checks.float32_error(saved[layout].folder, saved[layout].reference)
  print(f"qwen3_vl_moe ({layout} layout) float32 max abs error: {error:.3g}")
  said = " ".join(r.getMessage() for r in caplog.records)
  assert "vision tower and projector" in said and "model.visual.*" in said
  assert "Qwen3-VL-MoE's language model only" in said


def test_bfloat16_as_close_as_transformers_own(saved):
  checks.check_bfloat16(saved["hub"], "qwen3_vl_moe")


def test_kv_cache_and_greedy_generation_match_generate(saved):
  model = pzp.pretrained.load_hf(saved["hub"].folder)
  checks.check_kv_cache(model)
  checks.check_generate(saved["hub"], steps=8)


@pytest.mark.parametrize("layout", ["saved", "hub"])
def test_exported_as_the_text_model(saved, tmp_path, layout):
  """``export_hf`` writes the language model as ``qwen3_moe`` (per-expert
  tensors), with ``like=`` the folder or alone; transformers'
  ``Qwen3MoeForCausalLM`` and `load_hf` read it back with the folder's
  text-only logits."""
  model = pzp.pretrained.load_hf(saved[layout].folder)
  reference = saved[layout].reference
  pzp.export_hf(model, tmp_path / "like", like=saved[layout].folder)
  written = checks.config(tmp_path / "like")
  assert written["model_type"] == "qwen3_moe" and written["norm_topk_prob"] is True
  assert "text_config" not in written and "vision_config" not in written
  names = set(checks.tensors(tmp_path / "like"))
  assert "model.layers.0.mlp.experts.3.down_proj.weight" in names
  assert not any("visual" in name for name in names)
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "like").eval()
  assert isinstance(exported, transformers.Qwen3MoeForCausalLM)
  np.testing.assert_allclose(checks.reference_logits(exported), reference,
                             atol=1e-5, rtol=1e-5)
  reloaded = pzp.pretrained.load_hf(tmp_path / "like")
  before, after = checks.params(model), checks.params(reloaded)
  assert before.keys() == after.keys()
  for label, value in before.items():  # Bit for bit, whatever the stored axis order.
    axes = value.named_shape.keys()
    np.testing.assert_array_equal(np.asarray(after[label].untag(*axes).unwrap()),
                                  np.asarray(value.untag(*axes).unwrap()), err_msg=label)
  np.testing.assert_allclose(checks.penzai_logits(reloaded), checks.penzai_logits(model),
                             atol=1e-5, rtol=1e-5)
  pzp.export_hf(model, tmp_path / "alone")
  assert checks.config(tmp_path / "alone")["model_type"] == "qwen3_moe"
  alone = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "alone").eval()
  np.testing.assert_allclose(checks.reference_logits(alone), reference, atol=1e-5, rtol=1e-5)


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["hub"], tmp_path)


def test_a_square_gate_up_is_read_as_transformers_reads_it(tmp_path):
  """Experts of 16 neurons make ``gate_up_proj`` square (``[4, 32, 32]``):
  transformers cannot tell a transposed one from its shape and reads it as
  stored, while it transposes the (non-square) ``down_proj``; so does
  `load_hf`."""
  model = _make(moe_intermediate_size=16)
  model.save_pretrained(tmp_path / "m")
  hub = _hub_layout(tmp_path / "m", tmp_path)
  theirs = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(hub).eval()
  reference = checks.reference_logits(theirs)
  assert np.abs(reference - checks.reference_logits(model)).max() > 1e-2  # Not the original.
  checks.float32_error(hub, reference)


def test_the_layout_is_read_tensor_by_tensor(saved, tmp_path):
  """A folder mixing the layouts (one ``down_proj`` in memory's layout, the
  rest the Hub's) is read tensor by tensor, by shape, as transformers reads
  it: the same model."""
  tensors = checks.tensors(saved["saved"].folder)
  name = "model.language_model.layers.0.mlp.experts.down_proj"
  assert tensors[name].shape == (4, 32, 8)
  hub = checks.tensors(saved["hub"].folder)
  mixed = {**hub, name: tensors[name]}  # One layer's down_proj in memory's layout.
  folder = checks.edited(saved["hub"].folder, tmp_path)
  for file in folder.iterdir():
    if file.suffix == ".safetensors":
      file.unlink()
  safetensors.numpy.save_file(mixed, folder / "model.safetensors")
  theirs = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(folder).eval()
  np.testing.assert_array_equal(checks.reference_logits(theirs), saved["saved"].reference)
  checks.float32_error(folder, saved["saved"].reference)


@pytest.mark.parametrize("text,match", [
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"model_type": "qwen3_moe"}, "model_type"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"mlp_only_layers": [7]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"router_aux_loss_coef": "x"}, "router_aux_loss_coef"),
    ({"rope_parameters": {**_TEXT["rope_parameters"], "mrope_interleaved": False}},
     "mrope_interleaved"),
    ({"rope_parameters": {**_TEXT["rope_parameters"], "mrope_section": [1, 1]}},
     "mrope_section"),
    ({"shared_expert_intermediate_size": 8}, "shared_expert_intermediate_size"),
])
def test_hostile_text_config_refused_before_building(saved, tmp_path, monkeypatch, text, match):
  raw = checks.config(saved["hub"].folder)
  folder = checks.edited(saved["hub"].folder, tmp_path, text_config={**raw["text_config"], **text})
  checks.check_refused_before_building(folder, match, monkeypatch)


def test_a_forged_expert_count_is_refused_before_building(saved, tmp_path, monkeypatch):
  """The fused tensors' first dimension bounds the count (the plan's specs do
  not grow with it): the router's shape check refuses it, nothing built."""
  raw = checks.config(saved["hub"].folder)
  folder = checks.edited(saved["hub"].folder, tmp_path,
                         text_config={**raw["text_config"], "num_local_experts": 10**9})
  monkeypatch.setattr(checks.llamalike_common, "build_llamalike_transformer", None)
  with pytest.raises(errors.SafetensorsFormatError, match=r"mlp\.gate\.weight.*1000000000"):
    pzp.pretrained.load_hf(folder)


def test_a_folder_field_nobody_reads_is_refused(saved, tmp_path, monkeypatch):
  folder = checks.edited(saved["hub"].folder, tmp_path, audio_config={})
  checks.check_refused_before_building(folder, "audio_config", monkeypatch)


def _rewritten(src, tmp_path, edit):
  tensors = checks.tensors(src)
  edit(tensors)
  folder = checks.edited(src, tmp_path)
  for file in folder.iterdir():
    if file.suffix == ".safetensors":
      file.unlink()
  safetensors.numpy.save_file(tensors, folder / "model.safetensors")
  return folder


def test_experts_stored_one_per_expert_are_refused(saved, tmp_path):
  """transformers' Qwen3-VL-MoE reads only the fused tensors; a folder
  holding per-expert ones is refused before a tensor is read."""
  def split(tensors):
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj")]:
      prefix = name.removesuffix("gate_up_proj")
      fused, down = tensors.pop(name), tensors.pop(prefix + "down_proj")
      for e in range(fused.shape[0]):
        gate, up = np.split(fused[e].T, 2)
        tensors.update({f"{prefix}{e}.gate_proj.weight": np.ascontiguousarray(gate),
                        f"{prefix}{e}.up_proj.weight": np.ascontiguousarray(up),
                        f"{prefix}{e}.down_proj.weight": np.ascontiguousarray(down[e].T)})
  folder = _rewritten(saved["hub"].folder, tmp_path, split)
  with pytest.raises(errors.SafetensorsFormatError, match="one per expert"):
    pzp.pretrained.load_hf(folder)


@pytest.mark.parametrize("shape", [(4, 16, 16), (4, 32), (5, 32, 16), (4, 33, 16)])
def test_a_fused_tensor_of_neither_layout_is_refused(saved, tmp_path, shape):
  name = "model.language_model.layers.2.mlp.experts.gate_up_proj"

  def forge(tensors):
    tensors[name] = np.zeros(shape, np.float32)
  folder = _rewritten(saved["hub"].folder, tmp_path, forge)
  with pytest.raises(errors.PzPersistError, match="gate_up_proj"):
    pzp.pretrained.load_hf(folder)


def test_the_hubs_config_is_read(saved, tmp_path):
  """Qwen3-VL-30B-A3B-Instruct's text_config as the Hub has it (shrunk):
  ``num_experts``, ``norm_topk_prob: true``, ``rope_scaling`` beside
  ``rope_theta``, ``dtype``; transformers reads the folder as we do."""
  raw = checks.config(saved["hub"].folder)
  text = {**{k: v for k, v in raw["text_config"].items()
             if k not in ("rope_parameters", "num_local_experts", "sliding_window")},
          "num_experts": 4, "norm_topk_prob": True, "dtype": "bfloat16", "rope_theta": 1e4,
          "rope_scaling": {"mrope_interleaved": True, "mrope_section": [1, 1, 2],
                           "rope_type": "default"}}
  folder = checks.edited(saved["hub"].folder, tmp_path, text_config=text)
  theirs = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(
      folder, dtype=torch.float32).eval()
  reference = checks.reference_logits(theirs)
  np.testing.assert_array_equal(reference, saved["hub"].reference)
  checks.float32_error(folder, reference)


def test_defaults_are_the_text_config_class():
  """Each default of the ``qwen3_vl_moe`` row is ``Qwen3VLMoeTextConfig``'s
  (``tie_word_embeddings`` the folder class's, which transformers 5 reads)."""
  text, folder = transformers.Qwen3VLMoeTextConfig(), transformers.Qwen3VLMoeConfig()
  declared = families.MODEL_TYPES["qwen3_vl_moe"]
  assert declared.defaults and not declared.defaults_why
  for field, ours in declared.defaults.items():
    if field == "tie_word_embeddings":
      theirs = folder.tie_word_embeddings
    elif field in ("rope_theta", "partial_rotary_factor"):
      theirs = text.rope_parameters.get(field, 1.0)
    else:
      theirs = getattr(text, field)
    assert theirs == ours, (field, ours, theirs)


def test_sizes_alone_load_as_transformers_reads_them(tmp_path):
  """A text_config of sizes only (no RoPE dict, no epsilon, no expert
  counts but the experts'): the text class's defaults, as transformers."""
  text = {k: _TEXT[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "vocab_size", "pad_token_id",
                                "num_experts", "moe_intermediate_size", "num_experts_per_tok")}
  torch.manual_seed(0)
  model = checks.randomized(transformers.Qwen3VLMoeForConditionalGeneration(
      transformers.Qwen3VLMoeConfig(text_config=text, vision_config=_VISION)))
  model.save_pretrained(tmp_path / "m")
  raw = checks.config(tmp_path / "m")
  raw["text_config"] = {**text, "model_type": "qwen3_vl_moe_text"}
  (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
  checks.float32_error(tmp_path / "m", checks.reference_logits(model))
