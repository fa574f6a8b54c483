"""Nemotron-H's mixture-of-experts layers (``E`` / ``moe``: Nemotron 3 Nano's)
through `load_hf` and `export_hf`, against transformers on tiny random
models (no downloads)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist import errors
from pz_persist.nn import mixture_of_experts as moe

_MAMBA = {"mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 8,
          "conv_kernel": 4, "chunk_size": 4, "num_key_value_heads": 2, "head_dim": 8}
_EXPERTS = {"n_routed_experts": 8, "moe_intermediate_size": 16,
            "moe_shared_expert_intermediate_size": 24, "num_experts_per_tok": 3,
            "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5}

CASES = {
    # Two MoE layers among every other kind; experts in two groups, one kept
    # per token (group-limited choice), three chosen, renormalised and scaled
    # by 2.5; correction biases drawn (saved_biased_cases).
    "moe": harness.Case(transformers.NemotronHConfig, transformers.NemotronHForCausalLM, {
        **_MAMBA, **_EXPERTS, "hybrid_override_pattern": "M*E-E"}),
    # The experts in an 8-wide latent space (fc1 / fc2_latent_proj), one
    # group, no renormalisation; transformers 5's spelling (8: transformers' bfloat16
    # grouped matmul needs rows of a multiple of 16 bytes); transformers' default
    # chunk_size, which a model exported alone is written with.
    "latent": harness.Case(transformers.NemotronHConfig, transformers.NemotronHForCausalLM, {
        **_MAMBA, **_EXPERTS, "layers_block_type": ["linear_attention", "moe", "full_attention"],
        "moe_latent_size": 8, "n_group": 1, "norm_topk_prob": False, "chunk_size": 128}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return harness.saved_biased_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", ["moe", "latent"])
def test_float32_logits_match_transformers(saved, case):
  harness.check_float32(saved[case], case)


def test_the_experts_are_read_as_one_stack_per_layer(saved):
  """Each layer's per-expert tensors (the Hub's layout) become one Penzai
  parameter with an ``experts`` axis, the latent ones over ``latent``."""
  model = pzp.pretrained.load_hf(saved["latent"].folder)
  shapes = {p.label: p.value.named_shape for p in pz.unbind_params(model)[1]}
  assert shapes["transformer/block_1/mlp/experts/up.weights"] == {
      "experts": 8, "neurons": 16, "latent": 8}
  assert shapes["transformer/block_1/mlp/experts/down.weights"] == {
      "experts": 8, "latent": 8, "neurons": 16}
  assert shapes["transformer/block_1/mlp/latent_in.weights"] == {"latent": 8, "embedding": 32}
  assert pz.select(model).at_instances_of(moe.LatentMixtureOfExperts).count() == 1
  plain = pzp.pretrained.load_hf(saved["moe"].folder)
  mixtures = pz.select(plain).at_instances_of(moe.MixtureOfExperts).get_sequence()
  assert len(mixtures) == 2 and not any(isinstance(m, moe.LatentMixtureOfExperts)
                                        for m in mixtures)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["moe", "latent"])
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved, case):
  harness.check_bfloat16(saved[case], case)


def test_kv_cache_sampling_matches_a_forward_pass(saved):
  harness.check_kv_cache(pzp.pretrained.load_hf(saved["moe"].folder))


@pytest.mark.parametrize("case", ["moe", "latent"])
def test_greedy_generation_matches_transformers_generate(saved, case):
  """Token for token (and logit for logit) what ``generate`` picks."""
  harness.check_generate(saved[case], steps=10, prompt=4)


_ROUTING_FIELDS = ("layers_block_type", "n_routed_experts", "moe_intermediate_size",
                   "moe_shared_expert_intermediate_size", "moe_latent_size",
                   "num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob",
                   "routed_scaling_factor", "n_shared_experts")


def test_export_gives_back_the_folder(saved, tmp_path):
  """With ``like`` (bit-exact tensors, transformers' config, its logits) and
  from the model alone: the per-expert tensors written back one by one."""
  harness.check_export(saved["latent"], tmp_path, "nemotron_h", same_fields=_ROUTING_FIELDS)


def test_export_of_group_limited_routing(saved, tmp_path):
  """With ``like``, and alone: the routing fields (two groups, one kept,
  renormalised, scaled) come from the model (``chunk_size``, which no
  model records, is then transformers' default)."""
  harness.check_export(saved["moe"], tmp_path, None)
  model = pzp.pretrained.load_hf(saved["moe"].folder)
  pzp.export_hf(model, tmp_path / "alone")
  harness.assert_same_tensors(harness.tensors(tmp_path / "alone"),
                              harness.tensors(saved["moe"].folder))
  written, original = harness.config(tmp_path / "alone"), harness.config(saved["moe"].folder)
  assert {k: written.get(k) for k in _ROUTING_FIELDS} == {
      k: original.get(k) for k in _ROUTING_FIELDS}
  assert written["model_type"] == "nemotron_h"


@pytest.mark.slow
def test_save_model_round_trip_and_cli_export(saved, tmp_path):
  harness.check_save_model(saved["latent"], tmp_path)
  harness.check_save_model(saved["moe"], tmp_path / "moe")
  harness.check_cli_export_from_native(saved["latent"], tmp_path / "cli")


def test_each_moe_feature_binds(saved):
  """Each piece of the mixture moves transformers' logits (same weights) far
  from the reference when taken out: the correction bias, the group limit,
  the scaling factor, the renormalisation, the number chosen, the shared
  expert, the latent projection back; in Penzai, the experts' squaring."""
  plain, latent = saved["moe"], saved["latent"]
  harness.check_modules_bind(plain, CASES["moe"], "the correction biases",
                             harness.zero_correction_biases)
  harness.check_feature_binds(plain, CASES["moe"], n_group=1, topk_group=1)
  harness.check_feature_binds(plain, CASES["moe"], routed_scaling_factor=1.0)
  harness.check_feature_binds(plain, CASES["moe"], norm_topk_prob=False)
  harness.check_feature_binds(plain, CASES["moe"], num_experts_per_tok=2)
  harness.check_modules_bind(plain, CASES["moe"], "the shared expert", lambda hf: [
      layer.mixer.shared_experts.down_proj.weight.data.zero_()
      for layer in hf.model.layers if layer.block_type == "moe"])
  harness.check_modules_bind(latent, CASES["latent"], "the latent projection back", lambda hf: [
      layer.mixer.fc2_latent_proj.weight.data.mul_(2.0)
      for layer in hf.model.layers if layer.block_type == "moe"])
  model = pzp.pretrained.load_hf(plain.folder)
  print("experts without squaring:", harness.check_penzai_edit_binds(
      pz.select(model).at_instances_of(moe.MixtureOfExperts).apply(
          lambda m: dataclasses.replace(m, experts=pz.select(m.experts).at_instances_of(
              pz.nn.Elementwise).where(lambda e: e.fn is jnp.square).remove_from_parent())),
      plain.reference))


def test_the_router_reads_float32_logits(saved):
  """transformers keeps the router's weight in float32 and casts the
  activations to it; the Penzai router casts them too."""
  model = pzp.pretrained.load_hf(saved["moe"].folder, dtype=jnp.bfloat16)
  router = pz.select(model).at_instances_of(moe.TopKRouter).get_sequence()[0]
  assert isinstance(router.logits, pz.nn.Sequential)
  assert isinstance(router.logits.sublayers[0], pz.nn.CastToDType)
  assert router.logits.sublayers[0].dtype == jnp.float32


@pytest.mark.parametrize("changes, match", [
    ({"n_routed_experts": 10**9}, "n_routed_experts"),
    ({"n_routed_experts": 6, "n_group": 2, "num_experts_per_tok": 2}, "n_routed_experts"),
    ({"n_group": 3}, "n_group"),
    ({"n_group": 8}, "n_group"),  # Groups of one expert: transformers ranks a group by its best two.
    ({"topk_group": 3}, "topk_group"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),  # More than the one kept group holds.
    ({"n_shared_experts": 0}, "n_shared_experts"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"moe_latent_size": 0}, "moe_latent_size"),
    ({"moe_intermediate_size": -1}, "moe_intermediate_size"),
    ({"routed_scaling_factor": "2.5"}, "routed_scaling_factor"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"layers_block_type": ["linear_attention", "full_attention", "moe", "mlp", "moe", "moe"]},
     "num_hidden_layers"),
])
def test_hostile_moe_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                                  changes, match):
  folder = harness.edited(saved["moe"].folder, tmp_path, **changes)
  harness.check_refused_before_building(folder, match, monkeypatch)


