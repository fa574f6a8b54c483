"""Falcon-H1 (attention and a Mamba-2 mixer side by side in every layer, with
µP constants) through `load_hf` and `export_hf`, against transformers on
tiny random models (no downloads); the `FalconH1Mamba2` layer's own
options."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist import errors
from pz_persist.nn import mamba2
from pz_persist.nn.constant_scale import ConstantScale
from pz_persist.nn.mamba2 import FalconH1Mamba2

_MULTIPLIERS = {
    "embedding_multiplier": 1.7, "lm_head_multiplier": 0.6, "key_multiplier": 0.8,
    "attention_in_multiplier": 1.3, "attention_out_multiplier": 0.7, "ssm_in_multiplier": 1.2,
    "ssm_out_multiplier": 0.9, "mlp_multipliers": [1.4, 0.6],
    "ssm_multipliers": [0.5, 1.5, 0.8, 1.2, 1.1]}


def _case(**fields) -> harness.Case:
  return harness.Case(transformers.FalconH1Config, transformers.FalconH1ForCausalLM, fields)


CASES = {
    # Every constant away from 1, the norm before the gate over two groups,
    # a mixer width of its own (mamba_d_ssm) and an attention head_dim of its
    # own, grouped-query attention, chunks shorter than the sequences.
    "parallel": _case(**_MULTIPLIERS, mamba_n_heads=4, mamba_d_head=12, mamba_d_ssm=48,
                      mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=4,
                      num_key_value_heads=2, head_dim=16, mamba_rms_norm=True,
                      mamba_norm_before_gate=True),
    # The published checkpoints' mixer: no norm (the gate alone); the width
    # from mamba_expand (mamba_d_ssm null), head size 'auto', no
    # convolution bias, tied embeddings, one chunk.
    "no_norm": _case(**_MULTIPLIERS, mamba_n_heads=4, mamba_d_ssm=None, mamba_n_groups=1,
                     mamba_d_state=8, mamba_d_conv=3, mamba_chunk_size=256, mamba_conv_bias=False,
                     num_key_value_heads=4, tie_word_embeddings=True, mamba_rms_norm=False),
    # The norm after the gate (Bamba's order), every constant 1, a clipped
    # time step (which transformers' one-token decoding step does not clip:
    # its generate disagrees with its own forward pass, so this case is
    # checked against the forward pass only).
    "gate_then_norm": _case(mamba_n_heads=2, mamba_d_ssm=32, mamba_d_state=8,
                            num_key_value_heads=2, mamba_rms_norm=True,
                            mamba_norm_before_gate=False, time_step_limit=(0.0, 0.5)),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return harness.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", ["parallel", "no_norm",
                                  pytest.param("gate_then_norm", marks=pytest.mark.slow)])
def test_float32_logits_match_transformers(saved, case):
  harness.check_float32(saved[case], case)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["parallel", "no_norm"])
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved, case):
  harness.check_bfloat16(saved[case], case)


@pytest.mark.parametrize("case", ["parallel", "gate_then_norm",
                                  pytest.param("no_norm", marks=pytest.mark.slow)])
def test_kv_cache_sampling_matches_a_forward_pass(saved, case):
  harness.check_kv_cache(pzp.pretrained.load_hf(saved[case].folder))


@pytest.mark.parametrize("case", ["parallel", "no_norm"])
def test_greedy_generation_matches_transformers_generate(saved, case):
  """KV cache and the mixers' convolution and recurrent state, against
  ``generate``'s own cache, token for token."""
  harness.check_generate(saved[case], steps=10, prompt=4)


_SAME = (*_MULTIPLIERS, "mamba_rms_norm", "mamba_norm_before_gate", "mamba_d_ssm", "head_dim",
         "tie_word_embeddings", "mamba_n_groups", "mamba_conv_bias", "mamba_d_conv",
         "num_key_value_heads")
"""What an export without ``like`` must read back from the model alone."""


@pytest.mark.parametrize("case", ["no_norm", pytest.param("gate_then_norm", marks=pytest.mark.slow)])
def test_export_gives_back_the_folder(saved, tmp_path, case):
  """With ``like`` and from the model alone (its mixers say Falcon-H1):
  every constant, the norm's place and the mixer's width are read back from
  the model. (These cases use transformers' chunk size, which an export
  without ``like`` writes: the chunks change only transformers' rounding.)"""
  # (no_norm's null mamba_d_ssm is written alone as the width it means.)
  harness.check_export(saved[case], tmp_path, "falcon_h1", same_fields=(
      *(f for f in _SAME if f != "mamba_d_ssm" or case != "no_norm"),
      *(("time_step_limit",) if "time_step_limit" in CASES[case].fields else ())))


