"""export_hf: Penzai transformers back to Hugging Face folders.

Hugging Face folders made by transformers (tiny random models, as in
test_hf.py) go through ``load_hf`` and ``export_hf``: the exported tensors
must be the original ones bit for bit (names, shapes, dtypes, bytes), the
config the same, and transformers must compute the same logits from the
export as from the original (exactly: same weights, same code). Models
edited in Penzai (blocks cut, LoRA merged) and Gemma models built by
``load_gemma`` (Penzai's structure, norms holding ``1 + w``) are checked
against their own Penzai logits, within 1e-4 in float32 (measured ~5e-6:
transformers computes ``1 + (v - 1)`` and its norms in another order).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common
from penzai.toolshed import lora

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pretrained.test_gemma import GEMMA1
from pretrained.test_gemma import GEMMA2
from pretrained.test_gemma import official_params
from pretrained.test_gemma import write
from pretrained.test_hf import TOKENS
from pretrained.test_hf import _hf_model
from pz_persist import errors
from pz_persist.pretrained import errors as pretrained_errors
from pz_persist.pretrained.hf import structure_match as hf_structure_match
from pz_persist.pretrained.hf import plan as hf_plan
from pz_persist.tools import cli

CASES = {
    "llama": ("llama", {}),  # Grouped-query attention (4 heads, 2 key/value heads).
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),  # Sliding window 3 < the 8 test tokens.
    "gpt_neox": ("gpt_neox", {}),
}
SHARD = 20_000  # Bytes: several shards for these tiny models.


def _transformers_logits(folder, **kwargs) -> np.ndarray:
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
  return harness.reference_logits(model, TOKENS)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """``{case: (original folder, its logits, loaded model, exported folder)}``."""
  result = {}
  for case, (family, overrides) in CASES.items():
    hf_model = _hf_model(family, **overrides)
    src = tmp_path_factory.mktemp(case)
    hf_model.save_pretrained(src, safe_serialization=True)
    model = pzp.pretrained.load_hf(src)
    dst = str(tmp_path_factory.mktemp(f"{case}_export") / "out")
    pzp.export_hf(model, dst, like=src, shard_size=SHARD)
    result[case] = (src, harness.reference_logits(hf_model, TOKENS), model, dst)
  return result


@pytest.mark.parametrize("case", CASES)
def test_round_trip_is_tensor_for_tensor_identical(folders, case):
  src, _, _, dst = folders[case]
  harness.assert_same_tensors(harness.tensors(dst), harness.tensors(src))
  assert harness.config(dst) == harness.config(src)
  with open(os.path.join(dst, "model.safetensors.index.json")) as f:
    index = json.load(f)
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
  assert sorted(n for n in os.listdir(dst) if n.endswith(".safetensors")) == shards
  assert index["metadata"]["total_size"] == sum(t.nbytes for t in harness.tensors(dst).values())


@pytest.mark.parametrize("case", CASES)
def test_transformers_reads_the_export(folders, case):
  _, reference, _, dst = folders[case]
  np.testing.assert_array_equal(_transformers_logits(dst), reference)


def test_family_from_structure_alone(folders, tmp_path):
  """Without ``like``, the family and tying come from the model itself."""
  for case in ("mistral", "llama_tied", "gpt_neox"):
    src, reference, model, _ = folders[case]
    dst = tmp_path / case
    pzp.export_hf(model, dst)
    harness.assert_same_tensors(harness.tensors(dst), harness.tensors(src))
    assert harness.config(dst)["model_type"] == CASES[case][0]
    np.testing.assert_array_equal(_transformers_logits(dst), reference)


def test_a_model_with_a_block_cut_exports(tmp_path):
  hf_model = _hf_model("llama", num_hidden_layers=3)
  src = tmp_path / "three"
  hf_model.save_pretrained(src, safe_serialization=True)
  model = pzp.pretrained.load_hf(src)
  cut = (pz.select(model).at_instances_of(model_parts.TransformerBlock)
         .pick_nth_selected(1).remove_from_parent())
  dst = tmp_path / "cut"
  pzp.export_hf(cut, dst, like=src)
  assert harness.config(dst)["num_hidden_layers"] == 2
  got, original = harness.tensors(dst), harness.tensors(src)
  np.testing.assert_array_equal(got["model.layers.1.self_attn.q_proj.weight"],
                                original["model.layers.2.self_attn.q_proj.weight"])
  np.testing.assert_allclose(_transformers_logits(dst), harness.penzai_logits(cut, TOKENS),
                             atol=1e-4, rtol=1e-4)


def _gemma_model(tmp_path, gemma2: bool):
  if gemma2:  # A window shorter than the test tokens, so it matters.
    cfg, preset = GEMMA2, {"like": "gemma2_2b", "attention_type": (
        llamalike_common.AttentionTypeSlidingWindowCausal(3),
        llamalike_common.AttentionTypeGlobalCausal())}
  else:
    cfg, preset = GEMMA1, {"like": "gemma_2b"}
  params = official_params(cfg, gemma2=gemma2)
  path = write(tmp_path / "gemma_ckpt", params)
  return params, pzp.pretrained.load_gemma(path, preset=preset)


@pytest.mark.parametrize("gemma2", [False, True], ids=["gemma", "gemma2"])
def test_load_gemma_model_exports_as_hf_gemma(tmp_path, gemma2):
  params, model = _gemma_model(tmp_path, gemma2)
  dst = tmp_path / "hf"
  pzp.export_hf(model, dst)
  config = harness.config(dst)
  assert config["model_type"] == ("gemma2" if gemma2 else "gemma")
  if gemma2:
    assert config["sliding_window"] == 3 and config["layer_types"][:2] == [
        "sliding_attention", "full_attention"]
  tensors = harness.tensors(dst)
  # Norms are written as the checkpoint's w again, through 1 + w and back in float32.
  np.testing.assert_allclose(tensors["model.layers.0.input_layernorm.weight"],
                             params["transformer/layer_0/pre_attention_norm"]["scale"],
                             atol=1e-6)
  np.testing.assert_array_equal(tensors["model.embed_tokens.weight"],
                                params["transformer/embedder"]["input_embedding"])
  vocab = GEMMA2["vocab_size"] if gemma2 else GEMMA1["vocab_size"]
  tokens = TOKENS % vocab
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      dst, attn_implementation="eager").eval()  # Eager: soft caps.
  with torch.no_grad():
    want = hf_model(torch.tensor(tokens)).logits.float().numpy()
  got = model(pz.nx.wrap(tokens, "batch", "seq")).unwrap("batch", "seq", "vocabulary")
  assert np.abs(want).max() > 0.5
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


def test_unmerged_lora_is_refused_and_merge_lora_fixes_it(folders, tmp_path):
  _, _, model, _ = folders["llama"]
  adapted = lora.loraify_linears_in_selection(
      pz.select(model).at_instances_of(pz.nn.Attention), rank=2,
      init_base_rng=jax.random.key(0))
  # LoRA's B starts at zero; give it values, so merging has something to add.
  adapted = (pz.select(adapted).at_instances_of(pz.Parameter)
             .where(lambda p: p.label.endswith("LoRA_B.weights"))
             .apply(lambda p: pz.Parameter(value=p.value + 0.1, label=p.label)))
  with pytest.raises(pretrained_errors.ExportError, match=r"LoRA.*merge_lora"):
    pzp.export_hf(adapted, tmp_path / "lora")
  assert not os.path.exists(tmp_path / "lora")
  merged = pzp.pretrained.merge_lora(adapted)
  np.testing.assert_allclose(harness.penzai_logits(merged, TOKENS),
                             harness.penzai_logits(adapted, TOKENS), atol=1e-4)
  pzp.export_hf(merged, tmp_path / "merged")
  np.testing.assert_allclose(_transformers_logits(tmp_path / "merged"),
                             harness.penzai_logits(adapted, TOKENS), atol=1e-4, rtol=1e-4)


def test_structure_the_family_cannot_express_is_refused(folders, tmp_path):
  """A change the config cannot carry (one block's norm epsilon) is named."""
  _, _, model, _ = folders["llama"]
  edited = (pz.select(model).at_instances_of(model_parts.TransformerBlock).pick_nth_selected(1)
            .at_instances_of(pz.nn.RMSStandardize).pick_nth_selected(0)
            .apply(lambda s: pz.nn.RMSStandardize(across=s.across, epsilon=1e-3)))
  with pytest.raises(pretrained_errors.ExportError, match=r"sublayers\[2\].*epsilon.*llama"):
    pzp.export_hf(edited, tmp_path / "edited")
  assert os.listdir(tmp_path) == []
  with pytest.raises(pretrained_errors.ExportError, match="SlidingWindow.*ApplyCausalAttentionMask"):  # Mistral as llama.
    pzp.export_hf(folders["mistral"][2], tmp_path / "as_llama", like="llama")


def test_existing_folder_is_refused_without_overwrite(folders, tmp_path):
  _, reference, model, _ = folders["gpt_neox"]
  dst = tmp_path / "dst"
  dst.mkdir()
  (dst / "keep.txt").write_text("mine")
  with pytest.raises(errors.CheckpointExistsError, match="overwrite"):
    pzp.export_hf(model, dst)
  assert os.listdir(dst) == ["keep.txt"]
  with pytest.raises(errors.CheckpointExistsError, match="not a folder export_hf wrote"):
    pzp.export_hf(model, dst, overwrite=True)  # Not its own: never replaced.
  assert os.listdir(dst) == ["keep.txt"]
  os.remove(dst / "keep.txt")
  pzp.export_hf(model, dst)
  pzp.export_hf(model, dst, overwrite=True)  # An earlier export: replaced.
  np.testing.assert_array_equal(_transformers_logits(dst), reference)
  assert sorted(os.listdir(tmp_path)) == ["dst"]  # No temporary folder left.


def test_failed_export_leaves_nothing(folders, tmp_path, monkeypatch):
  _, _, model, _ = folders["llama"]
  calls = []

  def failing(path, tensors, **kwargs):
    calls.append(path)
    if len(calls) == 2:
      raise OSError("disk full")
    return original(path, tensors, **kwargs)

  from pz_persist.pretrained import safetensors_io
  original = safetensors_io.write_safetensors
  monkeypatch.setattr(safetensors_io, "write_safetensors", failing)
  with pytest.raises(OSError, match="disk full"):
    pzp.export_hf(model, tmp_path / "dst", shard_size=SHARD)
  assert os.listdir(tmp_path) == []


def test_cli_export_from_a_native_checkpoint(folders, tmp_path, capsys):
  src, reference, model, _ = folders["mistral"]
  ckpt = tmp_path / "native"
  pzp.save_model(ckpt, model)
  dst = tmp_path / "hf"
  assert cli.main(["export", "hf", str(ckpt), str(dst), "--like", str(src), "--quiet"]) == 0
  assert "from_pretrained" in capsys.readouterr().out
  harness.assert_same_tensors(harness.tensors(dst), harness.tensors(src))
  np.testing.assert_array_equal(_transformers_logits(dst), reference)
  assert cli.main(["export", "hf", str(ckpt), str(dst), "--quiet"]) == 2
  assert "overwrite" in capsys.readouterr().err


def test_layouts_are_inverse():
  """`stored_layout` undoes `penzai_layout`: fused slices and offsets."""
  stored = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2 * 3 * 4, 5)
  specs = [hf_plan.TensorSpec(f"l{i}", "qkv", (2, 3, 4, 5), ("h", "p", "e"), take=(1, i),
                              stored=(24, 5)) for i in range(3)]
  parts = [hf_plan.penzai_layout(spec, stored) for spec in specs]
  assert parts[1].shape == (2, 4, 5)
  np.testing.assert_array_equal(hf_plan.stored_layout(specs[::-1], parts[::-1]), stored)
  norm = hf_plan.TensorSpec("n", "w", (5,), ("e",), offset=1.0)
  w = np.linspace(-1, 1, 5, dtype=np.float32)
  np.testing.assert_array_equal(hf_plan.penzai_layout(norm, w), w + 1)
  np.testing.assert_allclose(hf_plan.stored_layout([norm], [w + 1]), w, atol=1e-7)
  with pytest.raises(ValueError, match="different values"):
    whole = hf_plan.TensorSpec("a", "w", (5,), ("e",))
    hf_plan.stored_layout([whole, dataclasses.replace(whole, label="b")], [w, w + 1])


