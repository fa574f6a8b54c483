"""The family records (`pz_persist.pretrained.hf.record`): one module per
family declares everything about it, and load, export, detection, the CLI's
help and the pretrained guide's table are driven by the records."""

from __future__ import annotations

import ast
import json
import pathlib
import re

import pytest

import pz_persist as pzp
from pz_persist import errors
from pz_persist.pretrained import safetensors_io
from pz_persist.pretrained.hf import families
from pz_persist.pretrained.hf import record
from pz_persist.tools import cli

ROOT = pathlib.Path(__file__).parents[2]
PACKAGE = ROOT / "pz_persist"


def test_guide_table_is_rendered_from_the_records():
  """The pretrained guide's table of families is exactly what the records say
  (rewrite it with ``record.describe(families.FAMILIES)`` after changing a
  record)."""
  guide = (ROOT / "docs/guides/pretrained.md").read_text()
  table = record.describe(families.FAMILIES)
  assert table in guide, (
      f"docs/guides/pretrained.md's table of families differs; it should read:\n{table}")


def test_every_family_is_a_record_of_its_own_module():
  """Every module of the families package is a family: it defines a
  ``RECORD``, and every ``model_type`` belongs to one family (shared code
  lives in ``pretrained/hf/building``)."""
  modules = {p.stem for p in (PACKAGE / "pretrained/hf/families").glob("*.py")} - {"__init__"}
  with_records = {m for m in modules
                  if "\nRECORD = Family(" in (PACKAGE / f"pretrained/hf/families/{m}.py").read_text()}
  assert with_records == modules, f"modules without a RECORD: {sorted(modules - with_records)}"
  assert len(families.FAMILIES) == len(modules) >= 4
  assert sorted(families.MODEL_TYPES) == sorted(t for f in families.FAMILIES for t in f.model_types)
  assert len({f.rank for f in families.FAMILIES}) == len(families.FAMILIES), "ranks must differ"
  for family in families.FAMILIES:
    assert family.title and family.adds and family.refuses
    for model_type in family.model_types.values():
      # (GPT-2's causal LM is transformers' GPT2LMHeadModel.)
      assert re.fullmatch(r"[A-Za-z0-9_]+(ForCausalLM|ForConditionalGeneration|LMHeadModel)",
                          model_type.architecture)


def _imported_modules(path: pathlib.Path) -> set[str]:
  """The modules ``path`` imports (``from a.b import c`` counts ``a.b`` and ``a.b.c``)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      found.add(node.module)
      found.update(f"{node.module}.{alias.name}" for alias in node.names)
  return found


def test_no_family_imports_another_and_building_blocks_import_no_family():
  """A family's module imports no other family's module (what two share is
  a building block), and the building blocks import no family."""
  package = "pz_persist.pretrained.hf.families"
  family_modules = {f"{package}.{p.stem}"
                    for p in (PACKAGE / "pretrained/hf/families").glob("*.py")} - {
                        f"{package}.__init__"}
  reaching = {}
  for path in [*(PACKAGE / "pretrained/hf/families").glob("*.py"),
               *(PACKAGE / "pretrained/hf/building").glob("*.py")]:
    own = f"{package}.{path.stem}" if path.parent.name == "families" else None
    imported = (_imported_modules(path) & family_modules) - {own}
    if imported:
      reaching[str(path.relative_to(PACKAGE))] = sorted(imported)
  assert not reaching


@pytest.mark.parametrize("model_type", ["qwen3"])
def test_a_llama_plus_a_feature_family_is_one_file(model_type):
  """Qwen3 (Llama plus query/key norms) is named in one module of the
  package, of modest size: the record is all there was to add. (Families
  added later may import its layers, as Gemma 3 does; nothing else names it.)"""
  if model_type not in families.MODEL_TYPES:
    pytest.skip(f"{model_type} is not a family yet")
  home = f"pretrained/hf/families/{model_type}.py"
  importing = f"from pz_persist.pretrained.hf.families.{model_type} import "
  mentions = {}
  for path in PACKAGE.rglob("*.py"):
    # "qwen3" names Qwen3, not Qwen3-MoE (``qwen3_moe``, a family of its own).
    lines = [line for line in path.read_text().lower().splitlines()
             if re.search(rf"\b{model_type}\b(?![-_]|\.\d)", line)]
    # The refusal table names families as suggestions only (test_hf_refusals
    # checks each one it names is read).
    if lines and str(path.relative_to(PACKAGE)) not in (home, "pretrained/hf/unsupported.py"):
      mentions[str(path.relative_to(PACKAGE))] = [
          line for line in lines if not line.startswith(importing)]
  assert not {path: lines for path, lines in mentions.items() if lines}
  assert all(path.startswith("pretrained/hf/families/") for path in mentions)
  lines = (PACKAGE / home).read_text().count("\n")
  assert lines < 200, f"{model_type}.py has {lines} lines"


def test_cli_help_lists_the_records():
  parser = cli.build_parser()
  subcommands = next(a for a in parser._actions if a.dest == "command").choices  # pylint: disable=protected-access
  export_help = subcommands["export"].format_help()
  convert_help = subcommands["convert"].format_help()
  for model_type in families.EXPORTED:  # argparse wraps lines at spaces and hyphens.
    assert model_type in re.sub(r"\s+", "", export_help)
  for family in families.FAMILIES:
    assert family.title.replace(" ", "") in re.sub(r"\s+", "", convert_help)


def _folder(path: pathlib.Path, model_type: str) -> pathlib.Path:
  path.mkdir()
  (path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 8}))
  safetensors_io.write_safetensors(path / "model.safetensors", {})
  return path


@pytest.mark.parametrize("model_type", sorted(families.REFUSED))
def test_a_next_generation_is_refused_with_its_familys_reason(tmp_path, model_type):
  with pytest.raises(errors.UnsupportedConfigError) as raised:
    pzp.pretrained.load_hf(_folder(tmp_path / "m", model_type))
  assert families.REFUSED[model_type] in str(raised.value)
