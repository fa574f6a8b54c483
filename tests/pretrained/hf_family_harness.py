"""The one harness of the Hugging Face family tests: the checks every
family's test file runs against transformers, shared so that each family's
file lists only its cases and its features (and nothing here is copied in a
test module: helpers other tests need live here once).

A case is a tiny random transformers model (every parameter redrawn, norms
near one, see `randomized`) saved with ``save_pretrained``; `saved_cases`
builds them once per test module. The checks:

- `check_float32`: ``load_hf``'s logits within 1e-4 (absolute and
  relative) of transformers' on the two sequences of `SEQUENCES`; returns the
  measured maximum error, which the tests print.
- `check_bfloat16`: a bfloat16 load as far from the float32 logits as
  transformers' own bfloat16 run (within a factor of two, plus 0.05 on the
  maximum and 0.01 on the mean, as test_hf.py).
- `check_kv_cache`: Penzai's KV-cache sampling mode, fed the sequences token
  by token after a 3-token prompt, gives the forward pass's logits.
- `check_save_model`: ``save_model`` / ``load_model`` keeps every parameter
  bit for bit and the logits.
- `check_export`: ``export_hf`` (with ``like`` and from the model alone)
  writes the original tensors bit for bit, a config transformers reads as
  the same class and the same config, and transformers computes exactly
  the original logits from it.
- `check_feature_binds`: a feature switched off in transformers' config
  changes its logits by more than the tolerance (so a loader ignoring the
  feature would fail `check_float32`).

The same checks for a folder and a model the test holds itself, not a
`Saved` case: `float32_error`, `bfloat16_errors`, `check_kv_cache_sampling`
(greedy KV-cache sampling against a forward pass over what it chose),
`check_save_model_round_trip` and `check_export_model`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from penzai import pz
from penzai.models.transformer import sampling_mode
from penzai.models.transformer.variants import llamalike_common

import pz_persist as pzp
from pz_persist import errors
from pz_persist.pretrained.sampling import kv_caching_lm

SEQUENCES = np.array([
    [1, 5, 9, 3, 7, 2, 11, 60, 33, 17],
    [4, 4, 8, 15, 16, 23, 42, 0, 8, 1],
    [63, 2, 2, 2, 50, 49, 48, 12, 30, 6],
])
"""Three sequences of ten tokens (ids below 64, the tiny models' vocabulary),
longer than every test window and than the longrope cases' original
context."""

TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}

COMMON = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64,
              "intermediate_size": 64, "initializer_range": 0.3, "pad_token_id": 0}
"""The tiny size of every case (overridden per case)."""


@dataclasses.dataclass(frozen=True)
class Case:
  """A tiny transformers model: its config and model classes and fields."""

  config_cls: type
  model_cls: type
  fields: dict[str, Any]

  def config(self, **changes: Any) -> Any:
    return self.config_cls(**dict(COMMON, **dict(self.fields, **changes)))

  def make(self, **changes: Any) -> Any:
    torch.manual_seed(0)
    return randomized(self.model_cls(self.config(**changes)))


@dataclasses.dataclass(frozen=True)
class Saved:
  folder: Any
  hf_model: Any
  reference: np.ndarray


def randomized(model: torch.nn.Module, norm_center: float = 1.0, seed: int = 1) -> torch.nn.Module:
  """``model`` with every parameter redrawn (so a weight read into the wrong
  place, a norm or bias put on the wrong axis, or a feature left out changes
  the logits): norm weights around ``norm_center`` (1 where a norm
  multiplies by ``w``, 0 where by ``1 + w``), the rest around zero."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = torch.randn(param.shape, generator=generator) * 0.3
      param.copy_(noise + (norm_center if "norm" in name else 0.0))
  return model.eval()


def reference_logits(model, tokens: np.ndarray = SEQUENCES) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


def penzai_logits(model, tokens: np.ndarray = SEQUENCES) -> np.ndarray:
  out = model(pz.nx.wrap(jnp.asarray(tokens), "batch", "seq"))
  return np.asarray(out.untag("batch", "seq", "vocabulary").unwrap().astype(jnp.float32))


def saved_cases(tmp_path_factory, cases: dict[str, Case]) -> dict[str, Saved]:
  result = {}
  for name, case in cases.items():
    model = case.make()
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder, safe_serialization=True)
    result[name] = Saved(folder, model, reference_logits(model))
  return result


