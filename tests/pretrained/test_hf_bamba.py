"""Bamba (Mamba-2 layers among Llama attention layers) through `load_hf` and
`export_hf`, against transformers on tiny random models (no downloads), and
the `pz_persist.nn.mamba2.Mamba2` layer itself: its scan against
transformers' chunked ``torch_forward`` kernel, KV-cache sampling against
``generate``, treescope, ``save_model`` and surgery (LoRA, an inserted
layer).
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
from penzai import pz
from penzai.models.transformer import sampling_mode
from penzai.toolshed import lora

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist import errors
from pz_persist.nn.mamba2 import CachingMamba2
from pz_persist.nn.mamba2 import Mamba2
from pz_persist.pretrained.sampling import kv_caching_lm

_MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 8,
          "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 4}

CASES = {
    # Attention in the middle layer (RoPE over half of each head), two groups
    # of B / C and of the gated norm, grouped-query attention, a chunk size
    # smaller than the sequences (transformers' chunks meet at the boundary).
    "hybrid": harness.Case(transformers.BambaConfig, transformers.BambaForCausalLM, {
        "num_hidden_layers": 3, "num_key_value_heads": 2, "attn_layer_indices": [1], **_MAMBA}),
    # Attention first (transformers' cache cannot hold Mamba-2 layers alone),
    # transformers' default chunk size (256, a single chunk), one group, no convolution bias, a 3-tap convolution, tied embeddings, a
    # clipped time step.
    "attention_first": harness.Case(transformers.BambaConfig, transformers.BambaForCausalLM, {
        **_MAMBA, "attn_layer_indices": [0], "num_key_value_heads": 4, "mamba_n_groups": 1,
        "mamba_chunk_size": 256, "mamba_conv_bias": False, "mamba_d_conv": 3,
        "tie_word_embeddings": True, "time_step_limit": (0.0, 0.5)}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return harness.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", ["hybrid", pytest.param("attention_first", marks=pytest.mark.slow)])
def test_float32_logits_match_transformers(saved, case):
  harness.check_float32(saved[case], case)


@pytest.mark.slow
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  harness.check_bfloat16(saved["hybrid"], "hybrid")


@pytest.mark.parametrize("case", ["hybrid", "attention_first"])
def test_kv_cache_sampling_matches_a_forward_pass(saved, case):
  """A 3-token prompt, then one token per call: the mixers carry their
  convolution inputs and state from call to call (`kv_caching_lm`)."""
  harness.check_kv_cache(pzp.pretrained.load_hf(saved[case].folder))


def test_greedy_generation_matches_transformers_generate(saved):
  """Greedy KV-cache sampling picks, token for token, what transformers'
  ``generate`` (its own cache: convolution and recurrent states) picks."""
  hybrid = saved["hybrid"]
  model = pzp.pretrained.load_hf(hybrid.folder)
  prompt, steps = harness.SEQUENCES[:, :4], 12
  sampler = harness.sampling_jitted(kv_caching_lm(
      model, cache_len=prompt.shape[1] + steps, batch_axes={"batch": prompt.shape[0]}, pad_id=-1))
  tokens, ours = prompt, []
  for _ in range(steps):
    out = sampler(pz.nx.wrap(jnp.asarray(tokens), "batch", "seq"))
    tokens = np.argmax(np.asarray(out.untag("batch", "seq", "vocabulary").unwrap()[:, -1]),
                       axis=-1)[:, None]
    ours.append(tokens)
  with torch.no_grad():
    theirs = hybrid.hf_model.generate(
        torch.tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
        do_sample=False, max_new_tokens=steps, min_new_tokens=steps, pad_token_id=-1,
        eos_token_id=None)
  np.testing.assert_array_equal(np.concatenate(ours, 1), theirs[:, prompt.shape[1]:].numpy())


def test_penzai_sampling_mode_without_the_state_is_refused(saved):
  """``KVCachingTransformerLM.from_uncached`` converts only attention layers:
  the mixers refuse to run there rather than forget the past."""
  model = pzp.pretrained.load_hf(saved["hybrid"].folder)
  sampler = sampling_mode.KVCachingTransformerLM.from_uncached(
      model, cache_len=10, batch_axes={"batch": 3}, pad_id=-1)
  with pytest.raises(errors.ArgumentError, match="kv_caching_lm"):
    sampler(pz.nx.wrap(jnp.asarray(harness.SEQUENCES[:, :3]), "batch", "seq"))


def test_export_gives_back_the_folder(saved, tmp_path):
  """With ``like`` and from the model alone (its mixers say Bamba). The
  chunk size changes only transformers' rounding (its chunks regroup the
  same sums), so the case exported alone uses transformers' default, which
  an export without ``like`` writes."""
  harness.check_export(saved["attention_first"], tmp_path, "bamba",
                       same_fields=("attn_layer_indices", "tie_word_embeddings",
                                    "mamba_n_groups", "mamba_conv_bias", "mamba_d_conv",
                                    "time_step_limit"))


@pytest.mark.slow
def test_export_with_like_keeps_the_chunk_size(saved, tmp_path):
  harness.check_export(saved["hybrid"], tmp_path, None)


@pytest.mark.slow
def test_save_model_round_trip_and_cli_export(saved, tmp_path):
  harness.check_save_model(saved["hybrid"], tmp_path)
  harness.check_cli_export_from_native(saved["attention_first"], tmp_path / "cli")


def _differs(model, reference) -> float:
  changed = float(np.abs(harness.penzai_logits(model) - reference).max())
  assert changed > 100 * harness.TOLERANCE["atol"]
  return changed


def _with(param, edit) -> pz.Parameter:
  return pz.Parameter(value=pz.nx.nmap(edit)(param.value), label=param.label)


def test_each_feature_binds(saved):
  """Taken out of the loaded model, each piece of the mixer moves the
  logits far from transformers': the convolution (made the identity), the
  ``D`` skip, the gate, the time-step bias, the norm's groups (one group for
  all heads); the partial rotary fraction in transformers' config."""
  hybrid = saved["hybrid"]
  model = pzp.pretrained.load_hf(hybrid.folder)

  def edited(edit) -> pz.nn.Layer:
    return pz.select(model).at_instances_of(Mamba2).apply(edit)

  def unit(param):
    return pz.Parameter(value=pz.nx.nmap(lambda w: jnp.zeros_like(w).at[-1].set(1.0))(
        param.value.untag("conv_taps")).tag("conv_taps"), label=param.label)

  print("without the convolution:", _differs(edited(lambda m: dataclasses.replace(
      m, input_conv=unit(m.input_conv), input_matrix_conv=unit(m.input_matrix_conv),
      output_matrix_conv=unit(m.output_matrix_conv))), hybrid.reference))
  print("without D:", _differs(edited(lambda m: dataclasses.replace(
      m, skip=_with(m.skip, jnp.zeros_like))), hybrid.reference))
  print("without dt_bias:", _differs(edited(lambda m: dataclasses.replace(
      m, time_step_bias=_with(m.time_step_bias, jnp.zeros_like))), hybrid.reference))

  transformers_case = CASES["hybrid"]
  harness.check_modules_bind(hybrid, transformers_case, "the gated norm's groups",
                             lambda hf: [setattr(layer.mamba.norm, "group_size", 64)
                                         for layer in hf.model.layers if hasattr(layer, "mamba")])
  harness.check_feature_binds(hybrid, transformers_case, rope_parameters={
      "rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 1.0})


@pytest.mark.parametrize("changes, match", [
    ({"attn_layer_indices": [3]}, "attn_layer_indices"),
    ({"attn_layer_indices": "1"}, "attn_layer_indices"),
    ({"mamba_n_heads": 3}, "mamba_n_heads"),
    ({"mamba_d_head": 8}, "mamba_d_head"),
    ({"mamba_n_groups": 3}, "mamba_n_groups"),
    ({"mamba_proj_bias": True}, "mamba_proj_bias"),
    ({"mamba_d_conv": 0}, "mamba_d_conv"),
    ({"time_step_limit": [1.0, 0.5]}, "time_step_limit"),
    ({"time_step_limit": [0.0]}, "time_step_limit"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"num_experts": 4}, "num_experts"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              changes, match):
  folder = harness.edited(saved["hybrid"].folder, tmp_path, **changes)
  harness.check_refused_before_building(folder, match, monkeypatch)


def test_a_wrongly_sized_fused_projection_is_refused(saved, tmp_path, monkeypatch):
  """``mamba_d_state`` that does not fit ``in_proj``'s stored rows is
  refused from the safetensors header, before a tensor is read."""
  folder = harness.edited(saved["hybrid"].folder, tmp_path, mamba_d_state=4)
  with pytest.raises(errors.PzPersistError, match="in_proj"):
    pzp.pretrained.load_hf(folder)


# --- the layer -------------------------------------------------------------


def test_the_scan_matches_transformers_chunked_kernel():
  """The layer's sequential scan against transformers' ``mamba2_chunk_scan``
  (the state space dual, by chunks), from a random initial state, with
  chunks that split the sequence unevenly (float32): its final state, and
  its outputs through the gate and the grouped norm (applied to
  transformers' in numpy)."""
  from transformers.models.bamba import modeling_bamba  # pylint: disable=import-outside-toplevel

  from pz_persist.nn import mamba2  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  seq, heads, dim, groups, state = 11, 4, 3, 2, 5
  x = rng.normal(size=(seq, heads, dim)).astype(np.float32)
  dt = rng.normal(size=(seq, heads)).astype(np.float32)
  b, c = (rng.normal(size=(seq, groups, state)).astype(np.float32) for _ in range(2))
  a_log = rng.normal(size=(heads,)).astype(np.float32) * 0.5
  dt_bias, skip = (rng.normal(size=(heads,)).astype(np.float32) for _ in range(2))
  gate = rng.normal(size=(seq, heads, dim)).astype(np.float32)
  scale = rng.normal(size=(heads, dim)).astype(np.float32)
  initial = rng.normal(size=(heads, dim, state)).astype(np.float32)
  with torch.no_grad():
    want, want_final = modeling_bamba.mamba2_chunk_scan(
        *(torch.tensor(v)[None] for v in (x, dt)), -torch.exp(torch.tensor(a_log)),
        torch.tensor(b)[None], torch.tensor(c)[None], chunk_size=4, D=torch.tensor(skip),
        dt_bias=torch.tensor(dt_bias), dt_softplus=True, initial_states=torch.tensor(initial)[None],
        return_final_states=True)
  y = want[0].numpy().astype(np.float64)
  gated = (y * gate / (1 + np.exp(-gate))).reshape(seq, groups, -1)
  normed = gated / np.sqrt(np.mean(gated ** 2, axis=-1, keepdims=True) + 1e-5)
  expected = scale * normed.reshape(seq, heads, dim)
  identity = {name: np.zeros(shape + (2,), np.float32) for name, shape in (
      ("input", (heads, dim)), ("input_matrix", (groups, state)),
      ("output_matrix", (groups, state)))}
  for kernel in identity.values():
    kernel[..., -1] = 1.0  # A convolution that passes each token through.
  got, _, final = mamba2._mix(  # pylint: disable=protected-access
      {"input": x, "input_matrix": b, "output_matrix": c}, gate, dt, identity,
      dict.fromkeys(identity, np.float32(0)),
      {name: np.zeros((1,) + k.shape[:-1], np.float32) for name, k in identity.items()},
      initial, a_log, dt_bias, skip, scale, norm_epsilon=1e-5, limit=(0.0, float("inf")),
      activation=lambda v: v)
  print("final state vs transformers:", np.abs(np.asarray(final) - want_final[0].numpy()).max(),
        "outputs:", np.abs(np.asarray(got) - expected).max())
  np.testing.assert_allclose(np.asarray(final), want_final[0].numpy(), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(got), expected, atol=1e-4, rtol=1e-4)


def test_layer_renders_in_treescope_and_survives_save_model(saved, tmp_path):
  model = pzp.pretrained.load_hf(saved["hybrid"].folder)
  mixer = pz.select(model).at_instances_of(Mamba2).get_sequence()[0]
  text = treescope.render_to_text(mixer)
  assert "Mamba2" in text and "ssm_heads" in text and "time_step_limit" in text
  pzp.save_model(tmp_path / "native", model)
  restored = pzp.load_model(tmp_path / "native")
  assert len(pz.select(restored).at_instances_of(Mamba2).get_sequence()) == 2
  np.testing.assert_array_equal(harness.penzai_logits(restored), harness.penzai_logits(model))
  sampler = kv_caching_lm(restored, cache_len=8, batch_axes={"batch": 1})
  assert len(pz.select(sampler).at_instances_of(CachingMamba2).get_sequence()) == 2


def test_surgery_lora_and_an_inserted_layer_save_and_load(saved, tmp_path):
  """LoRA adapters on a mixer's projections and a layer inserted after a
  mixer: the edited model runs, differs only where edited (a zero-initialised
  adapter changes nothing), and comes back from ``save_model`` exactly."""
  model = pzp.pretrained.load_hf(saved["hybrid"].folder)
  reference = harness.penzai_logits(model)
  adapted = lora.loraify_linears_in_selection(
      pz.select(model).at_instances_of(Mamba2).at(lambda m: (m.input, m.output), multiple=True),
      rank=2, init_base_rng=jax.random.key(3))
  assert pz.select(adapted).at_instances_of(lora.LowRankAdapter).count() == 4
  np.testing.assert_allclose(harness.penzai_logits(adapted), reference, atol=1e-6)
  inserted = pz.select(adapted).at_instances_of(Mamba2).apply(
      lambda m: pz.nn.Sequential([m, pz.nn.ConstantRescale(by=0.5)]))
  assert float(np.abs(harness.penzai_logits(inserted) - reference).max()) > 1e-2
  harness.check_save_model_round_trip(inserted, tmp_path / "edited",
                                      harness.penzai_logits(inserted))