@pytest.mark.parametrize("changes, name", [
    ({"moe_intermediate_size": 32}, "experts.up_proj"),
    ({"moe_shared_expert_intermediate_size": 10**9}, "shared_experts.up_proj"),
    ({"moe_latent_size": 10**9}, "experts/up.weights"),
])
def test_sizes_that_do_not_fit_the_tensors_are_refused(saved, tmp_path, changes, name):
  """Refused from the safetensors headers, before a tensor is read (the
  experts' stack named as the plan reads it)."""
  folder = harness.edited(saved["latent"].folder, tmp_path, **changes)
  with pytest.raises(errors.PzPersistError, match=name):
    pzp.pretrained.load_hf(folder)


def test_experts_stored_fused_are_refused(saved, tmp_path):
  """transformers 5's in-memory layout (``mixer.experts.up_proj`` of every
  expert) is not what the Hub or ``save_pretrained`` writes: refused, naming
  the per-expert tensors it looked for."""
  folder = harness.edited(saved["moe"].folder, tmp_path)
  weights = harness.tensors(folder)
  for layer in (2, 4):
    prefix = f"backbone.layers.{layer}.mixer.experts."
    for part in ("up_proj", "down_proj"):
      weights[prefix + part] = np.stack([weights.pop(f"{prefix}{e}.{part}.weight")
                                         for e in range(8)])
  for name in folder.iterdir():
    if name.suffix == ".safetensors" or name.name.endswith(".index.json"):
      name.unlink()
  safetensors.numpy.save_file(weights, folder / "model.safetensors")
  with pytest.raises(errors.UnsupportedConfigError, match="fused"):
    pzp.pretrained.load_hf(folder)


def test_export_refuses_a_mixture_transformers_cannot_express(saved, tmp_path):
  """A softmax router, or gated experts, are not Nemotron-H's."""
  model = pzp.pretrained.load_hf(saved["moe"].folder)
  softmax = pz.select(model).at_instances_of(moe.TopKRouter).apply(
      lambda r: dataclasses.replace(r, score="softmax"))
  with pytest.raises(errors.PzPersistError, match="sigmoid"):
    pzp.export_hf(softmax, tmp_path / "softmax", like=saved["moe"].folder)
  unshared = pz.select(model).at_instances_of(moe.MixtureOfExperts).apply(
      lambda m: dataclasses.replace(m, shared=None))
  with pytest.raises(errors.PzPersistError, match="shared"):
    pzp.export_hf(unshared, tmp_path / "unshared", like=saved["moe"].folder)


def test_surgery_around_the_latent_mixture_of_experts(saved, tmp_path):
  from pz_persist.nn.mixture_of_experts import LatentMixtureOfExperts

  harness.check_surgery_around(saved["latent"], LatentMixtureOfExperts, tmp_path)
