"""A refused ``model_type`` says why in a sentence and which supported family
is nearest by architecture, the useful clause first, through every entry
point that reads one (`load_hf`, the CLI's ``convert hf``, `export_hf`'s
``like``).

Before, the suggestion came from the spelling: ``gpt2`` was sent to
``gpt_oss`` and ``jamba`` to ``llama``, and most refusals named no family.
Now `pz_persist.pretrained.hf.unsupported.UNSUPPORTED` is the only source.
"""

from __future__ import annotations

import json
import pathlib

import pytest
from transformers.models.auto import modeling_auto

import pz_persist as pzp
from pz_persist import errors
from pz_persist.pretrained import errors as pretrained_errors
from pz_persist.pretrained import safetensors_io
from pz_persist.pretrained.hf import families
from pz_persist.pretrained.hf import unsupported
from pz_persist.tools import cli

ISSUE_40 = (
    "qwen2_5_vl", "qwen3_vl", "mistral3", "phi", "falcon", "stablelm",
    "starcoder2", "granitemoehybrid", "nemotron_h", "falcon_h1", "bamba", "jamba", "lfm2",
    "lfm2_moe", "qwen3_next", "gemma3n", "deepseek_v32", "minimax_m2", "glm4_moe_lite", "glm4",
    "glm", "hunyuan_v1_dense", "hunyuan_v1_moe", "ernie4_5", "ernie4_5_moe", "exaone4",
    "seed_oss", "apertus", "cohere2", "kimi_linear", "qwen2_moe", "olmoe", "phimoe",
    "internlm3", "exaone", "glm_moe_dsa")
"""Every ``model_type`` issue 40 §2 names."""

COMMON_DECODERS = (
    "gpt_neo", "gptj", "gpt_bigcode", "codegen", "bloom", "mpt", "openai-gpt", "gpt-sw3",
    "persimmon", "cohere", "olmo", "nemotron", "dbrx", "jetmoe", "granitemoe",
    "granitemoeshared", "deepseek_v2", "minicpm3", "minimax", "mamba", "mamba2",
    "falcon_mamba", "rwkv", "recurrent_gemma", "zamba", "zamba2", "ministral", "diffllama",
    "arcee", "bitnet", "helium", "xlstm")
"""The common decoder language models of transformers' causal-LM mapping."""

KNOWN = sorted({*ISSUE_40, *COMMON_DECODERS} - set(families.MODEL_TYPES))
_TAIL = " pz_persist.pretrained.load_hf reads the families"


def _folder(path: pathlib.Path, model_type: object) -> pathlib.Path:
  path.mkdir()
  (path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 8}))
  safetensors_io.write_safetensors(path / "model.safetensors", {})
  return path


def _refusal(tmp_path, model_type: object) -> str:
  with pytest.raises(errors.UnsupportedConfigError) as raised:
    pzp.pretrained.load_hf(_folder(tmp_path / "m", model_type))
  message = str(raised.value)
  assert message.startswith(f"{tmp_path / 'm' / 'config.json'}: model_type=")
  return message.split(": ", 1)[1]


def test_every_named_model_type_is_read_or_known():
  assert all(name in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or name in (
      "qwen2_5_vl", "qwen3_vl", "mistral3") for name in (*ISSUE_40, *COMMON_DECODERS))
  for name in KNOWN:
    assert name in unsupported.UNSUPPORTED or name in families.REFUSED, name


def test_no_row_for_a_supported_model_type():
  """A family that starts reading a ``model_type`` deletes its row here."""
  assert not set(unsupported.UNSUPPORTED) & set(families.MODEL_TYPES), (
      "supported now: delete their rows in pretrained/hf/unsupported.py")
  assert not set(unsupported.UNSUPPORTED) & set(families.REFUSED)


@pytest.mark.parametrize("model_type", sorted(unsupported.UNSUPPORTED))
def test_the_refusal_says_why_and_the_nearest_family_first(tmp_path, model_type):
  row = unsupported.UNSUPPORTED[model_type]
  message = _refusal(tmp_path, model_type)
  head, tail = message.split(_TAIL)
  assert head.startswith(f"model_type={model_type!r} is not supported: {row.name} has ")
  assert tail  # The list of families comes last.
  if row.nearest is None:
    assert f"No supported family is close: {row.nearest_why}." in head
  else:
    assert row.nearest in families.MODEL_TYPES, row.nearest
    assert (f"nearest supported family by architecture is"
            f" {families.FAMILY_OF[row.nearest].title} (model_type {row.nearest!r})") in head
  # The one family named is the row's: no lexical cousin rides along.
  named = [t for t in families.MODEL_TYPES if f"'{t}'" in head]
  assert named == ([row.nearest] if row.nearest else []), named
  assert "did you mean" not in message
  assert "load_gemma" not in message


