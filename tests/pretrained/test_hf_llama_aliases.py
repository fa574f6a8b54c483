"""The ``model_type`` values transformers itself reads with its Llama classes
(``internlm3``, ``iquestcoder``: ``AutoModelForCausalLM`` builds
``LlamaForCausalLM`` from their config classes, which hold Llama's fields
only) load as Llama, against transformers, with the checks of
`hf_family_harness` (``exaone``, which transformers also reads as Llama
after renaming its tensors and fields, has its own record and tests:
test_hf_exaone.py)."""

from __future__ import annotations

import pytest
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as checks


def _case(model_type: str, **fields):
  return checks.Case(transformers.CONFIG_MAPPING[model_type], transformers.LlamaForCausalLM,
                     dict(fields, head_dim=8))


CASES = {
    # InternLM3's own defaults (two key/value heads, eps 1e-5) left absent.
    "internlm3": _case("internlm3"),
    # Biases on every projection (InternLM3's qkv_bias and bias, which its
    # config class requires to agree), untied head, dynamic RoPE.
    "internlm3_biases": _case("internlm3", attention_bias=True, mlp_bias=True,
                              num_key_value_heads=4, rope_parameters={
                                  "rope_type": "dynamic", "rope_theta": 50_000.0, "factor": 6.0}),
    "iquestcoder": _case("iquestcoder", num_key_value_heads=2, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


def test_transformers_reads_them_with_llamas_classes():
  from transformers.models.auto import modeling_auto  # pylint: disable=import-outside-toplevel
  for model_type in ("internlm3", "iquestcoder", "exaone"):
    assert modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == "LlamaForCausalLM"


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  assert checks.config(saved[case].folder)["model_type"] == case.split("_")[0]
  checks.check_float32(saved[case], case)


def test_kv_cache_sampling_matches_the_forward_pass(saved):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved["internlm3_biases"].folder))


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  """With ``like`` the folder's own model_type is written back; without,
  the model is Llama's (the same class transformers builds)."""
  checks.check_export(saved[case], tmp_path, "llama")


_INTERNLM3_HUB = {
    "architectures": ["InternLM3ForCausalLM"], "attn_implementation": "eager",
    "auto_map": {"AutoConfig": "configuration_internlm3.InternLM3Config",
                 "AutoModel": "modeling_internlm3.InternLM3Model",
                 "AutoModelForCausalLM": "modeling_internlm3.InternLM3ForCausalLM"},
    "bias": False, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 10240,
    "max_position_embeddings": 32768, "model_type": "internlm3", "num_attention_heads": 32,
    "num_hidden_layers": 48, "num_key_value_heads": 2, "pad_token_id": 2, "qkv_bias": False,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 6.0, "rope_type": "dynamic"},
    "rope_theta": 50000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.47.1", "use_cache": True, "vocab_size": 128512}
"""internlm/internlm3-8b-instruct's config.json, as the Hub has it."""


@pytest.mark.parametrize("biases", [False, True])
def test_internlm3_hub_config_with_its_bias_aliases(tmp_path, biases):
  """The Hub's ``qkv_bias`` / ``bias`` are transformers' other names for
  ``attention_bias`` / ``mlp_bias``; ``auto_map`` names code nobody runs."""
  saved = checks.hub_saved(tmp_path, {**_INTERNLM3_HUB, **checks.TINY, "head_dim": 8,
                                      "pad_token_id": 0, "qkv_bias": biases, "bias": biases})
  assert saved.hf_model.config.attention_bias is biases
  checks.check_float32(saved, f"internlm3_hub_biases_{biases}")


def test_internlm3_aliases_disagreeing_are_refused(tmp_path, monkeypatch):
  saved = checks.hub_saved(tmp_path, {**_INTERNLM3_HUB, **checks.TINY, "head_dim": 8,
                                      "pad_token_id": 0})
  folder = checks.edited(saved.folder, tmp_path, attention_bias=True)
  checks.check_refused_before_building(folder, "qkv_bias=False.*attention_bias's other name",
                                       monkeypatch)