def float32_error(folder, reference: np.ndarray) -> float:
  """Loads ``folder`` in float32; asserts its logits are within 1e-4 of
  ``reference`` and returns the largest absolute difference."""
  logits = penzai_logits(pzp.pretrained.load_hf(folder))
  assert np.abs(reference).max() > 0.5  # Logits of order one: a meaningful check.
  np.testing.assert_allclose(logits, reference, **TOLERANCE)
  return float(np.abs(logits - reference).max())


def check_float32(saved: Saved, name: str) -> float:
  error = float32_error(saved.folder, saved.reference)
  print(f"{name} float32 max abs error: {error:.3g}")
  return error


def _bfloat16_distances(folder, model_cls, reference: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
  """How far a bfloat16 load's logits are from the float32 ``reference``,
  and transformers' own bfloat16 run's, asserting ours are as close (within
  a factor of two, plus 0.05 on the maximum and 0.01 on the mean)."""
  theirs = np.abs(reference_logits(model_cls.from_pretrained(folder, dtype=torch.bfloat16))
                  - reference)
  loaded = pzp.pretrained.load_hf(folder, dtype=jnp.bfloat16)
  assert {p.value.dtype for p in pz.unbind_params(loaded)[1]} == {jnp.dtype(jnp.bfloat16)}
  ours = np.abs(penzai_logits(loaded) - reference)
  assert ours.max() <= 2 * theirs.max() + 0.05
  assert ours.mean() <= 2 * theirs.mean() + 0.01
  return ours, theirs


def bfloat16_errors(folder, model_cls, reference: np.ndarray) -> tuple[float, float]:
  """`check_bfloat16` for a folder: both largest errors (ours, transformers')."""
  ours, theirs = _bfloat16_distances(folder, model_cls, reference)
  return float(ours.max()), float(theirs.max())


def check_bfloat16(saved: Saved, name: str) -> None:
  ours, theirs = _bfloat16_distances(saved.folder, type(saved.hf_model), saved.reference)
  print(f"{name} bfloat16 vs float32: max {ours.max():.3g} mean {ours.mean():.3g}"
        f" (transformers bfloat16: max {theirs.max():.3g} mean {theirs.mean():.3g})")


def sampling_jitted(sampler):
  """``sampler``'s calls compiled whole, its KV cache carried between them.

  Why: run eagerly, every new input shape (the prompt, then one token)
  compiles each of the model's operations one by one, 6 s per shape for a
  tiny Gemma 2; compiled whole, under 3 s. The computation is the same: Penzai's
  layers, bound to the cache state each call, as `pz.bind_variables` does.
  """
  slots, frozen = pz.unbind_state_vars(sampler, freeze=True)

  @jax.jit
  def step(state, tokens):
    variables = [value.unfreeze_as_copy() for value in state]
    out = pz.bind_variables(slots, variables)(tokens)
    return out, [variable.freeze() for variable in variables]

  def call(tokens):
    nonlocal frozen
    out, frozen = step(frozen, tokens)
    return out

  return call


def check_kv_cache(model, prompt: int = 3) -> None:
  """The sequences fed to the KV-cache sampler (prompt, then one token per
  call) give the forward pass's logits at every position after the prompt."""
  full = penzai_logits(model)
  sampler = sampling_jitted(kv_caching_lm(  # from_uncached, each cache sized by its layer.
      model, cache_len=SEQUENCES.shape[1], batch_axes={"batch": SEQUENCES.shape[0]}, pad_id=-1))
  steps = [sampler(pz.nx.wrap(jnp.asarray(SEQUENCES[:, :prompt]), "batch", "seq"))]
  for i in range(prompt, SEQUENCES.shape[1]):
    steps.append(sampler(pz.nx.wrap(jnp.asarray(SEQUENCES[:, i:i + 1]), "batch", "seq")))
  cached = np.concatenate(
      [np.asarray(s.untag("batch", "seq", "vocabulary").unwrap(), np.float32) for s in steps], 1)
  np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)


