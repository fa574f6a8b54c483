"""EXAONE 3 / 3.5 (``model_type`` ``exaone``) against transformers, with the
checks of `hf_family_harness`: transformers builds ``LlamaForCausalLM`` for
it, renaming the folder's tensors (``transformer.h.N.attn.attention.*``) and
fields (``num_layers``, ``layer_norm_epsilon``, ``activation_function``) as
it loads; `load_hf` reads the same names and `export_hf` writes them back."""

from __future__ import annotations

import json
import types

import hypothesis
import numpy as np
import pytest
import transformers
from hypothesis import strategies as st

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.pretrained.hf.building import renamed
from pz_persist.pretrained.hf.families.exaone import EXAONE_NAMES


def _case(**fields):
  return checks.Case(transformers.ExaoneConfig, transformers.LlamaForCausalLM,
                     dict({"num_key_value_heads": 2, "head_dim": 8}, **fields))


CASES = {
    "exaone": _case(),
    # Biases on every projection, a tied head and EXAONE 3.5's llama3 RoPE.
    "exaone_biases": _case(attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 1e6,
                                            "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 4}),
}

HUB = {
    "activation_function": "silu", "architectures": ["ExaoneForCausalLM"],
    "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_exaone.ExaoneConfig",
                 "AutoModelForCausalLM": "modeling_exaone.ExaoneForCausalLM"},
    "bos_token_id": 1, "embed_dropout": 0.0, "eos_token_id": 361, "head_dim": 80,
    "hidden_size": 2560, "initializer_range": 0.02, "intermediate_size": 7168,
    "layer_norm_epsilon": 1e-05, "max_position_embeddings": 32768, "model_type": "exaone",
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_layers": 30, "pad_token_id": 0,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 1000000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0", "use_cache": True, "vocab_size": 102400}
"""EXAONE-3.5-2.4B-Instruct's config.json as the Hub has it (fields under
EXAONE's names, ``auto_map`` naming remote code)."""

_TINY_HUB = {**{k: v for k, v in HUB.items() if k != "num_layers"}, **checks.TINY,
             "head_dim": 8, "eos_token_id": 2, "layer_norm_epsilon": 0.3,
             "rope_scaling": {**HUB["rope_scaling"], "original_max_position_embeddings": 4}}
_TINY_HUB["num_layers"] = _TINY_HUB.pop("num_hidden_layers")
"""`HUB` shrunk (`checks.TINY`) with an epsilon of 0.3, large enough that
reading the default 1e-5 instead would change the logits."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
  return checks.hub_saved(tmp_path_factory.mktemp("exaone_hub"), _TINY_HUB)


def test_the_folders_hold_exaones_names(saved, hub):
  for folder in (saved["exaone"].folder, hub.folder):
    names = checks.tensors(folder)
    assert "transformer.h.1.attn.attention.out_proj.weight" in names
    assert not any(name.startswith("model.") for name in names)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


def test_hub_config_under_exaones_field_names(hub):
  """``num_layers``, ``layer_norm_epsilon``, ``activation_function``,
  ``rope_scaling`` / ``rope_theta`` and ``auto_map``, as the Hub writes them."""
  assert hub.hf_model.config.rms_norm_eps == 0.3
  checks.check_float32(hub, "exaone_hub")


def test_layer_norm_epsilon_binds(hub):
  """Read as rms_norm_eps: the default 1e-5 in its place changes transformers'
  logits beyond the tolerance."""
  case = checks.Case(transformers.ExaoneConfig, transformers.LlamaForCausalLM,
                     {**{k: v for k, v in _TINY_HUB.items() if k not in (
                         "auto_map", "embed_dropout", "architectures", "num_layers",
                         "layer_norm_epsilon", "activation_function", "torch_dtype",
                         "transformers_version", "model_type")}, "num_hidden_layers": 2})
  checks.check_feature_binds(hub, case, rms_norm_eps=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_kv_cache_and_greedy_generation_match_transformers(saved, case):
  checks.check_cached_decoding(saved[case])


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  """With ``like``: EXAONE's own names and config, which transformers reloads."""
  checks.check_export(saved[case], tmp_path, None)


