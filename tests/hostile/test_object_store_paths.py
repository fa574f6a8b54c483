"""Every entry point refuses an object-store URL that names objects ambiguously.

One URL reaches three libraries that read it differently: epath drops ``.``
and empty segments, fsspec keeps ``..`` as a literal key part, TensorStore
resolves it. ``save("s3://b/p/a/../ck")`` reported success with the arrays
under ``b/p/ck`` and the rest under ``b/p/a/../ck``, and ``S3://b/ck`` raised
a bare ``KeyError``. `pz_persist.storage.stores.urls.check_url`, reached from
`stores.choose` (every entry point), refuses them all before anything is
written or read; this file holds every entry point to it, on both emulators.
"""

from __future__ import annotations

import orbax.checkpoint as ocp
import pytest
from etils import epath
from orbax.checkpoint import v1 as ocp_v1

import pz_persist as pzp
from hostile.path_entry_points import TREE
from hostile.path_entry_points import entry_points
from pz_persist import errors
from pz_persist.storage import stores


def _variants(remote: str) -> list[str]:
  """Ambiguous spellings of a path under ``remote`` (``gs://pz-test/<id>``)."""
  kind, rest = remote.split("://", 1)
  return [
      f"{remote}/p/a/../ck",
      f"{remote}/p/../../ck",
      f"{remote}/p/./ck",
      f"{remote}/p//ck",
      f"{remote}/ck//",
      f"{remote}/p/%2e%2e/ck",
      f"{remote}/p/ck?x=1",
      f"{remote}/p/ck#frag",
      f"{remote}/p\\..\\ck",
      f"{kind.upper()}://{rest}/ck",
      f"{kind.capitalize()}://{rest}/ck",
      f"{kind}:///{rest}/ck",
  ]


@pytest.fixture(scope="module")
def local_checkpoint(tmp_path_factory) -> str:
  path = str(tmp_path_factory.mktemp("paths") / "ck")
  pzp.save(path, TREE)
  return path


def _written(remote: str) -> dict:
  return stores.for_path(remote).tree(remote)


def test_every_entry_point_refuses_an_ambiguous_object_store_path(remote, local_checkpoint):
  for url in _variants(remote):
    for name, call in entry_points(url, local_checkpoint):
      with pytest.raises(errors.UnsupportedStorageError, match="not an object-store path") as e:
        call()
      assert url in str(e.value) and "BUCKET/FOLDER/NAME" in str(e.value), (name, url)
    assert _written(remote) == {}, url


def test_the_cli_refuses_an_ambiguous_object_store_path(remote, local_checkpoint, capsys):
  from pz_persist.tools import cli  # pylint: disable=import-outside-toplevel

  for url in _variants(remote):
    for command in (
        ["inspect", url], ["verify", url], ["ls", url], ["clean", url],
        ["diff", url, local_checkpoint],
        ["migrate", local_checkpoint, url, "--model", "penzai.pz.nn:Identity"],
    ):
      status = cli.main(command)
      assert status != 0, command
      assert "not an object-store path" in capsys.readouterr().err, command
  assert _written(remote) == {}


def test_orbax_entry_points_refuse_an_ambiguous_object_store_path(remote):
  """Orbax's own save paths reach the handler without `as_path`. What Orbax
  itself writes first (its folder, before the handler runs) is its own; no
  array and no manifest may land anywhere."""
  # Orbax's epath.Path drops '.' and empty segments before the handler sees
  # them (one spelling for all from there on) and refuses upper-case schemes.
  variants = _variants(remote)
  for url in [variants[i] for i in (0, 1, 5, 6, 7, 8)]:
    with pytest.raises(errors.UnsupportedStorageError, match="not an object-store path"):
      with ocp.Checkpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
        checkpointer.save(url, args=pzp.PenzaiSave(TREE))
    handler = pzp.PenzaiCheckpointHandler()  # What Orbax calls once its checks pass.
    for call in (handler.restore, handler.metadata):
      with pytest.raises(errors.UnsupportedStorageError, match="not an object-store path"):
        call(epath.Path(url))
    with pytest.raises(errors.UnsupportedStorageError, match="not an object-store path"):
      ocp_v1.save_checkpointables(url + "v1", {"model": TREE})  # Not v0's folder.
    written = [k for k in _written(remote) if "ocdbt" in k or "pz_persist" in k or "zarr" in k]
    assert written == [], url


def test_the_plain_spellings_still_work(remote):
  """What is refused is only ever an ambiguous spelling: the plain one, with
  or without one trailing slash, saves and loads."""
  pzp.save(f"{remote}/p/ck", TREE)
  assert float(pzp.load(f"{remote}/p/ck/")["w"].unwrap("x")[3]) == 3.0
  pzp.save(f"{remote}/p/ck2/", TREE)
  assert float(pzp.load(f"{remote}/p/ck2")["w"].unwrap("x")[3]) == 3.0
  assert sorted({k.split("/")[1] for k in _written(remote)}) == ["ck", "ck2"]