def params(model) -> dict[str, Any]:
  """``model``'s parameters by label."""
  return {p.label: p.value for p in pz.unbind_params(model)[1]}


def _saved_and_restored(model, path):
  """``model`` after ``save_model`` / ``load_model`` at ``path``, every
  parameter checked bit for bit."""
  pzp.save_model(path, model)
  restored = pzp.load_model(path)
  before, after = params(model), params(restored)
  assert before.keys() == after.keys()
  for label, value in before.items():
    np.testing.assert_array_equal(np.asarray(after[label].data_array),
                                  np.asarray(value.data_array), err_msg=label)
  return restored


def check_save_model(saved: Saved, tmp_path) -> None:
  """The round trip keeps every parameter and exactly the logits."""
  model = pzp.pretrained.load_hf(saved.folder)
  restored = _saved_and_restored(model, tmp_path / "native")
  np.testing.assert_array_equal(penzai_logits(restored), penzai_logits(model))


def check_save_model_round_trip(model, path, reference: np.ndarray) -> None:
  """The round trip of a model the test holds keeps every parameter, and its
  logits within the tolerance of ``reference``."""
  restored = _saved_and_restored(model, path)
  np.testing.assert_allclose(penzai_logits(restored), reference, **TOLERANCE)


def check_surgery_around(saved: Saved, layer_class: type, tmp_path) -> None:
  """Issue 40 §3: a layer a family adds is one others can edit. LoRA on every
  linear inside each ``layer_class`` (zero-initialised: the logits stay), a
  layer inserted after each (they move), the edited model sampled with
  `kv_caching_lm`, and ``save_model`` bringing the edit back."""
  from penzai.toolshed import lora

  model = pzp.pretrained.load_hf(saved.folder)
  reference = penzai_logits(model)
  found = pz.select(model).at_instances_of(layer_class)
  assert found.count(), f"no {layer_class.__name__} in the model"
  adapted = lora.loraify_linears_in_selection(
      found.at_instances_of(pz.nn.Linear), rank=2, init_base_rng=jax.random.key(3))
  assert pz.select(adapted).at_instances_of(lora.LowRankAdapter).count()
  np.testing.assert_allclose(penzai_logits(adapted), reference, **TOLERANCE)
  inserted = pz.select(adapted).at_instances_of(layer_class).apply(
      lambda layer: pz.nn.Sequential([layer, pz.nn.ConstantRescale(by=0.5)]))
  edited = penzai_logits(inserted)
  assert float(np.abs(edited - reference).max()) > 1e-3, "the inserted layer changed nothing"
  sampler = kv_caching_lm(inserted, cache_len=8, batch_axes={"batch": 1})
  assert pz.select(sampler).at_instances_of(pz.nn.ConstantRescale).count() >= found.count()
  check_save_model_round_trip(inserted, tmp_path / "edited", edited)


def tensors(folder) -> dict[str, np.ndarray]:
  out = {}
  for name in os.listdir(folder):
    if name.endswith(".safetensors"):
      out.update(safetensors.numpy.load_file(os.path.join(folder, name)))
  return out


def config(folder) -> dict:
  with open(os.path.join(folder, "config.json")) as f:
    return json.load(f)


def transformers_config(folder) -> dict:
  """``folder``'s config as transformers reads it, without its bookkeeping."""
  loaded = transformers.AutoConfig.from_pretrained(folder).to_dict()
  for bookkeeping in ("_name_or_path", "transformers_version"):
    loaded.pop(bookkeeping, None)
  return loaded


def assert_same_tensors(got: dict, want: dict) -> None:
  assert sorted(got) == sorted(want)
  for name in want:
    assert (got[name].dtype, got[name].shape) == (want[name].dtype, want[name].shape), name
    assert got[name].tobytes() == want[name].tobytes(), name


