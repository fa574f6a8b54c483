"""The pz-persist command in an 80-column terminal and in scripts (``--json``).

At 80 columns no two rows of different arrays may look alike (labels are
wrapped, never cut; where labels repeat, the distinguishing part of the tree
path is shown), no axis name is split, every line fits; ``--json`` prints
the documented, versioned schema of docs/reference/cli-json.md.
"""

from __future__ import annotations

import json
import pathlib
import re

import jax.numpy as jnp
import model_zoo
import optax
import pytest
from penzai import pz

import pz_persist as pzp
from pz_persist.tools import cli

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "reference" / "cli-json.md"


def _run(capsys, *argv):
  code = cli.main(list(argv))
  captured = capsys.readouterr()
  return code, captured.out, captured.err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A CheckpointManager step: params, Adam's state (mu and nu share every
  label) and the model."""
  directory = tmp_path_factory.mktemp("cli") / "run"
  unbound, params = pz.unbind_params(model_zoo.llamalike_transformer(), freeze=True)
  with pzp.CheckpointManager(directory) as manager:
    manager.save(7, params=params, opt_state=optax.adam(1e-3).init(params), model=unbound)
  return directory


def _logical_rows(table: str) -> list[str]:
  """A table's rows, each with its continuation lines (those that start
  with spaces: wrapped cells) joined on."""
  rows: list[str] = []
  for line in table.splitlines()[1:]:
    if rows and line.startswith(" ") and not re.search(r"\d B$|[KMGT]iB$", line):
      rows[-1] += "\n" + line
    else:
      rows.append(line)
  return rows


def test_inspect_at_80_columns_tells_every_array_apart(run, capsys, monkeypatch):
  monkeypatch.setenv("COLUMNS", "80")
  code, out, _ = _run(capsys, "inspect", str(run / "7" / "opt_state"))
  assert code == 0
  assert max(map(len, out.splitlines())) <= 80
  table = out.split("\n\n")[1]
  assert table.splitlines()[0].split()[:2] == ["in", "label"]
  rows = _logical_rows(table)
  header = table.splitlines()[0]
  start, end = header.index("label"), header.index("axes")  # The label column.
  record = json.loads(_run(capsys, "inspect", "--json", str(run / "7" / "opt_state"))[1])
  arrays = record["items"][0]["arrays"]
  assert len(rows) == len(arrays) == 43  # count, then mu and nu of 21 parameters.
  assert len(set(rows)) == len(rows)  # No two rows look the same.
  assert sum(row.startswith("mu ") for row in rows) == sum(row.startswith("nu ") for row in rows) == 21
  for row, array in zip(rows, arrays):
    for axis in array["axes"]:  # Every axis name whole on one line.
      assert any(re.search(rf"[(\s]{axis}[,)]", line) for line in row.splitlines()), (axis, row)
    if array["label"]:  # The label whole once its wrapped pieces are joined.
      label_cells = "".join(line[start:end].strip() for line in row.splitlines())
      assert label_cells == array["label"], row
  assert "…" not in out


def test_inspect_of_a_step_shows_its_items(run, capsys):
  code, out, _ = _run(capsys, "inspect", str(run / "7"))
  assert code == 0
  assert out.startswith(f"{run / '7'}: 3 items (model, opt_state, params)\n")
  for item in ("model", "opt_state", "params"):
    assert f"\n{run / '7' / item}\n" in out
  record = json.loads(_run(capsys, "inspect", "--json", str(run / "7"))[1])
  assert [pathlib.Path(i["path"]).name for i in record["items"]] == ["model", "opt_state", "params"]


def test_a_dict_of_named_arrays_shows_its_keys(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("COLUMNS", "80")
  tree = {"queries": pz.nx.wrap(jnp.zeros((3, 4))).tag("batch", "features"),
          "keys": pz.nx.wrap(jnp.ones((2,))).tag("seq")}
  pzp.save(tmp_path / "named", tree)
  code, out, _ = _run(capsys, "inspect", str(tmp_path / "named"))
  assert code == 0
  lines = [line.split() for line in out.splitlines()]
  assert ["tree['keys']", "(seq)", "2", "float32", "8", "B"] in lines
  assert ["tree['queries']", "(batch,", "features)", "3x4", "float32", "48", "B"] in lines
  assert "data_array" not in out


def test_ls_fits_the_width(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("COLUMNS", "80")
  items = {f"a_long_item_name_number_{i}": [jnp.ones(2)] for i in range(4)}
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, **items)
  code, out, _ = _run(capsys, "ls", str(tmp_path / "run"))
  assert code == 0
  assert max(map(len, out.splitlines())) <= 80
  for name in items:  # Wrapped between items, never inside a name.
    assert re.search(rf"(^|\s){name}\*", out, re.M), name


def test_a_missing_path_is_one_clear_line(tmp_path, capsys):
  missing = tmp_path / "nowhere"
  for argv in (["ls", str(missing)], ["inspect", str(missing)], ["verify", str(missing)],
               ["diff", str(missing), str(missing)], ["ls", "--json", str(missing)]):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == "", argv
    assert err.count("\n") == 1 and str(missing) in err, argv
    assert "Errno" not in err and "does not exist" in err or "no such file" in err, argv


def test_diff_of_two_configurations_names_each_setting(tmp_path, capsys):
  pzp.save(tmp_path / "a", {"lr": 0.1, "layers": [64, 64], "name": "a", "adam": {"b1": 0.9}})
  pzp.save(tmp_path / "b", {"lr": 0.2, "layers": [64, 64, 64], "name": "a", "adam": {"b1": 0.95},
                            "seed": 3})
  code, out, _ = _run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"))
  assert code == 1
  rows = [line.split() for line in out.splitlines()]
  assert ["changed", "tree['lr']", "float", "0.1", "->", "0.2"] in rows
  assert ["changed", "tree['layers']", "list", "2", "items", "->", "3"] in rows
  assert ["added", "tree['layers'][2]", "int", "64"] in rows
  assert ["changed", "tree['adam']['b1']", "float", "0.9", "->", "0.95"] in rows
  assert ["added", "tree['seed']", "int", "3"] in rows
  assert "'name'" not in out


def _documented_fields() -> set[str]:
  return set(re.findall(r"^\| `(\w+)` \|", DOC.read_text(), re.M))


def _keys(value, found: set[str]) -> set[str]:
  if isinstance(value, dict):
    for key, child in value.items():
      found.add(key)
      _keys(child, found)
  elif isinstance(value, list):
    for child in value:
      _keys(child, found)
  return found


def test_json_of_each_command_follows_its_documented_schema(run, tmp_path, capsys):
  params = run / "7" / "params"
  pzp.save(tmp_path / "zeros", {"w": jnp.zeros(3), "v": jnp.ones(2)})
  pzp.save(tmp_path / "other", {"w": jnp.ones(3), "v": jnp.ones(2)})
  outputs = {
      "inspect": _run(capsys, "inspect", "--json", str(run / "7")),
      "ls": _run(capsys, "ls", "--json", str(run)),
      "verify": _run(capsys, "verify", "--json", "--quiet", str(params)),
      "diff": _run(capsys, "diff", "--json", "--quiet", str(tmp_path / "other"),
                   str(tmp_path / "zeros")),
  }
  documented = _documented_fields()
  for command, (code, out, err) in outputs.items():
    assert out.count("\n") == 1 and err == "", command  # One line of JSON.
    record = json.loads(out)
    assert record["schema"] == f"pz-persist.{command}/1"
    assert f"`\"pz-persist.{command}/1\"`" in DOC.read_text()
    assert _keys(record, set()) <= documented, (command, _keys(record, set()) - documented)
    assert out.isascii()
    assert code == (1 if command == "diff" else 0)
  diff = json.loads(outputs["diff"][1])
  w = next(a for a in diff["arrays"] if a["name"] == "tree['w']")
  assert w["relative_l2"] is None and w["max_abs"] == 1.0  # B is zeros: infinite, so null.
  assert w["fraction_changed"] == 1.0
  change = next(c for c in diff["changes"] if c["path"] == "tree['w']")
  assert change["status"] == "changed" and change["stats"]["max_abs"] == 1.0
  steps = json.loads(outputs["ls"][1])["steps"]
  assert steps[0]["step"] == 7 and steps[0]["pz_persist_items"] == ["model", "opt_state", "params"]
  assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", steps[0]["committed_at"])
  verify = json.loads(outputs["verify"][1])
  assert verify["ok"] and verify["checkpoints"][0]["arrays_checked"] == 21
