"""The version, the format numbers and the sample outputs the documentation
states are what the code says and prints.

Why: the README once said 0.6.0 and "formats 1 to 3" while the code was
0.7.0 and wrote format 4, and a guide showed what 0.6.0 printed; nobody reads
a page against the code after each release. So the pages of `pages` are read
here: every statement of the current release (``This is pz_persist X``, a
writer ``"pz_persist X"``, ``written by pz_persist X (format N)``), of the
formats it reads and writes, and the releases table's newest row are checked
against `pz_persist.version` and `pz_persist.format.manifest`; and every
block marked ``<!-- sample-output: SETUP -->`` (invisible on GitHub and on the
site) is run again: each ``$ pz-persist ...`` line, on what `SETUPS` [SETUP]
builds, must print exactly the lines under it (but for what `VARIES` lists,
which changes from run to run). To refresh a sample, run its
commands and paste what they print.
"""

from __future__ import annotations

import glob
import os
import re
import shlex

import pytest
from conftest import REPO

from pz_persist import version
from pz_persist.format import manifest
from pz_persist.tools import cli

VERSION = version.__version__

SAMPLE = re.compile(r"<!-- sample-output: (?P<setup>[\w-]+) -->\s*\n```\w*\n(?P<text>.*?)```", re.S)

SETUPS = {
    # The README's quick start: `pzp.save("/tmp/mlp_params", params)`.
    "quickstart-params": """
        import jax
        import pz_persist as pzp
        from penzai import pz
        from penzai.models import simple_mlp
        model = simple_mlp.MLP.from_config(
            name="mlp", init_base_rng=jax.random.key(0), feature_sizes=[8, 32, 8])
        unbound, params = pz.unbind_params(model, freeze=True)
        pzp.save("/tmp/mlp_params", params, overwrite=True)
    """,
}
"""What a sample's commands run on, by name: code run with ``/tmp/`` moved
into the test's temporary directory, as `tests/test_readme.py` moves it."""

COLUMNS = 100
"""The terminal width samples are printed at (the pages' own line length)."""

VARIES = ((re.compile(r"\b\d+ files checked"), "N files checked"),)
"""What a command prints that differs from run to run, read as equal: how
many data files TensorStore splits a checkpoint's arrays into depends on
timing (8 or 9 for the quick start's)."""


def _comparable(text: str) -> str:
  for pattern, replacement in VARIES:
    text = pattern.sub(replacement, text)
  return text


def pages() -> list[str]:
  """The README, ARCHITECTURE.md and every Markdown page of docs/ (not built ones)."""
  found = [os.path.join(REPO, "README.md"), os.path.join(REPO, "ARCHITECTURE.md")]
  for path in sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True)):
    parts = os.path.relpath(path, REPO).split(os.sep)
    if "_build" not in parts and "notebooks" not in parts:
      found.append(path)
  return found


def _texts() -> dict[str, str]:
  texts = {}
  for path in pages():
    with open(path, encoding="utf-8") as f:
      texts[os.path.relpath(path, REPO)] = f.read()
  return texts


def _found(pattern: str) -> list[tuple[str, tuple[str, ...]]]:
  """``(page, groups)`` of every match of ``pattern`` in every page."""
  return [(page, m.groups()) for page, text in _texts().items()
          for m in re.finditer(pattern, text)]


def test_the_release_the_pages_state_is_this_one():
  statements = {
      r"This is pz_persist (\d+\.\d+\.\d+)": 1,  # The README's Versions section.
      r"\"pz_persist (\d+\.\d+\.\d+)\"": 3,  # Writer fields, as examples.
      r"written by pz_persist (\d+\.\d+\.\d+) \(format \d+\)": 1,  # inspect's output.
  }
  for pattern, at_least in statements.items():
    found = _found(pattern)
    assert len(found) >= at_least, f"{pattern}: the pages no longer say it; update this test"
    wrong = [(page, groups[0]) for page, groups in found if groups[0] != VERSION]
    assert wrong == [], f"pages stating another release than {VERSION}: {wrong}"


def test_the_formats_the_pages_state_are_the_codes():
  reads = _found(r"\bread(?:s)? (?:checkpoint |manifest )?formats 1 to (\d+)")
  assert {page for page, _ in reads} >= {"README.md", os.path.join("docs", "format-spec.md")}
  assert [(page, n) for page, (n,) in reads if int(n) != manifest.FORMAT_VERSION] == []
  writes = _found(r"\bwrites? (?:format )?(\d+)\b")
  assert {page for page, _ in writes} >= {"README.md", os.path.join("docs", "format-spec.md")}
  assert [(page, n) for page, (n,) in writes if int(n) != manifest.WRITTEN_FORMAT] == []
  shown = _found(r"written by pz_persist [\d.]+ \(format (\d+)\)")
  assert [(page, n) for page, (n,) in shown if int(n) != manifest.WRITTEN_FORMAT] == []
  assert f"Current manifest format: **{manifest.FORMAT_VERSION}**" in _texts()[
      os.path.join("docs", "format-spec.md")]


