"""Step directory names, read as Orbax reads them, with pz_persist's rules."""

from __future__ import annotations

import pytest

from pz_persist.storage.lifecycle import steps


@pytest.mark.parametrize(
    "name, expected",
    [
        ("100", (100, True)),
        ("step_100", (100, True)),
        ("my_run_0042", (42, True)),
        ("100.orbax-checkpoint-tmp-1700000000", (100, False)),
        ("step_7.orbax-checkpoint-tmp", (7, False)),
        # Not steps: pz_persist's hidden save families, other names, and
        # names whose "digits" int() refuses (no crash in `pz-persist ls`).
        (".ckpt.pz_persist-new-12.orbax-checkpoint-tmp", None),
        ("._5", None),
        ("params", None),
        ("_5", None),
        ("step_", None),
        ("\u00b2", None),
        ("5\u00b2", None),
        ("abc123.orbax-checkpoint-tmp-1", None),
    ],
)
def test_parse_step_name(name, expected):
  assert steps.parse_step_name(name) == expected


def _run_with_two_steps(tmp_path):
  run = tmp_path / "run"
  for name in ("1", "2.orbax-checkpoint-tmp"):
    (run / name / "params").mkdir(parents=True)
    (run / name / "params" / "data").write_bytes(b"x" * 10)
  return run


def test_a_file_removed_while_the_run_is_listed_counts_as_gone(tmp_path, monkeypatch):
  """`pz-persist ls` beside a save: a file the save renames or removes
  between the listing and its size is not an error (the CI failure of a
  manager-interrupt test, where the listing met Orbax's vanishing lock file)."""
  run = _run_with_two_steps(tmp_path)
  real_walk = steps.os.walk

  def walk_meeting_a_removed_file(top, *args, **kwargs):
    for root, dirs, files in real_walk(top, *args, **kwargs):
      yield root, dirs, [*files, "manifest.ocdbt.__lock"]  # Gone by the lstat.

  monkeypatch.setattr(steps.os, "walk", walk_meeting_a_removed_file)
  found = steps.list_steps(run, commit_times=False)
  assert [(info.step, info.committed, info.nbytes) for info in found] == [
      (1, True, 10), (2, False, 10)
  ]


def test_a_step_renamed_while_the_run_is_listed_is_left_out(tmp_path, monkeypatch):
  """A save renaming its temporary as the run is listed: the temporary has
  gone, the listing goes on (a later listing shows the committed step)."""
  run = _run_with_two_steps(tmp_path)
  real_iterdir = type(steps.epath.Path(run)).iterdir

  def iterdir_after_a_rename(self):
    if self.name == "2.orbax-checkpoint-tmp":
      raise FileNotFoundError(2, "No such file or directory", str(self))
    return real_iterdir(self)

  monkeypatch.setattr(type(steps.epath.Path(run)), "iterdir", iterdir_after_a_rename)
  assert [info.step for info in steps.list_steps(run, commit_times=False)] == [1]
