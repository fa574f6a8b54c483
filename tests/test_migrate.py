"""Checkpoints written the old way (plain Orbax, no pz_persist): loaded into a
model built by code, and migrated to native checkpoints."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import model_zoo
import numpy as np
import orbax.checkpoint as ocp
import pytest
from penzai import pz
from penzai.models import simple_mlp
from penzai.models.transformer import sampling_mode
from penzai.models.transformer.variants import llamalike_common as llamalike
from treecompare import assert_identical
from treecompare import assert_same_outputs

import pz_persist as pzp
from pz_persist import errors

P = jax.sharding.PartitionSpec
CHECKPOINTERS = [ocp.StandardCheckpointer, ocp.PyTreeCheckpointer]


def _fresh_mlp(sizes=(8, 16, 8), seed=42):
  return simple_mlp.MLP.from_config(
      name="mlp", init_base_rng=jax.random.key(seed), feature_sizes=list(sizes)
  )


def _fresh_transformer():
  return llamalike.build_llamalike_transformer(
      model_zoo.llamalike_config(layer_stack=False), init_base_rng=jax.random.key(11),
      name="transformer",
  )


def _params(model):
  return pz.unbind_params(model, freeze=True)[1]


def _save_plain(path, tree, checkpointer=ocp.StandardCheckpointer):
  """What Penzai users did before pz_persist."""
  with checkpointer() as c:
    c.save(path, tree)


def _assert_params(model, params):
  """``model`` holds exactly ``params``: same labels in order, same bits."""
  assert_identical(tuple(_params(model)), tuple(params))


def _snapshot(model):
  return [np.asarray(x) for x in jax.tree.leaves(_params(model))]


def _unchanged(model, snapshot):
  return all(np.array_equal(a, b) for a, b in zip(_snapshot(model), snapshot))


@pytest.mark.parametrize("checkpointer", CHECKPOINTERS, ids=["standard", "pytree"])
@pytest.mark.parametrize(
    "saved, fresh",
    [(model_zoo.mlp, _fresh_mlp), (model_zoo.llamalike_transformer, _fresh_transformer)],
    ids=["mlp", "transformer"],
)
def test_plain_params_load_into_a_model_bit_exact(ckpt, checkpointer, saved, fresh):
  saved, fresh = saved(), fresh()
  _save_plain(ckpt, _params(saved), checkpointer)
  before = _snapshot(fresh)

  loaded = pzp.load_into(ckpt, fresh)

  _assert_params(loaded, _params(saved))
  assert _unchanged(fresh, before)  # The model passed in is left as it was.
  loaded_again, report = pzp.load_into(ckpt, fresh, strict=False)
  assert report.ok and set(report.loaded) == {p.label for p in _params(saved)}
  _assert_params(loaded_again, _params(saved))


def test_loaded_model_computes_what_the_saved_one_did(ckpt):
  saved = model_zoo.mlp()
  _save_plain(ckpt, _params(saved))
  loaded = pzp.load_into(ckpt, _fresh_mlp())
  assert_same_outputs(loaded(model_zoo.mlp_input()), saved(model_zoo.mlp_input()))


def _sampling(base):
  return sampling_mode.KVCachingTransformerLM.from_uncached(
      base, cache_len=16, batch_axes={"batch": 2}
  )


@pytest.mark.parametrize("layout", ["list", "index_dict", "variables", "frozen_model"])
def test_every_layout_of_the_old_way(ckpt, layout):
  if layout in ("list", "index_dict"):
    saved, fresh = model_zoo.mlp(), _fresh_mlp()
    params = _params(saved)
    tree = list(params) if layout == "list" else {str(i): p for i, p in enumerate(params)}
    expected = params
  else:  # A model with state (KV caches, filled by a prompt).
    saved = model_zoo.sampling_model(model_zoo.llamalike_transformer())
    fresh = _sampling(_fresh_transformer())
    expected = pz.unbind_variables(saved, freeze=True)[1]
    tree = expected if layout == "variables" else pz.freeze_variables(saved)
  _save_plain(ckpt, tree)

  loaded = pzp.load_into(ckpt, fresh)

  assert_identical(tuple(pz.unbind_variables(loaded, freeze=True)[1]), tuple(expected))


def test_shapes_that_differ_are_all_listed_and_nothing_is_loaded(ckpt):
  _save_plain(ckpt, _params(model_zoo.mlp()))  # features 8 -> 16 -> 8
  fresh = _fresh_mlp(sizes=(8, 32, 8))
  labels = [p.label for p in _params(fresh)]
  before = _snapshot(fresh)

  with pytest.raises(pzp.BindingError) as raised:
    pzp.load_into(ckpt, fresh)

  message = str(raised.value)
  assert "plain Orbax checkpoint" in message and "by position" in message
  assert "3 could not be loaded" in message
  mismatched = {m.label: m for m in raised.value.report.mismatched}
  assert set(mismatched) == set(labels[:3])  # The last bias, [8], fits.
  assert all(m.what == "shape" for m in mismatched.values())
  assert "float32[8, 16] at 0.value.data_array" in str(mismatched[labels[0]])
  assert "float32[8, 32]" in str(mismatched[labels[0]])
  assert _unchanged(fresh, before)


def test_strict_false_loads_what_fits_and_reports_the_rest(ckpt):
  saved = model_zoo.mlp()
  _save_plain(ckpt, _params(saved))
  fresh = _fresh_mlp(sizes=(8, 32, 8))

  loaded, report = pzp.load_into(ckpt, fresh, strict=False)

  labels = [p.label for p in _params(fresh)]
  assert report.loaded == (labels[3],) and not report.ok
  assert [m.label for m in report.mismatched] == labels[:3]
  new, old = _params(loaded), _params(fresh)
  assert_identical(new[3], _params(saved)[3])
  assert_identical(tuple(new[:3]), tuple(old[:3]))


def test_missing_and_unexpected_arrays(ckpt, tmp_path):
  params = _params(model_zoo.mlp())
  _save_plain(ckpt, params[:-1])
  with pytest.raises(pzp.BindingError, match="1 missing") as raised:
    pzp.load_into(ckpt, _fresh_mlp())
  assert raised.value.report.missing == (params[-1].label,)

  extra = dataclasses.replace(params[0], label="extra")
  _save_plain(tmp_path / "more", (*params, extra))
  with pytest.raises(pzp.BindingError, match=r"array at 4\.value\.data_array"):
    pzp.load_into(tmp_path / "more", _fresh_mlp())
  _, report = pzp.load_into(tmp_path / "more", _fresh_mlp(), strict=False)
  assert len(report.unexpected) == 1 and len(report.loaded) == 4


def test_dtype_must_match_unless_cast(ckpt):
  saved = model_zoo.mlp()
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params(saved))
  _save_plain(ckpt, bf16)
  with pytest.raises(pzp.BindingError, match="dtype differs: checkpoint has bfloat16"):
    pzp.load_into(ckpt, _fresh_mlp())

  loaded, report = pzp.load_into(ckpt, _fresh_mlp(), dtype=jnp.float32, strict=False)

  assert report.ok and len(report.cast) == 4
  assert report.cast[0][1:] == ("bfloat16", "float32")
  _assert_params(loaded, jax.tree.map(lambda x: x.astype(jnp.float32), bf16))


def test_64_bit_arrays_are_refused_when_jax_would_narrow_them(ckpt):
  params = jax.tree.map(lambda x: np.asarray(x, np.float64), _params(model_zoo.mlp()))
  _save_plain(ckpt, params)
  with pytest.raises(pzp.BindingError, match="jax_enable_x64"):
    pzp.load_into(ckpt, _fresh_mlp(), dtype=jnp.float32)


def test_only_loads_the_selected_labels(ckpt):
  saved, fresh = model_zoo.mlp(), _fresh_mlp()
  _save_plain(ckpt, _params(saved))

  loaded, report = pzp.load_into(ckpt, fresh, only="*Affine_0*", strict=False)

  assert report.ok and len(report.loaded) == 2
  assert_identical(tuple(_params(loaded)[:2]), tuple(_params(saved)[:2]))
  assert_identical(tuple(_params(loaded)[2:]), tuple(_params(fresh)[2:]))


@pytest.mark.parametrize(
    "option", [{"rename": {"a": "b"}}, {"rename_axes": {"a": "b"}}, {"overlay": True}]
)
def test_options_that_need_labels_or_axes_are_refused(ckpt, option):
  _save_plain(ckpt, _params(model_zoo.mlp()))
  with pytest.raises(ValueError, match=f"plain Orbax checkpoint.*{next(iter(option))}"):
    pzp.load_into(ckpt, _fresh_mlp(), **option)


def test_a_checkpoint_of_something_else(ckpt):
  _save_plain(ckpt, {"x": jnp.ones(3)})
  with pytest.raises(errors.NotACheckpointError, match=r"no array in it is where.*at x"):
    pzp.load_into(ckpt, _fresh_mlp())


def test_loading_without_a_model_says_how(ckpt):
  _save_plain(ckpt, _params(model_zoo.mlp()))
  for load in (pzp.load, pzp.load_model):
    with pytest.raises(errors.NotACheckpointError, match=r"load_into\(path, model\)"):
      load(ckpt)


def test_the_model_must_hold_its_values(ckpt):
  _save_plain(ckpt, _params(model_zoo.mlp()))
  unbound, _ = pz.unbind_params(_fresh_mlp())
  with pytest.raises(errors.PzPersistError, match="must hold a value for each"):
    pzp.load_into(ckpt, unbound)
  with pytest.raises(errors.PzPersistError, match="the model has none"):
    pzp.load_into(ckpt, pz.freeze_params(_fresh_mlp()))


def test_an_item_of_a_step_directory(tmp_path):
  params = _params(model_zoo.mlp())
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    checkpointer.save(tmp_path / "step", args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        other=ocp.args.StandardSave({"x": jnp.ones(2)}),
    ))
  with pytest.raises(errors.NotACheckpointError, match=r"several Orbax items \(other, params\)"):
    pzp.load_into(tmp_path / "step", _fresh_mlp())
  _assert_params(pzp.load_into(tmp_path / "step" / "params", _fresh_mlp()), params)

  with ocp.CheckpointManager(tmp_path / "run") as manager:  # One item: found.
    manager.save(3, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))
  _assert_params(pzp.load_into(tmp_path / "run" / "3", _fresh_mlp()), params)


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


RULES = {"embedding": "data", "neurons": "model", "vocabulary": "model", "projection": "model"}


def _spec(named, rules):
  view = named.as_namedarrayview()
  spec = [None] * view.data_array.ndim
  for name, index in view.data_axis_for_name.items():
    spec[index] = rules.get(name)
  return P(*spec)


def _placed(model, mesh, rules):
  """``model`` with each parameter sharded over ``mesh`` by its axis names."""
  unbound, params = pz.unbind_params(model, freeze=True)
  placed = [
      dataclasses.replace(p, value=dataclasses.replace(p.value, data_array=jax.device_put(
          p.value.data_array, jax.sharding.NamedSharding(mesh, _spec(p.value, rules))
      )))
      for p in params
  ]
  return pz.bind_variables(unbound, [p.unfreeze_as_copy() for p in placed])


def test_arrays_go_where_the_model_has_them(ckpt):
  assert jax.device_count() == 8
  saved = model_zoo.llamalike_transformer()
  _save_plain(ckpt, _params(saved))
  fresh = _placed(_fresh_transformer(), _mesh(), RULES)

  loaded = pzp.load_into(ckpt, fresh)

  for new, old in zip(_params(loaded), _params(fresh)):
    assert new.value.data_array.sharding == old.value.data_array.sharding
  assert any(len(p.value.data_array.sharding.device_set) == 8 for p in _params(loaded))
  _assert_params(loaded, _params(saved))


def test_axis_rules_shard_a_plain_checkpoint(ckpt):
  saved = model_zoo.llamalike_transformer()
  _save_plain(ckpt, _params(saved))
  mesh = _mesh()

  loaded = pzp.load_into(ckpt, _fresh_transformer(), sharding=pzp.AxisRules(mesh, RULES))

  sharded = 0
  for new, old in zip(_params(loaded), _params(saved)):
    sharding = new.value.data_array.sharding
    assert sharding.mesh == mesh and sharding.spec == _spec(new.value, RULES), new.label
    assert np.array_equal(np.asarray(new.value.data_array), np.asarray(old.value.data_array))
    sharded += any(axis is not None for axis in sharding.spec)
  assert sharded > 0


def test_migrate_writes_a_checkpoint_that_needs_no_code(ckpt, tmp_path):
  saved = model_zoo.mlp()
  _save_plain(ckpt, _params(saved), ocp.PyTreeCheckpointer)

  returned = pzp.migrate(ckpt, tmp_path / "native", _fresh_mlp())

  restored = pzp.load_model(tmp_path / "native")
  _assert_params(restored, _params(saved))
  _assert_params(returned, _params(saved))
  assert type(restored) is type(saved)
  assert_same_outputs(restored(model_zoo.mlp_input()), saved(model_zoo.mlp_input()))


def test_migrate_writes_nothing_when_the_model_does_not_fit(ckpt, tmp_path):
  _save_plain(ckpt, _params(model_zoo.mlp()))
  with pytest.raises(pzp.BindingError):
    pzp.migrate(ckpt, tmp_path / "native", _fresh_mlp(sizes=(8, 32, 8)))
  assert not (tmp_path / "native").exists()


def test_migrate_never_replaces_its_source(ckpt):
  _save_plain(ckpt, _params(model_zoo.mlp()))
  files = sorted(os.listdir(ckpt))
  with pytest.raises(errors.ArgumentError, match="the destination is the source itself"):
    pzp.migrate(ckpt, ckpt, _fresh_mlp(), overwrite=True)
  assert sorted(os.listdir(ckpt)) == files
  pzp.load_into(ckpt, _fresh_mlp())  # Still whole.


_BUILDER = """
import jax
from penzai.models import simple_mlp