def check_export(saved: Saved, tmp_path, model_type: str | None,
                 same_fields: tuple[str, ...] = ()) -> None:
  """With ``like``: the same tensors, the same transformers config and class,
  exactly the original logits. Without (unless ``model_type`` is None): the
  family and ``same_fields`` come from the model alone, and the tensors are
  the same."""
  model = pzp.pretrained.load_hf(saved.folder)
  dst = tmp_path / "like"
  pzp.export_hf(model, dst, like=saved.folder)
  assert_same_tensors(tensors(dst), tensors(saved.folder))
  got, want = transformers_config(dst), transformers_config(saved.folder)
  assert got == want, {k: (got.get(k), want.get(k)) for k in {*got, *want}
                       if got.get(k) != want.get(k)}
  exported = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
  assert type(exported) is type(saved.hf_model)
  np.testing.assert_array_equal(reference_logits(exported), saved.reference)
  if model_type is None:
    return

  alone = tmp_path / "alone"
  pzp.export_hf(model, alone)
  assert_same_tensors(tensors(alone), tensors(saved.folder))
  written, original = config(alone), config(saved.folder)
  assert written["model_type"] == model_type
  for field in same_fields:
    assert written.get(field) == original.get(field), (field, written.get(field),
                                                       original.get(field))
  # (The token ids are not the model's: the tiny vocabulary needs pad 0.)
  np.testing.assert_array_equal(reference_logits(transformers.AutoModelForCausalLM.from_pretrained(
      alone, pad_token_id=0).eval()), saved.reference)


def check_feature_binds(saved: Saved, case: Case, **off: Any) -> float:
  """transformers' logits with ``off`` applied to the config (the same
  weights) differ from the reference by more than the tolerance; returns
  that difference."""
  model = case.model_cls(case.config(**off))
  model.load_state_dict(saved.hf_model.state_dict())
  changed = float(np.abs(reference_logits(model.eval()) - saved.reference).max())
  print(f"without {off}: logits change by {changed:.3g}")
  assert changed > 100 * TOLERANCE["atol"]
  return changed


def edited(folder, tmp_path, **changes: Any):
  """A copy of ``folder`` with ``config.json`` edited (``DELETE`` removes a
  field); the weights copied, not linked."""
  target = tmp_path / "edited"
  target.mkdir()
  for name in os.listdir(folder):
    if name != "config.json":
      (target / name).write_bytes((folder / name).read_bytes())
  raw = config(folder)
  raw.update(changes)
  raw = {k: v for k, v in raw.items() if v is not DELETE}
  (target / "config.json").write_text(json.dumps(raw))
  return target


DELETE = object()


def check_modules_bind(saved: Saved, case: Case, what: str, edit: Callable[[Any], None]) -> float:
  """transformers' logits with ``edit`` applied to a copy of the model (a
  norm replaced by the identity...) differ from the reference by more than
  the tolerance; returns that difference."""
  model = case.model_cls(case.config())
  model.load_state_dict(saved.hf_model.state_dict())
  edit(model)
  changed = float(np.abs(reference_logits(model.eval()) - saved.reference).max())
  print(f"without {what}: logits change by {changed:.3g}")
  assert changed > 100 * TOLERANCE["atol"]
  return changed


def check_penzai_edit_binds(model, reference: np.ndarray) -> float:
  """A loaded model with one piece taken out (edited in Penzai) gives
  logits more than 100 times the tolerance from ``reference``; returns
  the difference."""
  changed = float(np.abs(penzai_logits(model) - reference).max())
  assert changed > 100 * TOLERANCE["atol"]
  return changed


