"""Every commit object written is one every reader recognises.

A checkpoint on gs:// / s3:// is current by its commit object,
``pz_persist.commit.<20 digits>``. With a (hand-written) commit at the last
20-digit sequence, an overwrite used to publish a 21-digit one that readers
pass over, and retire the old one: the checkpoint vanished behind a save that
reported success. Now such a save is refused before it writes anything
(`commit_objects.next_sequence`), and a reader meeting a commit-like name it
cannot read refuses it by name instead of passing over it.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from etils import epath
from penzai import pz

import pz_persist as pzp
from pz_persist import errors
from pz_persist.storage import stores
from pz_persist.storage.stores import base
from pz_persist.storage.stores import commit_objects

LAST = "pz_persist.commit." + "9" * 20  # The contract: 20 digits, not the constant.
TOO_LONG = "pz_persist.commit.1" + "0" * 20


def _tree(value: float):
  return {"w": pz.nx.wrap(jnp.full((4,), value)).tag("x")}


def _value(path: str) -> float:
  return float(pzp.load(path)["w"].unwrap("x")[0])


def _renamed_commit(path: str, name: str) -> None:
  """Gives the current commit object of ``path`` the name ``name``."""
  current = commit_objects.current(stores.for_path(path), path)
  data = stores.for_path(current.object).read(current.object, commit_objects.MAX_COMMIT_BYTES)
  stores.for_path(path).write_whole(f"{path}/{name}", data)
  stores.for_path(current.object).remove(current.object)


_MODEL_SOURCE = """
import jax
from penzai import pz


def build_model():
  return pz.nn.Linear.from_config(
      name="l", init_base_rng=jax.random.key(0), input_axes={"i": 2}, output_axes={"o": 2})
"""


def _model_and_plain_orbax(tmp_path, monkeypatch) -> tuple[pz.nn.Layer, str]:
  """A model whose code the CLI's ``--model seq_model:build_model`` finds, and
  its params saved by plain Orbax (what ``migrate`` reads)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  (tmp_path / "seq_model.py").write_text(_MODEL_SOURCE)
  monkeypatch.syspath_prepend(str(tmp_path))
  import seq_model  # pylint: disable=import-outside-toplevel,import-error

  model = seq_model.build_model()
  plain = str(tmp_path / "plain")
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(plain, pz.unbind_params(model, freeze=True)[1])
  return model, plain


def test_an_overwrite_past_the_last_sequence_is_refused_before_writing(
    remote, tmp_path, monkeypatch):
  path = f"{remote}/ck"
  pzp.save(path, _tree(1.0))
  _renamed_commit(path, LAST)
  assert _value(path) == 1.0  # The last sequence is readable,
  before = stores.for_path(path).tree(path)
  model, plain = _model_and_plain_orbax(tmp_path, monkeypatch)
  for name, call in (
      ("save", lambda: pzp.save(path, _tree(2.0), overwrite=True)),
      ("save_model", lambda: pzp.save_model(path, pz.nn.Identity(), overwrite=True)),
      ("migrate", lambda: pzp.migrate(plain, path, model, overwrite=True)),
  ):
    with pytest.raises(errors.ManifestError, match="highest a commit object's name holds") as e:
      call()
    assert LAST in str(e.value) and "Save to another path" in str(e.value), name
    assert stores.for_path(path).tree(path) == before, name  # Nothing written, nothing retired.
    assert _value(path) == 1.0, name


def test_the_cli_refuses_an_overwrite_past_the_last_sequence(
    remote, tmp_path, monkeypatch, capsys):
  from pz_persist.tools import cli  # pylint: disable=import-outside-toplevel

  path = f"{remote}/ck"
  pzp.save(path, _tree(1.0))
  _renamed_commit(path, LAST)
  before = stores.for_path(path).tree(path)
  _, plain = _model_and_plain_orbax(tmp_path, monkeypatch)
  status = cli.main(["migrate", plain, path, "--overwrite", "--model", "seq_model:build_model"])
  assert status == 2
  assert LAST in capsys.readouterr().err
  assert stores.for_path(path).tree(path) == before


def test_publish_itself_refuses_past_the_last_sequence(remote):
  """The check lives where the commit object is created, too: a caller that
  skipped `check_publishable` still cannot write an unreadable commit."""
  path = epath.Path(f"{remote}/ck")
  pzp.save(path, _tree(1.0))
  _renamed_commit(str(path), LAST)
  store = stores.for_path(path)
  seen = store.identity(path)
  new = commit_objects.new_generation(path, "00000000000000ab")
  store.write_whole(f"{new}/penzai/x", b"new")
  with pytest.raises(errors.ManifestError, match="highest a commit object's name holds"):
    store.publish(path, new, seen)
  assert sorted(store.names(path)) == sorted(
      [commit_objects.current(store, path).checkpoint.name, LAST])  # The new folder is gone.
  assert _value(str(path)) == 1.0


@pytest.mark.parametrize("name", [TOO_LONG, base.COMMIT_PREFIX + "7",
                                  base.COMMIT_PREFIX + "x" * 20])
def test_a_commit_name_no_reader_recognises_is_refused_by_name(remote, name, capsys):
  from pz_persist.tools import cli  # pylint: disable=import-outside-toplevel

  path = f"{remote}/ck"
  pzp.save(path, _tree(1.0))
  pzp.save(path, _tree(2.0), overwrite=True)
  _renamed_commit(path, name)  # What an overflowed overwrite left.
  before = stores.for_path(path).tree(path)
  for what, call in (
      ("load", lambda: pzp.load(path)),
      ("inspect", lambda: pzp.inspect(path)),
      ("verify", lambda: pzp.verify(path)),
      ("load_model", lambda: pzp.load_model(path)),
      ("save overwrite", lambda: pzp.save(path, _tree(3.0), overwrite=True)),
  ):
    with pytest.raises(errors.ManifestError, match="not a commit object name") as e:
      call()
    assert name in str(e.value), what
  for command in (["inspect", path], ["verify", path], ["clean", path]):
    assert cli.main(command) == 2, command
    assert name in capsys.readouterr().err, command
  assert stores.for_path(path).tree(path) == before  # Nothing retired.
