"""pzp.diff after several kinds of surgery at once, and its table at 80 columns.

Each edit alone aligned (tests/test_diff.py); together, a LoRA adapter on
every Linear changed each block's labels and an inserted layer changed the
list's length, so blocks were reported removed and re-added and only 14 of
30 arrays compared. Items now align by identity (exact keys, then shared
labels, then structure: `pz_persist.tools.diff_align`), so every array both
sides hold is compared, and the table groups the repeated changes so each
row stays within one or two lines of the terminal.
"""

from __future__ import annotations

import dataclasses

import jax
import model_zoo
import pytest
import surgery
from penzai import pz
from penzai.toolshed import lora

import pz_persist as pzp
from pz_persist.tools import cli
from pz_persist.tools import diff_table


def _lora_everywhere(model):
  return lora.loraify_linears_in_selection(
      pz.select(model).at_instances_of(pz.nn.Linear), rank=2, init_base_rng=jax.random.key(3))


def _insert_identity(model, at: int):
  return pz.select(model).at(lambda m: m.body.sublayers).apply(
      lambda layers: [*layers[:at], pz.nn.Identity(), *layers[at:]])


def _names(model) -> set[str]:
  side = pzp.diff(model, model, progress=False)
  return {a.name for a in side.arrays}


def _compared(result) -> set[str]:
  """A's names of the arrays compared (a relabelled one is ``old -> new``)."""
  return {a.name.split(" -> ")[0] for a in result.arrays}


@pytest.fixture(scope="module")
def base():
  return model_zoo.llamalike_transformer()


def test_lora_on_every_linear_and_an_inserted_layer_compare_every_array(base):
  edited = _insert_identity(_lora_everywhere(base), 2)
  result = pzp.diff(base, edited, progress=False)
  assert _compared(result) == _names(base) and len(result.arrays) == 30
  assert all(a.identical for a in result.arrays)  # The base weights are untouched.
  changes = result.changes()
  assert [(n.status, n.kind, n.path) for n in changes if n.status != "changed" and n.kind in (
      "Identity", "TransformerBlock", "RMSLayerNorm")] == [
          ("added", "Identity", "tree.body.sublayers[2]")]
  linears = len(pz.select(base).at_instances_of(pz.nn.Linear).get_sequence())
  assert sum(n.status == "added" and n.kind == "LowRankAdapter" for n in changes) == linears
  moved = [c.key for c in next(n for n in changes if n.path == "tree.body.sublayers").children
           if "(was" in c.key]
  assert moved == ["[3] (was [2])", "[4] (was [3])", "[5] (was [4])"]


def test_every_kind_of_surgery_at_once_compares_what_both_sides_hold(base):
  """tests/surgery.py's four edits (adapters in one block, a block cut, an
  activation swapped, a block relabelled), adapters on every other Linear,
  a layer inserted and a weight scaled."""
  edited = _insert_identity(_lora_everywhere(surgery.edited_transformer()), 1)
  structure, params = pz.unbind_params(edited, freeze=True)
  scaled = "transformer/kept_block/mlp/out_linear.weights"
  params = [dataclasses.replace(p, value=p.value * 2) if p.label == scaled else p
            for p in params]
  edited = pz.bind_variables(structure, params, unfreeze_as_copy=True)
  result = pzp.diff(base, edited, progress=False)
  cut = {name for name in _names(base)  # Block 1's parameters and constants.
         if name.startswith(("transformer/block_1/", "tree.body.sublayers[2]"))}
  assert cut and _compared(result) == _names(base) - cut
  relabelled = [a for a in result.arrays if a.name.startswith("transformer/") and " -> " in a.name]
  assert len(relabelled) == 9 and all("kept_block" in a.name for a in relabelled)
  assert [a.name for a in result.arrays if not a.identical] == [
      f"transformer/block_0/mlp/out_linear.weights -> {scaled}"]
  top = [(n.status, n.kind) for n in result.changes() if n.path.count(".") == 2]
  assert ("added", "Identity") in top and ("removed", "TransformerBlock") in top


def _rows(table: str) -> list[list[str]]:
  """The table's rows, each its lines (a row starts with its status word)."""
  lines = table.split("\n")
  start = next(i for i, line in enumerate(lines) if line.startswith("status"))
  rows: list[list[str]] = []
  for line in lines[start + 1:]:
    if not line or line.startswith("("):
      break
    if line.startswith(" "):
      rows[-1].append(line)
    else:
      rows.append([line])
  return rows


@pytest.mark.parametrize("width", [80, 100, 60, 40, 30])
def test_each_row_is_one_or_two_lines_and_repeats_are_grouped(base, width):
  for edited, adapters_alike in (
      (_insert_identity(_lora_everywhere(base), 2), True),
      (_insert_identity(_lora_everywhere(surgery.edited_transformer()), 1), False),
  ):
    table = pzp.diff(base, edited, progress=False).table(width=width)
    assert max(map(len, table.splitlines())) <= width
    rows = _rows(table)
    assert rows and all(len(row) <= 2 for row in rows)
    assert "places)" in table
    if width < 60:  # Room for the start and end of each row only.
      continue
    assert "LowRankAdapter" in table
    if adapters_alike:  # One row for all twenty adapters.
      assert table.count("LowRankAdapter") == 1 and "(20 places)" in table
    else:  # Nine adapters on adapters (block 0): one row; two alike: a row each.
      assert "(9 places)" in table and table.count("LowRankAdapter") == 3
      assert any(line.startswith("removed") for row in rows for line in row)


def test_the_command_line_at_80_columns(tmp_path, base, capsys, monkeypatch):
  pzp.save_model(tmp_path / "a", base)
  pzp.save_model(tmp_path / "b", _insert_identity(_lora_everywhere(base), 2))
  monkeypatch.setenv("COLUMNS", "80")
  code = cli.main(["diff", "--quiet", str(tmp_path / "a"), str(tmp_path / "b")])
  out = capsys.readouterr().out
  assert code == 1 and "0 of 30 compared array(s) differ" in out  # Only structure differs.
  assert max(map(len, out.splitlines())) <= 80 and out.count("wraps the Linear") == 1
  code = cli.main(["diff", "--quiet", "--all", str(tmp_path / "a"), str(tmp_path / "b")])
  out = capsys.readouterr().out
  assert max(map(len, out.splitlines())) <= 80
  assert all(len(row) <= 2 for row in _rows(out))


def test_a_wide_terminal_gets_one_line_per_row(base):
  edited = _insert_identity(base, 2)
  table = pzp.diff(base, edited, progress=False).table(width=200)
  assert all(len(row) == 1 for row in _rows(table))


def test_paths_keep_their_start_and_end():
  path = "tree.body.sublayers[1].sublayers[0].delta.sublayers[1].input_to_query.sublayers[0]"
  short = diff_table.elide(path, 40, path=True)
  assert len(short) <= 40 and short.startswith("tree...") and short.endswith(".sublayers[0]")
  assert diff_table.place_pattern([
      "tree.body.sublayers[1].sublayers[0].w", "tree.body.sublayers[3].sublayers[0].w",
      "tree.body.sublayers[4].x.sublayers[0].w"]) == "tree.body.sublayers[1,3,4]....sublayers[0].w"
