"""Greedy generation with Phi-3's LongRoPE across the original context,
token for token against transformers' ``generate``.

transformers' ``generate`` (``Phi3ForCausalLM.prepare_inputs_for_generation``)
drops its cache on the step whose sequence first exceeds
``original_max_position_embeddings`` tokens and recomputes the whole
sequence with the long factors; `pz_persist.pretrained.kv_caching_lm`
returns a `LongRopeKVCachingLM` that does the same. Penzai's plain
``from_uncached`` sampler keeps keys rotated with the short factors, and is
shown here to differ from ``generate`` (so the check binds).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from penzai import pz
from penzai.models.transformer import sampling_mode
from penzai.models.transformer import simple_decoding_loop

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist import errors
from pz_persist.nn.longrope import ApplyLongRoPE
from pz_persist.nn.longrope import LongRopeKVCachingLM

_ORIGINAL = 6
_PROMPT = np.array([[1, 5, 9, 3], [4, 4, 8, 15]])
_STEPS = 8  # Sequences of 4 + 8 tokens: the crossing (7 tokens > 6) at the third step.


def _factors(n: int, seed: int) -> list[float]:
  return [round(float(x), 4) for x in np.random.default_rng(seed).uniform(1.0, 6.0, n)]


_MADE: dict[str, tuple] = {}


@pytest.fixture(scope="module", params=["full", "partial"])
def saved(request, tmp_path_factory):
  """A tiny Phi-3 with longrope (original context 6), on every rotated pair
  (Phi-3.5-mini) or on 3/4 of each head (Phi-4-mini)."""
  if request.param not in _MADE:
    _MADE[request.param] = _made(request.param, tmp_path_factory)
  return _MADE[request.param]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
  """The whole-head case alone (for the slower eager checks)."""
  if "full" not in _MADE:
    _MADE["full"] = _made("full", tmp_path_factory)
  return _MADE["full"]


def _made(name: str, tmp_path_factory):
  partial = name == "partial"
  pairs = 6 if partial else 4
  rope = {"rope_type": "longrope", "rope_theta": 10000.0,
          "short_factor": _factors(pairs, 0), "long_factor": _factors(pairs, 1),
          **({"partial_rotary_factor": 0.75} if partial else {})}
  case = harness.Case(transformers.Phi3Config, transformers.Phi3ForCausalLM, {
      "hidden_size": 64 if partial else 32, "num_key_value_heads": 2,
      "max_position_embeddings": 64, "original_max_position_embeddings": _ORIGINAL,
      "rope_parameters": rope, "eos_token_id": None, "bos_token_id": None})
  model = case.make()
  folder = tmp_path_factory.mktemp(name)
  model.save_pretrained(folder, safe_serialization=True)
  return folder, model


def _generated(hf_model) -> tuple[np.ndarray, np.ndarray]:
  """transformers' greedy ``generate``: the new tokens and each step's logits."""
  prompt = torch.tensor(_PROMPT)
  with torch.no_grad():
    out = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                            max_new_tokens=_STEPS, min_new_tokens=_STEPS,
                            output_logits=True, return_dict_in_generate=True, pad_token_id=0)
  tokens = out.sequences[:, _PROMPT.shape[1]:].numpy()
  return tokens, torch.stack(out.logits, 1).float().numpy()


def _greedy(sampler) -> tuple[np.ndarray, np.ndarray]:
  """Greedy decoding through ``sampler`` (called eagerly or compiled): the
  new tokens and each step's logits."""
  logits = sampler(pz.nx.wrap(jnp.asarray(_PROMPT), "batch", "seq"))
  steps, tokens = [], []
  for _ in range(_STEPS):
    last = np.asarray(logits.untag("batch", "seq", "vocabulary").unwrap()[:, -1], np.float32)
    steps.append(last)
    tokens.append(np.argmax(last, axis=-1))
    logits = sampler(pz.nx.wrap(jnp.asarray(tokens[-1][:, None]), "batch", "seq"))
  return np.stack(tokens, 1), np.stack(steps, 1)


def _sampler(model, jitted: bool, plain: bool = False):
  make = sampling_mode.KVCachingTransformerLM.from_uncached if plain else (
      pzp.pretrained.kv_caching_lm)
  sampler = make(model, cache_len=_PROMPT.shape[1] + _STEPS, batch_axes={"batch": 2}, pad_id=-1)
  return harness.sampling_jitted(sampler) if jitted else sampler  # pylint: disable=protected-access


def test_greedy_generation_across_the_original_context_matches_generate(saved):
  """Compiled (the crossing under ``jax.lax.cond``), both cases."""
  _check_generation(saved, jitted=True)