@pytest.mark.parametrize("model_type, nearest", [
    ("gpt_neo", "gpt2"), ("zamba", "jamba"), ("zamba2", "bamba"), ("gpt_bigcode", "gpt2"),
    ("persimmon", "gpt_neox"), ("minicpm3", "deepseek_v3"),
    ("mamba", "jamba"), ("falcon_mamba", "jamba"), ("bert", None)])
def test_the_nearest_is_by_architecture_not_by_name(model_type, nearest):
  assert unsupported.UNSUPPORTED[model_type].nearest == nearest


@pytest.mark.parametrize("model_type", sorted(families.REFUSED))
def test_a_next_generation_names_its_family(tmp_path, model_type):
  message = _refusal(tmp_path, model_type)
  assert message == families.REFUSED[model_type] + "."
  assert any(f"'{t}'" in message for t in families.MODEL_TYPES)


@pytest.mark.parametrize("model_type, typo_of", [
    ("llama5", "llama"), ("Qwen3", "qwen3"), ("mistrall", "mistral"), ("gpt_os", "gpt_oss"),
    ("foo_model", None), ("gpt3", None), ("", None)])
def test_an_unknown_name_gets_did_you_mean_only_for_a_typo_of_a_supported_one(
    tmp_path, model_type, typo_of):
  head = _refusal(tmp_path, model_type).split(_TAIL)[0]
  assert head.startswith(f"model_type={model_type!r} is not supported: pz_persist knows no"
                         " architecture of that name")
  if typo_of:
    assert f"did you mean {typo_of!r}" in head
  else:
    assert "did you mean" not in head and "nearest" not in head


@pytest.mark.parametrize("model_type", [5, None, ["llama"], "x" * 10_000])
def test_a_model_type_that_is_not_a_name_is_refused_briefly(tmp_path, model_type):
  message = _refusal(tmp_path, model_type)
  assert len(message.split(_TAIL)[0]) < 200


def test_load_gemma_is_suggested_only_for_a_gemma(tmp_path):
  (tmp_path / "r").mkdir()
  assert "load_gemma" in _refusal(tmp_path, "gemma5")
  assert "load_gemma" not in _refusal(tmp_path / "r", "recurrent_gemma")


def test_the_cli_says_the_same(tmp_path, capsys):
  folder = _folder(tmp_path / "m", "zamba")
  assert cli.main(["convert", "hf", str(folder), str(tmp_path / "out"), "--quiet"]) == 2
  err = capsys.readouterr().err
  assert "model_type='zamba' is not supported: Zamba has" in err
  assert "(model_type 'jamba')" in err
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("like", ["gpt_neo", {"model_type": "gpt_neo"}, "folder"])
def test_export_hf_like_an_unsupported_model_type_says_why(tmp_path, like):
  model = pzp.pretrained.load_hf(_tiny_llama(tmp_path / "llama"))
  if like == "folder":
    like = _folder(tmp_path / "gpt_neo", "gpt_neo")
  with pytest.raises((pretrained_errors.ExportError, pretrained_errors.ArgumentError)) as raised:
    pzp.export_hf(model, tmp_path / "out", like=like)
  message = str(raised.value)
  assert "model_type='gpt_neo' is not supported: GPT-Neo has" in message
  assert message.index("(model_type 'gpt2')") < message.index("'llama'")
  assert not (tmp_path / "out").exists()


def _tiny_llama(path: pathlib.Path) -> pathlib.Path:
  import numpy as np  # pylint: disable=import-outside-toplevel
  path.mkdir()
  config = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 16, "tie_word_embeddings": True}
  (path / "config.json").write_text(json.dumps(config))
  rng = np.random.default_rng(0)
  shapes = {"model.embed_tokens.weight": (16, 8), "model.norm.weight": (8,),
            "model.layers.0.input_layernorm.weight": (8,),
            "model.layers.0.post_attention_layernorm.weight": (8,),
            "model.layers.0.self_attn.q_proj.weight": (8, 8),
            "model.layers.0.self_attn.k_proj.weight": (4, 8),
            "model.layers.0.self_attn.v_proj.weight": (4, 8),
            "model.layers.0.self_attn.o_proj.weight": (8, 8),
            "model.layers.0.mlp.gate_proj.weight": (16, 8),
            "model.layers.0.mlp.up_proj.weight": (16, 8),
            "model.layers.0.mlp.down_proj.weight": (8, 16)}
  safetensors_io.write_safetensors(path / "model.safetensors", {
      name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()})
  return path
