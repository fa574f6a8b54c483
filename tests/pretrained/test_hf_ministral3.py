"""Ministral 3 through `load_hf` and `export_hf`, against transformers on a
tiny random model (no downloads): Mistral's layout, yarn RoPE, and Llama 4's
position-dependent query scaling, shown to bind (a period of 4 positions, so
the ten-token sequences cross it twice)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist import errors

_ROPE = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
         "original_max_position_embeddings": 4, "max_position_embeddings": 16,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
         "llama_4_scaling_beta": 0.5}
CONFIG = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64,
          "max_position_embeddings": 16, "rope_parameters": _ROPE}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  torch.manual_seed(0)
  model = checks.randomized(transformers.Ministral3ForCausalLM(
      transformers.Ministral3Config(**CONFIG)))
  folder = tmp_path_factory.mktemp("ministral3")
  model.save_pretrained(folder, safe_serialization=True)
  return folder, model, checks.reference_logits(model)


def test_float32_logits_match_transformers(saved):
  folder, _, reference = saved
  print(f"ministral3: float32 max abs error {checks.float32_error(folder, reference):.2g}")


def test_kv_cache_sampling_save_model_and_export(saved, tmp_path):
  folder, _, reference = saved
  model = pzp.pretrained.load_hf(folder)
  checks.check_kv_cache_sampling(model)
  checks.check_save_model_round_trip(model, tmp_path / "native", reference)
  checks.check_export_model(model, folder, tmp_path / "like")
  config = checks.check_export_model(model, folder, tmp_path / "alone", like=False)
  assert config["rope_parameters"]["llama_4_scaling_beta"] == 0.5


def test_the_query_scaling_binds(saved, tmp_path):
  folder, _, reference = saved
  edited = checks.edited(folder, tmp_path, rope_parameters=dict(_ROPE, llama_4_scaling_beta=0.0))
  changed = checks.reference_logits(transformers.AutoModelForCausalLM.from_pretrained(
      edited, dtype=torch.float32).eval())
  assert np.abs(changed - reference).max() > 100 * checks.TOLERANCE["atol"]
  checks.float32_error(edited, changed)


@pytest.mark.parametrize("changes, match", [
    ({"rope_parameters": {k: v for k, v in _ROPE.items() if k != "llama_4_scaling_beta"}},
     "llama_4_scaling_beta"),
    ({"rope_parameters": dict(_ROPE, llama_4_scaling_beta=-1.0)}, "llama_4_scaling_beta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10.0,
                          "llama_4_scaling_beta": 0.1}}, "original_max_position_embeddings"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
])
def test_hostile_configs_are_refused(saved, tmp_path, changes, match):
  folder = checks.edited(saved[0], tmp_path, **changes)
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)
