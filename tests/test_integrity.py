"""Checksums: recorded on save, checked on load, and `verify` names the damage."""

from __future__ import annotations

import glob
import json
import os
import random

import jax
import jax.numpy as jnp
import manifest_json
import model_zoo
import numpy as np
import pytest
from penzai import pz
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import manifest as manifest_lib
from pz_persist.tools import cli


def _params():
  keys = jax.random.split(jax.random.key(0), 3)
  return [
      pz.Parameter(label="blocks/0/attn/query",
                   value=pz.nx.wrap(jax.random.normal(keys[0], (64, 256)), "embedding", "heads")),
      pz.Parameter(label="blocks/0/mlp/up",
                   value=pz.nx.wrap(jax.random.normal(keys[1], (256, 64), jnp.bfloat16),
                                    "neurons", "embedding")),
      pz.StateVariable(label="step", value=jnp.array(7, jnp.int32)),
  ]


def _manifest(path):
  return manifest_json.read(path / "penzai" / "pz_persist.json")


def _write_manifest(path, data):
  (path / "penzai" / "pz_persist.json").write_text(json.dumps(data))


def _item_files(path):
  """The item's files, but Orbax's commit marker (a timestamp, written after
  the item is complete, holding no data)."""
  return sorted(
      f for f in glob.glob(str(path / "penzai" / "**" / "*"), recursive=True)
      if os.path.isfile(f) and os.path.basename(f) != "commit_success.txt"
  )


def test_every_array_records_a_checksum_and_verifies(ckpt):
  pzp.save(ckpt, {"params": _params(), "host": np.arange(10), "scalar": np.float32(2)})
  entries = _manifest(ckpt)["arrays"]
  assert len(entries) == 5
  for entry in entries:
    (shard,) = entry["checksums"]  # Unsharded: one slice, the whole array.
    assert shard["index"] == [[0, n] for n in entry["shape"]]
    assert len(shard["xxh3_128"]) == 32
  report = pzp.verify(ckpt)
  assert report.ok and report.arrays_checked == 5 and not report.unverified
  assert report.files_checked == len(_item_files(ckpt)) - 1  # All but the digest list.
  assert str(report).endswith(": OK")
  report.raise_if_damaged()


def test_a_flipped_byte_in_any_file_is_reported(tmp_path):
  """Every trial flips one bit at a random place in a random file: 100% found."""
  original = tmp_path / "original"
  pzp.save(original, {"params": _params()})
  rng = random.Random(0)
  files = [os.path.relpath(f, original) for f in _item_files(original)]
  files.remove(os.path.join("penzai", manifest_lib.FILE_DIGESTS_FILENAME))
  trials = files + [rng.choice(files) for _ in range(40 - len(files))]
  for trial, name in enumerate(trials):
    copy = tmp_path / f"copy{trial}"
    os.system(f"cp -r {original} {copy}")
    data = bytearray((copy / name).read_bytes())
    position = rng.randrange(len(data))
    data[position] ^= 1 << rng.randrange(8)
    (copy / name).write_bytes(bytes(data))
    report = pzp.verify(copy)
    assert not report.ok, f"flip at byte {position} of {name} not reported"
    assert any(name in line for line in report.damaged), report.damaged
    with pytest.raises(errors.IntegrityError):
      report.raise_if_damaged()


def test_damaged_array_is_named_by_label_and_never_returned(ckpt):
  pzp.save(ckpt, {"params": _params()})
  manifest = _manifest(ckpt)
  entry = next(e for e in manifest["arrays"] if e["label"] == "blocks/0/mlp/up")
  entry["checksums"][0]["xxh3_128"] = "0" * 32  # As if the stored bytes changed.
  _write_manifest(ckpt, manifest)

  with pytest.raises(errors.IntegrityError, match=r"label 'blocks/0/mlp/up'.*slice\(s\) \[0:256, 0:64\]") as info:
    pzp.load(ckpt)
  assert len(info.value.damaged) == 1
  report = pzp.verify(ckpt)
  assert not report.ok
  assert any("blocks/0/mlp/up" in line for line in report.damaged)
  assert not any("attn/query" in line for line in report.damaged)
  # verify=False reads it anyway, for salvage.
  loaded = pzp.load(ckpt, verify=False)
  assert loaded["params"][1].label == "blocks/0/mlp/up"


def test_failed_verified_load_leaves_the_model_untouched(tmp_path):
  model = model_zoo.mlp()
  pzp.save_model(tmp_path / "m", model)
  manifest = _manifest(tmp_path / "m")
  manifest["arrays"][0]["checksums"][0]["xxh3_128"] = "f" * 32
  _write_manifest(tmp_path / "m", manifest)
  _, before = pz.unbind_params(model, freeze=True)
  with pytest.raises(errors.IntegrityError):
    pzp.load_into(tmp_path / "m", model)
  with pytest.raises(errors.IntegrityError):
    pzp.load_model(tmp_path / "m")
  assert_identical(pz.unbind_params(model, freeze=True)[1], before)


