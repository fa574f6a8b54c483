"""Hugging Face checkpoints into Penzai (`load_hf`) and safetensors exports.

Reference logits come from transformers itself (torch, CPU), on tiny random
models saved with ``save_pretrained``; pz_persist reads those folders without
importing torch. Weights are drawn with a large ``initializer_range`` so that
logits are of order one and the tolerances mean something.

Tolerances: float32 loads must match transformers to 1e-4 (absolute and
relative; measured differences are ~1e-6); bfloat16 loads (weights and
activations in bfloat16) must be as close to the float32 logits as
transformers' own bfloat16 run, within a factor of two (plus 0.05 absolute on
the maximum, 0.01 on the mean): the two bfloat16 runs round in different
places, so they cannot be compared with each other tightly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import model_zoo
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as harness
from pz_persist.pretrained import errors
from pz_persist.pretrained import safetensors_io

TOKENS = np.array([[1, 5, 9, 3, 7, 2, 11, 60], [4, 4, 8, 15, 16, 23, 42, 0]])

_COMMON = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=64,
    intermediate_size=64,
    initializer_range=0.3,
)


def _hf_model(family: str, **overrides):
  """A tiny random transformers model of ``family``, in eval mode."""
  torch.manual_seed(0)
  kwargs = dict(_COMMON, **overrides)
  if family == "llama":
    config = transformers.LlamaConfig(num_key_value_heads=2, **kwargs)
    cls = transformers.LlamaForCausalLM
  elif family == "mistral":
    # A window shorter than TOKENS, so the sliding-window mask is exercised.
    kwargs.setdefault("sliding_window", 3)
    config = transformers.MistralConfig(num_key_value_heads=2, **kwargs)
    cls = transformers.MistralForCausalLM
  else:
    config, cls = transformers.GPTNeoXConfig(**kwargs), transformers.GPTNeoXForCausalLM
  return cls(config).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """``{family: (folder, reference float32 logits)}``, saved once per module."""
  result = {}
  for family in ("llama", "mistral", "gpt_neox"):
    model = _hf_model(family)
    folder = tmp_path_factory.mktemp(family)
    model.save_pretrained(folder, safe_serialization=True)
    result[family] = (folder, harness.reference_logits(model, TOKENS))
  return result


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_neox"])
def test_float32_logits_match_transformers(saved, family):
  folder, reference = saved[family]
  model = pzp.pretrained.load_hf(folder)
  logits = harness.penzai_logits(model, TOKENS)
  assert np.abs(reference).max() > 0.5  # Logits of order one: a meaningful check.
  np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=1e-4)
  print(f"{family} float32 max abs diff: {np.abs(logits - reference).max():.3g}")
  params = pz.unbind_params(model)[1]
  assert all(p.value.dtype == jnp.float32 for p in params)


def test_each_stored_tensor_is_read_once_and_counted_once(saved, monkeypatch):
  """GPT-NeoX's fused ``query_key_value`` fills three Penzai parameters: it is
  read from its file once, not once per parameter, and progress counts the
  file's tensor bytes once (done == total == their sum)."""
  folder, _ = saved["gpt_neox"]
  reads: list[str] = []
  original = safetensors_io.SafetensorsFile.get

  def get(self, name, dtype=None, **options):
    reads.append(name)
    return original(self, name, dtype, **options)

  monkeypatch.setattr(safetensors_io.SafetensorsFile, "get", get)
  seen: list[tuple[int, int]] = []
  pzp.pretrained.load_hf(folder, progress=lambda done, total: seen.append((done, total)))
  assert any("query_key_value" in name for name in reads)
  assert len(reads) == len(set(reads)), sorted(n for n in set(reads) if reads.count(n) > 1)
  with safetensors_io.SafetensorsFile(os.path.join(folder, "model.safetensors")) as file:
    stored = sum(end - begin for name, (_, _, begin, end) in file.entries.items()
                 if name in reads)
  assert seen[-1] == (stored, stored)


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_bfloat16_load_is_as_close_as_transformers_bfloat16(saved, family):
  """bfloat16 weights and activations: compared with the float32 logits, the
  Penzai model must be about as far off as transformers' own bfloat16 run."""
  folder, reference = saved[family]
  hf_bf16 = harness.reference_logits(
      type(_hf_model(family)).from_pretrained(folder, dtype=torch.bfloat16), TOKENS)
  model = pzp.pretrained.load_hf(folder, dtype=jnp.bfloat16)
  params = pz.unbind_params(model)[1]
  assert {p.value.dtype for p in params} == {jnp.dtype(jnp.bfloat16)}
  logits = harness.penzai_logits(model, TOKENS)
  ours, theirs = np.abs(logits - reference), np.abs(hf_bf16 - reference)
  print(
      f"{family} bfloat16 vs float32: max {ours.max():.3g} mean {ours.mean():.3g}"
      f" (transformers bfloat16: max {theirs.max():.3g} mean {theirs.mean():.3g});"
      f" vs transformers bfloat16: max {np.abs(logits - hf_bf16).max():.3g}"
  )
  assert ours.max() <= 2 * theirs.max() + 0.05
  assert ours.mean() <= 2 * theirs.mean() + 0.01


