"""load_into(path, model): binding by label, every option, every refusal."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import model_zoo
import numpy as np
import pytest
import treescope
from penzai import pz
from penzai.models import simple_mlp
from penzai.models.transformer.variants import llamalike_common as llamalike
from penzai.toolshed import lora
from treecompare import assert_identical
from treecompare import assert_same_outputs

import pz_persist as pzp
from pz_persist.storage.reading import reader


def _fresh_mlp(name="mlp", sizes=(8, 16, 8), seed=42):
  return simple_mlp.MLP.from_config(
      name=name, init_base_rng=jax.random.key(seed), feature_sizes=list(sizes)
  )


def _fresh_transformer(**overrides):
  config = dataclasses.replace(model_zoo.llamalike_config(layer_stack=False), **overrides)
  return llamalike.build_llamalike_transformer(
      config, init_base_rng=jax.random.key(11), name="transformer"
  )


def _values(model):
  return {p.label: p.value for p in pz.unbind_params(model, freeze=True)[1]}


def _saved_mlp(ckpt):
  model = model_zoo.mlp()
  pzp.save_model(ckpt, model)
  return model


def test_into_a_fresh_model(ckpt):
  saved = _saved_mlp(ckpt)
  fresh = _fresh_mlp()
  before = _values(fresh)

  loaded = pzp.load_into(ckpt, fresh)

  assert_same_outputs(loaded(model_zoo.mlp_input()), saved(model_zoo.mlp_input()))
  assert_identical(_values(fresh), before)  # The model passed in is unchanged.


def test_into_an_unbound_model(ckpt):
  saved = _saved_mlp(ckpt)
  unbound, _ = pz.unbind_params(_fresh_mlp())
  loaded = pzp.load_into(ckpt, unbound)
  assert_same_outputs(loaded(model_zoo.mlp_input()), saved(model_zoo.mlp_input()))


def test_params_checkpoint_written_by_save(ckpt):
  saved = model_zoo.llamalike_transformer()
  pzp.save(ckpt, pz.unbind_params(saved, freeze=True)[1])
  loaded = pzp.load_into(ckpt, _fresh_transformer())
  assert_same_outputs(loaded(model_zoo.tokens()), saved(model_zoo.tokens()))


def test_strict_error_lists_every_difference_and_changes_nothing(ckpt):
  _saved_mlp(ckpt)
  target = pz.nn.Sequential([
      _fresh_mlp(sizes=(8, 12, 8)),  # Different hidden size: shape mismatches.
      pz.nn.Linear.from_config(
          name="extra", init_base_rng=jax.random.key(0),
          input_axes={"features": 8}, output_axes={"out": 2},
      ),
  ])
  before = _values(target)
  with pytest.raises(pzp.BindingError) as raised:
    pzp.load_into(ckpt, target)
  message = str(raised.value)
  assert "1 missing from the checkpoint:\n  extra.weights" in message
  assert "mlp/Affine_0/Linear.weights: shape differs" in message
  assert "features_out:16" in message and "features_out:12" in message
  assert message.count("shape differs") == 3  # All listed at once.
  assert raised.value.report.missing == ("extra.weights",)
  assert_identical(_values(target), before)


def test_unexpected_labels_are_reported(ckpt):
  _saved_mlp(ckpt)
  partial_model = pz.nn.Sequential([_fresh_mlp().sublayers[0]])
  with pytest.raises(pzp.BindingError, match=r"2 not in the model:\n  mlp/Affine_1/Linear.weights"):
    pzp.load_into(ckpt, partial_model)


def test_non_strict_returns_a_report(ckpt):
  _saved_mlp(ckpt)
  model, report = pzp.load_into(ckpt, _fresh_mlp(name="other"), strict=False)
  assert report.loaded == () and not report.ok
  assert set(report.missing) == set(_values(model))
  assert "4 missing from the checkpoint" in str(report)
  assert "LoadReport" in treescope.render_to_text(report)


def test_only_loads_a_subset(ckpt):
  saved = _saved_mlp(ckpt)
  fresh = _fresh_mlp()
  loaded = pzp.load_into(ckpt, fresh, only="mlp/Affine_0/*")
  values, saved_values, fresh_values = _values(loaded), _values(saved), _values(fresh)
  assert_identical(values["mlp/Affine_0/Linear.weights"], saved_values["mlp/Affine_0/Linear.weights"])
  assert_identical(values["mlp/Affine_1/Linear.weights"], fresh_values["mlp/Affine_1/Linear.weights"])


def test_only_reads_only_the_selected_arrays(ckpt, monkeypatch):
  _saved_mlp(ckpt)
  requested = []
  original = reader.read_arrays

  def spy(directory, manifest, **kwargs):
    requested.append(sorted(kwargs["refs"]))
    return original(directory, manifest, **kwargs)

  monkeypatch.setattr(reader, "read_arrays", spy)
  pzp.load_into(ckpt, _fresh_mlp(), only="*Linear.weights")
  manifest = pzp.checkpoint.read_manifest(ckpt)
  assert [manifest.arrays[i].label for i in requested[0]] == [
      "mlp/Affine_0/Linear.weights", "mlp/Affine_1/Linear.weights"]


def test_rename_rules(ckpt):
  saved = _saved_mlp(ckpt)
  loaded, report = pzp.load_into(
      ckpt, _fresh_mlp(name="net"), rename={r"^mlp/": "net/"}, strict=False
  )
  assert report.ok and ("mlp/Affine_0/AddBias.bias", "net/Affine_0/AddBias.bias") in report.renamed
  assert_same_outputs(loaded(model_zoo.mlp_input()), saved(model_zoo.mlp_input()))


def _saved_transformer_with(ckpt, change):
  saved = model_zoo.llamalike_transformer()
  params = tuple(change(p) for p in pz.unbind_params(saved, freeze=True)[1])
  pzp.save(ckpt, params)
  return saved


def test_stored_axes_in_another_order_are_transposed(ckpt):
  def reverse_query(p):
    if not p.label.endswith("query.weights"):
      return p
    return dataclasses.replace(p, value=p.value.order_as(*reversed(list(p.value.named_axes))))

  saved = _saved_transformer_with(ckpt, reverse_query)
  loaded, report = pzp.load_into(ckpt, _fresh_transformer(), strict=False)
  assert report.ok and set(report.transposed) == {
      "transformer/block_0/attention/query.weights",
      "transformer/block_1/attention/query.weights",
  }
  assert_same_outputs(loaded(model_zoo.tokens()), saved(model_zoo.tokens()))


def test_rename_axes(ckpt):
  def rename_embedding(p):
    if "embedding" not in p.value.named_axes:
      return p
    return dataclasses.replace(p, value=p.value.untag("embedding").tag("d_model"))

  saved = _saved_transformer_with(ckpt, rename_embedding)
  with pytest.raises(pzp.BindingError, match="axes differs.*d_model"):
    pzp.load_into(ckpt, _fresh_transformer())
  loaded = pzp.load_into(ckpt, _fresh_transformer(), rename_axes={"d_model": "embedding"})
  assert_same_outputs(loaded(model_zoo.tokens()), saved(model_zoo.tokens()))


def test_dtype_mismatch_is_an_error_not_a_silent_cast(ckpt):
  _saved_mlp(ckpt)
  unbound, params = pz.unbind_params(_fresh_mlp(), freeze=True)
  target = pz.bind_variables(
      unbound,
      [dataclasses.replace(p, value=p.value.astype(jnp.bfloat16)) for p in params],
      unfreeze_as_copy=True,
  )
  with pytest.raises(pzp.BindingError, match="dtype differs: checkpoint has float32, model wants bfloat16"):
    pzp.load_into(ckpt, target)
  loaded, report = pzp.load_into(ckpt, target, dtype=jnp.bfloat16, strict=False)
  assert report.ok and len(report.cast) == 4
  assert {v.dtype for v in _values(loaded).values()} == {jnp.dtype(jnp.bfloat16)}


def test_dtype_rules_per_label_glob(ckpt):
  _saved_mlp(ckpt)
  loaded, report = pzp.load_into(
      ckpt, _fresh_mlp(), strict=False,
      dtype={"*Linear.weights": jnp.bfloat16, "*": jnp.float16},
  )
  dtypes = {label: v.dtype for label, v in _values(loaded).items()}
  assert dtypes["mlp/Affine_0/Linear.weights"] == jnp.bfloat16
  assert dtypes["mlp/Affine_0/AddBias.bias"] == jnp.float16
  assert report.ok


@pytest.mark.parametrize(
    "stored, target, reason",
    [
        (jnp.array([1.0, 1e30]), jnp.float16, "overflow to inf"),
        (jnp.array([1.5, 2.0]), jnp.int32, "would truncate"),
        (jnp.array([1, 300], jnp.int32), jnp.int8, "cannot hold exactly"),
        (jnp.array([16777217], jnp.int32), jnp.float32, "cannot hold exactly"),
    ],
    ids=["float-overflow", "float-to-int", "int-overflow", "int-to-float-inexact"],
)
def test_lossy_casts_are_refused_unless_allowed(stored, target, reason, ckpt):
  pzp.save(ckpt, [pz.ParameterValue(label="w", value=stored)])
  model = pz.nn.Sequential([pz.nn.AddBias(
      bias=pz.Parameter(label="w", value=jnp.zeros(stored.shape, target)), new_axis_names=())])
  with pytest.raises(pzp.BindingError, match=reason):
    pzp.load_into(ckpt, model, dtype={"w": target})
  loaded = pzp.load_into(ckpt, model, dtype={"w": target}, allow_lossy=True)
  assert loaded.sublayers[0].bias.value.dtype == target


def test_narrowing_floats_is_done(ckpt):
  pzp.save(ckpt, [pz.ParameterValue(label="w", value=jnp.array([1.0, 1.0001, 3e38]))])
  model = pz.nn.Sequential([pz.nn.AddBias(
      bias=pz.Parameter(label="w", value=jnp.zeros(3, jnp.bfloat16)), new_axis_names=())])
  loaded = pzp.load_into(ckpt, model, dtype=jnp.bfloat16)
  np.testing.assert_array_equal(
      loaded.sublayers[0].bias.value, jnp.array([1.0, 1.0001, 3e38]).astype(jnp.bfloat16))


def test_overlay_base_then_adapter(ckpt, tmp_path):
  base = model_zoo.llamalike_transformer()
  pzp.save(ckpt, pz.unbind_params(base, freeze=True)[1])
  model = lora.loraify_linears_in_selection(
      pz.select(_fresh_transformer()).at_instances_of(pz.nn.Linear),
      rank=2, init_base_rng=jax.random.key(5),
  )
  with pytest.raises(pzp.BindingError, match="missing from the checkpoint"):
    pzp.load_into(ckpt, model)
  model = pzp.load_into(ckpt, model, overlay=True)
  assert_same_outputs(model(model_zoo.tokens()), base(model_zoo.tokens()))  # LoRA B is 0.

  trained_adapter = [
      dataclasses.replace(p, value=p.value + 0.5)
      for p in pz.unbind_params(model, freeze=True)[1] if "LoRA" in p.label
  ]
  pzp.save(tmp_path / "adapter", trained_adapter)
  adapted = pzp.load_into(tmp_path / "adapter", model, overlay=True)
  adapted_values = _values(adapted)
  for p in trained_adapter:
    assert_identical(adapted_values[p.label], p.value)
  base_values = _values(base)
  assert_identical(adapted_values["transformer/embedder.embeddings"],
                   base_values["transformer/embedder.embeddings"])


def test_kind_mismatch(ckpt):
  pzp.save(ckpt, [pz.StateVariableValue(label="w", value=jnp.zeros(3))])
  model = pz.nn.Sequential([pz.nn.AddBias(
      bias=pz.Parameter(label="w", value=jnp.zeros(3)), new_axis_names=())])
  with pytest.raises(pzp.BindingError, match="w: kind differs: checkpoint has state_variable, model wants parameter"):
    pzp.load_into(ckpt, model)


def test_kv_cache_state_into_a_new_sampler(ckpt):
  sampler = model_zoo.sampling_model(model_zoo.llamalike_transformer(layer_stack=True))
  pzp.save_model(ckpt, sampler)
  fresh = model_zoo.sampling_model(model_zoo.llamalike_transformer(layer_stack=True))
  fresh(model_zoo.tokens(length=2, offset=3))  # Different cache contents.
  loaded = pzp.load_into(ckpt, fresh)
  step = model_zoo.tokens(length=3, offset=5)
  assert_same_outputs(loaded(step), sampler(step))


def test_options_without_into_are_refused(ckpt):
  _saved_mlp(ckpt)
  with pytest.raises(ValueError, match=r"only, rename need a model to load into.*load_into"):
    pzp.load_model(ckpt, only="*", rename={"a": "b"})
  with pytest.raises(TypeError, match="unknown binding option.*onyl"):
    pzp.load_model(ckpt, onyl="*")  # type: ignore[call-overload]
