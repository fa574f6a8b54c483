"""Greedy KV-cache generation against transformers' ``generate``, token for
token: shared by the family tests that add it to `hf_family_harness`'s
checks (a module of its own so that families added in parallel share it)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks


def check_generate(model, hf_model, prompt: np.ndarray = checks.SEQUENCES[:, :4],
                   steps: int = 8) -> None:
  """Penzai's KV-cache greedy sampling of ``model`` chooses the tokens
  transformers' ``generate`` chooses for ``hf_model``, one by one (every
  position past the prompt reads the cache, windows and routing included)."""
  sampler = checks.sampling_jitted(pzp.pretrained.sampling.kv_caching_lm(
      model, cache_len=prompt.shape[1] + steps, batch_axes={"batch": prompt.shape[0]},
      pad_id=-1))
  tokens, ours = prompt, []
  for _ in range(steps):
    out = sampler(pz.nx.wrap(jnp.asarray(tokens), "batch", "seq"))
    tokens = np.argmax(np.asarray(out.untag("batch", "seq", "vocabulary").unwrap()[:, -1]),
                       axis=-1)[:, None]
    ours.append(tokens)
  with torch.no_grad():
    theirs = hf_model.generate(
        torch.tensor(prompt), max_new_tokens=steps, do_sample=False,
        attention_mask=torch.ones(prompt.shape, dtype=torch.long), pad_token_id=0)
  np.testing.assert_array_equal(np.concatenate(ours, 1), theirs[:, prompt.shape[1]:].numpy())