def check_kv_cache_like_transformers(model, hf_model, prompt: int = 3) -> None:
  """The KV-cache sampler fed the sequences token by token gives the logits
  transformers gives fed them the same way (its own KV cache): for RoPE
  whose frequencies depend on the call's largest position (longrope past
  its original context), where a forward pass over the whole sequence
  differs from both."""
  sampler = sampling_jitted(sampling_mode.KVCachingTransformerLM.from_uncached(
      model, cache_len=SEQUENCES.shape[1], batch_axes={"batch": SEQUENCES.shape[0]}, pad_id=-1))
  ours, theirs = [], []
  with torch.no_grad():
    out = hf_model(torch.tensor(SEQUENCES[:, :prompt]), use_cache=True)
    theirs.append(out.logits.float().numpy())
    for i in range(prompt, SEQUENCES.shape[1]):
      out = hf_model(torch.tensor(SEQUENCES[:, i:i + 1]), past_key_values=out.past_key_values,
                     use_cache=True)
      theirs.append(out.logits.float().numpy())
  ours.append(sampler(pz.nx.wrap(jnp.asarray(SEQUENCES[:, :prompt]), "batch", "seq")))
  for i in range(prompt, SEQUENCES.shape[1]):
    ours.append(sampler(pz.nx.wrap(jnp.asarray(SEQUENCES[:, i:i + 1]), "batch", "seq")))
  cached = np.concatenate(
      [np.asarray(s.untag("batch", "seq", "vocabulary").unwrap(), np.float32) for s in ours], 1)
  np.testing.assert_allclose(cached, np.concatenate(theirs, 1), **TOLERANCE)


def check_generate(saved: Saved, steps: int = 10, prompt: int = 4) -> None:
  """Penzai's KV-cache sampler, greedy from a ``prompt``-token prompt for
  ``steps`` steps, picks transformers' ``generate``'s tokens, token for
  token, with its logits (within `TOLERANCE`)."""
  tokens = SEQUENCES[:, :prompt]
  # An end-of-sequence id past the vocabulary: the tiny vocabulary holds the
  # config's own, which generate would stop at (or, under min_new_tokens,
  # never pick, where greedy sampling does).
  config = copy.deepcopy(saved.hf_model.generation_config)
  config.eos_token_id = saved.hf_model.config.get_text_config().vocab_size
  with torch.no_grad():
    out = saved.hf_model.generate(
        torch.tensor(tokens), attention_mask=torch.ones(tokens.shape, dtype=torch.long),
        generation_config=config, do_sample=False, max_new_tokens=steps, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0)
  want_tokens = out.sequences[:, prompt:].numpy()
  want_logits = torch.stack(out.logits, 1).float().numpy()
  sampler = sampling_jitted(kv_caching_lm(
      pzp.pretrained.load_hf(saved.folder), cache_len=prompt + steps,
      batch_axes={"batch": tokens.shape[0]}, pad_id=-1))
  got_tokens, got_logits = [], []
  for _ in range(steps):
    logits = sampler(pz.nx.wrap(jnp.asarray(tokens), "batch", "seq"))
    last = np.asarray(logits.untag("batch", "seq", "vocabulary").unwrap()[:, -1], np.float32)
    got_logits.append(last)
    got_tokens.append(np.argmax(last, axis=-1))
    tokens = got_tokens[-1][:, None]
  np.testing.assert_array_equal(np.stack(got_tokens, 1), want_tokens)
  np.testing.assert_allclose(np.stack(got_logits, 1), want_logits, **TOLERANCE)


def check_refused_before_building(folder, match: str, monkeypatch) -> None:
  """``load_hf`` refuses ``folder`` with `UnsupportedConfigError` naming
  ``match``, before any skeleton is built (Penzai's builder is replaced by
  one that fails the test)."""
  def no_build(*args, **kwargs):
    raise AssertionError("a skeleton was built before the config was refused")

  monkeypatch.setattr(llamalike_common, "build_llamalike_transformer", no_build)
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)


TINY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 64,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
"""The sizes a Hub ``config.json`` is shrunk to (its other fields kept)."""