def test_bfloat16_round_trip_is_identical(tmp_path):
  src = tmp_path / "bf16"
  _hf_model("llama").to(torch.bfloat16).save_pretrained(src, safe_serialization=True)
  model = pzp.pretrained.load_hf(src)
  pzp.export_hf(model, tmp_path / "out", like=src)
  assert harness.config(tmp_path / "out")["dtype"] == "bfloat16"
  harness.assert_same_tensors(harness.tensors(tmp_path / "out"), harness.tensors(src))


@pytest.mark.parametrize("gemma2", [False, True], ids=["gemma", "gemma2"])
def test_exported_gemma_reads_back_through_the_same_plan(tmp_path, monkeypatch, gemma2):
  """load_hf with the plan export ran backwards gives the model back (the
  norms through ``w + 1`` in float32: within one rounding)."""
  from pz_persist.pretrained.hf import families as hf_families

  _, model = _gemma_model(tmp_path, gemma2)
  pzp.export_hf(model, tmp_path / "hf")
  family = "gemma2" if gemma2 else "gemma"
  native = hf_families.MODEL_TYPES[family]
  monkeypatch.setitem(hf_families.MODEL_TYPES, family,
                      dataclasses.replace(native, plan=native.export_plans[0]))
  back = pzp.pretrained.load_hf(tmp_path / "hf")
  slots = {}
  assert hf_structure_match.first_difference(pz.unbind_params(back)[0], pz.freeze_params(model),
                                             "model", slots) is None  # Same structure.
  assert all(ours == theirs for ours, theirs in slots.items())
  want = {p.label: p.value for p in pz.unbind_params(model)[1]}
  for param in pz.unbind_params(back)[1]:
    assert param.value.named_shape == want[param.label].named_shape
    np.testing.assert_allclose(np.asarray(param.value.unwrap(*param.value.named_shape)),
                               np.asarray(want[param.label].unwrap(*param.value.named_shape)),
                               rtol=0, atol=2e-7 if "norm" in param.label else 0)