def test_export_of_every_constant(saved, tmp_path):
  """The case with every constant away from 1 and the norm before the gate:
  bit-exact with ``like``; alone, the same tensors and every field."""
  parallel = saved["parallel"]
  harness.check_export(parallel, tmp_path, None)
  alone = tmp_path / "alone"
  pzp.export_hf(pzp.pretrained.load_hf(parallel.folder), alone)
  harness.assert_same_tensors(harness.tensors(alone), harness.tensors(parallel.folder))
  written, original = harness.config(alone), harness.config(parallel.folder)
  assert written["model_type"] == "falcon_h1"
  assert {k: written.get(k) for k in _SAME} == {k: original.get(k) for k in _SAME}


@pytest.mark.slow
def test_save_model_round_trip_and_cli_export(saved, tmp_path):
  harness.check_save_model(saved["parallel"], tmp_path)
  harness.check_cli_export_from_native(saved["no_norm"], tmp_path / "cli")


def test_each_feature_binds(saved):
  """Each constant, set to 1 in transformers' config (the same weights),
  and each norm option, switched in transformers' modules, moves the logits
  far past the tolerance: a loader ignoring any of them would fail
  `test_float32_logits_match_transformers`. The same constants set to 1 in
  the loaded model move its logits as far."""
  parallel = saved["parallel"]
  case = CASES["parallel"]
  for field in ("embedding_multiplier", "lm_head_multiplier", "key_multiplier",
                "attention_in_multiplier", "attention_out_multiplier", "ssm_in_multiplier",
                "ssm_out_multiplier"):
    harness.check_feature_binds(parallel, case, **{field: 1.0})
  for i in range(2):
    harness.check_feature_binds(parallel, case, mlp_multipliers=[
        1.0 if j == i else m for j, m in enumerate(_MULTIPLIERS["mlp_multipliers"])])
  for i in range(5):  # mup_vector: z, x, B, C, dt.
    harness.check_feature_binds(parallel, case, ssm_multipliers=[
        1.0 if j == i else m for j, m in enumerate(_MULTIPLIERS["ssm_multipliers"])])

  def mixers(hf):
    return [layer.mamba for layer in hf.model.layers]

  harness.check_modules_bind(parallel, case, "the gated norm (mamba_rms_norm)",
                             lambda hf: [setattr(m, "mamba_rms_norm", False) for m in mixers(hf)])
  harness.check_modules_bind(parallel, case, "the norm before the gate",
                             lambda hf: [setattr(m.norm, "norm_before_gate", False)
                                         for m in mixers(hf)])

  model = pzp.pretrained.load_hf(parallel.folder)
  scales = pz.select(model).at_instances_of(ConstantScale)
  for i, scale in enumerate(scales.get_sequence()):  # One at a time, in the first block.
    if i >= 10:
      break
    edited = scales.pick_nth_selected(i).apply(lambda s: dataclasses.replace(s, by=1.0))
    changed = float(np.abs(harness.penzai_logits(edited) - parallel.reference).max())
    print(f"{scale.by} set to 1 in the loaded model: logits change by {changed:.3g}")
    assert changed > 100 * harness.TOLERANCE["atol"], (i, scale)
  plain = pz.select(model).at_instances_of(FalconH1Mamba2).apply(
      lambda m: dataclasses.replace(m, stream_multipliers=(1.0,) * 5))
  assert float(np.abs(harness.penzai_logits(plain) - parallel.reference).max()) > 1e-2


