"""export_hf for the families load_hf learnt in round 2: scaled RoPE, Gemma /
Gemma 2 Hub folders, Qwen2 and Llama with biases.

Each tiny model is made by transformers with every parameter random (the
helpers of the load_hf tests for these families), saved, read by
``load_hf`` and written back by ``export_hf``. The round trip must be
tensor-for-tensor identical (names, shapes, dtypes, bytes: Gemma's norms are
`OffsetScale` layers holding Hugging Face's own ``w``), the configs must give
transformers the same model (the same ``PretrainedConfig`` dict), and
transformers must compute exactly the original logits from the export (same
weights, same code, so no tolerance).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers
from penzai import pz
from penzai.models.transformer import model_parts

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pretrained import test_export_hf
from pretrained import test_hf_gemma
from pretrained import test_hf_qwen2
from pretrained import test_rope_scaling
from pretrained.test_export_hf import _transformers_logits
from pretrained.test_hf import TOKENS
from pz_persist.pretrained import errors
from pz_persist.nn.scaled_rope import ApplyScaledRoPE
from pz_persist.pretrained.hf import config_from_model as hf_config_from_model
from pz_persist.pretrained.hf import families as hf_families
from pz_persist.pretrained.hf import structure_match as hf_structure_match
from pz_persist.tools import cli

# name: (makes the transformers model, the family export_hf finds alone)
CASES = {
    **{f"rope_{name}": (lambda name=name: test_rope_scaling._model(name), family)
       for name, family in [("llama3", "llama"), ("linear", "llama"), ("dynamic", "llama"),
                            ("yarn", "llama"), ("yarn_mscale", "llama"),
                            ("mistral_llama3", "mistral")]},
    **{name: (lambda name=name: test_hf_gemma._hf_model(name), family)
       for name, family in [("gemma", "gemma"), ("gemma2", "gemma2"),
                            ("gemma2_layer_types", "gemma2")]},
    **{name: (lambda name=name: test_hf_qwen2._hf_model(name), family)
       for name, family in [("qwen2", "qwen2"), ("qwen2_mqa_tied", "qwen2"),
                            ("llama_attention_bias", "llama"),
                            ("llama_mlp_bias_gelu_fast", "llama")]},
    # Sliding layers not last: only layer_types can say which they are.
    "qwen2_sliding_first": (lambda: _qwen2(layer_types=["sliding_attention", "full_attention"]),
                            "qwen2"),
}


def _qwen2(**fields):
  """A random Qwen2 with a 3-token window (shorter than the test tokens)."""
  config = transformers.Qwen2Config(**dict(test_hf_qwen2._COMMON, num_key_value_heads=2,
                                           use_sliding_window=True, sliding_window=3, **fields))
  return test_hf_qwen2._randomized(transformers.Qwen2ForCausalLM(config))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """``{case: (original folder, its logits, loaded model, exported folder)}``
  (logits from the fresh model: transformers' dynamic RoPE keeps state)."""
  result = {}
  for case, (make, _) in CASES.items():
    hf_model = make()
    src = tmp_path_factory.mktemp(case)
    hf_model.save_pretrained(src, safe_serialization=True)
    reference = harness.reference_logits(hf_model, TOKENS)
    model = pzp.pretrained.load_hf(src)
    dst = str(tmp_path_factory.mktemp(f"{case}_export") / "out")
    pzp.export_hf(model, dst, like=src)
    result[case] = (src, reference, model, dst)
  return result


def _eager(case: str) -> dict:
  """Gemma 2's references ran eager attention (soft caps); the others sdpa."""
  return {"attn_implementation": "eager"} if case.startswith("gemma2") else {}


@pytest.mark.parametrize("case", CASES)
def test_round_trip_is_tensor_for_tensor_identical(folders, case):
  src, _, _, dst = folders[case]
  harness.assert_same_tensors(harness.tensors(dst), harness.tensors(src))
  assert harness.transformers_config(dst) == harness.transformers_config(src)


@pytest.mark.parametrize("case", CASES)
def test_transformers_reads_the_export(folders, case):
  _, reference, _, dst = folders[case]
  np.testing.assert_array_equal(_transformers_logits(dst, **_eager(case)), reference)


@pytest.mark.parametrize("case", CASES)
def test_family_from_structure_alone(folders, tmp_path, case):
  """Without ``like``: the family, biases, windows and RoPE scaling come
  from the model itself (only fields that do not change the math differ)."""
  src, _, model, _ = folders[case]
  pzp.export_hf(model, tmp_path / "out")
  harness.assert_same_tensors(harness.tensors(tmp_path / "out"), harness.tensors(src))
  config = harness.config(tmp_path / "out")
  assert config["model_type"] == CASES[case][1]
  original = harness.config(src)
  for field in ("rope_parameters", "layer_types", "sliding_window", "attention_bias",
                "mlp_bias", "attn_logit_softcapping", "final_logit_softcapping"):
    assert config.get(field) == original.get(field), field


def test_qwen2_windows_as_transformers_4_writes_them(folders):
  """Sliding layers last: ``max_window_layers`` says where they start, so
  readers of transformers 4 configs (no ``layer_types``) agree."""
  config = harness.config(folders["qwen2"][3])
  assert config["layer_types"] == ["full_attention", "sliding_attention"]
  assert (config["use_sliding_window"], config["sliding_window"], config["max_window_layers"]) == (
      True, 3, 1)
  assert "head_dim" not in config  # Not a Qwen2 config field; hidden_size // heads.
  config = harness.config(folders["qwen2_sliding_first"][3])
  assert config["layer_types"] == ["sliding_attention", "full_attention"]
  assert "max_window_layers" not in config  # It cannot say this.


def test_scaled_rope_changed_in_one_block_is_refused(folders, tmp_path):
  _, _, model, _ = folders["rope_llama3"]
  edited = (pz.select(model).at_instances_of(model_parts.TransformerBlock).pick_nth_selected(1)
            .at_instances_of(ApplyScaledRoPE)
            .apply(lambda layer: dataclasses.replace(layer, rope_type="linear")))
  with pytest.raises(errors.ExportError, match=r"sublayers\[2\].*rope_type: 'linear' where the"
                                               r" family's layout has 'llama3'"):
    pzp.export_hf(edited, tmp_path / "edited")
  assert os.listdir(tmp_path) == []


def _without_biases_in_block(model, n: int):
  """``model`` with block ``n``'s query bias layer removed."""
  return (pz.select(model).at_instances_of(model_parts.TransformerBlock).pick_nth_selected(n)
          .at_instances_of(pz.nn.Attention).at(lambda a: a.input_to_query)
          .at_instances_of(pz.nn.AddBias).remove_from_parent())


@pytest.mark.parametrize("case", ["qwen2", "llama_attention_bias"])
def test_a_bias_on_one_block_only_is_refused(folders, tmp_path, case):
  _, _, model, _ = folders[case]
  with pytest.raises(errors.ExportError, match=r"sublayers.*entries where the family's layout"):
    pzp.export_hf(_without_biases_in_block(model, 1), tmp_path / "one_block")
  assert os.listdir(tmp_path) == []


def test_biases_the_family_cannot_express_are_refused(folders, tmp_path):
  """Qwen2's biases (no output bias) as Llama (whose attention_bias is all
  four), and Llama's as Mistral (no biases): refused, naming the family."""
  with pytest.raises(errors.ExportError, match=r"'llama' folder.*like="):
    pzp.export_hf(folders["qwen2"][2], tmp_path / "as_llama", like="llama")
  with pytest.raises(errors.ExportError, match=r"'mistral' folder"):
    pzp.export_hf(folders["llama_attention_bias"][2], tmp_path / "as_mistral", like="mistral")
  assert os.listdir(tmp_path) == []


def test_qwen2_with_two_window_sizes_is_refused(tmp_path):
  model = pzp.pretrained.load_hf(_saved_qwen2_all_sliding(tmp_path))
  edited = (pz.select(model).at_instances_of(pz.nn.ApplyCausalSlidingWindowAttentionMask)
            .pick_nth_selected(1)
            .apply(lambda mask: dataclasses.replace(mask, sliding_window_size=2)))
  with pytest.raises(errors.ExportError, match=r"2 where the family's layout has 3"):
    pzp.export_hf(edited, tmp_path / "out")


def _saved_qwen2_all_sliding(tmp_path) -> str:
  folder = str(tmp_path / "qwen2_sliding")
  _qwen2(max_window_layers=0).save_pretrained(folder, safe_serialization=True)
  return folder


@pytest.mark.parametrize("case", ["rope_yarn", "gemma2", "qwen2"])
def test_cli_export_from_a_native_checkpoint(folders, tmp_path, case):
  """The layers pz_persist adds (`ApplyScaledRoPE`, `OffsetScale`, bias
  layers) survive ``save_model`` and export from the checkpoint alone."""
  src, reference, model, _ = folders[case]
  pzp.save_model(tmp_path / "native", model)
  dst = tmp_path / "hf"
  assert cli.main(["export", "hf", str(tmp_path / "native"), str(dst), "--quiet"]) == 0
  harness.assert_same_tensors(harness.tensors(dst), harness.tensors(src))
  np.testing.assert_array_equal(_transformers_logits(dst, **_eager(case)), reference)


def test_a_family_refusing_the_derived_config_is_an_export_error(folders, tmp_path):
  """Scaled RoPE as Gemma (whose plan reads only unscaled RoPE): the plan's
  refusal of the derived config is named as an export refusal."""
  with pytest.raises(errors.ExportError, match=r"'gemma' folder.*rope_type='llama3'.*like="):
    pzp.export_hf(folders["rope_llama3"][2], tmp_path / "as_gemma", like="gemma")
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("gemma2", [False, True], ids=["gemma", "gemma2"])
def test_each_gemma_layout_is_written_through_its_own_plan(folders, tmp_path, gemma2):
  """A Hub Gemma (load_hf: norms hold w) goes through load_hf's plan, bit
  for bit; Penzai's own (load_gemma: norms hold 1 + w) through the native
  plan, whose norms have offset 1."""
  family = "gemma2" if gemma2 else "gemma"
  _, native = test_export_hf._gemma_model(tmp_path, gemma2)
  for model, offset in ((folders[family][2], 0.0), (native, 1.0)):
    model = pz.freeze_params(model)
    config = hf_config_from_model.derive_config(model, family, hf_families.FAMILY_OF[family])
    weights = hf_structure_match.ModelWeights(config["num_hidden_layers"], np.dtype("float32"))
    plan, _ = hf_structure_match.matching_plan(hf_structure_match.family_plans()[family], config,
                                               weights, model, family, str(tmp_path))
    assert {spec.offset for spec in plan.tensors if "norm" in spec.label} == {offset}


def test_gemma2_without_soft_caps_writes_them_null(folders, tmp_path):
  """No soft cap layers: the caps are written null ("off"), not left out
  (absent, transformers and load_hf would apply the defaults, 50 and 30)."""
  src = tmp_path / "off"
  shutil.copytree(folders["gemma2"][0], src)
  config = harness.config(src)
  config.update(final_logit_softcapping=None, attn_logit_softcapping=None)
  (src / "config.json").write_text(json.dumps(config))
  pzp.export_hf(pzp.pretrained.load_hf(src), tmp_path / "out")
  exported = harness.config(tmp_path / "out")
  assert exported["final_logit_softcapping"] is exported["attn_logit_softcapping"] is None
  harness.assert_same_tensors(harness.tensors(tmp_path / "out"), harness.tensors(src))
  np.testing.assert_array_equal(_transformers_logits(tmp_path / "out", **_eager("gemma2")),
                                _transformers_logits(src, **_eager("gemma2")))


@pytest.mark.parametrize("case", ["gemma2", "qwen2", "rope_llama3"])
def test_bfloat16_round_trip_is_identical(tmp_path, case):
  """No arithmetic on the way: Gemma's norms are written from the w their
  `OffsetScale` holds, so bfloat16 comes back bit for bit too."""
  src = tmp_path / "bf16"
  CASES[case][0]().to(torch.bfloat16).save_pretrained(src, safe_serialization=True)
  pzp.export_hf(pzp.pretrained.load_hf(src), tmp_path / "out", like=src)
  assert harness.config(tmp_path / "out")["dtype"] == "bfloat16"
  harness.assert_same_tensors(harness.tensors(tmp_path / "out"), harness.tensors(src))
