"""Jamba (Mamba-1 layers among attention layers, experts on every other
layer) through `load_hf` and `export_hf`, against transformers on tiny
random models (no downloads), and the `pz_persist.nn.mamba.Mamba` layer
itself: its scan against transformers' ``mamba_selective_scan``, KV-cache
sampling against ``generate``, treescope, ``save_model`` and surgery (LoRA,
an inserted layer).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
import treescope
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from penzai import pz
from penzai.models.transformer import sampling_mode
from penzai.toolshed import lora

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist import errors
from pz_persist.nn import mixture_of_experts as moe
from pz_persist.nn.mamba import CachingMamba
from pz_persist.nn.mamba import Mamba
from pz_persist.pretrained.sampling import kv_caching_lm

_MAMBA = {"mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 4}

CASES = {
    # Attention on the odd layers (grouped-query), experts on the even
    # (Mamba) layers, a time-step rank of its own.
    "hybrid": harness.Case(transformers.JambaConfig, transformers.JambaForCausalLM, {
        **_MAMBA, "num_hidden_layers": 4, "num_key_value_heads": 2, "attn_layer_period": 2,
        "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 0,
        "num_experts": 4, "num_experts_per_tok": 2}),
    # Attention first with experts on it, one expert per token, no convolution
    # bias, a 3-tap convolution, the 'auto' time-step rank (ceil(32 / 16)),
    # tied embeddings, as many key/value heads as heads.
    "attention_experts": harness.Case(transformers.JambaConfig, transformers.JambaForCausalLM, {
        **_MAMBA, "num_hidden_layers": 3, "num_key_value_heads": 4, "attn_layer_period": 3,
        "attn_layer_offset": 0, "expert_layer_period": 2, "expert_layer_offset": 0,
        "num_experts": 3, "num_experts_per_tok": 1, "mamba_conv_bias": False, "mamba_d_conv": 3,
        "mamba_dt_rank": "auto", "tie_word_embeddings": True}),
    # One expert: every layer a plain MLP (transformers' JambaMLP).
    "dense": harness.Case(transformers.JambaConfig, transformers.JambaForCausalLM, {
        **_MAMBA, "num_hidden_layers": 2, "num_key_value_heads": 2, "attn_layer_period": 2,
        "attn_layer_offset": 1, "num_experts": 1}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return harness.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", ["hybrid", "attention_experts",
                                  pytest.param("dense", marks=pytest.mark.slow)])
def test_float32_logits_match_transformers(saved, case):
  harness.check_float32(saved[case], case)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["hybrid", "dense"])
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved, case):
  """(The mixers' dt / B / C norms standardize in float32 and the scan rounds
  where transformers' does: in bfloat16 the norms alone doubled the hybrid
  case's largest error. The top-1 case is left out: one flipped expert
  choice of one token moves its logits by several units either way.)"""
  harness.check_bfloat16(saved[case], case)


@pytest.mark.parametrize("case", ["hybrid", pytest.param("dense", marks=pytest.mark.slow)])
def test_kv_cache_sampling_matches_a_forward_pass(saved, case):
  """A 3-token prompt, then one token per call: the mixers carry their
  convolution inputs and state from call to call (`kv_caching_lm`)."""
  harness.check_kv_cache(pzp.pretrained.load_hf(saved[case].folder))


@pytest.mark.parametrize("case", ["hybrid", "attention_experts"])
def test_greedy_generation_matches_transformers_generate(saved, case):
  """KV cache and the mixers' convolution and recurrent state, against
  ``generate``'s own cache, token for token."""
  harness.check_generate(saved[case], steps=10, prompt=4)


