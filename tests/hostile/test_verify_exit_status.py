"""``pz-persist verify`` tells damage from a check that could not run (issue 36).

A checkpoint holding a weakly typed value (``jnp.asarray(1.0)``) made verify
raise ``AttributeError``, and the command exit 1, the status for damage: a
script would have deleted or replaced a healthy checkpoint. Every checkpoint a
save writes verifies OK (`tests/test_saved_always_loads.py` over every value
kind); and when verify itself fails, the command says "could not check" and
exits 3 (`pz_persist.tools.cli.COULD_NOT_CHECK`), never 1.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pz_persist as pzp
from pz_persist.storage.reading import reader
from pz_persist.tools import cli

WEAK = {
    "float": lambda: jnp.asarray(1.0), "int": lambda: jnp.asarray(3),
    "complex": lambda: jnp.asarray(1j), "bool": lambda: jnp.asarray(True),
    "in a list": lambda: [jnp.asarray(1.0), np.float32(2.0), jnp.ones(2)],
}


@pytest.mark.parametrize("kind", list(WEAK))
def test_a_weakly_typed_value_verifies_ok(kind, tmp_path, capsys):
  value = WEAK[kind]()
  pzp.save(tmp_path / "c", {"w": value})
  report = pzp.verify(tmp_path / "c")
  assert report.ok and not report.damaged, report
  capsys.readouterr()
  assert cli.main(["verify", str(tmp_path / "c")]) == 0
  assert "OK" in capsys.readouterr().out
  loaded = pzp.load(tmp_path / "c")["w"]
  weak = [getattr(leaf, "weak_type", None) for leaf in jax.tree.leaves(value)]
  assert [getattr(leaf, "weak_type", None) for leaf in jax.tree.leaves(loaded)] == weak


def _fail_reading(*args, **kwargs):
  raise RuntimeError("boom: a bug in the reader")


def test_a_failed_check_is_not_damage(tmp_path, capsys, monkeypatch):
  pzp.save(tmp_path / "c", {"w": jnp.arange(4.0)})
  monkeypatch.setattr(reader, "read_arrays", _fail_reading)
  capsys.readouterr()
  code = cli.main(["verify", str(tmp_path / "c")])
  out = capsys.readouterr()
  assert code == cli.COULD_NOT_CHECK == 3, out
  assert "could not check" in out.err and "boom" in out.err and "not damage" in out.err
  assert "DAMAGED" not in out.out + out.err

  code = cli.main(["verify", "--json", str(tmp_path / "c")])
  record = json.loads(capsys.readouterr().out)
  assert code == 3 and record["ok"] is False
  (entry,) = record["checkpoints"]
  assert entry["checked"] is False and "boom" in entry["error"] and entry["damaged"] == []


def test_damage_outranks_a_failed_check_and_every_path_is_checked(tmp_path, capsys, monkeypatch):
  pzp.save(tmp_path / "fails", {"w": jnp.arange(4.0)})
  pzp.save(tmp_path / "damaged", {"w": jnp.arange(4.0)})
  (tmp_path / "damaged" / "penzai" / "pz_persist.json").write_text("{}")
  pzp.save(tmp_path / "fine", {"w": 1.5})  # No array: nothing read.
  real = reader.read_arrays

  def fail_for_one(item, *args, **kwargs):
    if "fails" in str(item):
      _fail_reading()
    return real(item, *args, **kwargs)

  monkeypatch.setattr(reader, "read_arrays", fail_for_one)
  capsys.readouterr()
  paths = [str(tmp_path / name) for name in ("fails", "damaged", "fine")]
  code = cli.main(["verify", "--json", *paths])
  record = json.loads(capsys.readouterr().out)
  assert code == cli.DAMAGED == 1
  assert [entry["checked"] for entry in record["checkpoints"]] == [False, True, True]
  assert [entry["ok"] for entry in record["checkpoints"]] == [False, False, True]
  assert cli.main(["verify", paths[0], paths[2]]) == 3


def test_a_healthy_checkpoint_verifies_with_status_0(tmp_path, capsys):
  pzp.save(tmp_path / "c", {"w": jnp.arange(4.0)})
  capsys.readouterr()
  assert cli.main(["verify", "--json", str(tmp_path / "c")]) == 0
  (entry,) = json.loads(capsys.readouterr().out)["checkpoints"]
  assert entry["checked"] is True and entry["error"] is None and entry["ok"] is True
