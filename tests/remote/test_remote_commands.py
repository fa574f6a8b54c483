"""Every ``pz-persist`` command on object-store paths, run in-process."""

from __future__ import annotations

import hashlib
import json
import textwrap

import jax.numpy as jnp
import model_zoo
import pytest

import pz_persist as pzp
from pz_persist.format import manifest as manifest_lib
from pz_persist.storage import stores
from pz_persist.storage.lifecycle import leftovers
from pz_persist.storage.lifecycle import steps
from pz_persist.storage.stores import base
from pz_persist.storage.stores import commit_objects
from pz_persist.storage.stores import urls
from pz_persist.tools import cli


def _run(capsys, *argv):
  code = cli.main(list(argv))
  captured = capsys.readouterr()
  return code, captured.out, captured.err


@pytest.fixture
def writable(remote, store) -> str:
  """``remote``, on a store Orbax can write arrays to."""
  if store.scheme == "s3":  # Orbax writes S3 arrays once helper s3's kvstore spec lands.
    pytest.importorskip("pz_persist.storage.stores.s3_kvstore").enable_orbax_s3()
  return remote


def _tree(shift: float = 0.0):
  return {"w": jnp.arange(4.0) + shift, "b": jnp.ones(3)}


def _write_step(run: str, step: str, *, marker: bool) -> None:
  """A step as Orbax lays it out on a store, written object by object (no
  Orbax needed: `list_steps` reads only the listing and the metadata)."""
  store = stores.for_path(run)
  store.write_whole(f"{run}/{step}/_CHECKPOINT_METADATA",
                    json.dumps({"commit_timestamp_nsecs": 1_700_000_000 * 10**9}).encode())
  store.write_whole(f"{run}/{step}/params/pz_persist.json", b"{}")
  store.write_whole(f"{run}/{step}/params/d/0", b"x" * 1000)
  store.write_whole(f"{run}/{step}/opt/d/0", b"y" * 24)
  if marker:
    store.write_whole(f"{run}/{step}/{steps.COMMIT_MARKER}", b"")


def test_ls_lists_steps_from_the_store_listing(remote, capsys):
  run = f"{remote}/run"
  _write_step(run, "10", marker=True)
  _write_step(run, "20", marker=False)  # Being written, or half deleted.
  _write_step(run, "30.orbax-checkpoint-tmp-1", marker=True)
  stores.for_path(run).write_whole(f"{run}/notes.txt", b"not a step")
  listed = steps.list_steps(run)
  assert [(s.step, s.committed) for s in listed] == [(10, True), (20, False), (30, False)]
  assert listed[0].items == ("opt", "params") and listed[0].penzai_items == ("params",)
  assert listed[0].nbytes == sum(info.size for name, info in stores.for_path(run).tree(run).items()
                                 if name.startswith("10/"))
  assert listed[0].commit_time_ns == 1_700_000_000 * 10**9
  code, out, _ = _run(capsys, "ls", run)
  assert code == 0
  assert "10  yes" in out and "20  no (partial)" in out and "params*" in out
  assert "2023-11-14" in out  # The commit time, read from the step's metadata.
  assert f"pz-persist clean {run}" in out  # The uncommitted steps are leftovers.


def test_ls_of_an_empty_prefix(remote, capsys):
  code, out, _ = _run(capsys, "ls", f"{remote}/nothing")
  assert code == 0 and f"no steps in {remote}/nothing" in out


def test_clean_removes_uncommitted_steps_only_with_force(remote, capsys):
  run = f"{remote}/run"
  _write_step(run, "1", marker=True)
  _write_step(run, "2", marker=False)
  code, out, _ = _run(capsys, "clean", run)
  assert code == 0
  assert f"kept {run}/2" in out and "orbax tmp step" in out and "--force" in out
  assert "object store" in out  # Why nothing is removed without --force.
  code, out, _ = _run(capsys, "clean", "--dry-run", "--force", run)
  assert f"would remove {run}/2" in out
  assert [s.step for s in steps.list_steps(run)] == [1, 2]
  code, out, _ = _run(capsys, "clean", "--force", run)
  assert code == 0 and f"removed {run}/2" in out
  assert [(s.step, s.committed) for s in steps.list_steps(run)] == [(1, True)]
  assert not any(name.startswith("2/") for name in stores.for_path(run).tree(run))


