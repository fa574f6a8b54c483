"""Gemma 4 through `load_hf` and `export_hf`: ``gemma4_text`` (dense, with
per-layer inputs and shared keys/values as in E2B/E4B; keys as values as in
31B; mixture of experts as in 26B-A4B) and the text model of ``gemma4``
multimodal folders, against transformers on tiny random models (no
downloads).

Each Gemma 4 feature is shown to bind: switched off in the reference, the
logits move far beyond the tolerance, so a loader that ignored it would fail
the float32 match.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist import errors
from pz_persist.nn import kv_sharing
from pz_persist.nn import mixture_of_experts
from pz_persist.nn import per_layer_inputs
from pz_persist.nn.proportional_rope import ApplyProportionalRoPE

_BASE = {
    "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 16, "vocab_size": 64,
    "intermediate_size": 64, "sliding_window": 3, "hidden_size_per_layer_input": 0,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                           "rope_theta": 10_000.0},
    },
}

CASES = {
    # E2B / E4B: per-layer inputs, the last two layers reusing keys and values
    # (with the double-wide MLP), a final soft cap.
    "gemma4_text": dict(_BASE, vocab_size_per_layer_input=64, hidden_size_per_layer_input=4,
                        num_kv_shared_layers=2, use_double_wide_mlp=True,
                        final_logit_softcapping=30.0),
    # 31B: keys as values on the global layers, one global key/value head.
    "gemma4_text_k_eq_v": dict(_BASE, attention_k_eq_v=True, num_global_key_value_heads=1),
    # 26B-A4B: experts beside the dense MLP (and keys as values).
    "gemma4_text_moe": dict(_BASE, attention_k_eq_v=True, num_global_key_value_heads=1,
                            enable_moe_block=True, num_experts=4, top_k_experts=2,
                            moe_intermediate_size=16),
}
_SEED = {"gemma4_text": 3}  # Seeds 1-2 give a model float32 itself resolves only to 2e-4.


def _text_model(case: str) -> transformers.Gemma4ForCausalLM:
  torch.manual_seed(0)
  return checks.randomized(
      transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**CASES[case])),
      seed=_SEED.get(case, 1))


def _multimodal_model() -> transformers.Gemma4ForConditionalGeneration:
  torch.manual_seed(0)
  vision = transformers.Gemma4VisionConfig(hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           num_key_value_heads=2, head_dim=8)
  config = transformers.Gemma4Config(
      text_config=transformers.Gemma4TextConfig(**CASES["gemma4_text_k_eq_v"]).to_dict(),
      vision_config=vision.to_dict(), audio_config=None)
  return checks.randomized(transformers.Gemma4ForConditionalGeneration(config))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """``{case: (folder, transformers model, reference float32 logits)}``."""
  result = {}
  for case in [*CASES, "gemma4"]:
    model = _multimodal_model() if case == "gemma4" else _text_model(case)
    folder = tmp_path_factory.mktemp(case)
    model.save_pretrained(folder, safe_serialization=True)
    result[case] = (folder, model, checks.reference_logits(model))
  return result


@pytest.mark.parametrize("case", [*CASES, "gemma4"])
def test_float32_logits_match_transformers(saved, case):
  folder, _, reference = saved[case]
  print(f"{case}: float32 max abs error {checks.float32_error(folder, reference):.2g}")


@pytest.mark.parametrize("case", [
    "gemma4_text", *(pytest.param(case, marks=pytest.mark.slow) for case in CASES
                     if case != "gemma4_text")])
def test_kv_cache_sampling_matches_a_forward_pass(saved, case):
  """Through `pz_persist.pretrained.kv_caching_lm` (the global layers' caches have
  their own head sizes); the layers reusing keys and values keep a copy of
  the producing layer's cache."""
  checks.check_kv_cache_sampling(pzp.pretrained.load_hf(saved[case][0]))


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  """Dense: in bfloat16 an expert choice may flip on a near tie, in either
  implementation, which no tolerance covers."""
  folder, _, reference = saved["gemma4_text_k_eq_v"]
  ours, theirs = checks.bfloat16_errors(folder, transformers.Gemma4ForCausalLM, reference)
  print(f"gemma4_text_k_eq_v bfloat16: ours {ours:.3g}, transformers' {theirs:.3g}")


def test_save_model_round_trip(saved, tmp_path):
  for case in ("gemma4_text", "gemma4_text_moe"):
    folder, _, reference = saved[case]
    checks.check_save_model_round_trip(pzp.pretrained.load_hf(folder), tmp_path / case,
                                       reference)


