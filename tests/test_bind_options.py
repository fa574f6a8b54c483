"""`pzp.BindOptions`: one value for how a checkpoint binds into a model.

Every entry point that binds into a model (`load_into`, plain Orbax through
it, `migrate`, the deprecated ``load_model(into=)``) takes the options as this
value or as keywords; both spellings must bind the same, and the older
``load_model(path, into=model)`` must keep working while it warns.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings

import hypothesis
import jax.numpy as jnp
import model_zoo
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import strategies as st
from penzai import pz

import pz_persist as pzp
from pz_persist import binding
from pz_persist import errors


def _values(model):
  return {v.label: np.asarray(v.value.unwrap(*v.value.named_axes)
                              if isinstance(v.value, pz.nx.NamedArray) else v.value)
          for v in pz.unbind_variables(model, freeze=True)[1]}


def _same(a, b):
  va, vb = _values(a), _values(b)
  assert va.keys() == vb.keys()
  for label in va:
    assert va[label].dtype == vb[label].dtype and np.array_equal(va[label], vb[label]), label


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  path = tmp_path_factory.mktemp("bind") / "mlp"
  pzp.save_model(path, model_zoo.mlp())
  return path


def test_the_keywords_are_the_fields():
  """`BindKeywords` (the typed ``**keywords``) and `BindOptions` name the
  same options with the same types: one list, never two that drift."""
  fields = {f.name: f.type for f in dataclasses.fields(pzp.BindOptions)}
  keywords = typing.get_type_hints(binding.BindKeywords)
  assert set(keywords) == set(fields)


def test_options_are_frozen_and_unknown_keywords_are_refused():
  options = pzp.BindOptions(dtype=jnp.bfloat16)
  with pytest.raises(dataclasses.FrozenInstanceError):
    options.dtype = None  # type: ignore[misc]
  with pytest.raises(errors.ArgumentTypeError, match="renmae.*the options are"):
    options.with_keywords(renmae={"a": "b"})
  with pytest.raises(TypeError):
    pzp.BindOptions(jnp.bfloat16)  # type: ignore[misc]  # Keywords only.
  with pytest.raises(errors.ArgumentTypeError, match="must be a pz_persist.BindOptions"):
    pzp.load_into("/nonexistent", model_zoo.mlp(), {"dtype": "bfloat16"})  # type: ignore[call-overload]


def test_keywords_beside_options_win(saved):
  options = pzp.BindOptions(dtype=jnp.bfloat16, only="mlp/Affine_0/*")
  both = pzp.load_into(saved, model_zoo.mlp(), options, dtype=None)
  plain = pzp.load_into(saved, model_zoo.mlp(), only="mlp/Affine_0/*")
  _same(both, plain)
  assert options.dtype == jnp.bfloat16  # The value given is not changed.


_OPTIONS = st.fixed_dictionaries({}, optional={
    "only": st.sampled_from(["mlp/Affine_0/*", ["mlp/*"], "*Linear.weights"]),
    "dtype": st.sampled_from([jnp.bfloat16, jnp.float32, {"mlp/Affine_1/*": jnp.float16}]),
    "rename": st.sampled_from([{"^mlp/": "mlp/"}, [("^(mlp)/", r"\1/")]]),
    "overlay": st.booleans(),
    "allow_lossy": st.booleans(),
})


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(options=_OPTIONS, split=st.integers(0, 5))
def test_a_value_and_keywords_bind_the_same(saved, options, split):
  """Generated options given as keywords, as a value, and split between the
  two bind the same model, with the same report."""
  names = sorted(options)
  in_value = {k: options[k] for k in names[:split]}
  as_keywords, report_k = pzp.load_into(saved, model_zoo.mlp(), strict=False, **options)
  as_value, report_v = pzp.load_into(
      saved, model_zoo.mlp(), pzp.BindOptions(**options), strict=False)
  split_up, report_s = pzp.load_into(
      saved, model_zoo.mlp(), pzp.BindOptions(**in_value), strict=False,
      **{k: options[k] for k in names[split:]})
  _same(as_keywords, as_value)
  _same(as_keywords, split_up)
  assert report_k == report_v == report_s


def test_load_model_into_still_works_and_warns(saved):
  with pytest.warns(DeprecationWarning, match=r"load_model\(path, into=model\).*2027-06-01.*load_into\(path, model\)"):
    old = pzp.load_model(saved, into=model_zoo.mlp(), dtype=jnp.bfloat16, only="mlp/*")
  _same(old, pzp.load_into(saved, model_zoo.mlp(), dtype=jnp.bfloat16, only="mlp/*"))
  with pytest.warns(DeprecationWarning):
    old, report = pzp.load_model(
        saved, into=model_zoo.mlp(), options=pzp.BindOptions(dtype=jnp.bfloat16),
        strict=False)
  assert report.cast and all(v.dtype == jnp.bfloat16 for v in _values(old).values())


def test_load_model_alone_warns_nothing_and_refuses_binding_options(saved):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    pzp.load_model(saved)
  with pytest.raises(errors.ArgumentError, match="only need a model to load into.*load_into"):
    pzp.load_model(saved, only="mlp/*")
  with pytest.raises(errors.ArgumentError, match="options need a model to load into"):
    pzp.load_model(saved, options=pzp.BindOptions())  # type: ignore[call-overload]
  with pytest.raises(errors.ArgumentTypeError, match="unknown binding option.*onyl"):
    pzp.load_into(saved, model_zoo.mlp(), onyl="mlp/*")  # type: ignore[call-overload]


def test_plain_orbax_and_migrate_take_the_value(tmp_path):
  model = model_zoo.mlp()
  _, params = pz.unbind_params(model, freeze=True)
  plain = tmp_path / "plain"
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(plain, params)
  bf16 = pzp.BindOptions(dtype=jnp.bfloat16)
  loaded = pzp.load_into(plain, model_zoo.mlp(), bf16)
  assert all(v.dtype == jnp.bfloat16 for v in _values(loaded).values())
  with pytest.raises(errors.ArgumentError, match="rename cannot apply"):
    pzp.load_into(plain, model_zoo.mlp(), bf16.with_keywords(rename={"a": "b"}))
  migrated = pzp.migrate(plain, tmp_path / "native", model_zoo.mlp(), bf16)
  _same(migrated, pzp.load_model(tmp_path / "native"))
  assert all(v.dtype == jnp.bfloat16 for v in _values(migrated).values())
