"""load_gemma: tiny checkpoints in the official Gemma Flax layout, written with
plain Orbax, load into exactly the model Penzai's own converter builds."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from penzai import pz
from penzai.models.transformer.variants import gemma as pz_gemma

import pz_persist as pzp
from pz_persist.pretrained import errors
from pz_persist.pretrained import gemma as gemma_lib
from pz_persist.pretrained import load_gemma
from pz_persist.tools import cli

# Tiny sizes; "like" gives the Gemma 1 / Gemma 2 architecture settings.
GEMMA1 = dict(num_decoder_blocks=2, vocab_size=32, num_kv_heads=1, query_head_multiplier=4,
              embedding_dim=16, projection_dim=8, mlp_hidden_dim=24)
GEMMA2 = dict(num_decoder_blocks=4, vocab_size=32, num_kv_heads=2, query_head_multiplier=2,
              embedding_dim=16, projection_dim=8, mlp_hidden_dim=24)
GEMMA1_MHA = dict(GEMMA1, num_kv_heads=4, query_head_multiplier=1)


def official_params(cfg, *, gemma2: bool, transposed_gating: bool = False, seed: int = 0,
                    extra: dict | None = None) -> dict:
  """Flat ``{"transformer/...": {"w": array}}`` as in the published checkpoints."""
  rng = np.random.default_rng(seed)
  e, p, h = cfg["embedding_dim"], cfg["projection_dim"], cfg["mlp_hidden_dim"]
  kv, heads = cfg["num_kv_heads"], cfg["num_kv_heads"] * cfg["query_head_multiplier"]
  r = lambda *shape: rng.normal(size=shape).astype(np.float32) * 0.3
  params = {
      "transformer/embedder": {"input_embedding": r(cfg["vocab_size"], e)},
      "transformer/final_norm": {"scale": r(e)},
  }
  for i in range(cfg["num_decoder_blocks"]):
    layer = f"transformer/layer_{i}"
    if kv == heads:
      params[f"{layer}/attn/qkv_einsum"] = {"w": r(3, heads, e, p)}
    else:
      params[f"{layer}/attn/q_einsum"] = {"w": r(heads, e, p)}
      params[f"{layer}/attn/kv_einsum"] = {"w": r(2, kv, e, p)}
    params[f"{layer}/attn/attn_vec_einsum"] = {"w": r(heads, p, e)}
    params[f"{layer}/mlp/gating_einsum"] = {"w": r(2, h, e) if transposed_gating else r(2, e, h)}
    params[f"{layer}/mlp/linear"] = {"w": r(h, e)}
    norms = ["pre_attention_norm", "pre_ffw_norm"]
    if gemma2:
      norms += ["post_attention_norm", "post_ffw_norm"]
    for norm in norms:
      params[f"{layer}/{norm}"] = {"scale": r(e)}
  params.update(extra or {})
  return params


def write(path, params) -> str:
  ocp.PyTreeCheckpointer().save(path, params)
  return str(path)


@contextlib.contextmanager
def penzai_preset(cfg, like: str, transpose: bool = False):
  """Registers the tiny preset in Penzai's own table, for the reference model."""
  kwargs = {k: v for k, v in pz_gemma._GEMMA_PRESETS[like].items()
            if k not in gemma_lib._SHAPE_KEYS}
  kwargs.update(cfg)
  pz_gemma._GEMMA_PRESETS["test_tiny"] = kwargs
  pz_gemma._NEEDS_GATING_TRANSPOSE["test_tiny"] = transpose
  try:
    yield "test_tiny"
  finally:
    del pz_gemma._GEMMA_PRESETS["test_tiny"], pz_gemma._NEEDS_GATING_TRANSPOSE["test_tiny"]


def reference(params, cfg, like, transpose=False):
  with penzai_preset(cfg, like, transpose) as name:
    return pz_gemma.gemma_from_pretrained_checkpoint(params, preset_name=name)


TOKENS = pz.nx.wrap(jnp.array([[1, 5, 7, 2, 31, 0]], jnp.int32)).tag("batch", "seq")


