"""Format 4's hostile cases through the entry points the catalogue's own test
does not take: the ``pz-persist`` command (``inspect``, ``verify``),
`pz_persist.CheckpointManager`, and Orbax's v0 ``Checkpointer`` around
`pz_persist.PenzaiCheckpointHandler` (``test_catalogue.py`` takes
``pzp.load``, ``inspect``, ``load_model`` and ``load_into``;
``test_read_paths.py`` Orbax's v1 ``load_checkpointables``).

Each case of `catalogue.CASES` named ``f4_*`` damages a valid format 4
checkpoint; every entry point must refuse it with a pz_persist error naming
the manifest (or, for what only decoding meets, the tree), and never crash
or hang.
"""

from __future__ import annotations

import shutil

import model_zoo
import orbax.checkpoint as ocp
import pytest
from hostile import catalogue

import pz_persist as pzp
from pz_persist import errors
from pz_persist.tools import cli

F4_CASES = [case for case in catalogue.CASES if case.name.startswith("f4_")]


def test_there_are_format_4_cases():
  assert len(F4_CASES) >= 30


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("case", F4_CASES, ids=lambda case: case.name)
def test_format_4_case_through_cli_manager_and_orbax_v0(case, tmp_path, monkeypatch, capsys):
  ckpt = tmp_path / "ckpt"
  pzp.save_model(ckpt, model_zoo.mlp())
  case.build(ckpt, monkeypatch)
  decoded_only = catalogue.INSPECT not in case.entry_points or case.entry_points != catalogue.ALL

  # The command: inspect reads the manifest (and, for the table, no tree).
  capsys.readouterr()
  code = cli.main(["inspect", str(ckpt)])
  err = capsys.readouterr().err
  if not decoded_only:
    assert code != 0 and "pz_persist.json" in err, err
  code = cli.main(["verify", str(ckpt)])
  out = capsys.readouterr()
  if not decoded_only:
    assert code != 0, out

  # Orbax's v0 Checkpointer around the handler.
  with ocp.Checkpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
    with pytest.raises(case.error, match=case.match):
      checkpointer.restore(ckpt / "penzai")

  # pz_persist's CheckpointManager, the checkpoint as its step 1.
  run = tmp_path / "run"
  with pzp.CheckpointManager(run) as manager:
    manager.save(1, params=model_zoo.mlp())
  step_item = next(p.parent for p in (run / "1").rglob("pz_persist.json"))
  shutil.copyfile(catalogue.manifest_file(ckpt), step_item / "pz_persist.json")
  with pzp.CheckpointManager(run) as manager:
    with pytest.raises(errors.PzPersistError, match=case.match.replace("penzai/", "params/")):
      manager.restore(1)
