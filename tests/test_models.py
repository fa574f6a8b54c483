"""Real Penzai models round-trip with bit-identical outputs (issue: core)."""

from __future__ import annotations

import jax
import model_zoo
import pytest
from penzai import pz
from treecompare import assert_identical
from treecompare import assert_same_outputs

import pz_persist as pzp

MODELS = {
    "mlp": (model_zoo.mlp, model_zoo.mlp_input),
    "llamalike": (lambda: model_zoo.llamalike_transformer(layer_stack=False), model_zoo.tokens),
    "llamalike_layer_stack": (lambda: model_zoo.llamalike_transformer(layer_stack=True), model_zoo.tokens),
    "gemma_style": (model_zoo.gemma_style_transformer, model_zoo.tokens),
}


@pytest.mark.parametrize("name", MODELS)
def test_frozen_params_round_trip(name, ckpt):
  build, make_input = MODELS[name]
  model = build()
  unbound, params = pz.unbind_params(model, freeze=True)
  pzp.save(ckpt, params)

  loaded = pzp.load(ckpt)

  assert_identical(loaded, params)
  rebuilt = pz.bind_variables(unbound, loaded)
  assert_same_outputs(rebuilt(make_input()), model(make_input()))


@pytest.mark.parametrize("name", MODELS)
def test_mutable_variables_round_trip(name, ckpt):
  build, make_input = MODELS[name]
  model = build()
  unbound, variables = pz.unbind_variables(model)
  pzp.save(ckpt, variables)

  loaded = pzp.load(ckpt)

  assert_identical(loaded, variables)
  assert all(isinstance(v, pz.Parameter) for v in loaded)
  rebuilt = pz.bind_variables(unbound, loaded)
  assert_same_outputs(rebuilt(make_input()), model(make_input()))


@pytest.mark.parametrize("layer_stack", [False, True])
def test_kv_cache_state_round_trip(layer_stack, ckpt):
  """Sampling-mode KV caches (Enum metadata under a layer stack) resume exactly."""
  sampler = model_zoo.sampling_model(
      model_zoo.llamalike_transformer(layer_stack=layer_stack)
  )
  unbound, variables = pz.unbind_variables(sampler, freeze=True)
  if layer_stack:
    assert any(v.metadata for v in variables if isinstance(v, pz.StateVariableValue))
  pzp.save(ckpt, variables)

  loaded = pzp.load(ckpt)

  assert_identical(loaded, variables)
  resumed = pz.bind_variables(unbound, loaded, unfreeze_as_copy=True)
  next_tokens = model_zoo.tokens(length=3, offset=5)
  assert_same_outputs(resumed(next_tokens), sampler(next_tokens))


def test_whole_tree_of_model_values(ckpt):
  """One checkpoint holding params, state, RNG key and plain values."""
  sampler = model_zoo.sampling_model(model_zoo.gemma_style_transformer())
  _, params = pz.unbind_params(sampler, freeze=True)
  _, state = pz.unbind_state_vars(sampler, freeze=True)
  tree = {"params": params, "state": state, "rng": jax.random.key(7), "step": 12}
  pzp.save(ckpt, tree)
  assert_identical(pzp.load(ckpt), tree)


def test_shared_parameter_stays_shared(ckpt):
  model = model_zoo.mlp()
  weights = model.sublayers[0].sublayers[0].weights
  tree = {"a": weights, "b": [weights], "model_vars": pz.unbind_variables(model)[1]}
  pzp.save(ckpt, tree)

  loaded = pzp.load(ckpt)

  assert loaded["a"] is loaded["b"][0] is loaded["model_vars"][0]
  assert_identical(loaded, tree)


def test_inspect_reads_no_arrays(ckpt):
  model = model_zoo.llamalike_transformer(layer_stack=True)
  _, params = pz.unbind_params(model, freeze=True)
  pzp.save(ckpt, params)
  for path in (ckpt / "penzai" / "d").iterdir():
    path.unlink()  # No array data left: inspect must not need any.

  abstract = pzp.inspect(ckpt)

  expected = jax.eval_shape(lambda: params)
  assert jax.tree.structure(abstract) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(abstract), jax.tree.leaves(expected)):
    assert isinstance(a, jax.ShapeDtypeStruct)
    assert (a.shape, a.dtype) == (e.shape, e.dtype)