def logits(model):
  return np.asarray(model(TOKENS).unwrap("batch", "seq", "vocabulary"))


def values(model) -> dict:
  return {p.label: p.value for p in pz.unbind_params(model)[1]}


@pytest.mark.parametrize("cfg,like,gemma2,transpose", [
    (GEMMA1, "gemma_2b", False, False),
    (GEMMA1_MHA, "gemma_7b", False, False),
    (GEMMA2, "gemma2_2b", True, False),
    (GEMMA2, "gemma2_9b", True, True),
])
def test_tiny_checkpoint_loads_as_penzai_converts_it(tmp_path, cfg, like, gemma2, transpose):
  params = official_params(cfg, gemma2=gemma2, transposed_gating=transpose)
  path = write(tmp_path / "ckpt", params)
  model = load_gemma(path, preset={"like": like})
  expected = reference(params, cfg, like, transpose)
  got, want = values(model), values(expected)
  assert got.keys() == want.keys()
  for label in want:
    assert got[label].named_shape == want[label].named_shape, label
    np.testing.assert_array_equal(np.asarray(got[label].data_array),
                                  np.asarray(want[label].data_array), err_msg=label)
  np.testing.assert_array_equal(logits(model), logits(expected))
  assert "pz_persist_custom" not in pz_gemma._GEMMA_PRESETS  # Registration undone.


def test_custom_preset_never_enters_penzais_tables(tmp_path, monkeypatch):
  """Penzai's preset tables are the same objects with the same contents while
  the conversion runs (seen from inside it, where another thread would look)
  and after it: pz_persist gives the preset to Penzai without writing them."""
  import copy

  from penzai.models.transformer.variants import llamalike_common

  tables = (pz_gemma._GEMMA_PRESETS, pz_gemma._NEEDS_GATING_TRANSPOSE)
  before = copy.deepcopy(tables)
  seen = []
  build = llamalike_common.build_llamalike_transformer

  def spying_build(*args, **kwargs):
    seen.append(copy.deepcopy(tables))
    return build(*args, **kwargs)

  monkeypatch.setattr(llamalike_common, "build_llamalike_transformer", spying_build)
  path = write(tmp_path / "ckpt", official_params(GEMMA2, gemma2=True, transposed_gating=True))
  load_gemma(path, preset={"like": "gemma2_9b"})
  assert seen  # The conversion ran through Penzai's builder.
  assert all(during == before for during in seen)
  assert (pz_gemma._GEMMA_PRESETS, pz_gemma._NEEDS_GATING_TRANSPOSE) == before


def test_nested_layout_loads_the_same(tmp_path):
  params = official_params(GEMMA2, gemma2=True)
  nested: dict = {}
  for key, leaves in params.items():
    node = nested
    for part in key.split("/"):
      node = node.setdefault(part, {})
    node.update(leaves)
  path = write(tmp_path / "ckpt", nested)
  model = load_gemma(path, preset={"like": "gemma2_2b"})
  np.testing.assert_array_equal(logits(model), logits(reference(params, GEMMA2, "gemma2_2b")))


def test_dtype_cast_on_read(tmp_path):
  params = official_params(GEMMA2, gemma2=True)
  path = write(tmp_path / "ckpt", params)
  model = load_gemma(path, preset={"like": "gemma2_2b"}, dtype=jnp.bfloat16)
  assert {v.dtype for v in values(model).values()} == {np.dtype(jnp.bfloat16)}
  cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  np.testing.assert_array_equal(logits(model), logits(reference(cast, GEMMA2, "gemma2_2b")))


