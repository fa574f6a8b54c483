"""Messages that tell a user to install or upgrade pz_persist name what to
run both from a package index and in a clone of the repository (as the README
installs it), all through `pz_persist.version.install_command`.

Why: a user who installed from a clone, told only ``pip install
'pz-persist[gcs]'``, fetches a release other than the code they run, or
nothing at all; one function says it, and the scan below finds a message that
says it alone.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re
import sys

import jax.numpy as jnp
import manifest_json
import pytest

import pz_persist as pzp
from pz_persist import errors
from pz_persist import version
from pz_persist.format import manifest as manifest_lib

PACKAGE = pathlib.Path(pzp.__file__).parent


INSTALLS_PZ_PERSIST = re.compile(r"pip install (-U )?(-e |'?pz[-_]persist)")
"""A command installing pz_persist (not another package, ``orbax-checkpoint``...)."""


def _docstrings(tree: ast.AST) -> set[int]:
  """The ids of ``tree``'s docstrings, of modules, classes, functions and
  attributes: strings standing alone as statements (they document, never tell)."""
  return {
      id(node.value) for node in ast.walk(tree)
      if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
  }


def _strings(path: pathlib.Path) -> list[tuple[int, str]]:
  """The text of every string of ``path`` but docstrings, an f-string's
  literal parts joined (so one split over lines is read whole)."""
  tree = ast.parse(path.read_text(encoding="utf-8"))
  skip = _docstrings(tree)
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.JoinedStr):
      text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
      found.append((node.lineno, text))
      skip.update(id(v) for v in node.values)
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
      found.append((node.lineno, node.value))
  return found


def test_only_install_command_tells_how_to_install_pz_persist():
  own = PACKAGE / "version.py"
  told = [
      f"{path.relative_to(PACKAGE.parent)}:{line}"
      for path in sorted(PACKAGE.rglob("*.py")) if path != own
      for line, text in _strings(path)
      if INSTALLS_PZ_PERSIST.search(text)
  ]
  assert told == [], f"say these through pz_persist.version.install_command: {told}"


def test_the_scan_finds_a_message_that_says_it_alone(tmp_path):
  """The scan above is not blind: it finds the message it is meant to."""
  module = tmp_path / "m.py"
  module.write_text('"""Docs: pip install pz-persist."""\n'
                    'def f(extra):\n'
                    '  raise ImportError("need it:"\n'
                    '                    f" pip install \'pz-persist[{extra}]\'")\n')
  assert [text for _, text in _strings(module) if INSTALLS_PZ_PERSIST.search(text)] == [
      "need it: pip install 'pz-persist[]'"]


def test_install_command_names_both_ways():
  assert version.install_command("s3") == (
      "pip install 'pz-persist[s3]' (in a clone of the repository: pip install -e '.[s3]')")
  assert version.install_command() == (
      "pip install pz-persist (in a clone of the repository: pip install -e .)")
  assert "git pull, then pip install -e ." in version.install_command(upgrade=True)
  with pytest.raises(ValueError, match="give no extra"):
    version.install_command("gcs", upgrade=True)


@pytest.mark.parametrize("scheme,extra", [("gs", "gcs"), ("s3", "s3")])
def test_a_missing_extra_names_both_commands(monkeypatch, scheme, extra):
  package = {"gcs": "gcsfs", "s3": "s3fs"}[extra]
  monkeypatch.setitem(sys.modules, package, None)  # `import gcsfs` raises ImportError.
  for entry_point in (pzp.inspect, pzp.load, pzp.verify):
    with pytest.raises(errors.MissingExtraError) as raised:
      entry_point(f"{scheme}://bucket/ckpt")
    assert version.install_command(extra) in str(raised.value), (entry_point, raised.value)


def test_a_newer_format_names_both_upgrades(ckpt):
  pzp.save(ckpt, {"x": jnp.ones(2)})
  path = ckpt / "penzai" / manifest_lib.MANIFEST_FILENAME
  data = manifest_json.read(path)
  data.update(format_version=manifest_lib.FORMAT_VERSION + 1, writer="pz_persist 9.0.0")
  path.write_text(json.dumps(data))
  for entry_point in (pzp.load, pzp.inspect, pzp.load_model):
    with pytest.raises(errors.FormatVersionError) as raised:
      entry_point(ckpt)
    assert version.install_command(upgrade=True) in str(raised.value)


def test_a_newer_node_type_names_both_upgrades(tmp_path):
  """A node type a later release added, in a format this one reads."""
  path = tmp_path / "c"
  pzp.save(path, {"w": pzp_parameter()})
  manifest_file = path / "penzai" / manifest_lib.MANIFEST_FILENAME
  data = manifest_json.read(manifest_file)
  data["variables"][0]["value"] = {"t": "quantized_array", "ref": 0, "bits": 4}
  data["writer"] = "pz_persist 9.0.0"
  manifest_file.write_text(json.dumps(data))
  with pytest.raises(errors.FormatVersionError, match="node type 'quantized_array'") as raised:
    pzp.load(path)
  assert version.install_command(upgrade=True) in str(raised.value)


def pzp_parameter():
  from penzai import pz  # pylint: disable=import-outside-toplevel

  return pz.Parameter(value=pz.nx.wrap(jnp.ones((2, 3)), "a", "b"), label="w")