def test_sharded_checkpoint_with_index(tmp_path, saved):
  model = _hf_model("llama")
  model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
  shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
  assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
  logits = harness.penzai_logits(pzp.pretrained.load_hf(tmp_path), TOKENS)
  np.testing.assert_allclose(logits, saved["llama"][1], atol=1e-4, rtol=1e-4)


def test_tied_embeddings(tmp_path):
  model = _hf_model("llama", tie_word_embeddings=True)
  model.save_pretrained(tmp_path, safe_serialization=True)
  logits = harness.penzai_logits(pzp.pretrained.load_hf(tmp_path), TOKENS)
  np.testing.assert_allclose(logits, harness.reference_logits(model, TOKENS), atol=1e-4, rtol=1e-4)


def test_bfloat16_checkpoint_keeps_its_dtype(tmp_path):
  model = _hf_model("mistral").to(torch.bfloat16)
  model.save_pretrained(tmp_path, safe_serialization=True)
  loaded = pzp.pretrained.load_hf(tmp_path)  # No dtype: the stored one.
  params = pz.unbind_params(loaded)[1]
  assert {p.value.dtype for p in params} == {jnp.dtype(jnp.bfloat16)}
  ref = model.model.embed_tokens.weight.detach().float().numpy()
  got = {p.label: p.value for p in params}["transformer/embedder.embeddings"]
  np.testing.assert_array_equal(np.asarray(got.unwrap("vocabulary", "embedding"), np.float32), ref)