def test_sharded_saves_record_one_checksum_per_distinct_shard(ckpt):
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  rules = pzp.AxisRules(mesh, {"embedding": "data", "heads": "model"})
  value = pz.nx.wrap(jax.random.normal(jax.random.key(1), (64, 256)), "embedding", "heads")
  sharded = jax.device_put(value.data_array, rules.sharding(("embedding", "heads"), (64, 256), what="q"))
  param = pz.Parameter(label="q", value=pz.nx.NamedArray(value.named_axes, sharded))
  pzp.save(ckpt, [param])
  (entry,) = _manifest(ckpt)["arrays"]
  assert len(entry["checksums"]) == 8
  assert sorted(tuple(map(tuple, c["index"])) for c in entry["checksums"])[0] == ((0, 32), (0, 64))

  # Each recorded slice is checked wherever it lies within what is read:
  # the same mesh, another mesh (resharding), or one device.
  other = pzp.AxisRules(
      jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",)), {"heads": "x"}
  )
  for sharding in (rules, other, None):
    (loaded,) = pzp.load(ckpt, sharding=sharding)
    np.testing.assert_array_equal(np.asarray(loaded.value.data_array), np.asarray(value.data_array))
  manifest = _manifest(ckpt)
  manifest["arrays"][0]["checksums"][5]["xxh3_128"] = "1" * 32
  _write_manifest(ckpt, manifest)
  for sharding in (rules, other, None):
    with pytest.raises(errors.IntegrityError, match="label 'q'"):
      pzp.load(ckpt, sharding=sharding)


def test_checkpoints_from_before_checksums_still_load(ckpt):
  params = _params()
  pzp.save(ckpt, params)
  manifest = _manifest(ckpt)  # Rewrite it as format 1 (no checksums) was.
  manifest["format_version"] = 1
  for entry in manifest["arrays"]:
    del entry["checksums"]
  _write_manifest(ckpt, manifest)
  os.remove(ckpt / "penzai" / manifest_lib.FILE_DIGESTS_FILENAME)

  loaded = pzp.load(ckpt)
  assert [p.label for p in loaded] == [p.label for p in params]
  report = pzp.verify(ckpt)
  assert report.ok and report.files_checked is None and report.arrays_checked == 0
  assert report.unverified == ("blocks/0/attn/query", "blocks/0/mlp/up", "step")
  assert "no file digests recorded" in str(report) and "have no checksums" in str(report)


def test_missing_data_is_an_integrity_error_naming_labels(ckpt):
  pzp.save(ckpt, {"params": _params()})
  for data_file in glob.glob(str(ckpt / "penzai" / "ocdbt.process_0" / "d" / "*")):
    os.remove(data_file)
  with pytest.raises(errors.PzPersistError, match=r"blocks/0/attn/query|cannot read"):
    pzp.load(ckpt)
  report = pzp.verify(ckpt)
  assert not report.ok and any("missing" in line for line in report.damaged)


def test_cli_verify(ckpt, tmp_path, capsys):
  pzp.save(ckpt, {"params": _params()})
  assert cli.main(["verify", str(ckpt)]) == 0
  assert ": OK" in capsys.readouterr().out
  damaged = tmp_path / "damaged"
  os.system(f"cp -r {ckpt} {damaged}")
  manifest = _manifest(damaged)
  manifest["arrays"][0]["checksums"][0]["xxh3_128"] = "2" * 32
  _write_manifest(damaged, manifest)
  assert cli.main(["verify", str(ckpt), str(damaged)]) == 1
  out = capsys.readouterr().out
  assert "DAMAGED" in out and "blocks/0/attn/query" in out and "pz_persist.json" in out
  assert cli.main(["verify", str(tmp_path / "nope")]) == 2


def test_manager_restore_checks_checksums(tmp_path):
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, params=_params())
    manager.wait_until_finished()
  (item,) = glob.glob(str(tmp_path / "run" / "1" / "params"))
  path = os.path.join(item, "pz_persist.json")
  manifest = manifest_json.read(path)
  manifest["arrays"][1]["checksums"][0]["xxh3_128"] = "3" * 32
  with open(path, "w") as f:
    json.dump(manifest, f)
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    with pytest.raises(errors.IntegrityError, match="blocks/0/mlp/up"):
      manager.restore(1)
    assert manager.restore(1, verify=False)["params"][1].label == "blocks/0/mlp/up"
  assert not pzp.verify(item).ok