@pytest.mark.parametrize("changes, match", [
    ({"mamba_n_heads": 5}, "mamba_n_heads"),
    ({"mamba_d_head": 8}, "mamba_d_head"),
    ({"mamba_d_ssm": 50}, "mamba_n_heads"),
    ({"mamba_d_ssm": 0}, "mamba_d_ssm"),
    ({"mamba_d_ssm": True}, "mamba_d_ssm"),
    ({"embedding_multiplier": None}, "embedding_multiplier"),
    ({"mamba_n_groups": 3}, "mamba_n_groups"),
    ({"mamba_proj_bias": True}, "mamba_proj_bias"),
    ({"projectors_bias": True}, "projectors_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"mamba_rms_norm": "yes"}, "mamba_rms_norm"),
    ({"mamba_norm_before_gate": 1}, "mamba_norm_before_gate"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"embedding_multiplier": -1.0}, "embedding_multiplier"),
    ({"key_multiplier": "2"}, "key_multiplier"),
    ({"ssm_out_multiplier": float("nan")}, "ssm_out_multiplier"),
    ({"mlp_multipliers": [1.0]}, "mlp_multipliers"),
    ({"ssm_multipliers": [1.0, 1.0, 1.0, 1.0]}, "ssm_multipliers"),
    ({"ssm_multipliers": [1.0, 1.0, 1.0, 1.0, 0.0]}, "ssm_multipliers"),
    ({"time_step_limit": [1.0, 0.5]}, "time_step_limit"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"num_experts": 4}, "num_experts"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  folder = harness.edited(saved["parallel"].folder, tmp_path, **changes)
  harness.check_refused_before_building(folder, match, monkeypatch)


def test_a_mixer_width_the_weights_do_not_have_is_refused(saved, tmp_path):
  """``mamba_d_ssm`` (with its head size) that does not fit ``in_proj``'s
  stored rows is refused from the safetensors header, before a tensor is
  read; so is a norm the checkpoint does not hold."""
  folder = harness.edited(saved["parallel"].folder, tmp_path, mamba_d_ssm=32, mamba_d_head=8)
  with pytest.raises(errors.PzPersistError, match="in_proj"):
    pzp.pretrained.load_hf(folder)
  (tmp_path / "edited").rename(tmp_path / "first")
  folder = harness.edited(saved["no_norm"].folder, tmp_path, mamba_rms_norm=True)
  with pytest.raises(errors.PzPersistError, match="norm.weight"):
    pzp.pretrained.load_hf(folder)


def test_export_refuses_blocks_whose_constants_differ(saved, tmp_path):
  """``config.json`` holds one of each constant: a model edited to differ
  per block has no Falcon-H1 config."""
  model = pzp.pretrained.load_hf(saved["parallel"].folder)
  edited = pz.select(model).at_instances_of(FalconH1Mamba2).pick_nth_selected(1).apply(
      lambda m: dataclasses.replace(m, stream_multipliers=(1.0,) * 5))
  with pytest.raises(errors.PzPersistError, match="differ from one block"):
    pzp.export_hf(edited, tmp_path / "out")


def test_export_refuses_a_model_without_one_of_its_constants(saved, tmp_path):
  """A constant taken out (the mixer's output scale replaced by the
  identity): no config.json says what is left, so export names the place."""
  model = pzp.pretrained.load_hf(saved["parallel"].folder)
  branch = pz.select(model).at_instances_of(pz.nn.BranchAndAddTogether).pick_nth_selected(0)
  edited = branch.apply(lambda b: dataclasses.replace(b, branches=[
      pz.nn.Sequential(b.branches[0].sublayers[:-1] + [pz.nn.Identity()]), *b.branches[1:]]))
  with pytest.raises(errors.PzPersistError, match="after the mixer"):
    pzp.export_hf(edited, tmp_path / "out")


def test_layer_refuses_unknown_options():
  sizes = {"embedding": 8, "heads": 2, "head_dim": 4, "groups": 1, "state": 4, "conv_taps": 2,
           "norm_epsilon": 1e-5}
  with pytest.raises(errors.ArgumentError, match="norm_order"):
    FalconH1Mamba2.from_falcon_config("m", stream_multipliers=(1.0,) * 5, norm_order="after",
                                      **sizes)
  with pytest.raises(errors.ArgumentError, match="stream_multipliers"):
    FalconH1Mamba2.from_falcon_config("m", stream_multipliers=(1.0,) * 4,
                                      norm_order=mamba2.NO_NORM, **sizes)
  layer = FalconH1Mamba2.from_falcon_config("m", stream_multipliers=(2.0,) * 5,
                                            norm_order=mamba2.NO_NORM, **sizes)
  assert layer.norm_scale is None and layer.stream_multipliers == (2.0,) * 5


_FALCON_H1_05B = {  # tiiuae/Falcon-H1-0.5B-Instruct's fields, sizes shrunk.
    "architectures": ["FalconH1ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attention_in_multiplier": 1.0, "attention_out_multiplier": 0.9375,
    "attn_layer_indices": None, "bos_token_id": 1, "embedding_multiplier": 5.656854249492381,
    "eos_token_id": 11, "head_dim": 8, "hidden_act": "silu", "hidden_size": 32,
    "initializer_range": 0.02, "intermediate_size": 64, "key_multiplier": 0.39062499999999994,
    "lm_head_multiplier": 0.0390625, "mamba_chunk_size": 128, "mamba_conv_bias": True,
    "mamba_d_conv": 4, "mamba_d_head": 12, "mamba_d_ssm": 48, "mamba_d_state": 8,
    "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 4, "mamba_norm_before_gate": False,
    "mamba_proj_bias": False, "mamba_rms_norm": False, "mamba_use_mlp": True,
    "max_position_embeddings": 16384, "mlp_bias": False, "mlp_expansion_factor": 8,
    "mlp_multipliers": [0.8838834764831844, 0.5859375], "model_type": "falcon_h1",
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "pad_token_id": 0, "projectors_bias": False, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 100000000000.0, "ssm_in_multiplier": 1.25,
    "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
    "ssm_out_multiplier": 0.23570226039551587, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.52.0.dev0", "use_cache": True,
    "vocab_size": 64}


def test_hub_config(tmp_path):
  """The Hub's config.json as written by the original code (its own fields
  ``attn_layer_indices``, ``mamba_use_mlp``, ``mlp_expansion_factor``, which
  transformers does not read), ``rope_theta`` 1e11. (Its ``lm_head_multiplier``
  of 0.039 would leave this tiny model's logits too small to compare: 1 here.)"""
  harness.check_float32(harness.hub_saved(tmp_path, {**_FALCON_H1_05B, "lm_head_multiplier": 1.0}),
                        "Falcon-H1-0.5B")


@pytest.mark.parametrize("changes", [{"attn_layer_indices": [0]}, {"mamba_use_mlp": False}])
def test_hub_settings_transformers_would_ignore_are_refused(tmp_path, changes):
  """The original code's settings that would change the model (attention on
  some layers only, no MLP after the mixer): transformers ignores them and
  builds every layer whole; pz_persist refuses rather than guess which."""
  folder = harness.edited(harness.hub_saved(tmp_path, _FALCON_H1_05B).folder, tmp_path, **changes)
  with pytest.raises(errors.UnsupportedConfigError, match=next(iter(changes))):
    pzp.pretrained.load_hf(folder)


def test_surgery_lora_an_inserted_layer_and_sampling_around_the_mixer(saved, tmp_path):
  """Issue 40 §3: `FalconH1Mamba2` is a Penzai layer others can edit. LoRA on
  its input and output projections (zero-initialised: nothing changes), a
  layer inserted after it (the logits move), the edited model sampled with
  `kv_caching_lm` (the mixer becomes a `CachingMamba2`), and ``save_model``
  bringing the edit back exactly."""
  import jax
  from penzai.toolshed import lora

  from pz_persist.pretrained import kv_caching_lm

  model = pzp.pretrained.load_hf(saved["parallel"].folder)
  reference = harness.penzai_logits(model)
  adapted = lora.loraify_linears_in_selection(
      pz.select(model).at_instances_of(FalconH1Mamba2).at(
          lambda m: (m.input, m.output), multiple=True),
      rank=2, init_base_rng=jax.random.key(3))
  mixers = pz.select(adapted).at_instances_of(FalconH1Mamba2).count()
  assert pz.select(adapted).at_instances_of(lora.LowRankAdapter).count() == 2 * mixers
  np.testing.assert_allclose(harness.penzai_logits(adapted), reference, atol=1e-5)
  inserted = pz.select(adapted).at_instances_of(FalconH1Mamba2).apply(
      lambda m: pz.nn.Sequential([m, pz.nn.ConstantRescale(by=0.5)]))
  assert float(np.abs(harness.penzai_logits(inserted) - reference).max()) > 1e-2
  sampler = kv_caching_lm(inserted, cache_len=8, batch_axes={"batch": 1})
  assert pz.select(sampler).at_instances_of(mamba2.CachingMamba2).count() == mixers
  harness.check_save_model_round_trip(inserted, tmp_path / "edited",
                                      harness.penzai_logits(inserted))