def test_penzai_sampling_mode_without_the_state_is_refused(saved):
  """``KVCachingTransformerLM.from_uncached`` converts only attention layers:
  the mixers refuse to run there rather than forget the past."""
  model = pzp.pretrained.load_hf(saved["hybrid"].folder)
  sampler = sampling_mode.KVCachingTransformerLM.from_uncached(
      model, cache_len=10, batch_axes={"batch": 3}, pad_id=-1)
  with pytest.raises(errors.ArgumentError, match="kv_caching_lm"):
    sampler(pz.nx.wrap(jnp.asarray(harness.SEQUENCES[:, :3]), "batch", "seq"))


_SAME = ("attn_layer_period", "attn_layer_offset", "expert_layer_period", "expert_layer_offset",
         "num_experts", "num_experts_per_tok", "mamba_d_state", "mamba_d_conv", "mamba_expand",
         "mamba_conv_bias", "num_key_value_heads", "tie_word_embeddings", "intermediate_size")
"""What an export without ``like`` must read back from the model alone."""


@pytest.mark.parametrize("case", ["hybrid", "attention_experts"])
def test_export_gives_back_the_folder(saved, tmp_path, case):
  """With ``like``: the same tensors (the Hub's per-expert layout), config
  and logits bit for bit, reloading in transformers. From the model alone
  (its Mamba mixers say Jamba): the layer pattern, experts and mixer sizes
  read back (``mamba_dt_rank`` written as the number 'auto' meant)."""
  harness.check_export(saved[case], tmp_path, "jamba", same_fields=_SAME)
  written = harness.config(tmp_path / "alone")
  assert written["mamba_dt_rank"] == harness.transformers_config(saved[case].folder)[
      "mamba_dt_rank"]


@pytest.mark.slow
def test_export_of_the_dense_case(saved, tmp_path):
  harness.check_export(saved["dense"], tmp_path, "jamba",
                       same_fields=("attn_layer_period", "attn_layer_offset", "num_experts"))


def test_save_model_round_trip_and_cli_export(saved, tmp_path):
  harness.check_save_model(saved["hybrid"], tmp_path)
  harness.check_cli_export_from_native(saved["attention_experts"], tmp_path / "cli")


def _differs(model, reference) -> float:
  changed = float(np.abs(harness.penzai_logits(model) - reference).max())
  assert changed > 100 * harness.TOLERANCE["atol"]
  return changed


def _with(param, edit) -> pz.Parameter:
  return pz.Parameter(value=pz.nx.nmap(edit)(param.value), label=param.label)


def test_each_feature_binds(saved):
  """Taken out of the loaded model, each piece moves the logits far from
  transformers': the convolution (made the identity), each of the three RMS
  norms (dt, B, C), the ``D`` skip, the time-step bias, the per-state decay
  (every state entry given the first's), the unnormalised top-k weights
  (renormalised); in transformers, B's norm weight set to one."""
  hybrid = saved["hybrid"]
  model = pzp.pretrained.load_hf(hybrid.folder)

  def edited(edit) -> pz.nn.Layer:
    return pz.select(model).at_instances_of(Mamba).apply(edit)

  def unit(param):
    return pz.Parameter(value=pz.nx.nmap(lambda w: jnp.zeros_like(w).at[-1].set(1.0))(
        param.value.untag("conv_taps")).tag("conv_taps"), label=param.label)

  print("without the convolution:", _differs(edited(
      lambda m: dataclasses.replace(m, conv=unit(m.conv))), hybrid.reference))
  for norm in ("time_step_norm", "input_matrix_norm", "output_matrix_norm"):
    print(f"without {norm}:", _differs(edited(
        lambda m, n=norm: dataclasses.replace(m, **{n: pz.nn.Identity()})), hybrid.reference))
  print("without D:", _differs(edited(lambda m: dataclasses.replace(
      m, skip=_with(m.skip, jnp.zeros_like))), hybrid.reference))
  print("without dt_bias:", _differs(edited(lambda m: dataclasses.replace(
      m, time_step_bias=_with(m.time_step_bias, jnp.zeros_like))), hybrid.reference))
  print("one decay per channel:", _differs(edited(lambda m: dataclasses.replace(
      m, log_decay_rate=pz.Parameter(value=pz.nx.nmap(lambda a: jnp.broadcast_to(a[:1], a.shape))(
          m.log_decay_rate.value.untag("ssm_state")).tag("ssm_state"),
                                     label=m.log_decay_rate.label))), hybrid.reference))
  renormalised = pz.select(model).at_instances_of(moe.TopKRouter).apply(
      lambda r: dataclasses.replace(r, normalize=True))
  print("top-k renormalised:", _differs(renormalised, hybrid.reference))

  harness.check_modules_bind(hybrid, CASES["hybrid"], "B's norm weight (transformers' side)",
                             lambda hf: [setattr(layer.mamba.b_layernorm, "weight",
                                                 torch.nn.Parameter(torch.ones_like(
                                                     layer.mamba.b_layernorm.weight)))
                                         for layer in hf.model.layers if hasattr(layer, "mamba")])


