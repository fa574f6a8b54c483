"""Orbax's own entry points, v0 and v1, save and restore Penzai values."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import model_zoo
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import run_python
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz
from treecompare import assert_identical
from treecompare import assert_same_outputs

import pz_persist as pzp
from pz_persist.storage.writing import writer


def _tree():
  """Frozen Gemma-style params, KV-cache state, a shared mutable parameter."""
  sampler = model_zoo.sampling_model(model_zoo.gemma_style_transformer())
  _, params = pz.unbind_params(sampler, freeze=True)
  _, state = pz.unbind_state_vars(sampler, freeze=True)
  shared = pz.Parameter(label="extra/w.0", value=pz.nx.wrap(jnp.ones((2, 3)), "a", "b"))
  return {"params": params, "state": state, "shared": [shared, shared], "rng": jax.random.key(1)}


def test_v0_checkpointer_restores_without_arguments(tmp_path):
  tree = _tree()
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    checkpointer.save(tmp_path / "c", args=ocp.args.Composite(model=pzp.PenzaiSave(tree)))
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    restored = checkpointer.restore(tmp_path / "c")
  assert_identical(restored.model, tree)


def test_v0_single_item_checkpointer(tmp_path):
  tree = _tree()
  with ocp.AsyncCheckpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
    checkpointer.save(tmp_path / "c", args=pzp.PenzaiSave(tree))
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "c", args=pzp.PenzaiRestore())
  assert_identical(restored, tree)
  assert_identical(pzp.load(tmp_path / "c"), tree)


def test_v0_checkpoint_manager_async_and_no_template(tmp_path):
  tree = _tree()
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    for step in (1, 2):
      manager.save(step, args=ocp.args.Composite(params=pzp.PenzaiSave(tree), meta=ocp.args.JsonSave({"step": step})))
    manager.wait_until_finished()
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    assert manager.latest_step() == 2
    restored = manager.restore(2)
  assert_identical(restored.params, tree)
  assert restored.meta == {"step": 2}
  assert_identical(pzp.load(tmp_path / "run" / "2" / "params"), tree)


def test_v1_save_and_load_checkpointables(tmp_path):
  tree = _tree()
  ocp_v1.save_checkpointables(tmp_path / "c", {"model": tree, "config": {"lr": 0.1}})
  loaded = ocp_v1.load_checkpointables(tmp_path / "c")
  assert_identical(loaded["model"], tree)
  assert loaded["config"] == {"lr": 0.1}
  assert_identical(pzp.load(tmp_path / "c" / "model"), tree)


def test_v1_loads_checkpoints_written_by_pzp_save(ckpt):
  tree = _tree()
  pzp.save(ckpt, tree)
  assert_identical(ocp_v1.load_checkpointables(ckpt)["penzai"], tree)
  metadata = ocp_v1.checkpointables_metadata(ckpt).metadata["penzai"]
  assert jax.tree.structure(metadata) == jax.tree.structure(
      jax.eval_shape(lambda: _frozen(tree))
  )


def _frozen(tree):
  return pz.freeze_variables(tree)


def test_v1_training_checkpointer(tmp_path):
  tree = _tree()
  with ocp_v1.training.Checkpointer(tmp_path / "run") as checkpointer:
    checkpointer.save_checkpointables(5, {"model": tree})
  with ocp_v1.training.Checkpointer(tmp_path / "run") as checkpointer:
    assert checkpointer.latest.step == 5
    loaded = checkpointer.load_checkpointables(5)
  assert_identical(loaded["model"], tree)


def test_plain_tree_still_goes_to_orbax_pytree_handler(tmp_path):
  ocp_v1.save_checkpointables(tmp_path / "c", {"plain": {"x": np.arange(3)}})
  loaded = ocp_v1.load_checkpointables(tmp_path / "c")
  np.testing.assert_array_equal(loaded["plain"]["x"], np.arange(3))
  assert not (tmp_path / "c" / "plain" / "pz_persist.json").exists()


def test_type_handler_accepts_mutable_variable_leaves(tmp_path):
  model = model_zoo.mlp()
  tree = {"model": model, "again": model.sublayers[0].sublayers[0].weights}
  checkpointer = ocp.PyTreeCheckpointer()
  checkpointer.save(tmp_path / "c", tree)

  restored = checkpointer.restore(tmp_path / "c", item=tree)
  assert restored["again"] is restored["model"].sublayers[0].sublayers[0].weights
  assert_identical(restored, tree)
  assert_same_outputs(restored["model"](model_zoo.mlp_input()), model(model_zoo.mlp_input()))

  untemplated = checkpointer.restore(tmp_path / "c")
  weights = untemplated["model"]["sublayers"][0]["sublayers"][0]["weights"]
  assert isinstance(weights, pz.Parameter) and weights is untemplated["again"]
  assert weights.label == "mlp/Affine_0/Linear.weights"


def _dump_leaves_script(load_expression: str, *, imports: str) -> str:
  """A script that loads a tree and prints its structure and leaf digests."""
  return f"""
import json, hashlib, sys
import jax, numpy as np
{imports}
tree = {load_expression}
is_var = lambda x: type(x).__name__ in ("Parameter", "StateVariable")
leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_var)
def digest(x):
  if is_var(x):
    return [type(x).__name__, repr(x.label), digest(x.value.data_array)]
  if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return [type(x).__name__, str(x.dtype), list(np.shape(x)), hashlib.sha256(np.asarray(x).tobytes()).hexdigest()]
print(json.dumps({{"treedef": str(treedef), "leaves": [digest(l) for l in leaves],
                  "pz_persist_imported": "pz_persist" in sys.modules}}))
"""


def _expected_digest(tree):
  import hashlib
  is_var = lambda x: isinstance(x, pz.AbstractVariable)
  leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_var)

  def digest(x):
    if is_var(x):
      return [type(x).__name__, repr(x.label), digest(x.value.data_array)]
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return [type(x).__name__, str(x.dtype), list(np.shape(x)),
            hashlib.sha256(np.asarray(x).tobytes()).hexdigest()]

  return str(treedef), [digest(l) for l in leaves]


@pytest.mark.parametrize(
    "entry_point",
    [
        "pz_persist.load(PATH)",
        "ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(PATH).penzai",
        "ocp.v1.load_checkpointables(PATH)['penzai']",
    ],
    ids=["pz_persist", "orbax-v0", "orbax-v1"],
)
def test_fresh_process_restores_through_each_entry_point(entry_point, ckpt):
  tree = _tree()
  pzp.save(ckpt, tree)
  script = _dump_leaves_script(
      entry_point.replace("PATH", repr(str(ckpt))),
      imports="import orbax.checkpoint as ocp\nimport pz_persist",
  )
  out = json.loads(run_python(script).strip().splitlines()[-1])
  treedef, leaves = _expected_digest(tree)
  assert out["treedef"] == treedef
  assert out["leaves"] == leaves


def test_plain_orbax_without_pz_persist_reads_the_arrays(ckpt):
  tree = _tree()
  pzp.save(ckpt, tree)
  script = _dump_leaves_script(
      f"ocp.PyTreeCheckpointer().restore({str(ckpt / 'penzai')!r})",
      imports="import orbax.checkpoint as ocp",
  )
  out = json.loads(run_python(script).strip().splitlines()[-1])
  assert out["pz_persist_imported"] is False
  # Plain Orbax sees the flat {key: array} dict pz_persist stored.
  _, stored = writer.encode_hashed(tree)
  _, expected = _expected_digest(stored)
  assert out["leaves"] == expected
  assert len(expected) == len(jax.tree.leaves(pz.freeze_variables(tree))) - 1  # shared once
