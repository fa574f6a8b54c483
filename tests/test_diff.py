"""pzp.diff of models, paths and both: each kind of surgery gets the right marks.

What a person asks of a diff after an edit: that a LoRA adapter shows as
added with the original weights unchanged inside it, a block cut from a
Sequential as removed (and the blocks after it not as changed), a swapped
layer as replaced, relabelled parameters, metadata, axis names and dtypes as
notes, edited weights with their statistics, and an unedited model as "no
differences" from any side (model, path). Text from a checkpoint is escaped
in the HTML and on the terminal.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import model_zoo
import numpy as np
import pytest
import surgery
from penzai import pz
from penzai.toolshed import lora

import pz_persist as pzp
from pz_persist.storage.reading import opening
from pz_persist.storage.reading import reader
from pz_persist.tools import cli
from pz_persist.tools import diff_sides
from pz_persist.tools import diff_view
from pz_persist.tools import diffing


def _by_path(result):
  return {node.path: node for node in result.tree.walk()}


def _with_params(model, change):
  unbound, params = pz.unbind_params(model, freeze=True)
  return pz.bind_variables(unbound, [change(p) for p in params], unfreeze_as_copy=True)


def test_identical_model_and_path_say_no_differences(tmp_path, capsys):
  model = model_zoo.mlp()
  pzp.save_model(tmp_path / "m", model)
  for a, b in ((model, model), (model, tmp_path / "m"), (tmp_path / "m", model),
               (str(tmp_path / "m"), str(tmp_path / "m"))):
    result = pzp.diff(a, b, progress=False)
    assert result.identical and result.changes() == []
    assert len(result.arrays) == 4 and all(a.identical for a in result.arrays)
    assert result.table(width=80).startswith("no differences")
  code = cli.main(["diff", "--quiet", str(tmp_path / "m"), str(tmp_path / "m")])
  assert code == 0 and "identical: 4 array(s) compared" in capsys.readouterr().out


def test_lora_adapter_is_added_with_the_original_weights_unchanged_inside():
  model = model_zoo.mlp()
  adapted = lora.loraify_linears_in_selection(
      pz.select(model).at_instances_of(pz.nn.Linear).pick_nth_selected(0),
      rank=2, init_base_rng=jax.random.key(1))
  result = pzp.diff(model, adapted, progress=False)
  added = [n for n in result.changes() if n.status == "added" and n.kind == "LowRankAdapter"]
  assert len(added) == 1
  assert any(note.startswith("wraps the Linear") for note in added[0].notes)
  inside = [n for n in added[0].walk() if n.stats is not None]
  original = [n for n in inside if n.refs[0] is not None]
  assert len(original) == 1 and original[0].stats.identical and original[0].status == "unchanged"
  lora_arrays = [n for n in inside if n.refs[0] is None]
  assert len(lora_arrays) == 0  # The adapter's own arrays exist only in B: not compared.
  assert [n.status for n in added[0].walk() if n.kind == "Parameter"].count("added") == 2
  assert all(a.identical for a in result.arrays) and not result.identical


def test_cut_block_is_removed_and_later_blocks_meet_their_old_selves():
  model = model_zoo.llamalike_transformer()
  cut = pz.select(model).at(lambda m: m.body.sublayers).apply(
      lambda layers: [layer for i, layer in enumerate(layers) if i != 1])
  result = pzp.diff(model, cut, progress=False)
  nodes = _by_path(result)
  assert nodes["tree.body.sublayers"].notes == ["5 items -> 4"]
  removed = [n for n in result.changes() if n.status == "removed" and n.kind == "TransformerBlock"]
  assert [n.path for n in removed] == ["tree.body.sublayers[1]"]
  moved = [n for n in nodes["tree.body.sublayers"].children if "(was" in n.key]
  assert [n.key for n in moved] == ["[1] (was [2])", "[2] (was [3])", "[3] (was [4])"]
  assert all(n.status == "unchanged" for n in moved)
  assert all(a.identical for a in result.arrays)


def test_swapped_layer_is_replaced():
  model = model_zoo.mlp()
  swapped = pz.select(model).at_instances_of(pz.nn.Elementwise).apply(
      lambda _: pz.nn.Identity())
  result = pzp.diff(model, swapped, progress=False)
  replaced = [n for n in result.changes() if n.status == "replaced"]
  assert [(n.kind, n.notes) for n in replaced] == [("Identity", ["was Elementwise"])]
  assert [c.status for c in replaced[0].children] == ["removed", "added"]


def test_surgery_of_the_tests_shows_each_edit():
  """tests/surgery.py's four edits at once: adapters, a cut, a swapped
  activation and relabelled parameters."""
  result = pzp.diff(model_zoo.llamalike_transformer(), surgery.edited_transformer(),
                    progress=False)
  changes = result.changes()
  assert sum(n.status == "added" and n.kind == "LowRankAdapter" for n in changes) == 9
  assert [n.path for n in diff_view.top_changes(result) if n.status == "removed"] == [
      "tree.body.sublayers[2]"]
  assert any(n.notes == ["silu -> partial(gelu, approximate=True)"] for n in changes)
  relabelled = [note for n in changes for note in n.notes if note.startswith("label ")]
  assert len(relabelled) == 9 and all("kept_block" in note for note in relabelled)


def test_edited_weights_have_their_statistics():
  model = model_zoo.mlp()

  def edit(p):
    if p.label == "mlp/Affine_0/Linear.weights":
      data = p.value.data_array.at[0, :4].add(2.0)
      return dataclasses.replace(p, value=pz.nx.NamedArray(p.value.named_axes, data))
    return p

  result = pzp.diff(model, _with_params(model, edit), progress=False)
  changed = [a for a in result.arrays if not a.identical]
  assert [a.name for a in changed] == ["mlp/Affine_0/Linear.weights"]
  weights = np.asarray(model.sublayers[0].sublayers[0].weights.value.data_array)
  assert changed[0].max_abs == pytest.approx(2.0)
  assert changed[0].fraction_changed == pytest.approx(4 / weights.size)
  assert changed[0].relative_l2 == pytest.approx(
      4.0 / np.linalg.norm(weights + np.pad(np.full((1, 4), 2.0), ((0, 7), (0, 12)))),
      rel=1e-5)
  leaf = next(n for n in result.tree.walk() if n.stats is not None and not n.stats.identical)
  assert leaf.status == "changed" and leaf.name == "mlp/Affine_0/Linear.weights"


def test_labels_metadata_axes_and_dtypes_are_notes():
  params = [
      pz.ParameterValue(label="w", value=pz.nx.wrap(jnp.ones((2, 3)), "a", "b"),
                        metadata={"lr": 1}),
      pz.ParameterValue(label="v", value=pz.nx.wrap(jnp.ones(4), "c"), metadata={}),
      pz.ParameterValue(label="u", value=jnp.arange(3.0), metadata={}),
  ]
  edited = [
      dataclasses.replace(params[0], value=pz.nx.wrap(jnp.ones((2, 3)), "a", "z"),
                          metadata={"lr": 2}),
      dataclasses.replace(params[1], label="v2"),
      dataclasses.replace(params[2], value=jnp.arange(3.0).astype(jnp.bfloat16) + 0.5),
  ]
  notes = [note for n in pzp.diff(params, edited, progress=False).changes() for note in n.notes]
  assert "metadata {'lr': 1} -> {'lr': 2}" in notes
  assert "axes ('a', 'b') -> ('a', 'z')" in notes
  assert "label 'v' -> 'v2'" in notes
  assert "dtype float32 -> bfloat16" in notes
  dtype_node = next(n for n in pzp.diff(params, edited, progress=False).tree.walk()
                    if "dtype float32 -> bfloat16" in n.notes)
  assert dtype_node.stats.max_abs == pytest.approx(0.5) and dtype_node.stats.fraction_changed == 1


def test_a_shared_variable_is_compared_once_and_says_so():
  shared = pz.Parameter(value=jnp.ones(3), label="tied")
  tree_a = {"embed": shared, "logits": shared}
  tree_b = {"embed": pz.Parameter(value=jnp.ones(3), label="tied"),
            "logits": pz.Parameter(value=jnp.ones(3) * 2, label="tied2")}
  same = pzp.diff(tree_a, tree_a, progress=False)
  assert same.identical and len(same.arrays) == 1
  assert [n.shared for n in same.tree.walk() if n.shared] == ["tree['embed']"]
  untied = pzp.diff(tree_a, tree_b, progress=False)
  notes = [note for n in untied.changes() for note in n.notes]
  assert any(note.startswith("sharing differs") for note in notes)


def test_model_against_its_saved_edit(tmp_path):
  model = model_zoo.mlp()
  edited = _with_params(model, lambda p: dataclasses.replace(p, value=p.value * 2)
                        if p.label.endswith("bias") else p)
  pzp.save_model(tmp_path / "edited", edited)
  for a, b in ((model, tmp_path / "edited"), (tmp_path / "edited", model)):
    result = pzp.diff(a, b, progress=False)
    # The biases start at zero: doubled, still zero, so bit-identical.
    assert result.identical == all(a.identical for a in result.arrays)


def test_values_compared_in_bounded_pieces_give_the_same_statistics(monkeypatch):
  rng = np.random.default_rng(0)
  a = rng.normal(size=(300, 7)).astype(np.float32)
  b = a.copy()
  b[::3] += 1.5
  b[5, 2] = np.nan
  whole = diffing.compare_values(a, b)
  monkeypatch.setattr(diffing, "COMPARE_ELEMENTS", 64)
  pieces = diffing.compare_values(a, b)
  assert whole.fraction_changed == pieces.fraction_changed == pytest.approx(
      (100 * 7 + 1) / a.size)
  assert np.isnan(whole.max_abs) and np.isnan(pieces.max_abs)
  a[5, 2] = b[5, 2] = np.nan  # NaN on both sides is no change.
  both = diffing.compare_values(a, b)
  assert both.max_abs == pytest.approx(1.5) and both.fraction_changed == pytest.approx(
      100 * 7 / a.size)
  assert both.relative_l2 == pytest.approx(
      np.sqrt(100 * 7 * 1.5**2) / np.sqrt(np.nansum(b.astype(np.float64) ** 2)), rel=1e-6)


def test_table_fits_80_columns_and_json_lists_changes(tmp_path, capsys, monkeypatch):
  pzp.save_model(tmp_path / "a", model_zoo.llamalike_transformer())
  pzp.save_model(tmp_path / "b", surgery.edited_transformer())
  result = pzp.diff(tmp_path / "a", tmp_path / "b", progress=False)
  text = result.table(width=80)
  assert max(map(len, text.splitlines())) <= 80
  assert "LowRankAdapter" in text and "removed" in text
  monkeypatch.setenv("COLUMNS", "80")
  code = cli.main(["diff", "--quiet", str(tmp_path / "a"), str(tmp_path / "b"),
                   "--html", str(tmp_path / "diff.html")])
  out = capsys.readouterr().out
  assert code == 1 and max(map(len, out.splitlines())) <= 80
  assert "\x1b[" not in out  # Not a terminal: no colours.
  assert (tmp_path / "diff.html").read_text().count("LowRankAdapter") >= 9
  code = cli.main(["diff", "--quiet", "--json", str(tmp_path / "a"), str(tmp_path / "b")])
  record = json.loads(capsys.readouterr().out)
  assert code == 1 and record["schema"] == "pz-persist.diff/1"
  statuses = {c["status"] for c in record["changes"]}
  assert statuses == {"changed", "added", "removed"}
  assert any(c["kind"] == "LowRankAdapter" and c["status"] == "added" for c in record["changes"])


HOSTILE = "<script>alert(1)</script>\x1b[31mred\x1b]0;title\x07\u202e"


def test_hostile_labels_and_metadata_are_only_text(tmp_path, capsys):
  """Labels may not hold control characters (saving refuses them), metadata
  and dict keys may: both reach the HTML and the terminal only as text."""
  a = [pz.ParameterValue(label="w", value=jnp.ones(2), metadata={"note": "x"})]
  b = [pz.ParameterValue(label="<script>alert(1)</script>", value=jnp.ones(2) * 3,
                         metadata={"note": HOSTILE, HOSTILE: 1})]
  pzp.save(tmp_path / "a", a)
  pzp.save(tmp_path / "b", b)
  result = pzp.diff(tmp_path / "a", tmp_path / "b", progress=False)
  page = result.to_html()
  assert "<script>alert" not in page and "&lt;script&gt;alert(1)" in page
  assert "\x1b" not in result.table(width=80) and "\u202e" not in result.table(width=80)
  assert "\\x1b[31mred" in result.table(width=200)
  code = cli.main(["diff", "--quiet", str(tmp_path / "a"), str(tmp_path / "b")])
  out = capsys.readouterr().out
  assert code == 1 and "\x1b" not in out and "\x07" not in out and "\u202e" not in out
  code = cli.main(["diff", "--quiet", "--json", str(tmp_path / "a"), str(tmp_path / "b")])
  out = capsys.readouterr().out
  assert code == 1 and out.isascii() and "\x1b" not in out


def test_coloured_table_colours_each_rows_own_status():
  model = model_zoo.mlp()
  swapped = pz.select(model).at_instances_of(pz.nn.Elementwise).apply(lambda _: pz.nn.Identity())
  edited = _with_params(swapped, lambda p: dataclasses.replace(p, value=p.value + 1)
                        if p.label.endswith("bias") else p)
  result = pzp.diff(model, edited, progress=False)
  plain = result.table(width=100).splitlines()
  coloured = result.table(width=100, color=True).splitlines()
  assert len(plain) == len(coloured)
  codes = {"changed": "33", "replaced": "35"}
  for line, shown in zip(plain, coloured):
    word = line.split(" ", 1)[0]
    if word in codes:
      assert shown == f"\x1b[{codes[word]}m{word}\x1b[0m{line[len(word):]}"
    else:
      assert shown == line
  assert sum(line.startswith("\x1b[") for line in coloured) == 3  # 2 biases, 1 replaced


class _Handle:
  """Stands in for an opened lazy handle: its structure, and reads by index."""

  def __init__(self, path):
    self.opened = opening.read(path, lambda opened: opened)
    self.reads: list[set[int]] = []

  def __pz_persist_diff_side__(self):
    def read(refs):
      self.reads.append(set(refs))
      return reader.read_arrays(self.opened.item, self.opened.manifest, refs=set(refs))

    return diff_sides.FunctionSide(f"handle of {self.opened.item}", self.opened.manifest, read)


def test_an_opened_handle_plugs_in_with_one_small_adapter(tmp_path):
  model = model_zoo.mlp()
  edited = _with_params(model, lambda p: dataclasses.replace(p, value=p.value + 1)
                        if p.label.endswith("bias") else p)
  pzp.save_model(tmp_path / "m", model)
  handle = _Handle(tmp_path / "m")
  result = pzp.diff(handle, edited, progress=False, batch_bytes=1)
  assert [a.name for a in result.arrays if not a.identical] == [
      "mlp/Affine_0/AddBias.bias", "mlp/Affine_1/AddBias.bias"]
  assert result.a.startswith("handle of") and all(len(r) == 1 for r in handle.reads)
  assert pzp.diff(model, handle, progress=False).identical


def test_a_handle_from_pzp_open_is_a_side_read_through_its_own_checks(tmp_path):
  model = model_zoo.mlp()
  edited = _with_params(model, lambda p: dataclasses.replace(p, value=p.value + 1)
                        if p.label.endswith("bias") else p)
  pzp.save_model(tmp_path / "m", model)
  with pzp.open(tmp_path / "m") as ckpt:
    result = pzp.diff(ckpt, edited, progress=False, batch_bytes=1)
    assert [a.name for a in result.arrays if not a.identical] == [
        "mlp/Affine_0/AddBias.bias", "mlp/Affine_1/AddBias.bias"]
    assert result.a == str(ckpt.path)
    assert pzp.diff(model, ckpt, progress=False).identical
    pzp.save_model(tmp_path / "m", edited, overwrite=True)  # Replaced under the handle.
    with pytest.raises(pzp.errors.CheckpointReplacedError):
      pzp.diff(ckpt, model, progress=False)


def test_a_side_that_cannot_be_saved_says_which_and_why(tmp_path):
  with pytest.raises(pzp.errors.EncodingError, match=r"pzp.diff compares what pz_persist can"
                     r" save, and B \(a dict\) cannot be: tree\['f'\]: cannot save a value"):
    pzp.diff(model_zoo.mlp(), {"f": object()}, progress=False)
