"""Seed-OSS (``model_type`` ``seed_oss``) through `load_hf` and `export_hf`,
against transformers, with the checks of `hf_family_harness`: Llama's
layout with query/key/value biases, an output bias of its own and MLP
biases, each shown to bind; its dropout fields change nothing at inference."""

from __future__ import annotations

import numpy as np
import pytest
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as checks

_SIZES = {"num_key_value_heads": 2, "head_dim": 8, "bos_token_id": 1, "eos_token_id": 2}

CASES = {
    # transformers' defaults: query/key/value biases, none on the output or MLP.
    "seed_oss": checks.Case(transformers.SeedOssConfig, transformers.SeedOssForCausalLM, _SIZES),
    # Every bias, tied embeddings, dropout fields set (inference ignores them).
    "seed_oss_all_biases": checks.Case(
        transformers.SeedOssConfig, transformers.SeedOssForCausalLM,
        {**_SIZES, "attention_out_bias": True, "mlp_bias": True, "tie_word_embeddings": True,
         "residual_dropout": 0.3, "attention_dropout": 0.2}),
    # An output bias alone (Llama cannot say it).
    "seed_oss_output_bias": checks.Case(
        transformers.SeedOssConfig, transformers.SeedOssForCausalLM,
        {**_SIZES, "attention_bias": False, "attention_out_bias": True}),
}
_FIELDS = ("attention_bias", "attention_out_bias", "mlp_bias", "head_dim", "tie_word_embeddings",
           "num_key_value_heads")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["seed_oss_all_biases"], "seed_oss_all_biases")


@pytest.mark.parametrize("case", ["seed_oss", "seed_oss_all_biases"])
def test_kv_cache_and_greedy_generation_match_generate(saved, case):
  model = pzp.pretrained.load_hf(saved[case].folder)
  checks.check_kv_cache(model)
  checks.check_kv_cache_like_transformers(model, saved[case].hf_model)
  checks.check_generate(saved[case], steps=6)


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["seed_oss_all_biases"], tmp_path)


_WITHOUT_LIKE = {"seed_oss": "qwen2", "seed_oss_all_biases": "llama",
                 "seed_oss_output_bias": "seed_oss"}
"""What ``export_hf`` writes from the structure alone: Seed-OSS's defaults
(query/key/value biases only) are Qwen2's math, every bias is Llama's
(``attention_bias`` and ``mlp_bias``); an output bias without query/key/value
biases only Seed-OSS can say."""


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  """With ``like``: the same tensors, config and class, exactly the logits;
  without, the family the structure shows."""
  own = _WITHOUT_LIKE[case] == "seed_oss"
  checks.check_export(saved[case], tmp_path, "seed_oss" if own else None, same_fields=_FIELDS)


@pytest.mark.parametrize("case", ["seed_oss", "seed_oss_all_biases"])
def test_without_like_an_equivalent_family_is_written(saved, tmp_path, case):
  model = pzp.pretrained.load_hf(saved[case].folder)
  pzp.export_hf(model, tmp_path / "out")
  assert checks.config(tmp_path / "out")["model_type"] == _WITHOUT_LIKE[case]
  assert checks.tensors(tmp_path / "out").keys() == checks.tensors(saved[case].folder).keys()
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", pad_token_id=0)
  np.testing.assert_allclose(checks.reference_logits(exported.eval()), saved[case].reference,
                             **checks.TOLERANCE)


@pytest.mark.parametrize("case,off", [
    ("seed_oss", {"attention_bias": False}),
    ("seed_oss_all_biases", {"attention_out_bias": False}),
    ("seed_oss_all_biases", {"mlp_bias": False}),
])
def test_each_bias_binds(saved, case, off):
  """transformers' model without the bias (the same weights otherwise) gives
  other logits."""
  case_ = CASES[case]
  model = case_.model_cls(case_.config(**off))
  state = {k: v for k, v in saved[case].hf_model.state_dict().items()
           if not (k.endswith(".bias") and model.state_dict().get(k) is None)}
  model.load_state_dict(state, strict=False)
  changed = abs(checks.reference_logits(model.eval()) - saved[case].reference).max()
  assert changed > 100 * checks.TOLERANCE["atol"]


@pytest.mark.parametrize("changes,match", [
    ({"residual_dropout": 2.0}, "residual_dropout"),
    ({"attention_out_bias": "yes"}, "attention_out_bias"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers|layers"),
    ({"rope_parameters": {"rope_type": "su"}}, "rope_type"),
    ({"use_qk_norm": True}, "use_qk_norm"),
])
def test_hostile_configs_refused_before_building(saved, tmp_path, monkeypatch, changes, match):
  folder = checks.edited(saved["seed_oss"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)
