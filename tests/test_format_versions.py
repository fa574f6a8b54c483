"""Format versions are explicit: every node type says which manifest format
(and release) introduced it, a manifest declares the format its nodes need,
and a reader meeting what it does not know says which format or release the
checkpoint needs and which it reads, instead of calling it damaged."""

from __future__ import annotations

import dataclasses
import json

import model_zoo
import manifest_json
import pytest

import pz_persist as pzp
from pz_persist import errors
from pz_persist import version
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import nodes
from pz_persist.storage.writing import writer
from pz_persist.tools import cli

NEWER = manifest_lib.FORMAT_VERSION + 1

ENTRY_POINTS = {
    "load": pzp.load,
    "inspect": pzp.inspect,
    "load_model": pzp.load_model,
    "load_into": lambda path: pzp.load_into(path, model_zoo.mlp()),
}


def _forge(tmp_path, *, format_version: int, writer_name: str) -> str:
  """A checkpoint of the mlp whose first parameter's value is a node type no
  pz_persist knows, declared as written by ``writer_name`` in ``format_version``."""
  path = tmp_path / "c"
  pzp.save(path, model_zoo.mlp())
  manifest_file = path / "penzai" / manifest_lib.MANIFEST_FILENAME
  manifest = manifest_json.read(manifest_file)
  manifest["variables"][0]["value"] = {"t": "quantized_array", "ref": 0, "bits": 4}
  manifest["format_version"] = format_version
  manifest["writer"] = writer_name
  manifest_file.write_text(json.dumps(manifest))
  return str(path)


@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
def test_a_newer_format_says_which_format_it_needs(tmp_path, entry_point):
  path = _forge(tmp_path, format_version=NEWER, writer_name="pz_persist 9.0.0")
  with pytest.raises(errors.FormatVersionError) as raised:
    ENTRY_POINTS[entry_point](path)
  message = str(raised.value)
  assert f"manifest format {NEWER}: it needs a pz_persist that reads format {NEWER}" in message
  assert f"({version.__version__}) reads formats 1 to {manifest_lib.FORMAT_VERSION}" in message
  assert "pz_persist 9.0.0" in message and "pip install -U pz-persist" in message


def test_the_command_says_it_too(tmp_path, capsys):
  path = _forge(tmp_path, format_version=NEWER, writer_name="pz_persist 9.0.0")
  assert cli.main(["inspect", path]) != 0
  assert f"reads format {NEWER}" in capsys.readouterr().err


@pytest.mark.parametrize("entry_point", ["load", "inspect", "load_model"])
def test_a_node_type_from_a_newer_release_says_which_release(tmp_path, entry_point):
  # Node types added within a format (0.6.0's mesh nodes) are told apart from
  # damage by the release that wrote them.
  path = _forge(tmp_path, format_version=2, writer_name="pz_persist 9.1.0")
  with pytest.raises(errors.FormatVersionError) as raised:
    ENTRY_POINTS[entry_point](path)
  message = str(raised.value)
  assert "'quantized_array'" in message and "variables[0]" in message
  assert "written by pz_persist 9.1.0 in manifest format 2 and needs that release" in message
  assert f"this pz_persist ({version.__version__}) reads manifest formats 1 to" in message


@pytest.mark.parametrize("writer_name", [f"pz_persist {version.__version__}", "pz_persist 0.1.0",
                                         "someone else"])
def test_an_unknown_node_type_from_no_newer_release_is_damage(tmp_path, writer_name):
  path = _forge(tmp_path, format_version=2, writer_name=writer_name)
  with pytest.raises(errors.ManifestError) as raised:
    pzp.load(path)
  assert not isinstance(raised.value, errors.FormatVersionError)
  assert "not a node type of manifest format 2" in str(raised.value)
  assert "damaged or was edited" in str(raised.value)


def test_every_node_type_says_which_format_and_release_introduced_it():
  for node_type in nodes.NODE_TYPES.values():
    assert 1 <= node_type.format <= manifest_lib.FORMAT_VERSION, node_type.tag
    assert nodes.release_tuple(node_type.since) <= nodes.release_tuple(version.__version__)
  assert {t.tag for t in nodes.NODE_TYPES.values() if t.since == "0.6.0"} == {
      "mesh", "partition_spec", "named_sharding"}


def test_a_manifest_declares_the_format_its_nodes_need(tmp_path, monkeypatch):
  assert writer.encode(model_zoo.mlp()).manifest.format_version == manifest_lib.WRITTEN_FORMAT
  # A node type of a format newer than this reader: the manifest declares it.
  newer = dataclasses.replace(nodes.NODE_TYPES["int"], format=NEWER)
  monkeypatch.setitem(nodes.NODE_TYPES, "int", newer)
  monkeypatch.setattr(nodes, "_NEWEST_NODE_FORMAT", NEWER)
  # That newer release reads what it writes (its save checks the manifest with its reader).
  monkeypatch.setattr(manifest_lib, "FORMAT_VERSION", NEWER)
  assert writer.encode({"a": "text"}).manifest.format_version == manifest_lib.WRITTEN_FORMAT
  assert writer.encode({"a": [1.5, (3,)]}).manifest.format_version == NEWER
  pzp.save(tmp_path / "c", {"steps": 3})
  monkeypatch.undo()
  with pytest.raises(errors.FormatVersionError, match=f"reads format {NEWER}"):
    pzp.load(tmp_path / "c")


def test_release_numbers():
  assert nodes.release_of("pz_persist 0.6.0") == (0, 6, 0)
  assert nodes.release_of("pz_persist 0.7.0.dev1") == (0, 7, 0)
  assert nodes.release_of("orbax 1.0") is None