def test_clean_lists_orphan_generations_and_removes_them_only_with_force(writable, capsys):
  path = f"{writable}/ck"
  pzp.save(path, _tree())
  orphan = f"{path}/gen-{'0' * 16}"  # As a killed save leaves it: no commit names it.
  stores.for_path(orphan).write_whole(f"{orphan}/penzai/pz_persist.json", b"{}")
  assert [str(p) for p in commit_objects.orphans(stores.for_path(path), path)] == [orphan]
  code, out, _ = _run(capsys, "clean", path)
  assert code == 0 and f"kept {orphan}" in out and "--force" in out
  code, out, _ = _run(capsys, "inspect", path)
  assert f"pz-persist clean {path}" in out
  code, out, _ = _run(capsys, "clean", "--force", path)
  assert f"removed {orphan}" in out
  store, path = stores.choose(path)
  assert commit_objects.orphans(store, path) == [] and leftovers.find(store, path) == []
  assert pzp.load(path)["b"].shape == (3,)  # The committed checkpoint is untouched.


def test_inspect_verify_diff_on_remote_checkpoints(writable, capsys):
  a, b = f"{writable}/a", f"{writable}/b"
  pzp.save(a, _tree())
  pzp.save(b, _tree(shift=1.0))
  code, out, _ = _run(capsys, "inspect", a)
  assert code == 0 and a in out and "float32" in out
  code, out, _ = _run(capsys, "verify", a)
  assert code == 0 and a in out and out.strip().endswith(": OK")
  assert "2 arrays checked" in out and "objects against the store's checksums" in out
  code, out, _ = _run(capsys, "diff", a, b)
  assert code == 1 and "tree['w']" in out and "1 of 2 compared array(s) differ" in out
  assert _run(capsys, "diff", a, a)[0] == 0


def test_verify_names_an_object_whose_bytes_differ_from_the_store_checksum(
    writable, capsys, monkeypatch):
  """The store's checksum check compares what is read with what the store
  recorded; a mismatch (simulated: the emulators never serve bad bytes) is
  named by object, and fails verify."""
  path = f"{writable}/ck"
  pzp.save(path, _tree())
  store = stores.for_path(path)
  real_tree = store.tree
  bad = []

  def one_wrong(directory):
    found = real_tree(directory)
    name = next(n for n in sorted(found) if n.endswith("pz_persist.json"))
    bad.append(f"{directory}/{name}")
    found[name] = base.ObjectInfo(found[name].size, found[name].generation,
                                  {"md5": hashlib.md5(b"other").digest()})
    return found

  monkeypatch.setattr(store, "tree", one_wrong)
  code, out, _ = _run(capsys, "verify", path)
  assert code == 1 and "1 DAMAGED" in out
  assert f"{bad[0]}: its bytes do not match the store's MD5 of it" in out