def test_axis_rules_shard_by_axis_name(tmp_path):
  params = official_params(GEMMA2, gemma2=True)
  path = write(tmp_path / "ckpt", params)
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  rules = pzp.AxisRules(mesh, {"neurons": "model", "vocabulary": "model",
                               "head_groups": "data", "projection": "model"})
  seen = []
  model = load_gemma(path, preset={"like": "gemma2_2b"}, sharding=rules,
                     progress=lambda done, total: seen.append((done, total)))
  checked = 0
  for label, value in values(model).items():
    dims = (None,) * len(value.positional_shape) + tuple(value.named_axes)
    expected = rules.sharding(dims, value.data_array.shape, what=label)
    assert value.data_array.sharding.is_equivalent_to(expected, value.data_array.ndim), label
    checked += "neurons" in value.named_axes
  assert checked == 3 * GEMMA2["num_decoder_blocks"]
  gating = values(model)["transformer/block_0/mlp/gating_linear.weights"]
  assert gating.data_array.sharding.spec == jax.sharding.PartitionSpec(None, "model")
  np.testing.assert_allclose(logits(model), logits(reference(params, GEMMA2, "gemma2_2b")),
                             rtol=1e-5, atol=1e-5)
  assert seen[-1][0] == seen[-1][1] and len(seen) >= len(params)


def test_one_sharding_for_all(tmp_path):
  path = write(tmp_path / "ckpt", official_params(GEMMA1, gemma2=False))
  device = jax.devices()[3]
  model = load_gemma(path, preset={"like": "gemma_2b"},
                     sharding=jax.sharding.SingleDeviceSharding(device))
  assert all(v.data_array.devices() == {device} for v in values(model).values())


def test_auto_preset_matches_shapes_or_lists_presets(tmp_path, monkeypatch):
  params = official_params(GEMMA2, gemma2=True)
  path = write(tmp_path / "ckpt", params)
  with pytest.raises(errors.GemmaCheckpointError) as info:
    load_gemma(path)
  message = str(info.value)
  assert all(name in message for name in ("gemma_2b", "gemma2_9b", "gemma2_27b"))
  assert "Gemma 2-style" in message and "'embedding_dim': 16" in message
  assert isinstance(info.value, pzp.PzPersistError)
  # "auto" picks a preset by shapes, not only by the number of layers.
  tiny = dict(pz_gemma._GEMMA_PRESETS["gemma2_2b"], **GEMMA2)
  monkeypatch.setitem(pz_gemma._GEMMA_PRESETS, "tiny_gemma2", tiny)
  monkeypatch.setitem(pz_gemma._NEEDS_GATING_TRANSPOSE, "tiny_gemma2", False)
  model = load_gemma(path)
  np.testing.assert_array_equal(logits(model), logits(reference(params, GEMMA2, "gemma2_2b")))


def test_unknown_and_gemma3_presets_are_refused(tmp_path):
  path = write(tmp_path / "ckpt", official_params(GEMMA2, gemma2=True))
  with pytest.raises(errors.GemmaCheckpointError, match="no Gemma 3 presets"):
    load_gemma(path, preset="gemma3_4b")
  with pytest.raises(errors.GemmaCheckpointError, match="unknown Gemma preset 'gemma_3b'.*gemma2_2b"):
    load_gemma(path, preset="gemma_3b")
  with pytest.raises(errors.GemmaCheckpointError, match="preset's sizes differ"):
    load_gemma(path, preset={"like": "gemma2_2b", "embedding_dim": 32})


def test_incomplete_gemma3_checkpoint_is_refused(tmp_path):
  """Gemma 3's query norms on a tree that lacks the rest of Gemma 3 (a key
  norm per layer): refused, naming the first array missing."""
  extra = {f"transformer/layer_{i}/attn/_query_norm": {"scale": np.ones(8, np.float32)}
           for i in range(4)}
  extra["transformer/layer_0/attn/_key_norm"] = {"scale": np.ones(8, np.float32)}
  path = write(tmp_path / "ckpt", official_params(GEMMA2, gemma2=True, extra=extra))
  with pytest.raises(errors.GemmaCheckpointError,
                     match="Gemma 3's query norms but not 'transformer/layer_1/attn/_key_norm'"):
    load_gemma(path, preset={"like": "gemma2_2b"})


def test_gemma3n_checkpoint_is_not_called_gemma3(tmp_path):
  extra = {"transformer/layer_0/altup": {"w": np.ones((2, 8), np.float32)},
           "transformer/layer_0/attn/_query_norm": {"scale": np.ones(8, np.float32)}}
  path = write(tmp_path / "ckpt", official_params(GEMMA2, gemma2=True, extra=extra))
  with pytest.raises(errors.GemmaCheckpointError, match="Gemma 3n checkpoint") as raised:
    load_gemma(path, preset={"like": "gemma2_2b"})
  assert "Gemma 3 checkpoint" not in str(raised.value)


