"""Exact resume: stopping, saving and resuming in a new process changes nothing.

Train N steps without stopping; train k steps, save, and in a *new process*
restore and train the remaining N-k: every loss and the final parameters are
bit-identical (Adam moments, the exponential-decay schedule's count and the
RNG are all restored).
"""

from __future__ import annotations

import json

import pytest
from conftest import run_python

STEPS, STOP = 12, 5


def _run(mode, directory, *flags):
  out = run_python(
      "import runpy, sys\n"
      f"sys.argv = ['training_run.py', {mode!r}, {str(directory)!r}, *{list(flags)!r}]\n"
      "runpy.run_path('tests/training_run.py', run_name='__main__')\n"
  )
  return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["optax", "trainer"])
def test_resume_in_a_new_process_is_exact(mode, tmp_path):
  straight = _run(mode, tmp_path / "straight", "--steps", str(STEPS))
  first = _run(mode, tmp_path / "resumed", "--steps", str(STEPS), "--stop-after", str(STOP))
  resumed = _run(mode, tmp_path / "resumed", "--steps", str(STEPS), "--resume")

  assert first["losses"] == straight["losses"][:STOP]
  assert resumed["losses"] == straight["losses"]  # Every loss, bit for bit.
  assert resumed["params"] == straight["params"]
  assert resumed["count"] == straight["count"] == STEPS  # Schedule not restarted.


def test_restore_trainer_names_the_items_of_another_kind_of_step(tmp_path):
  """A step of a plain optax loop is not a trainer checkpoint: say so."""
  import jax  # pylint: disable=import-outside-toplevel
  import model_zoo  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from penzai import pz  # pylint: disable=import-outside-toplevel
  from penzai.toolshed import basic_training  # pylint: disable=import-outside-toplevel

  import pz_persist as pzp  # pylint: disable=import-outside-toplevel

  _, params = pz.unbind_params(model_zoo.mlp(), freeze=True)
  optimizer = optax.adam(1e-3)
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, params=params, opt_state=optimizer.init(params))
    manager.wait_until_finished()
    items = manager.restore()
  trainer = basic_training.StatefulTrainer.build(
      jax.random.key(0), pz.unbind_params(model_zoo.mlp())[0], optimizer,
      lambda **kwargs: (0.0, None, {}),
  )
  with pytest.raises(pzp.errors.WrongItemsError,
                     match=r"this step holds opt_state, params, not a StatefulTrainer"
                           r" checkpoint \(which holds root_rng, variables"):
    pzp.restore_trainer(trainer, items)
