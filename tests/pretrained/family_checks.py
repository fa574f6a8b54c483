"""The checks each Hugging Face family's tests run against transformers
(issue 27, item 5), shared so that a family's test file holds only its cases.

Each takes a tiny random transformers model saved to a folder: float32
logits within 1e-4 of transformers on several sequences (the real error is
returned, to be printed), bfloat16 as close as transformers' own bfloat16
run, KV-cache sampling equal to a forward pass, a ``save_model`` round trip,
and ``export_hf`` back to a folder that transformers loads as the same class
with bit-identical tensors.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import safetensors.numpy
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained.test_hf import sampling_jitted
from pz_persist.pretrained.sampling import kv_caching_lm

SEQUENCES = np.array([
    [1, 5, 9, 3, 7, 2, 11, 60, 33, 17],
    [4, 4, 8, 15, 16, 23, 42, 0, 8, 1],
    [63, 2, 2, 2, 50, 49, 48, 12, 30, 6],
])
"""Three sequences of ten tokens (ids below 64, the tiny models' vocabulary)."""

FLOAT32 = {"atol": 1e-4, "rtol": 1e-4}


def randomized(model: torch.nn.Module, norm_center: float = 1.0, seed: int = 1) -> torch.nn.Module:
  """``model`` with every parameter redrawn (so a weight read into the wrong
  place, or a feature left out, changes the logits): norm weights around
  ``norm_center`` (1 where a norm multiplies by ``w``, 0 where by ``1 + w``)."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = torch.randn(param.shape, generator=generator) * 0.3
      param.copy_(noise + (norm_center if "norm" in name else 0.0))
  return model.eval()


def reference_logits(model: torch.nn.Module, tokens: np.ndarray = SEQUENCES) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


def penzai_logits(model, tokens: np.ndarray = SEQUENCES) -> np.ndarray:
  out = model(pz.nx.wrap(jnp.asarray(tokens), "batch", "seq"))
  return np.asarray(out.untag("batch", "seq", "vocabulary").unwrap().astype(jnp.float32))


def float32_error(folder, reference: np.ndarray) -> float:
  """Loads ``folder`` in float32; asserts its logits are within 1e-4 of
  ``reference`` and returns the largest absolute difference."""
  logits = penzai_logits(pzp.pretrained.load_hf(folder))
  assert np.abs(reference).max() > 0.5  # Logits of order one: a meaningful check.
  np.testing.assert_allclose(logits, reference, **FLOAT32)
  return float(np.abs(logits - reference).max())


def bfloat16_errors(folder, model_cls, reference: np.ndarray) -> tuple[float, float]:
  """Loads ``folder`` in bfloat16 and asserts its logits are as close to the
  float32 ``reference`` as transformers' own bfloat16 run; returns both
  largest errors (ours, transformers')."""
  theirs = np.abs(reference_logits(model_cls.from_pretrained(folder, dtype=torch.bfloat16))
                  - reference)
  loaded = pzp.pretrained.load_hf(folder, dtype=jnp.bfloat16)
  assert {p.value.dtype for p in pz.unbind_params(loaded)[1]} == {jnp.dtype(jnp.bfloat16)}
  ours = np.abs(penzai_logits(loaded) - reference)
  assert ours.max() <= 2 * theirs.max() + 0.05
  assert ours.mean() <= 2 * theirs.mean() + 0.01
  return float(ours.max()), float(theirs.max())


def check_kv_cache_sampling(model, prompt: np.ndarray = SEQUENCES[:, :4], steps: int = 6) -> None:
  """Greedy KV-cache sampling gives, at each step, the logits a forward pass
  over the whole sequence gives at that position (float32)."""
  batch = prompt.shape[0]
  sampler = sampling_jitted(kv_caching_lm(  # from_uncached, each cache sized by its layer.
      model, cache_len=prompt.shape[1] + steps, batch_axes={"batch": batch}, pad_id=-1))
  tokens, sequence, cached = prompt, prompt, []
  for _ in range(steps):
    out = sampler(pz.nx.wrap(jnp.asarray(tokens), "batch", "seq"))
    last = np.asarray(out.untag("batch", "seq", "vocabulary").unwrap()[:, -1], np.float32)
    cached.append(last)
    tokens = np.argmax(last, axis=-1)[:, None]
    sequence = np.concatenate([sequence, tokens], axis=1)
  full = penzai_logits(model, sequence[:, :-1])[:, prompt.shape[1] - 1:]
  np.testing.assert_allclose(np.stack(cached, 1), full, atol=1e-4, rtol=1e-4)


def check_save_model_round_trip(model, path, reference: np.ndarray) -> None:
  pzp.save_model(path, model)
  restored = pzp.load_model(path)
  before = {p.label: p.value for p in pz.unbind_params(model)[1]}
  after = {p.label: p.value for p in pz.unbind_params(restored)[1]}
  assert before.keys() == after.keys()
  for label, value in before.items():
    np.testing.assert_array_equal(np.asarray(after[label].data_array),
                                  np.asarray(value.data_array), err_msg=label)
  np.testing.assert_allclose(penzai_logits(restored), reference, **FLOAT32)


def tensors(folder) -> dict[str, np.ndarray]:
  out = {}
  for name in os.listdir(folder):
    if name.endswith(".safetensors"):
      out.update(safetensors.numpy.load_file(os.path.join(folder, name)))
  return out


def check_export(model, source, out, like=True) -> dict:
  """``export_hf`` of ``model`` (loaded from ``source``) writes a folder
  transformers loads as the source's class with the same tensors, bit for
  bit; without ``like`` the structure alone must give the same
  ``model_type``. Returns the written config."""
  pzp.export_hf(model, out, like=source if like else None)
  config = json.loads((out / "config.json").read_text())
  original = json.loads((source / "config.json").read_text())
  assert config["model_type"] == original["model_type"]
  assert config["architectures"] == original["architectures"]
  got, want = tensors(out), tensors(source)
  assert sorted(got) == sorted(want)
  for name in want:
    assert (got[name].dtype, got[name].shape) == (want[name].dtype, want[name].shape), name
    assert got[name].tobytes() == want[name].tobytes(), name
  theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(theirs).__name__ == original["architectures"][0]
  return config