def test_the_releases_table_starts_with_this_release():
  text = _texts()[os.path.join("docs", "releases.md")]
  rows = re.findall(r"^\| (\d+\.\d+\.\d+)[^|]* \| ([\d, ]+) \| (\d+)\b", text, re.M)
  assert rows, "docs/releases.md lost its table of releases"
  release, reads, writes = rows[0]
  assert release == VERSION
  assert [int(n) for n in reads.split(",")] == list(range(1, manifest.FORMAT_VERSION + 1))
  assert int(writes) == manifest.WRITTEN_FORMAT


def _samples() -> list[tuple[str, str, str]]:
  """``(page, setup, text)`` of every marked sample block."""
  return [(page, m["setup"], m["text"]) for page, text in _texts().items()
          for m in SAMPLE.finditer(text)]


def _sample_params() -> list:
  return [pytest.param(*sample, id=f"{sample[0]}:{sample[2].split(chr(10))[0]}")
          for sample in _samples()]


def _commands(text: str) -> list[tuple[list[str], str]]:
  """A sample's ``$ pz-persist`` commands (arguments, comments dropped),
  each with the text printed under it."""
  found: list[tuple[list[str], str]] = []
  for line in text.splitlines():
    if line.startswith("$ "):
      argv = shlex.split(line[2:], comments=True)
      assert argv[0] == "pz-persist", f"a sample runs only pz-persist: {line}"
      found.append((argv[1:], ""))
    else:
      assert found, f"a sample starts with its command: {line}"
      found[-1] = (found[-1][0], found[-1][1] + line + "\n")
  return found


def test_every_sample_names_a_setup_and_prints_something():
  samples = _samples()
  assert {page for page, _, _ in samples} >= {
      os.path.join("docs", "guides", "saving-and-loading.md"),
      os.path.join("docs", "guides", "integrity.md"),
  }
  for page, setup, text in samples:
    assert setup in SETUPS, (page, setup)
    for argv, printed in _commands(text):
      assert printed.strip(), f"{page}: `pz-persist {' '.join(argv)}` shows no output"


@pytest.fixture(scope="module")
def setups(tmp_path_factory) -> dict[str, str]:
  """Each setup run once, in a directory of its own: its name -> that root."""
  import textwrap  # pylint: disable=import-outside-toplevel

  roots = {}
  for name, code in SETUPS.items():
    root = str(tmp_path_factory.mktemp(name))
    os.makedirs(os.path.join(root, "tmp"))
    exec(textwrap.dedent(code).replace('"/tmp/', f'"{root}/tmp/'), {})  # pylint: disable=exec-used
    roots[name] = root
  return roots


@pytest.mark.parametrize("page,setup,text", _sample_params())
def test_sample_output_is_what_the_command_prints(page, setup, text, setups, capsys, monkeypatch):
  monkeypatch.setenv("COLUMNS", str(COLUMNS))
  root = setups[setup]
  for argv, printed in _commands(text):
    status = cli.main([a.replace("/tmp/", f"{root}/tmp/") for a in argv])
    out = capsys.readouterr().out.replace(f"{root}/tmp/", "/tmp/")
    assert status == 0, (page, argv, out)
    assert _comparable(out) == _comparable(printed), (
        f"{page}: `pz-persist {' '.join(argv)}` now prints:\n{out}")


def test_ci_runs_the_readmes_test_command_in_a_fresh_environment():
  """CI runs what the README tells a new user to run, as they would: in a
  virtual environment of its own, so no test leans on the system Python."""
  readme = _texts()["README.md"]
  command = re.search(r"```bash\n(pip install -e '\.\[test\]'.*)\n```", readme)
  assert command is not None, "the README lost its test command"
  with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
    steps = [line.strip() for line in f if line.strip() and not line.startswith("#")]
  assert command[1] in steps, f".ci/run does not run the README's `{command[1]}`"
  before = steps[:steps.index(command[1])]
  assert any(re.fullmatch(r"python -m venv \S+", step) for step in before), before
  assert any(re.fullmatch(r'source "?\S+/bin/activate"?', step) for step in before), before


def test_what_the_demo_says_to_try_next_exists_and_the_readme_names_it(tmp_path, monkeypatch):
  from pz_persist import demo  # pylint: disable=import-outside-toplevel

  readme = _texts()["README.md"]
  for path, _ in demo.NEXT_IN_THE_REPOSITORY:
    assert os.path.isfile(os.path.join(REPO, path)), path
    assert f"]({path})" in readme, f"the README does not link {path}, as the demo's end does"
  monkeypatch.chdir(tmp_path)
  text = demo.next_steps(tmp_path / "pz_persist_demo" / "checkpoint")
  assert "pz-persist inspect pz_persist_demo/checkpoint" in text
  assert "pz-persist inspect pz_persist_demo/checkpoint" in readme
  assert max(map(len, text.splitlines())) <= 100


def test_the_readme_and_the_quick_start_guide_state_the_same_times():
  """The two pages that say how long the tests take say the same."""
  texts = _texts()
  patterns = (r"runs the test suite \(about ([\w-]+) minutes on two cores: ([\d:]+) of",
              r"`pytest -m unit` \(([^)]*)\)")
  for pattern in patterns:
    found = [re.findall(pattern, " ".join(texts[page].split()))  # Lines wrap differently.
             for page in ("README.md", os.path.join("docs", "guides", "quickstart.md"))]
    assert found[0] and found[0] == found[1], (pattern, found)