def test_export_of_the_hub_folder_keeps_its_names(hub, tmp_path):
  """Like the Hub folder: its tensors bit for bit, which transformers reads
  as the same model (``auto_map``, remote code nobody runs, is not copied)."""
  pzp.export_hf(pzp.pretrained.load_hf(hub.folder), tmp_path / "out", like=hub.folder)
  checks.assert_same_tensors(checks.tensors(tmp_path / "out"), checks.tensors(hub.folder))
  written = checks.config(tmp_path / "out")
  assert (written["model_type"], written["rms_norm_eps"]) == ("exaone", 0.3)
  np.testing.assert_array_equal(checks.reference_logits(
      transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()),
      hub.reference)


def test_export_without_like_is_llama(saved, tmp_path):
  """The structure is Llama's: written as a Llama folder, under Llama's
  names, which transformers reads as the same model."""
  model = pzp.pretrained.load_hf(saved["exaone_biases"].folder)
  pzp.export_hf(model, tmp_path / "alone")
  assert checks.config(tmp_path / "alone")["model_type"] == "llama"
  written = checks.tensors(tmp_path / "alone")
  assert "model.layers.0.self_attn.o_proj.weight" in written
  np.testing.assert_array_equal(checks.reference_logits(
      transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "alone").eval()),
      saved["exaone_biases"].reference)


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["exaone_biases"], tmp_path)


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["exaone"], "exaone")


def test_aliases_disagreeing_are_refused(hub, tmp_path, monkeypatch):
  folder = checks.edited(hub.folder, tmp_path, rms_norm_eps=1e-5)
  checks.check_refused_before_building(
      folder, "layer_norm_epsilon=0.3.*rms_norm_eps's other name", monkeypatch)


@pytest.mark.parametrize("changes, match", [
    ({"num_layers": 10**9}, "num_hidden_layers.*layers 0..1"),
    ({"layer_norm_epsilon": -1.0}, "layer_norm_epsilon must be a positive"),
    ({"activation_function": "relu"}, "hidden_act"),
    ({"num_layers": "2"}, "num_layers must be a positive integer"),
])
def test_hostile_fields_are_refused_before_building(hub, tmp_path, monkeypatch, changes, match):
  checks.check_refused_before_building(checks.edited(hub.folder, tmp_path, **changes), match,
                                       monkeypatch)


def test_llamas_names_in_an_exaone_folder_are_not_its_layers(saved, tmp_path, monkeypatch):
  """A folder saying ``exaone`` that holds Llama's names has no EXAONE layers:
  refused from the headers, not read as another family's tensors."""
  folder = tmp_path / "llama_named"
  pzp.export_hf(pzp.pretrained.load_hf(saved["exaone"].folder), folder)
  raw = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps({**raw, "model_type": "exaone"}))
  checks.check_refused_before_building(folder, "num_hidden_layers.*no layers", monkeypatch)


_EXAONE_PARTS = ("attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj",
                 "attn.attention.out_proj", "ln_1", "ln_2", "mlp.c_fc_0", "mlp.c_fc_1",
                 "mlp.c_proj")


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(layer=st.integers(0, 10**6), part=st.sampled_from(_EXAONE_PARTS),
                  kind=st.sampled_from(("weight", "bias")))
def test_every_exaone_layer_name_goes_to_llamas_and_back(layer, part, kind):
  """Renaming is one-to-one on EXAONE's names: each maps to a Llama name
  (as transformers' conversion mapping does) that maps back to it."""
  name = f"transformer.h.{layer}.{part}.{kind}"
  planned = EXAONE_NAMES.planned(name)
  assert planned.startswith(f"model.layers.{layer}.") and ".attn." not in planned
  assert EXAONE_NAMES.stored(planned) == name


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(name=st.text(st.sampled_from("abhlmnorstw_.0123"), max_size=40))
def test_a_name_is_planned_only_if_it_comes_back(name):
  """Whatever a folder names a tensor, the plan sees it only under a name
  that leads back to it: no stored tensor stands in for another."""
  planned = EXAONE_NAMES.planned(name)
  if EXAONE_NAMES.stored(planned) != name:
    assert planned not in renamed._PlannedNames(  # pylint: disable=protected-access
        types.SimpleNamespace(names={name}), EXAONE_NAMES).names