def build():
  return simple_mlp.MLP.from_config(
      name="mlp", init_base_rng=jax.random.key(42), feature_sizes=[8, 16, 8]
  )

def not_a_model():
  return 3
"""


def _cli(cwd, *argv):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      filter(None, [repo, os.environ.get("PYTHONPATH")])
  ))
  return subprocess.run(
      [sys.executable, "-m", "pz_persist.tools.cli", *argv], cwd=cwd, env=env,
      capture_output=True, text=True, timeout=300,
  )


def test_cli_migrate(ckpt, tmp_path):
  saved = model_zoo.mlp()
  _save_plain(ckpt, _params(saved))
  (tmp_path / "my_models.py").write_text(textwrap.dedent(_BUILDER))

  result = _cli(tmp_path, "migrate", str(ckpt), "native", "--model", "my_models:build")

  assert result.returncode == 0, result.stderr
  assert "wrote native" in result.stdout
  _assert_params(pzp.load_model(tmp_path / "native"), _params(saved))

  again = _cli(tmp_path, "migrate", str(ckpt), "native", "--model", "my_models:build")
  assert again.returncode == 2 and "overwrite" in again.stderr
  for spec, says in [("my_models:not_a_model", "returned a int"),
                     ("my_models", "expected module:function"),
                     ("no_such_module:build", "cannot import no_such_module"),
                     ("my_models:nothing", "my_models has no nothing")]:
    bad = _cli(tmp_path, "migrate", str(ckpt), "other", "--model", spec)
    assert bad.returncode == 2 and says in bad.stderr, (spec, bad.stderr)
  assert not (tmp_path / "other").exists()


def test_cli_migrate_help_says_it_runs_the_named_code(tmp_path):
  result = _cli(tmp_path, "migrate", "--help")
  assert result.returncode == 0 and "IMPORTS AND RUNS" in result.stdout
