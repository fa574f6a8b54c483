"""Qwen3 (dense, tied and untied) through `load_hf` and `export_hf`, against
transformers' own Qwen3 on tiny random models (no downloads).

Qwen3 is Llama plus query/key RMS norms: `test_hf_records` checks that the
family is one module; here, that it computes what transformers computes, and
that the norms (and the window) bind: switched off in the reference, the
logits move far beyond the tolerance.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pretrained.test_hf import _COMMON
from pz_persist import errors

CASES = {
    # Grouped-query attention, head_dim (16) other than hidden/heads (8), and
    # layer 1 attending through a 3-token window (shorter than the sequences).
    "qwen3": {"num_key_value_heads": 2, "head_dim": 16, "use_sliding_window": True,
              "sliding_window": 3, "max_window_layers": 1},
    # Tied embeddings, multi-query attention, attention biases on all four projections.
    "qwen3_tied_bias": {"num_key_value_heads": 1, "head_dim": 8, "tie_word_embeddings": True,
                        "attention_bias": True},
}


def _hf_model(case: str) -> transformers.Qwen3ForCausalLM:
  torch.manual_seed(0)
  config = transformers.Qwen3Config(**dict(_COMMON, **CASES[case]))
  return checks.randomized(transformers.Qwen3ForCausalLM(config))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """``{case: (folder, transformers model, reference float32 logits)}``."""
  result = {}
  for case in CASES:
    model = _hf_model(case)
    folder = tmp_path_factory.mktemp(case)
    model.save_pretrained(folder, safe_serialization=True)
    result[case] = (folder, model, checks.reference_logits(model))
  return result


@pytest.mark.parametrize("case", list(CASES))
def test_float32_logits_match_transformers(saved, case):
  folder, _, reference = saved[case]
  print(f"{case}: float32 max abs error {checks.float32_error(folder, reference):.2g}")


def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  folder, _, reference = saved["qwen3"]
  ours, theirs = checks.bfloat16_errors(folder, transformers.Qwen3ForCausalLM, reference)
  print(f"qwen3 bfloat16: ours {ours:.3g}, transformers' {theirs:.3g}")


def test_kv_cache_sampling_matches_a_forward_pass(saved):
  checks.check_kv_cache_sampling(pzp.pretrained.load_hf(saved["qwen3"][0]))


def test_save_model_round_trip(saved, tmp_path):
  folder, _, reference = saved["qwen3_tied_bias"]
  checks.check_save_model_round_trip(pzp.pretrained.load_hf(folder), tmp_path / "native",
                                     reference)


@pytest.mark.parametrize("case", list(CASES))
def test_export_gives_back_the_folder(saved, tmp_path, case):
  """With ``like`` and without (the structure says Qwen3)."""
  folder = saved[case][0]
  model = pzp.pretrained.load_hf(folder)
  checks.check_export_model(model, folder, tmp_path / "like")
  config = checks.check_export_model(model, folder, tmp_path / "alone", like=False)
  assert config["tie_word_embeddings"] == CASES[case].get("tie_word_embeddings", False)


QWEN3_0_6B_CONFIG = {
    # The Hub's config.json of Qwen/Qwen3-0.6B (transformers 4.51: rope_theta,
    # rope_scaling null, sliding_window null), with only the sizes shrunk.
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 64,
}


def test_the_hubs_qwen3_config(tmp_path):
  torch.manual_seed(0)
  model = checks.randomized(transformers.Qwen3ForCausalLM(
      transformers.Qwen3Config(**QWEN3_0_6B_CONFIG)))
  model.save_pretrained(tmp_path, safe_serialization=True)
  (tmp_path / "config.json").write_text(json.dumps(QWEN3_0_6B_CONFIG))
  reference = checks.reference_logits(
      transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval())
  print(f"Qwen/Qwen3-0.6B's config: float32 max abs error"
        f" {checks.float32_error(tmp_path, reference):.2g}")


def test_query_key_norms_bind(saved):
  """Without its query/key norms, transformers' model gives logits far from
  the loaded model's: a loader that dropped them would fail the match."""
  _, model, reference = saved["qwen3"]
  unnormed = checks.reference_logits(without_query_key_norms(model))
  assert np.abs(unnormed - reference).max() > 100 * checks.TOLERANCE["atol"]


def without_query_key_norms(model: torch.nn.Module) -> torch.nn.Module:
  """A copy of ``model`` whose query/key norms do nothing."""
  model = copy.deepcopy(model)
  for layer in model.model.layers:
    layer.self_attn.q_norm, layer.self_attn.k_norm = torch.nn.Identity(), torch.nn.Identity()
  return model


def test_window_binds(saved, tmp_path):
  folder, _, reference = saved["qwen3"]
  unwindowed = checks.edited(folder, tmp_path, use_sliding_window=False, layer_types=checks.DELETE)
  global_reference = checks.reference_logits(
      transformers.Qwen3ForCausalLM.from_pretrained(unwindowed).eval())
  assert np.abs(global_reference - reference).max() > 100 * checks.TOLERANCE["atol"]


@pytest.mark.parametrize("changes, match", [
    ({"mlp_bias": True}, "mlp_bias"),  # Qwen3's MLP has none; transformers ignores it.
    ({"use_mrope": False}, "use_mrope"),  # Not a Qwen3 field.
    ({"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": False},
     "layer_types.*no window"),
    ({"head_dim": 0}, "head_dim"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6}}, "longrope"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  from penzai.models.transformer.variants import llamalike_common  # pylint: disable=import-outside-toplevel

  def never(*args, **kwargs):
    raise AssertionError("the skeleton was built before the config was refused")

  monkeypatch.setattr(llamalike_common, "build_llamalike_transformer", never)
  folder = checks.edited(saved["qwen3"][0], tmp_path, **changes)
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)