def hub_saved(tmp_path, hub_config: dict[str, Any]) -> Saved:
  """A random model of a Hub ``config.json`` (as the Hub has it, written by
  an older transformers; sizes from `TINY` unless it sets them), saved
  with that very file."""
  folder = tmp_path / "hub"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps(hub_config))
  torch.manual_seed(0)
  # Built in float32 from the start: built in the config's dtype (the Hub's
  # say bfloat16) and then cast, the scalars a model keeps outside its
  # weights (Gemma's embedding scales, non-persistent buffers) stay rounded
  # to bfloat16, where transformers' own float32 load computes them anew
  # (Gemma 3n's logits moved by 0.015 on ten layers).
  model = randomized(transformers.AutoModelForCausalLM.from_config(
      transformers.AutoConfig.from_pretrained(folder), dtype=torch.float32))
  model.save_pretrained(tmp_path / "weights", safe_serialization=True)
  for name in os.listdir(tmp_path / "weights"):
    if name.endswith(".safetensors"):
      (folder / name).write_bytes((tmp_path / "weights" / name).read_bytes())
  return Saved(folder, model, reference_logits(model))


def check_cli_export_from_native(saved: Saved, tmp_path) -> None:
  """The layers pz_persist adds survive ``save_model``, and ``pz-persist
  export hf`` writes the original tensors from that checkpoint alone."""
  from pz_persist.tools import cli  # pylint: disable=import-outside-toplevel
  pzp.save_model(tmp_path / "native", pzp.pretrained.load_hf(saved.folder))
  dst = tmp_path / "hf"
  assert cli.main(["export", "hf", str(tmp_path / "native"), str(dst), "--quiet"]) == 0
  assert_same_tensors(tensors(dst), tensors(saved.folder))
  np.testing.assert_array_equal(reference_logits(transformers.AutoModelForCausalLM.from_pretrained(
      dst, pad_token_id=0).eval()), saved.reference)


def check_bfloat16_export(case: Case, tmp_path) -> None:
  """A bfloat16 folder comes back bit for bit (no arithmetic on the way)."""
  src = tmp_path / "bf16"
  case.make().to(torch.bfloat16).save_pretrained(src, safe_serialization=True)
  pzp.export_hf(pzp.pretrained.load_hf(src), tmp_path / "out", like=src)
  assert config(tmp_path / "out")["dtype"] == "bfloat16"
  assert_same_tensors(tensors(tmp_path / "out"), tensors(src))


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


def check_export_model(model, source, out, like=True) -> dict:
  """``export_hf`` of ``model`` (loaded from ``source``) writes a folder
  transformers loads as the source's class with the same tensors, bit for
  bit; without ``like`` the structure alone must give the same
  ``model_type``. Returns the written config."""
  pzp.export_hf(model, out, like=source if like else None)
  config = json.loads((out / "config.json").read_text())
  original = json.loads((source / "config.json").read_text())
  assert config["model_type"] == original["model_type"]
  assert config["architectures"] == original["architectures"]
  assert_same_tensors(tensors(out), tensors(source))
  theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(theirs).__name__ == original["architectures"][0]
  return config


def with_correction_biases(model: torch.nn.Module) -> torch.nn.Module:
  """``model`` with its routers' ``e_score_correction_bias`` buffers drawn
  too (`randomized` redraws parameters only, leaving them at zero, where a
  loader ignoring them would pass)."""
  generator = torch.Generator().manual_seed(2)
  with torch.no_grad():
    for name, buffer in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.5)
  return model


def zero_correction_biases(model: torch.nn.Module) -> None:
  """Zeroes ``model``'s routers' correction biases (to show they bind)."""
  with torch.no_grad():
    for name, buffer in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        buffer.zero_()


def saved_biased_cases(tmp_path_factory, cases: dict[str, Case]) -> dict[str, Saved]:
  """`saved_cases` for routers with a correction bias (drawn too)."""
  result = {}
  for name, case in cases.items():
    model = with_correction_biases(case.make())
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder, safe_serialization=True)
    result[name] = Saved(folder, model, reference_logits(model))
  return result


def check_cached_decoding(saved: Saved) -> None:
  """Penzai's KV cache against its forward pass and against transformers'
  cache (`check_kv_cache`, `check_kv_cache_like_transformers`), and greedy
  decoding against ``generate`` (`check_generate`)."""
  model = pzp.pretrained.load_hf(saved.folder)
  check_kv_cache(model)
  check_kv_cache_like_transformers(model, saved.hf_model)
  check_generate(saved)
