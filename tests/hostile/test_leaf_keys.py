"""Format 3's array keys (Orbax leaf names, for the type handler's items) stay
names: parts of ``[A-Za-z0-9_-]`` joined by ``.``, never an empty part, so
never ``.``, ``..``, a path or an absolute name; and only in format 3.

Every entry point that reads a manifest refuses a forged key before any file
is opened by it: the library's loads, ``inspect``, ``verify`` and the command.
"""

from __future__ import annotations

import json

import model_zoo
import orbax.checkpoint as ocp
import manifest_json
import pytest

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import manifest as manifest_lib
from pz_persist.tools import cli

FORGED_KEYS = ["..", ".", "a..b", ".hidden", "trailing.", "../../etc/passwd", "/etc/passwd",
               "a/b", "a.b\\c", "", "a.b c"]

ENTRY_POINTS = {
    "load": pzp.load,
    "inspect": pzp.inspect,
    "load_into": lambda path: pzp.load_into(path, model_zoo.mlp()),
    "verify": lambda path: _raise_if_damaged(pzp.verify(path)),
}


def _raise_if_damaged(report):
  """`verify` reports what it refuses; raised here like the loads' errors."""
  assert not report.ok
  raise errors.ManifestError("\n".join(report.damaged))


def _type_handler_item(tmp_path, key: str, *, format_version: int | None = None):
  path = tmp_path / "c"
  with ocp.PyTreeCheckpointer() as checkpointer:
    checkpointer.save(path, model_zoo.mlp())
  manifest_file = path / manifest_lib.MANIFEST_FILENAME
  manifest = manifest_json.read(manifest_file)
  manifest["arrays"][0]["key"] = key
  if format_version is not None:
    manifest["format_version"] = format_version
  manifest_file.write_text(json.dumps(manifest))
  return path


@pytest.mark.parametrize("key", FORGED_KEYS)
@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
def test_a_forged_leaf_key_is_refused(tmp_path, key, entry_point):
  path = _type_handler_item(tmp_path, key)
  with pytest.raises(errors.ManifestError, match=r"pz_persist\.json: arrays\[0\].*invalid array key"):
    ENTRY_POINTS[entry_point](path)


def test_the_command_refuses_it(tmp_path, capsys):
  path = _type_handler_item(tmp_path, "../../etc/passwd")
  assert cli.main(["verify", str(path)]) != 0
  assert "invalid array key" in capsys.readouterr().out


def test_a_leaf_key_needs_format_3(tmp_path):
  # A format 2 manifest keeps format 2's keys: no dotted name sneaks in.
  path = _type_handler_item(tmp_path, "model.sublayers.0.sublayers.0.weights", format_version=2)
  with pytest.raises(errors.ManifestError, match="invalid array key"):
    pzp.load(path)


def test_the_real_leaf_keys_load(tmp_path):
  path = tmp_path / "c"
  with ocp.PyTreeCheckpointer() as checkpointer:
    checkpointer.save(path, model_zoo.mlp())
  keys = [spec["key"] for spec in manifest_json.read(path / manifest_lib.MANIFEST_FILENAME)["arrays"]]
  assert keys and all("." in key for key in keys)
  assert pzp.verify(path).ok