def test_verify_of_rewritten_array_data_names_the_label(writable, capsys):
  """An object written again since the save has a new store checksum; the
  arrays' own checksums still catch it, by label."""
  path = f"{writable}/ck"
  pzp.save(path, {"w": jnp.arange(1000.0)})
  listed = stores.for_path(path).tree(path)
  data = max((n for n in listed if "/d/" in n), key=lambda n: listed[n].size)
  raw = bytearray(stores.for_path(path).read(f"{path}/{data}", listed[data].size))
  raw[len(raw) // 2] ^= 0xFF
  stores.for_path(path).write_whole(f"{path}/{data}", bytes(raw))
  code, out, _ = _run(capsys, "verify", path)
  assert code == 1 and "DAMAGED" in out and "tree['w']" in out


def test_verify_of_a_copied_checkpoint_checks_its_digest_list(writable, tmp_path, capsys):
  """A checkpoint saved on a disk and copied to a store keeps its digest list:
  every file is checked against it, a changed one named."""
  local = tmp_path / "ck"
  pzp.save(local, _tree())
  path = f"{writable}/copied"
  stores.for_path(path).filesystem(path).put(str(local), urls.key(path), recursive=True)
  report = pzp.verify(path)
  assert report.ok and report.files_checked and report.objects_checked is None
  recorded = json.loads(
      stores.for_path(path).read(f"{path}/penzai/{manifest_lib.FILE_DIGESTS_FILENAME}", 10**6))
  name = next(n for n in recorded["files"] if n.startswith("d/"))
  stores.for_path(path).write_whole(f"{path}/penzai/{name}", b"changed")
  code, out, _ = _run(capsys, "verify", path)
  assert code == 1 and f"{path}/penzai/{name}: " in out


def test_errors_name_the_remote_path(remote, capsys):
  missing = f"{remote}/missing"
  for command in ("inspect", "verify"):
    code, _, err = _run(capsys, command, missing)
    assert code == 2 and f"{missing} is not a pz_persist checkpoint" in err


def test_convert_to_a_remote_destination(writable, tmp_path, capsys):
  from hostile.test_pretrained_hostile import hf_folder  # pylint: disable=import-outside-toplevel

  src = str(hf_folder(tmp_path / "llama"))
  dst = f"{writable}/native"
  code, out, _ = _run(capsys, "convert", "hf", src, dst, "--quiet")
  assert code == 0 and f"wrote {dst}" in out
  model = pzp.load_model(dst)
  assert pzp.verify(dst).ok
  code, _, err = _run(capsys, "convert", "hf", src, dst, "--quiet")
  assert code == 2 and f"{dst} exists; pass --overwrite" in err
  assert _run(capsys, "convert", "hf", src, dst, "--quiet", "--overwrite")[0] == 0
  assert type(pzp.load_model(dst)) is type(model)


def test_migrate_to_a_remote_destination(writable, tmp_path, capsys, monkeypatch):
  import test_migrate  # pylint: disable=import-outside-toplevel

  saved = model_zoo.mlp()
  src = tmp_path / "plain"
  test_migrate._save_plain(src, test_migrate._params(saved))  # pylint: disable=protected-access
  (tmp_path / "remote_migrate_models.py").write_text(textwrap.dedent(test_migrate._BUILDER))  # pylint: disable=protected-access
  monkeypatch.chdir(tmp_path)
  dst = f"{writable}/native"
  argv = ["migrate", str(src), dst, "--model", "remote_migrate_models:build"]
  code, out, err = _run(capsys, *argv)
  assert code == 0, err
  assert f"wrote {dst}" in out
  test_migrate._assert_params(pzp.load_model(dst), test_migrate._params(saved))  # pylint: disable=protected-access
  code, _, err = _run(capsys, *argv)
  assert code == 2 and f"{dst} already exists" in err


def test_inspect_of_a_step_shows_its_items(writable, capsys):
  run = f"{writable}/run"
  with pzp.CheckpointManager(run) as manager:
    manager.save(1, params=_tree(), opt_state=_tree(1.0))
  code, out, err = _run(capsys, "inspect", f"{run}/1")
  assert code == 0, err
  assert out.startswith(f"{run}/1: 2 items (opt_state, params)\n")
  assert f"\n{run}/1/opt_state\n" in out and f"\n{run}/1/params\n" in out
  code, out, _ = _run(capsys, "inspect", "--json", f"{run}/1")
  assert code == 0 and [item["path"] for item in json.loads(out)["items"]] == [
      f"{run}/1/opt_state", f"{run}/1/params"]