@pytest.mark.parametrize("case", list(CASES))
def test_export_gives_back_the_folder(saved, tmp_path, case):
  """With ``like`` and without (the structure says Gemma 4)."""
  folder = saved[case][0]
  model = pzp.pretrained.load_hf(folder)
  checks.check_export_model(model, folder, tmp_path / "like")
  checks.check_export_model(model, folder, tmp_path / "alone", like=False)


def test_the_layers_are_there(saved):
  """Experts over a named ``experts`` axis, the proportional RoPE on the
  global layers, keys and values published once per kind and reused."""
  moe = pzp.pretrained.load_hf(saved["gemma4_text_moe"][0])
  experts = pz.select(moe).at_instances_of(mixture_of_experts.MixtureOfExperts).get_sequence()
  assert len(experts) == 4
  gate = pz.select(experts[0]).at_instances_of(pz.nn.Linear).get_sequence()[2]
  assert gate.weights.label.endswith("moe/experts/gate.weights")
  assert gate.weights.value.named_shape == {"experts": 4, "neurons": 16, "embedding": 32}
  assert len(pz.select(moe).at_instances_of(ApplyProportionalRoPE).get_sequence()) == 4
  e2b = pzp.pretrained.load_hf(saved["gemma4_text"][0])
  published = pz.select(e2b).at_instances_of(kv_sharing.PublishKV).get_sequence()
  assert sorted(p.slot for p in published) == ["full_attention/key", "full_attention/value",
                                                "sliding_attention/key",
                                                "sliding_attention/value"]
  assert len(pz.select(e2b).at_instances_of(kv_sharing.SharedKV).get_sequence()) == 4
  assert pz.select(e2b).at_instances_of(per_layer_inputs.PerLayerInputs).count() == 1


def test_multimodal_folder_gives_the_text_model_and_reports_the_towers(saved, caplog, tmp_path):
  folder, _, reference = saved["gemma4"]
  with caplog.at_level(logging.WARNING, logger="pz_persist.pretrained.hf"):
    model = pzp.pretrained.load_hf(folder)
  assert "vision and audio towers" in caplog.text and "model.vision_tower.*" in caplog.text
  pzp.export_hf(model, tmp_path / "text", like=folder)
  config = json.loads((tmp_path / "text" / "config.json").read_text())
  assert (config["model_type"], config["architectures"]) == ("gemma4_text", ["Gemma4ForCausalLM"])
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()
  np.testing.assert_allclose(checks.reference_logits(theirs), reference, **checks.TOLERANCE)
  written, original = checks.tensors(tmp_path / "text"), checks.tensors(folder)
  for name, value in written.items():
    assert value.tobytes() == original["model.language_model." + name.removeprefix("model.")
                                       ].tobytes(), name


def _reference_of(folder) -> np.ndarray:
  return checks.reference_logits(
      transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())


_ROPE_OFF = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
             "full_attention": {"rope_type": "default", "rope_theta": 10_000.0}}


@pytest.mark.parametrize("case, feature, changes", [
    ("gemma4_text_k_eq_v", "proportional RoPE", {"rope_parameters": _ROPE_OFF}),
    ("gemma4_text_k_eq_v", "global head size", {"global_head_dim": 8}),
    ("gemma4_text_k_eq_v", "window", {"sliding_window": 100}),
    ("gemma4_text", "final soft cap", {"final_logit_softcapping": 1.0}),
])
def test_each_feature_binds(saved, tmp_path, case, feature, changes):
  """The same weights (where they fit) with the feature changed:
  transformers' logits move far beyond the tolerance, and load_hf follows
  them."""
  folder, _, reference = saved[case]
  if feature == "global head size":  # New weights for the smaller heads.
    model = checks.randomized(transformers.Gemma4ForCausalLM(
        transformers.Gemma4TextConfig(**dict(CASES[case], **changes))))
    edited = tmp_path / "edited"
    model.save_pretrained(edited)
    changed = checks.reference_logits(model)
  else:
    edited = checks.edited(folder, tmp_path, **changes)
    changed = _reference_of(edited)
  assert np.abs(changed - reference).max() > 100 * checks.TOLERANCE["atol"], feature
  checks.float32_error(edited, changed)


