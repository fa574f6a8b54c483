"""Hunyuan MoE (``model_type`` ``hunyuan_v1_moe``) against transformers, with
the checks of `hf_family_harness`: float32 logits, bfloat16, KV-cache
decoding and greedy generation against ``generate``, export back, the shared
MLP and the routing (per-layer ``moe_topk``, renormalised, in float32) shown
to bind, the Hub's per-layer fields, hostile configs."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.nn import mixture_of_experts as moe
from pz_persist.pretrained.hf import families

_ALPHA = {"rope_type": "dynamic", "rope_theta": 10_000.0, "alpha": 1000.0, "factor": 1.0}


def _case(**fields):
  return checks.Case(transformers.HunYuanMoEV1Config, transformers.HunYuanMoEV1ForCausalLM,
                     dict({"num_key_value_heads": 2, "head_dim": 8, "num_experts": 4,
                           "intermediate_size": 16}, **fields))


CASES = {
    # Top 2, 3 and 1 of 4 experts in layers 0, 1 and 2 (a per-layer moe_topk).
    "hunyuan_v1_moe": _case(num_hidden_layers=3, moe_topk=[2, 3, 1]),
    # Hunyuan-A13B's shape: RoPE dynamic with alpha, a tied head, one top-k
    # for every layer, and the Hub's per-layer fields saying what transformers
    # builds; attention biases; tanh-GELU experts and shared MLP.
    "hunyuan_v1_moe_hub": _case(moe_topk=2, rope_parameters=_ALPHA, tie_word_embeddings=True,
                                attention_bias=True, hidden_act="gelu_pytorch_tanh",
                                moe_intermediate_size=[16, 16], num_shared_expert=[1, 1]),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


@pytest.mark.parametrize("case", CASES)
def test_kv_cache_and_greedy_generation_match_transformers(saved, case):
  checks.check_cached_decoding(saved[case])


def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["hunyuan_v1_moe"], "hunyuan_v1_moe")


def test_export_hf_round_trip(saved, tmp_path):
  checks.check_export(saved["hunyuan_v1_moe"], tmp_path, "hunyuan_v1_moe",
                      same_fields=("num_experts", "moe_topk", "intermediate_size", "head_dim"))


def test_export_of_the_hub_shape_keeps_its_fields(saved, tmp_path):
  """The Hub's ``moe_intermediate_size`` / ``num_shared_expert`` come back as
  ``like`` spells them, ``alpha`` as the plain base it gives: the tensors bit
  for bit, and transformers reads the same model (within float32 rounding)."""
  source = saved["hunyuan_v1_moe_hub"]
  model = pzp.pretrained.load_hf(source.folder)
  pzp.export_hf(model, tmp_path / "out", like=source.folder)
  checks.assert_same_tensors(checks.tensors(tmp_path / "out"), checks.tensors(source.folder))
  written = checks.config(tmp_path / "out")
  assert (written["moe_intermediate_size"], written["num_shared_expert"]) == ([16, 16], [1, 1])
  assert (written["moe_topk"], written["tie_word_embeddings"], written["attention_bias"]) == (
      2, True, True)
  assert written["rope_parameters"] == {"rope_type": "default",
                                        "rope_theta": pytest.approx(1e4 * 1000.0 ** (8 / 6))}
  np.testing.assert_allclose(checks.reference_logits(
      transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()),
      source.reference, **checks.TOLERANCE)
  assert families.detect(model) == "hunyuan_v1_moe"


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["hunyuan_v1_moe_hub"], tmp_path)


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  checks.check_cli_export_from_native(saved["hunyuan_v1_moe"], tmp_path)


def test_the_per_layer_top_k_binds(saved):
  """transformers with one top-k for every layer computes other logits: the
  per-layer list is read layer by layer."""
  checks.check_feature_binds(saved["hunyuan_v1_moe"], CASES["hunyuan_v1_moe"], moe_topk=2)
  model = pzp.pretrained.load_hf(saved["hunyuan_v1_moe"].folder)
  routers = pz.select(model).at_instances_of(moe.TopKRouter).get_sequence()
  assert [router.top_k for router in routers] == [2, 3, 1]


def _no_shared_mlp(model):
  for layer in model.model.layers:
    layer.mlp.shared_mlp = _Zero()


class _Zero(torch.nn.Module):
  def forward(self, x):
    return torch.zeros_like(x)


def test_the_shared_mlp_binds(saved):
  """Without the shared MLP transformers' logits move beyond the tolerance
  (a loader leaving it out fails the float32 check), and ours too."""
  checks.check_modules_bind(saved["hunyuan_v1_moe"], CASES["hunyuan_v1_moe"], "the shared MLP",
                            _no_shared_mlp)
  _check_ours_moved(saved["hunyuan_v1_moe"], "the shared MLP", shared=None)


def _check_ours_moved(source, what, router=None, **changes):
  model = pzp.pretrained.load_hf(source.folder)
  edited = pz.select(model).at_instances_of(moe.MixtureOfExperts).apply(
      lambda layer: dataclasses.replace(
          layer, router=router(layer.router) if router else layer.router, **changes))
  changed = float(np.abs(checks.penzai_logits(edited) - source.reference).max())
  print(f"ours without {what}: logits change by {changed:.3g}")
  assert changed > 100 * checks.TOLERANCE["atol"]


def test_the_routing_binds(saved):
  """Not renormalising the chosen weights, or choosing one expert fewer,
  moves our logits beyond the tolerance."""
  _check_ours_moved(saved["hunyuan_v1_moe"], "renormalising",
                    router=lambda r: dataclasses.replace(r, normalize=False))
  _check_ours_moved(saved["hunyuan_v1_moe"], "the top k",
                    router=lambda r: dataclasses.replace(r, top_k=max(r.top_k - 1, 1)))


_HUB = {  # tencent/Hunyuan-A13B-Instruct's config.json fields transformers reads, sizes shrunk.
    "architectures": ["HunYuanMoEV1ForCausalLM"], "model_type": "hunyuan_v1_moe",
    "attention_bias": False, "attention_dropout": 0.1, "bos_token_id": 1, "eod_token_id": 127967,
    "eos_token_id": 127960, "head_dim": 8, "hidden_act": "silu", "initializer_range": 0.02,
    "intermediate_size": 16, "max_position_embeddings": 32768, "moe_intermediate_size": [16, 16],
    "moe_topk": [3, 3], "num_experts": 4, "num_shared_expert": [1, 1], "rms_norm_eps": 1e-05,
    "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0, "type": "dynamic"},
    "rope_theta": 10000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 64, "pad_token_id": 0}


def test_hub_config(tmp_path):
  """Read as transformers reads it: the per-layer lists, ``alpha`` RoPE (its
  other keys unread there too); transformers' alias ``num_experts_per_tok``
  for ``moe_topk`` read alike."""
  saved = checks.hub_saved(tmp_path, _HUB)
  checks.check_float32(saved, "Hunyuan-A13B's config")
  aliased = checks.edited(saved.folder, tmp_path, moe_topk=checks.DELETE, num_experts_per_tok=3)
  checks.float32_error(aliased, saved.reference)


@pytest.mark.parametrize("changes, match", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"num_experts": 10**9}, "num_experts.*holds experts 0..3"),
    ({"num_experts": [4, 4, 4]}, "num_experts must be a positive integer"),
    ({"num_local_experts": 5}, "num_experts, num_local_experts"),
    ({"moe_topk": 5}, "moe_topk.*more experts per token"),
    ({"moe_topk": [2, 3]}, "moe_topk.*each of the 3 layers"),
    ({"moe_topk": [2, 0, 1]}, "moe_topk must be"),
    ({"moe_topk": "2"}, "moe_topk must be"),
    ({"num_experts_per_tok": 2}, "moe_topk, num_experts_per_tok"),
    ({"moe_intermediate_size": 8}, "moe_intermediate_size"),
    ({"moe_intermediate_size": [16, 16, 8]}, "moe_intermediate_size"),
    ({"num_shared_expert": [1, 2, 1]}, "num_shared_expert"),
    ({"num_shared_expert": 0}, "num_shared_expert must be"),
    ({"rope_parameters": {**_ALPHA, "rope_type": "linear"}}, "alpha is read with rope type"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"use_cla": True}, "use_cla"),
])
def test_hostile_configs_are_refused_before_building(saved, tmp_path, monkeypatch, changes,
                                                     match):
  checks.check_refused_before_building(
      checks.edited(saved["hunyuan_v1_moe"].folder, tmp_path, **changes), match, monkeypatch)


@pytest.mark.parametrize("what, changes", [
    ("no shared MLP", {"shared": None}),
    ("a gated shared MLP", {"shared_gate": "gate"}),
])
def test_export_refuses_what_hunyuan_moe_cannot_say(saved, tmp_path, what, changes):
  """A mixture transformers' Hunyuan MoE does not compute is refused by
  export with ``like`` (and not recognised as Hunyuan MoE without it)."""
  model = pzp.pretrained.load_hf(saved["hunyuan_v1_moe"].folder)

  def edit(layer):
    fields = dict(changes)
    if fields.get("shared_gate") == "gate":
      fields["shared_gate"] = pz.nn.Linear.from_config(
          name="gate", init_base_rng=jax.random.key(0), input_axes={"embedding": 32},
          output_axes={})
    return dataclasses.replace(layer, **fields)

  edited = pz.select(model).at_instances_of(moe.MixtureOfExperts).apply(edit)
  assert families.detect(edited) != "hunyuan_v1_moe", what
  with pytest.raises(pzp.errors.PzPersistError, match="block 0's MixtureOfExperts is not"):
    pzp.export_hf(edited, tmp_path / "out", like=saved["hunyuan_v1_moe"].folder)