def test_eager_generation_matches_generate(full):
  """Called eagerly (the crossing decided in Python)."""
  _check_generation(full, jitted=False)


def _check_generation(saved, jitted: bool) -> None:
  folder, hf_model = saved
  want_tokens, want_logits = _generated(hf_model)
  model = pzp.pretrained.load_hf(folder)
  assert isinstance(pzp.pretrained.kv_caching_lm(model, 16, {"batch": 2}), LongRopeKVCachingLM)
  tokens, logits = _greedy(_sampler(model, jitted))
  np.testing.assert_array_equal(tokens, want_tokens)
  np.testing.assert_allclose(logits, want_logits, **harness.TOLERANCE)
  print(f"longrope generation ({'jit' if jitted else 'eager'}): {_STEPS} greedy tokens equal,"
        f" float32 logits max abs error {np.abs(logits - want_logits).max():.3g}")


def test_keeping_the_short_rotated_cache_differs_from_generate(saved):
  """Penzai's plain sampler (no recomputation) departs from ``generate`` at
  the crossing: the recomputation is what the test above checks."""
  folder, hf_model = saved
  _, want_logits = _generated(hf_model)
  _, logits = _greedy(_sampler(pzp.pretrained.load_hf(folder), jitted=True, plain=True))
  crossing = _ORIGINAL + 1 - _PROMPT.shape[1]  # The step whose sequence first exceeds 6 tokens.
  np.testing.assert_allclose(logits[:, :crossing], want_logits[:, :crossing],
                             **harness.TOLERANCE)
  assert np.abs(logits[:, crossing:] - want_logits[:, crossing:]).max() > 100 * 1e-4


def test_a_prompt_past_the_original_context_needs_no_recomputation(full):
  """A prompt already longer than the original context is computed with the
  long factors from the start: both samplers agree with ``generate``'s
  first logits."""
  folder, hf_model = full
  prompt = np.tile(_PROMPT, 2)  # 8 tokens > 6.
  with torch.no_grad():
    want = hf_model(torch.tensor(prompt)).logits.float().numpy()
  model = pzp.pretrained.load_hf(folder)
  for sampler in (_sampler(model, jitted=False), _sampler(model, jitted=False, plain=True)):
    out = sampler(pz.nx.wrap(jnp.asarray(prompt), "batch", "seq"))
    np.testing.assert_allclose(np.asarray(out.untag("batch", "seq", "vocabulary").unwrap()),
                               want, **harness.TOLERANCE)


def test_penzais_sampling_loop_runs_the_recomputing_sampler(full):
  """Penzai's ``temperature_sample_pyloop`` drives the sampler unchanged:
  at a tiny temperature it picks ``generate``'s greedy tokens."""
  folder, hf_model = full
  want_tokens, _ = _generated(hf_model)
  sampler = pzp.pretrained.kv_caching_lm(pzp.pretrained.load_hf(folder),
                                         cache_len=_PROMPT.shape[1] + _STEPS,
                                         batch_axes={"batch": 2}, pad_id=-1)
  out = simple_decoding_loop.temperature_sample_pyloop(
      sampler, prompt=pz.nx.wrap(jnp.asarray(_PROMPT), "batch", "seq"), rng=jax.random.key(0),
      temperature=1e-6, max_sampling_steps=_STEPS)
  np.testing.assert_array_equal(np.asarray(out.untag("batch", "seq").unwrap()), want_tokens)


def test_longrope_beside_a_recurrent_state_is_refused(tmp_path):
  """A model edited to hold both LongRoPE and gated DeltaNet layers cannot
  rewind its recurrent state to recompute at the crossing: refused when the
  sampler is made, not sampled wrongly."""
  torch.manual_seed(0)
  fields = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "num_hidden_layers": 4, "intermediate_size": 64, "vocab_size": 64, "pad_token_id": 0,
            "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4}
  transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
      "qwen3_5_text", **fields)).save_pretrained(tmp_path, safe_serialization=True)
  model = pzp.pretrained.load_hf(tmp_path)

  def longrope(layer):
    return ApplyLongRoPE(embedding_axis=layer.embedding_axis, max_wavelength=10_000.0,
                         positions_input_name=layer.positions_input_name,
                         short_factor=(1.0,), long_factor=(1.0,),
                         original_max_position_embeddings=4, factor=2.0)

  edited = pz.select(model).at_instances_of(pz.nn.ApplyRoPEToSubset | pz.nn.ApplyRoPE).apply(
      longrope)
  assert pz.select(edited).at_instances_of(ApplyLongRoPE).count()
  with pytest.raises(errors.ArgumentError, match="DeltaNet"):
    pzp.pretrained.kv_caching_lm(edited, cache_len=8, batch_axes={"batch": 1})