@pytest.mark.parametrize("changes, match", [
    ({"attn_layer_offset": 2}, "attn_layer_offset"),
    ({"expert_layer_offset": 2}, "expert_layer_offset"),
    ({"attn_layer_period": 0}, "attn_layer_period"),
    ({"expert_layer_offset": -1}, "expert_layer_offset"),
    ({"mamba_proj_bias": True}, "mamba_proj_bias"),
    ({"mamba_dt_rank": 0}, "mamba_dt_rank"),
    ({"mamba_dt_rank": "big"}, "mamba_dt_rank"),
    ({"mamba_d_conv": 0}, "mamba_d_conv"),
    ({"mamba_conv_bias": "yes"}, "mamba_conv_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"sliding_window": 4}, "sliding_window"),
    ({"rope_theta": 10_000.0}, "rope_theta"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_local_experts": 8}, "num_experts"),
    ({"num_experts": 10**9}, "num_experts"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"use_mamba_kernels": "no"}, "use_mamba_kernels"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  folder = harness.edited(saved["hybrid"].folder, tmp_path, **changes)
  harness.check_refused_before_building(folder, match, monkeypatch)


@pytest.mark.parametrize("changes, match", [({"mamba_d_state": 4}, "x_proj"),
                                            ({"mamba_expand": 3}, "in_proj"),
                                            ({"mamba_dt_rank": 2}, "x_proj")])
def test_sizes_the_weights_do_not_have_are_refused(saved, tmp_path, changes, match):
  """Mixer sizes that do not fit the stored fused tensors are refused from
  the safetensors header, before a tensor is read."""
  folder = harness.edited(saved["hybrid"].folder, tmp_path, **changes)
  with pytest.raises(errors.PzPersistError, match=match):
    pzp.pretrained.load_hf(folder)


def test_the_hubs_kernel_and_training_fields_are_accepted(saved, tmp_path):
  """Jamba-1.5's config.json fields that change nothing at inference
  (kernel choices, the load-balancing loss, 4.x's ``num_logits_to_keep``, a
  null window) load to the same logits."""
  folder = harness.edited(saved["hybrid"].folder, tmp_path, use_mamba_kernels=False,
                          use_mambapy=True, num_logits_to_keep=1, sliding_window=None,
                          output_router_logits=True, router_aux_loss_coef=0.01,
                          num_local_experts=4)
  np.testing.assert_allclose(harness.penzai_logits(pzp.pretrained.load_hf(folder)),
                             saved["hybrid"].reference, **harness.TOLERANCE)


def test_transformers_5_fused_experts_load_and_export_as_read(saved, tmp_path):
  """The experts fused as transformers 5 holds them in memory
  (``feed_forward.experts.gate_up_proj`` ``[experts, 2 * neurons,
  hidden]``, ``down_proj``): the same logits; an export writes the Hub's
  per-expert layout (what transformers 5's ``save_pretrained`` writes too),
  bit for bit the original folder's."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  hybrid = saved["hybrid"]
  stored = harness.tensors(hybrid.folder)
  fused = {}
  for name, value in stored.items():
    if ".feed_forward.experts." not in name:
      fused[name] = value
      continue
    prefix = name.split(".experts.")[0] + ".experts."
    if prefix + "gate_up_proj" in fused:
      continue
    count = CASES["hybrid"].fields["num_experts"]
    fused[prefix + "gate_up_proj"] = np.stack([np.concatenate(
        [stored[f"{prefix}{e}.gate_proj.weight"], stored[f"{prefix}{e}.up_proj.weight"]])
        for e in range(count)])
    fused[prefix + "down_proj"] = np.stack([stored[f"{prefix}{e}.down_proj.weight"]
                                            for e in range(count)])
  folder = tmp_path / "fused"
  folder.mkdir()
  (folder / "config.json").write_bytes((hybrid.folder / "config.json").read_bytes())
  save_file(fused, str(folder / "model.safetensors"), metadata={"format": "pt"})
  model = pzp.pretrained.load_hf(folder)
  np.testing.assert_allclose(harness.penzai_logits(model), hybrid.reference, **harness.TOLERANCE)
  pzp.export_hf(model, tmp_path / "out", like=folder)
  harness.assert_same_tensors(harness.tensors(tmp_path / "out"), stored)


# --- the layer -------------------------------------------------------------


def test_the_scan_matches_transformers_selective_scan():
  """The layer's scan against transformers' ``mamba_selective_scan`` (its
  sequential loop), float32, with the gate and the skip; and the same
  sequence fed in two pieces, the state carried, gives the same outputs."""
  from transformers.models.jamba import modeling_jamba  # pylint: disable=import-outside-toplevel

  from pz_persist.nn import mamba  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  seq, channels, state = 9, 6, 5
  x, dt, gate = (rng.normal(size=(seq, channels)).astype(np.float32) for _ in range(3))
  b, c = (rng.normal(size=(seq, state)).astype(np.float32) for _ in range(2))
  a_log = rng.normal(size=(channels, state)).astype(np.float32) * 0.5
  dt_bias, skip = (rng.normal(size=(channels,)).astype(np.float32) for _ in range(2))
  with torch.no_grad():  # Without mamba_ssm installed: transformers' own loop.
    want = modeling_jamba.mamba_selective_scan(
        *(torch.tensor(v.T)[None] for v in (x, dt)), -torch.exp(torch.tensor(a_log)),
        torch.tensor(b.T)[None], torch.tensor(c.T)[None], D=torch.tensor(skip),
        z=torch.tensor(gate.T)[None], delta_bias=torch.tensor(dt_bias), delta_softplus=True,
        use_associative_scan=False)[0].numpy().T
  zero = np.zeros((channels, state), np.float32)
  got, final = mamba._scan(x, gate, dt, b, c, zero, dt_bias, a_log, skip)  # pylint: disable=protected-access
  print("outputs vs transformers:", np.abs(np.asarray(got) - want).max())
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
  first, middle = mamba._scan(x[:4], gate[:4], dt[:4], b[:4], c[:4], zero, dt_bias, a_log, skip)  # pylint: disable=protected-access
  second, end = mamba._scan(x[4:], gate[4:], dt[4:], b[4:], c[4:], middle, dt_bias, a_log, skip)  # pylint: disable=protected-access
  np.testing.assert_allclose(np.concatenate([first, second]), np.asarray(got), atol=1e-6)
  np.testing.assert_allclose(np.asarray(end), np.asarray(final), atol=1e-6)


def test_from_config_refuses_sizes_that_are_not_positive():
  with pytest.raises(errors.ArgumentError, match="time_step_rank=0"):
    Mamba.from_config("m", embedding=4, channels=8, state=2, time_step_rank=0, conv_taps=2,
                      norm_epsilon=None)


@settings(max_examples=8, deadline=None)  # Each example compiles the layer for its shapes.
@given(sizes=st.tuples(*(st.integers(1, 4) for _ in range(4))),
                  length=st.integers(1, 7), cuts=st.lists(st.integers(1, 6), max_size=3),
                  conv_bias=st.booleans(), norms=st.booleans(), seed=st.integers(0, 2**16))
def test_a_fresh_layer_fed_in_pieces_gives_the_whole_sequence(sizes, length, cuts, conv_bias,
                                                              norms, seed):
  """Property: a layer built with a key (any sizes, with or without the
  norms and the convolution bias), its sampling form fed the sequence in
  any pieces, gives what one call over the whole sequence gives."""
  state, rank, taps, batch = sizes
  layer = Mamba.from_config("m", embedding=4, channels=6, state=state, time_step_rank=rank,
                            conv_taps=taps, norm_epsilon=1e-6 if norms else None,
                            conv_bias=conv_bias, init_base_rng=jax.random.key(seed))
  assert isinstance(layer.time_step_norm, pz.nn.RMSLayerNorm if norms else pz.nn.Identity)
  x = pz.nx.wrap(jax.random.normal(jax.random.key(seed + 1), (batch, length, 4)), "batch", "seq",
                 "embedding")
  whole = np.asarray(layer(x).untag("batch", "seq", "embedding").unwrap())
  cached = CachingMamba.from_uncached(layer, {"batch": batch}, label="state")
  bounds = sorted({0, length, *(c for c in cuts if c < length)})
  pieces = [cached(x[{"seq": pz.slice[a:b]}]) for a, b in zip(bounds, bounds[1:])]
  joined = np.concatenate([np.asarray(p.untag("batch", "seq", "embedding").unwrap())
                           for p in pieces], 1)
  np.testing.assert_allclose(joined, whole, atol=1e-5, rtol=1e-5)


def test_layer_renders_in_treescope_and_survives_save_model(saved, tmp_path):
  model = pzp.pretrained.load_hf(saved["hybrid"].folder)
  mixer = pz.select(model).at_instances_of(Mamba).get_sequence()[0]
  text = treescope.render_to_text(mixer)
  assert "Mamba" in text and "ssm_channels" in text and "time_step_rank" in text
  pzp.save_model(tmp_path / "native", model)
  restored = pzp.load_model(tmp_path / "native")
  assert len(pz.select(restored).at_instances_of(Mamba).get_sequence()) == 2
  np.testing.assert_array_equal(harness.penzai_logits(restored), harness.penzai_logits(model))
  sampler = kv_caching_lm(restored, cache_len=8, batch_axes={"batch": 1})
  assert len(pz.select(sampler).at_instances_of(CachingMamba).get_sequence()) == 2


def test_surgery_lora_and_an_inserted_layer_save_and_load(saved, tmp_path):
  """LoRA adapters on a mixer's projections and a layer inserted after a
  mixer: the edited model runs, differs only where edited (a zero-initialised
  adapter changes nothing), and comes back from ``save_model`` exactly."""
  model = pzp.pretrained.load_hf(saved["hybrid"].folder)
  reference = harness.penzai_logits(model)
  adapted = lora.loraify_linears_in_selection(
      pz.select(model).at_instances_of(Mamba).at(
          lambda m: (m.input, m.input_matrix, m.output), multiple=True),
      rank=2, init_base_rng=jax.random.key(3))
  assert pz.select(adapted).at_instances_of(lora.LowRankAdapter).count() == 6
  np.testing.assert_allclose(harness.penzai_logits(adapted), reference, atol=1e-6)
  inserted = pz.select(adapted).at_instances_of(Mamba).apply(
      lambda m: pz.nn.Sequential([m, pz.nn.ConstantRescale(by=0.5)]))
  assert float(np.abs(harness.penzai_logits(inserted) - reference).max()) > 1e-2
  harness.check_save_model_round_trip(inserted, tmp_path / "edited",
                                      harness.penzai_logits(inserted))
