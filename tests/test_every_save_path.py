"""Every save path writes what every entry point reads (`pz_persist.storage.writing.writer`).

One model is saved by each way there is to save it (`pzp.save`, Orbax's v0
``Checkpointer`` and ``AsyncCheckpointer`` around `PenzaiCheckpointHandler`,
`PenzaiSave` inside ``ocp.args.Composite`` in Orbax's own checkpointers and
``CheckpointManager``, `pzp.CheckpointManager`, Orbax's v1 API (sync and
async), and Orbax's
``PyTreeCheckpointer`` with the registered type handler), then read back by
every entry point: `pzp.verify` (every array against its checksum, every file
against its digest), the ``pz-persist verify`` command, `pzp.load`,
`pzp.inspect`, ``load_model`` in both forms and `pzp.migrate`.
"""

from __future__ import annotations

import json
import pathlib

import jax
import model_zoo
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz
from penzai.models import simple_mlp
from treecompare import assert_same_outputs

import pz_persist as pzp
from pz_persist.format import manifest as manifest_lib
from pz_persist.tools import cli


def _pzp_save(path, model):
  pzp.save(path, model)


def _v0_sync(path, model):
  with ocp.Checkpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
    checkpointer.save(path, args=pzp.PenzaiSave(model))


def _v0_async(path, model):
  with ocp.AsyncCheckpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
    checkpointer.save(path, args=pzp.PenzaiSave(model))
    checkpointer.wait_until_finished()


def _composite(checkpointer_class):
  def save(path, model):
    with checkpointer_class(ocp.CompositeCheckpointHandler()) as checkpointer:
      checkpointer.save(path, args=ocp.args.Composite(params=pzp.PenzaiSave(model)))
      if hasattr(checkpointer, "wait_until_finished"):
        checkpointer.wait_until_finished()
  return save


def _orbax_manager(path, model):
  with ocp.CheckpointManager(path) as manager:
    manager.save(3, args=ocp.args.Composite(params=pzp.PenzaiSave(model)))
    manager.wait_until_finished()


def _pzp_manager(path, model):
  with pzp.CheckpointManager(path) as manager:
    manager.save(3, params=model)
    manager.wait_until_finished()


def _v1(path, model):
  ocp_v1.save_checkpointables(path, {"model": model})


def _v1_async(path, model):
  ocp_v1.save_checkpointables_async(path, {"model": model}).result()


def _type_handler(path, model):
  with ocp.PyTreeCheckpointer() as checkpointer:
    checkpointer.save(path, model)


SAVE_PATHS = {
    "pzp.save": _pzp_save,
    "v0 Checkpointer (sync)": _v0_sync,
    "v0 AsyncCheckpointer": _v0_async,
    "PenzaiSave in Checkpointer(Composite)": _composite(ocp.Checkpointer),
    "PenzaiSave in AsyncCheckpointer(Composite)": _composite(ocp.AsyncCheckpointer),
    "PenzaiSave in ocp.CheckpointManager": _orbax_manager,
    "pzp.CheckpointManager": _pzp_manager,
    "v1 save_checkpointables": _v1,
    "v1 save_checkpointables_async": _v1_async,
    "type handler (PyTreeCheckpointer)": _type_handler,
}

TYPE_HANDLER = "type handler (PyTreeCheckpointer)"


def _fresh() -> pz.nn.Layer:
  """The model of `model_zoo.mlp` built again with other values."""
  return simple_mlp.MLP.from_config(
      name="mlp", init_base_rng=jax.random.key(1), feature_sizes=[8, 16, 8]
  )


def _item(root: pathlib.Path) -> pathlib.Path:
  (manifest,) = root.rglob(manifest_lib.MANIFEST_FILENAME)
  return manifest.parent


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  """Each parameter's label and shape, mutable or frozen, real or abstract."""
  kinds = (pz.Parameter, pz.ParameterValue)
  leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, kinds))
  return {
      leaf.label: tuple(leaf.value.data_array.shape)
      for leaf in leaves if isinstance(leaf, kinds)
  }


@pytest.mark.parametrize("save", list(SAVE_PATHS))
def test_every_save_path_is_read_by_every_entry_point(tmp_path, save, capsys):
  model = _fresh()
  SAVE_PATHS[save](tmp_path / "c", model)
  item = _item(tmp_path / "c")
  manifest = json.loads((item / manifest_lib.MANIFEST_FILENAME).read_text())
  # The one writer: the same manifest and the same digest list on every path.
  report = pzp.verify(item)
  assert report.ok and report.arrays_checked == 4, report
  if save == TYPE_HANDLER:  # Orbax finalizes that item after pz_persist's last word.
    assert report.files_checked is None
    assert manifest["format_version"] == manifest_lib.WRITTEN_FORMAT and manifest["leaf_keys"]
  else:
    assert report.files_checked and (item / manifest_lib.FILE_DIGESTS_FILENAME).is_file()
    assert manifest["format_version"] == manifest_lib.WRITTEN_FORMAT
    assert manifest["leaf_keys"] is False
  assert cli.main(["verify", str(item)]) == 0
  assert "OK" in capsys.readouterr().out

  saved = _shapes(model)
  assert _shapes(pzp.load(item)) == saved
  assert _shapes(pzp.inspect(item)) == saved

  into = pzp.load_into(item, _fresh())
  assert_same_outputs(into(model_zoo.mlp_input()), model(model_zoo.mlp_input()))
  migrated = pzp.migrate(item, tmp_path / "migrated", _fresh())
  assert_same_outputs(migrated(model_zoo.mlp_input()), model(model_zoo.mlp_input()))
  if save == TYPE_HANDLER:  # Orbax's tree of it records no classes: no model.
    with pytest.raises(pzp.errors.PzPersistError, match="load_into"):
      pzp.load_model(item)
  else:
    whole = pzp.load_model(item)
    assert_same_outputs(whole(model_zoo.mlp_input()), model(model_zoo.mlp_input()))
