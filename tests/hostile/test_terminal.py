"""What ``pz-persist`` prints cannot drive the terminal.

Writer strings, labels, axis names, class names, array paths and file names
come from the checkpoint. Printed raw, an escape sequence in one could clear
the screen, set the window title, or move the cursor up and redraw a
``DAMAGED`` line as ``OK``. Every command's output, on stdout and stderr, must
hold no control character but newlines, no C1 control and no bidi override.
"""

from __future__ import annotations

import json
import os
import re

import model_zoo
import manifest_json
import pytest

import pz_persist as pzp
from pz_persist.safety import terminal
from pz_persist.tools import cli

UNSAFE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[1A\r\x9b2K\u202e"
"""Set the title, clear the screen, go up a line, overwrite it (C1 CSI too),
and reverse what follows."""


def _forge(item: str, fn) -> None:
  path = os.path.join(item, "pz_persist.json")
  with open(path) as f:
    manifest = manifest_json.expanded(f.read().encode())
  fn(manifest)
  with open(path, "w") as f:
    json.dump(manifest, f)


def _evil_names(manifest: dict) -> None:
  """Escapes wherever the manifest's validation lets free text through."""
  manifest["tree"]["class"]["qualname"] = "MLP" + ESCAPES
  label = "mlp/Affine_0/Linear.weights\x9b2J\u202e"  # Labels refuse only C0.
  manifest["variables"][0]["label"]["v"] = label
  manifest["arrays"][0]["label"] = label
  manifest["variables"][0]["value"]["axes"][0][0]["v"] = "features" + ESCAPES


def _evil_writer(manifest: dict) -> None:
  manifest["writer"] = "pz_persist" + ESCAPES


def _evil_path(manifest: dict) -> None:
  manifest["arrays"][1]["path"] = "tree" + ESCAPES


def _run(capsys, *argv: str) -> tuple[int, str]:
  status = cli.main(list(argv))
  captured = capsys.readouterr()
  return status, captured.out + captured.err


@pytest.fixture
def run(tmp_path):
  """A step directory holding a checkpoint at step 1 (``run/1``)."""
  pzp.save_model(tmp_path / "run" / "1", model_zoo.mlp())
  return tmp_path / "run"


@pytest.mark.parametrize("forge", [_evil_names, _evil_writer, _evil_path])
def test_checkpoint_strings_are_escaped(run, capsys, forge, monkeypatch):
  monkeypatch.setenv("COLUMNS", "400")  # Long escaped names on one line, to find them.
  clean = run.parent / "clean"
  pzp.save_model(clean, model_zoo.mlp())
  _forge(os.path.join(run, "1", "penzai"), forge)
  outputs = [
      _run(capsys, "inspect", str(run / "1")),
      _run(capsys, "verify", str(run / "1")),
      _run(capsys, "diff", str(clean), str(run / "1")),
  ]
  for status, output in outputs:
    assert not UNSAFE.search(output), output
  if forge is _evil_names:  # Accepted by validation, and shown escaped.
    assert "MLP\\x1b]0;pwned\\x07\\x1b[2J" in outputs[0][1]
    assert "features\\x1b]0;pwned" in outputs[0][1]
    assert "Linear.weights\\x9b2J\\u202e" in outputs[2][1]
  else:  # Refused by validation; the message shows what, escaped.
    assert all(status == 2 or "DAMAGED" in out for status, out in outputs)


def test_file_and_item_names_are_escaped(run, capsys):
  evil = os.path.join(run, "1", "penzai", "x" + ESCAPES + "\n  OK")
  with open(evil, "wb") as f:
    f.write(b"added")
  os.mkdir(os.path.join(run, "1", "item" + ESCAPES))
  status, verified = _run(capsys, "verify", str(run / "1"))
  assert status == 1 and not UNSAFE.search(verified), verified
  # The file name's newline cannot start a line of its own ("  OK").
  assert verified.count("\n") == 2, verified
  status, listed = _run(capsys, "ls", str(run))
  assert status == 0 and not UNSAFE.search(listed), listed
  assert "item\\x1b]0;pwned" in listed


def test_printable():
  assert terminal.printable("a\x1b[2Jb\n\tc\u202e") == "a\\x1b[2Jb\n\\x09c\\u202e"
  assert terminal.printable("a\nb", newlines=False) == "a\\x0ab"
  assert terminal.printable("mlp/Affine_0 é ü 日本 🙂") == "mlp/Affine_0 é ü 日本 🙂"


@pytest.mark.parametrize("forge", [_evil_names, _evil_path])
def test_json_output_escapes_checkpoint_strings(run, capsys, forge):
  """``--json`` output is ASCII: what the checkpoint names arrives as ``\\u``
  escapes, which a parser reads back exactly and a terminal shows as text."""
  clean = run.parent / "clean"
  pzp.save_model(clean, model_zoo.mlp())
  _forge(os.path.join(run, "1", "penzai"), forge)
  os.mkdir(os.path.join(run, "1", "item" + ESCAPES))
  outputs = [
      _run(capsys, "inspect", "--json", str(run / "1")),
      _run(capsys, "verify", "--json", str(run / "1")),
      _run(capsys, "diff", "--json", str(clean), str(run / "1")),
      _run(capsys, "ls", "--json", str(run)),
  ]
  for _, output in outputs:
    assert not UNSAFE.search(output) and output.isascii(), output
  listed = json.loads(outputs[3][1])
  assert "item" + ESCAPES in listed["steps"][0]["items"]  # Read back exactly.
  if forge is _evil_names:
    inspected = json.loads(outputs[0][1])
    assert inspected["items"][0]["class"].endswith("MLP" + ESCAPES)
    assert "features" + ESCAPES in inspected["items"][0]["arrays"][0]["axes"]


def _evil_markup(manifest: dict) -> None:
  """Markup and escapes where a diff's tree shows them: a class name, a label."""
  manifest["tree"]["class"]["qualname"] = "MLP<script>alert(1)</script>" + ESCAPES
  label = "mlp/<img src=x onerror=alert(2)>\x9b2J\u202e"
  manifest["variables"][0]["label"]["v"] = label
  manifest["arrays"][0]["label"] = label


def test_diff_html_and_coloured_table_show_checkpoint_text_as_text(run, capsys, monkeypatch):
  """``pz-persist diff --html`` and ``CheckpointDiff.to_html``: no markup from
  the checkpoint; the table on a terminal (coloured): only its own colour
  codes, each around a status word at the start of a row."""
  from pz_persist.tools import diff_view  # pylint: disable=import-outside-toplevel

  monkeypatch.setenv("COLUMNS", "400")
  clean = run.parent / "clean"
  pzp.save_model(clean, model_zoo.mlp())
  _forge(os.path.join(run, "1", "penzai"), _evil_markup)
  page = run.parent / "diff.html"
  status, output = _run(capsys, "diff", str(clean), str(run / "1"), "--html", str(page))
  assert status == 1 and not UNSAFE.search(output), output
  for text in (page.read_text(), pzp.diff(clean, run / "1", progress=False).to_html()):
    assert "<script>alert(1)" not in text and "<img src=x" not in text
    assert "&lt;script&gt;alert(1)" in text and "&lt;img src=x" in text
  monkeypatch.setattr(diff_view, "use_colour", lambda stream=None: True)
  status, output = _run(capsys, "diff", str(clean), str(run / "1"))
  own = re.compile(r"^\x1b\[3[1235]m(changed|added|removed|replaced)\x1b\[0m", re.M)
  assert status == 1 and own.search(output)
  assert not UNSAFE.search(own.sub("", output)), output