def test_incomplete_gemma4_checkpoint_is_named(tmp_path):
  """A tree with Gemma 4's ``skip_scale`` (and per-layer inputs, which are
  not Gemma 3n's) but not its other blocks is named as an incomplete Gemma 4
  (complete ones load: tests/pretrained/test_gemma4_flax.py)."""
  extra = {"transformer/layer_0": {"skip_scale": np.ones(1, np.float32)},
           "transformer/layer_0/per_layer_input_gate": {"w": np.ones((8, 2), np.float32)},
           "transformer/layer_0/attn/query_norm": {"scale": np.ones(8, np.float32)}}
  path = write(tmp_path / "ckpt", official_params(GEMMA2, gemma2=True, extra=extra))
  with pytest.raises(errors.GemmaCheckpointError, match="not a complete Gemma 4") as raised:
    load_gemma(path, preset={"like": "gemma2_2b"})
  assert "3n" not in str(raised.value)
  extra = {"transformer/layer_1": {"skip_scale": np.ones(1, np.float32)}}
  path = write(tmp_path / "later", official_params(GEMMA2, gemma2=True, extra=extra))
  with pytest.raises(errors.GemmaCheckpointError, match="layer_0/skip_scale"):
    load_gemma(path, preset={"like": "gemma2_2b"})


def test_not_a_checkpoint(tmp_path):
  with pytest.raises(pzp.errors.NotACheckpointError):
    load_gemma(tmp_path / "missing")


def test_cli_convert_gemma(tmp_path, capsys, monkeypatch):
  params = official_params(GEMMA2, gemma2=True)
  write(tmp_path / "ckpt", params)
  monkeypatch.chdir(tmp_path)  # Relative paths, as typed at a shell.
  src, dst = "ckpt", "native"
  assert cli.main(["convert", "gemma", src, dst, "--preset-like", "gemma2_2b",
                   "--dtype", "bfloat16"]) == 0
  model = pzp.load_model(dst)
  assert {v.dtype for v in values(model).values()} == {np.dtype(jnp.bfloat16)}
  cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  np.testing.assert_array_equal(logits(model), logits(reference(cast, GEMMA2, "gemma2_2b")))
  assert "wrote" in capsys.readouterr().out
  assert cli.main(["convert", "gemma", src, dst, "--preset-like", "gemma2_2b"]) == 2
  assert "exists" in capsys.readouterr().err
  assert cli.main(["convert", "gemma", src, dst, "--preset-like", "gemma2_2b",
                   "--overwrite"]) == 0
  assert {v.dtype for v in values(pzp.load_model(dst)).values()} == {np.dtype(np.float32)}


def test_cli_convert_hf(tmp_path, capsys):
  import importlib.util  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel

  from pz_persist.pretrained import hf  # pylint: disable=import-outside-toplevel

  here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  spec = importlib.util.spec_from_file_location(
      "pretrained_benchmark", os.path.join(here, "benchmarks", "pretrained.py"))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  src, dst = str(tmp_path / "hf"), str(tmp_path / "native")
  bench.write_llama(src, 2**18, shards=2)
  assert cli.main(["convert", "hf", src, dst, "--dtype", "bfloat16", "--quiet"]) == 0
  assert "wrote" in capsys.readouterr().out
  model = pzp.load_model(dst)
  assert {v.dtype for v in values(model).values()} == {np.dtype(jnp.bfloat16)}
  direct = hf.load_hf(src, dtype=jnp.bfloat16)
  assert values(model).keys() == values(direct).keys()
  tokens = pz.nx.wrap(jnp.array([[1, 5, 7, 2]], jnp.int32)).tag("batch", "seq")
  np.testing.assert_array_equal(np.asarray(model(tokens).unwrap("batch", "seq", "vocabulary")),
                                np.asarray(direct(tokens).unwrap("batch", "seq", "vocabulary")))