def test_value_norms_shared_keys_per_layer_inputs_scalars_and_experts_bind(saved):
  """Switched off inside transformers' model, each moves the logits."""
  _, model, reference = saved["gemma4_text_moe"]

  def moved(edit) -> float:
    edited = _copy(model)
    edit(edited)
    return float(np.abs(checks.reference_logits(edited) - reference).max())

  def no_value_norm(m):
    for layer in m.model.layers:
      if hasattr(layer.self_attn, "v_norm"):
        layer.self_attn.v_norm = torch.nn.Identity()

  def scalars(m):
    for layer in m.model.layers:
      layer.layer_scalar.fill_(0.5)

  def no_experts(m):
    for layer in m.model.layers:
      layer.experts.down_proj.data.zero_()

  def one_expert(m):
    m.config.top_k_experts = 1

  for edit in (no_value_norm, scalars, no_experts, one_expert):
    assert moved(edit) > 100 * checks.TOLERANCE["atol"], edit.__name__
  _, e2b, e2b_reference = saved["gemma4_text"]

  def e2b_moved(edit) -> float:
    edited = _copy(e2b)
    edit(edited)
    with torch.no_grad():  # No cache: it expects the layers that share to hold none.
      logits = edited(torch.tensor(checks.SEQUENCES), use_cache=False).logits.numpy()
    return float(np.abs(logits - e2b_reference).max())

  def no_per_layer_inputs(m):
    m.model.embed_tokens_per_layer.weight.data.zero_()
    m.model.per_layer_model_projection.weight.data.zero_()

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

  assert e2b_moved(no_per_layer_inputs) > 100 * checks.TOLERANCE["atol"]
  assert e2b_moved(own_keys) > 100 * checks.TOLERANCE["atol"]


def _copy(model):
  import copy  # pylint: disable=import-outside-toplevel
  return copy.deepcopy(model)


@pytest.mark.parametrize("changes, match", [
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10.0}}, "rope_parameters"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                          "full_attention": {"rope_type": "default"}}}, "rope_type"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default"},
                          "full_attention": {"rope_type": "default",
                                             "partial_rotary_factor": 0.5}}},
     "partial_rotary_factor"),
    ({"rope_theta": 10.0}, "rope_theta"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention",
                      "full_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention"] * 3 + ["sliding_attention"]}, "layer_types"),
    ({"attention_bias": True}, "attention_bias"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"num_kv_shared_layers": 4}, "num_kv_shared_layers"),
    ({"num_kv_shared_layers": 3}, "num_kv_shared_layers"),  # No sliding layer left to share.
    ({"enable_moe_block": True, "num_experts": 2, "top_k_experts": 3,
      "moe_intermediate_size": 4}, "top_k_experts"),
    ({"per_layer_config": {"0": {"head_dim": 16}}}, "per_layer_config"),
    ({"per_layer_config": {"1": {"sliding_window": 16}}}, "per_layer_config"),
    ({"num_global_key_value_heads": 3}, "num_key_value_heads"),
    ({"altup_num_inputs": 4}, "altup_num_inputs"),  # A Gemma 3n field.
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  from penzai.models.transformer.variants import llamalike_common  # pylint: disable=import-outside-toplevel

  def never(*args, **kwargs):
    raise AssertionError("the skeleton was built before the config was refused")

  monkeypatch.setattr(llamalike_common, "build_llamalike_block", never)
  changes = dict(changes)
  if "per_layer_config" not in changes and "num_global_key_value_heads" in changes:
    changes["per_layer_config"] = checks.DELETE
  folder = checks.edited(saved["gemma4_text_k_eq_v"][0], tmp_path, **changes)
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)


@pytest.mark.parametrize("changes, match", [
    ({"text_config": checks.DELETE}, "text_config"),
    ({"vision_soft_tokens_per_image": -1}, "vision_soft_tokens_per_image"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ({"unknown_field": 4}, "unknown_field"),
])
def test_hostile_multimodal_configs_are_refused(saved, tmp_path, changes, match):
  folder = checks.edited(saved["gemma4"][0], tmp_path, **changes)
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)


def test_the_hubs_spelling_of_the_global_sizes(saved, tmp_path):
  """The Hub's configs say ``global_head_dim`` / ``num_global_key_value_heads``
  (transformers 5 writes ``per_layer_config``): the same model."""
  folder, _, reference = saved["gemma4_text_k_eq_v"]
  edited = checks.edited(folder, tmp_path, per_layer_config=checks.DELETE, global_head_dim=16,
                        num_global_key_value_heads=1)
  checks.float32_error(edited, reference)