def test_axis_rules_place_each_array(saved):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
  rules = pzp.AxisRules(mesh, {"neurons": "model", "vocabulary": "data", "heads": "model"})
  model = pzp.pretrained.load_hf(saved["gpt_neox"][0], sharding=rules)
  params = {p.label: p.value for p in pz.unbind_params(model)[1]}
  mlp_in = params["transformer/block_0/mlp/in/Linear.weights"]
  assert mlp_in.data_array.sharding.spec == jax.sharding.PartitionSpec("model", None)
  query = params["transformer/block_1/attention/query/Linear.weights"]
  assert query.data_array.sharding.spec[0] == "model"
  np.testing.assert_allclose(harness.penzai_logits(model, TOKENS), saved["gpt_neox"][1],
                             atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "family, field, value",
    [
        ("llama", "rope_scaling", {"rope_type": "longrope", "factor": 2.0}),
        ("llama", "rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
        ("mistral", "attention_bias", True),  # Llama's biases: test_hf_qwen2.py.
        ("mistral", "mlp_bias", True),
        ("llama", "hidden_act", "gelu"),
        ("llama", "some_new_feature", 3),
        ("mistral", "hidden_act", "relu"),
        ("gpt_neox", "use_parallel_residual", False),
        ("gpt_neox", "hidden_act", "tanh"),
    ],
)
def test_config_fields_that_change_the_math_are_refused(saved, tmp_path, family, field, value):
  folder = harness.edited(saved[family][0], tmp_path, **{field: value})
  with pytest.raises(errors.UnsupportedConfigError, match=field) as info:
    pzp.pretrained.load_hf(folder)
  assert isinstance(info.value, errors.PzPersistError)


def test_untied_model_without_lm_head_is_refused(saved, tmp_path):
  folder = tmp_path / "nohead"
  folder.mkdir()
  (folder / "config.json").write_text((saved["llama"][0] / "config.json").read_text())
  tensors = safetensors.numpy.load_file(saved["llama"][0] / "model.safetensors")
  del tensors["lm_head.weight"]
  safetensors.numpy.save_file(tensors, folder / "model.safetensors")
  with pytest.raises(errors.UnsupportedConfigError, match="tie_word_embeddings"):
    pzp.pretrained.load_hf(folder)


def test_unsupported_model_type_lists_supported_ones(saved, tmp_path):
  folder = harness.edited(saved["llama"][0], tmp_path, model_type="bloom")
  with pytest.raises(errors.UnsupportedConfigError, match="bloom") as info:
    pzp.pretrained.load_hf(folder)
  for supported in ("llama", "mistral", "gpt_neox"):
    assert supported in str(info.value)


def test_truncated_safetensors_names_the_file(saved, tmp_path):
  folder = tmp_path / "truncated"
  folder.mkdir()
  source = saved["llama"][0]
  (folder / "config.json").write_text((source / "config.json").read_text())
  data = (source / "model.safetensors").read_bytes()
  (folder / "model.safetensors").write_bytes(data[: len(data) - 100])
  with pytest.raises(errors.SafetensorsFormatError, match="model.safetensors") as info:
    pzp.pretrained.load_hf(folder)
  assert isinstance(info.value, errors.PzPersistError)
  assert "truncated" in str(info.value)
  (folder / "model.safetensors").write_bytes(data[:5])
  with pytest.raises(errors.SafetensorsFormatError, match="model.safetensors"):
    pzp.pretrained.load_hf(folder)


def test_missing_weights_and_config(tmp_path):
  with pytest.raises(errors.CheckpointFolderError, match="config.json"):
    pzp.pretrained.load_hf(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  with pytest.raises(errors.CheckpointFolderError, match="model.safetensors"):
    pzp.pretrained.load_hf(tmp_path)


def test_pz_persist_imports_without_torch():
  code = (
      "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
      "import pz_persist, pz_persist.pretrained.hf\n"
      "print(pz_persist.pretrained.load_hf.__name__)"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "load_hf"


# --- export_safetensors / load_safetensors -------------------------------------


def _assert_same_values(restored, original):
  restored = {v.label: v for v in restored}
  original = {v.label: v for v in original}
  assert restored.keys() == original.keys()
  for label, want in original.items():
    got = restored[label]
    assert type(got) is type(want), label
    assert got.metadata == want.metadata, label
    structure = jax.tree_util.tree_structure
    assert structure(got.value) == structure(want.value), label
    a, b = np.asarray(got.value.data_array), np.asarray(want.value.data_array)
    assert a.dtype == b.dtype and a.shape == b.shape, label
    assert a.tobytes() == b.tobytes(), label


@pytest.mark.parametrize(
    "build",
    [model_zoo.gemma_style_transformer, model_zoo.llamalike_transformer],
    ids=["gemma_style_bfloat16", "llamalike_float32"],
)
def test_export_round_trip_is_exact(tmp_path, build):
  model = build()
  out = tmp_path / "model.safetensors"
  pzp.export_safetensors(model, out)
  unbound, original = pz.unbind_variables(model, freeze=True)
  restored = pzp.pretrained.load_safetensors(out)
  _assert_same_values(restored, original)
  # Same classes, labels, metadata, axis names, dtypes and bits: the rebuilt
  # model is the original one (running it would only cost compile time).
  rebuilt = pz.bind_variables(unbound, restored)
  pz.nn.assert_no_parameter_slots(rebuilt)
  into = pzp.pretrained.load_safetensors(out, into=model)
  _assert_same_values(pz.unbind_variables(into, freeze=True)[1], original)
  assert jax.tree_util.tree_structure(pz.unbind_variables(into)[0]) == (
      jax.tree_util.tree_structure(unbound)
  )
  with pytest.raises(errors.SafetensorsFormatError, match="does not fit"):
    pzp.pretrained.load_safetensors(out, into=model_zoo.mlp())


def test_export_with_bfloat16_is_read_by_plain_safetensors(tmp_path):
  model = model_zoo.gemma_style_transformer()  # bfloat16 parameters.
  out = tmp_path / "model.safetensors"
  pzp.export_safetensors(model, out)
  plain = safetensors.numpy.load_file(out)
  params = {p.label: p.value for p in pz.unbind_params(model)[1]}
  assert plain.keys() == params.keys()
  for label, value in params.items():
    assert plain[label].dtype == value.data_array.dtype
    assert plain[label].tobytes() == np.asarray(value.data_array).tobytes()
  assert any(v.dtype == ml_dtypes.bfloat16 for v in plain.values())
  with safetensors.safe_open(out, framework="numpy") as f:
    info = json.loads(f.metadata()["pz_persist"])
  assert info["format_version"] == 1
  entry = info["tensors"]["gemma/embedder.embeddings"]
  assert entry["axes"] == ["vocabulary", "embedding"] and entry["kind"] == "parameter"


def test_export_from_checkpoint_path(tmp_path):
  model = model_zoo.llamalike_transformer()
  pzp.save_model(tmp_path / "ckpt", model)
  pzp.export_safetensors(tmp_path / "ckpt", tmp_path / "model.safetensors")
  _assert_same_values(
      pzp.pretrained.load_safetensors(tmp_path / "model.safetensors"),
      pz.unbind_variables(model, freeze=True)[1],
  )


def test_hf_model_export_round_trip(saved, tmp_path):
  model = pzp.pretrained.load_hf(saved["gpt_neox"][0], dtype=jnp.bfloat16)
  pzp.export_safetensors(model, tmp_path / "neox.safetensors")
  _assert_same_values(
      pzp.pretrained.load_safetensors(tmp_path / "neox.safetensors"),
      pz.unbind_variables(model, freeze=True)[1],
  )


def test_plain_safetensors_file_is_refused(tmp_path):
  path = tmp_path / "plain.safetensors"
  safetensors.numpy.save_file({"w": np.ones((2, 3), np.float32)}, path)
  with pytest.raises(errors.SafetensorsFormatError, match="no 'pz_persist' metadata"):
    pzp.pretrained.load_safetensors(path)


def test_export_refuses_non_string_labels(tmp_path):
  value = pz.Parameter(value=pz.nx.wrap(jnp.ones(3), "a"), label=("not", "a", "string"))
  with pytest.raises(errors.EncodingError, match="not a string"):
    pzp.export_safetensors([value], tmp_path / "x.safetensors")
  assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("stored,wanted", [
    (np.float32, ml_dtypes.bfloat16), (np.float16, np.float32), (ml_dtypes.bfloat16, np.float16),
])
def test_cast_reads_stream_and_match_astype(tmp_path, monkeypatch, stored, wanted):
  """A cast read goes through a small buffer, piece by piece (several pieces
  and a remainder here), and gives exactly NumPy's cast of the whole tensor."""
  monkeypatch.setattr(safetensors_io, "CAST_BUFFER_BYTES", 64)
  rng = np.random.default_rng(0)
  tensors = {"w": (rng.standard_normal((7, 13)) * 3).astype(stored), "empty": np.zeros((0, 4), stored)}
  path = tmp_path / "t.safetensors"
  safetensors.numpy.save_file(tensors, path)
  file = safetensors_io.SafetensorsFile(path)
  for name, tensor in tensors.items():
    got = file.get(name, dtype=wanted)
    assert got.dtype == np.dtype(wanted) and got.shape == tensor.shape
    np.testing.assert_array_equal(got.view(np.uint8), tensor.astype(wanted).view(np.uint8))
    assert got.size == 0 or got.ctypes.data % 64 == 0  # JAX adopts it without a copy.
  np.testing.assert_array_equal(file.get("w"), tensors["w"])  # No dtype: as stored.
  # A file cut short after its header was read is reported, not zero-filled:
  # as a file that changed since it was opened.
  data = path.read_bytes()
  path.write_bytes(data[: len(data) - 100])
  with pytest.raises(errors.FileChangedError, match="t.safetensors changed while"):
    file.get("w", dtype=wanted)
  file.close()


