"""Optimizer states over Penzai parameters: every one saves, loads and resumes
exactly, and resuming under another optimizer is refused by name."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import model_zoo
import numpy as np
import optax
import optax_zoo
import pytest
import training_run
from conftest import run_python
from penzai import pz
from penzai.toolshed import basic_training
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import decode
from pz_persist.format import encode

NAMES = sorted(optax_zoo.optimizers(optax_zoo.model_params("mlp")))


def _run(mode: str, directory, *flags: str) -> dict:
  out = run_python(
      "import runpy, sys\n"
      f"sys.argv = ['optax_zoo.py', {mode!r}, {str(directory)!r}, *{list(flags)!r}]\n"
      "runpy.run_path('tests/optax_zoo.py', run_name='__main__')\n",
      timeout=1500,
  )
  return json.loads(out.strip().splitlines()[-1])


def _reports(tmp_path_factory, *flags: str) -> tuple[dict, dict]:
  """What every state was when saved, and what a fresh process loaded (and
  computed from it). One process for all: starting JAX dominates otherwise.
  The two share JAX's compiled programs (compiling dominates the rest)."""
  directory = tmp_path_factory.mktemp("optax_states")
  cache = f"--compilation-cache={tmp_path_factory.mktemp('optax_jax_cache')}"
  return _run("save", directory, *flags, cache), _run("check", directory, *flags, cache)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
  return _reports(tmp_path_factory)


def _assert_round_trip(reports, key: str) -> None:
  saved, loaded = reports
  assert loaded[key]["saved"] == saved[key]["saved"]  # Same treedef, same bits.
  assert loaded[key]["init_treedef"] == saved[key]["saved"]["treedef"]
  assert loaded[key]["next"] == saved[key]["next"]  # The next step too.


@pytest.mark.timeout(1800)  # Two fresh processes run every optimizer, twice.
@pytest.mark.parametrize(
    "key",
    [f"mlp/{name}" for name in NAMES]
    + [f"transformer/{name}" for name in optax_zoo.TRANSFORMER_SAMPLE],
)
def test_every_optax_state_round_trips_and_resumes_bit_exactly(reports, key):
  _assert_round_trip(reports, key)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_optax_state_of_the_transformer_round_trips(tmp_path_factory):
  reports = _reports(tmp_path_factory, "--all")
  for name in NAMES:
    _assert_round_trip(reports, f"transformer/{name}")


def test_every_exported_optimizer_is_tested():
  """An optimizer optax exports is either run or listed with a reason."""
  for full_name in optax_zoo.UNBUILT:
    module, name = full_name.rsplit(".", 1)
    assert hasattr({"optax": optax, "optax.contrib": optax.contrib}[module], name)
  assert {"adafactor", "novograd", "sm3", "masked", "multi_transform", "chain",
          "named_chain", "contrib.muon", "contrib.dpsgd", "lookahead",
          "contrib.galore"} <= set(NAMES)
  assert len(NAMES) > 125


def _params():
  _, params = pz.unbind_params(model_zoo.mlp(), freeze=True)
  return {p.label: p for p in params}


@pytest.mark.parametrize(
    "optimizer",
    [optax.adafactor(1e-3), optax.novograd(1e-3), optax.sm3(1e-3)],
    ids=["adafactor", "novograd", "sm3"],
)
def test_named_arrays_that_do_not_fit_their_axes_round_trip(ckpt, optimizer):
  """optax builds these states by tree_map over the parameters: NamedArrays
  around factored moments, scalars or lists. They used to save, then never
  load."""
  state = optimizer.init(_params())
  pzp.save(ckpt, state)
  loaded = pzp.load(ckpt)
  assert jax.tree.structure(loaded) == jax.tree.structure(state)
  assert_identical(loaded, state)


def test_masked_states_round_trip_through_the_manager(tmp_path):
  """Training LoRA adapters only: MaskedNode in the state, resumed exactly."""
  params = _params()
  labels = lambda p: jax.tree.map(lambda x: "train" if x.ndim == 2 else "frozen", p)  # pylint: disable=g-long-lambda
  optimizer = optax.multi_transform(
      {"train": optax.adam(1e-3), "frozen": optax.set_to_zero()}, labels
  )
  state = optimizer.init(params)
  assert optax.MaskedNode() in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, optax.MaskedNode)
  )
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, params=params, opt_state=state)
    manager.wait_until_finished()
    restored = manager.restore(optimizer=optimizer)
  assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(state)
  assert_identical(restored["opt_state"], state)


@pytest.mark.parametrize(
    "optimizer", [optax.adafactor(1e-2), optax.sm3(1e-2)], ids=["adafactor", "sm3"]
)
def test_a_trainer_resumes_with_a_factored_optimizer(tmp_path, optimizer):
  """StatefulTrainer keeps these states in a variable; restoring it compared
  them as NamedArrays and crashed on their (legitimately) misfitting axes."""
  build = lambda: basic_training.StatefulTrainer.build(  # pylint: disable=g-long-lambda
      jax.random.key(3), training_run.model(), optimizer, training_run.loss_fn
  )
  trainer = build()
  trainer.step(**training_run.batch(0))
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, **pzp.trainer_items(trainer))
    manager.wait_until_finished()
    resumed = pzp.restore_trainer(build(), manager.restore())
  assert_identical(resumed.state.value, trainer.state.value)
  expected = trainer.step(**training_run.batch(1))["loss"]
  assert np.asarray(resumed.step(**training_run.batch(1))["loss"]) == np.asarray(expected)
  assert_identical(pz.unbind_params(resumed.model, freeze=True)[1],
                   pz.unbind_params(trainer.model, freeze=True)[1])


def test_a_named_array_node_that_does_not_fit_is_still_refused():
  """Only values that fit their axes are stored as named_array nodes, and
  loading refuses a named_array node that does not fit (the same test)."""
  encoded = encode.encode(pz.nx.wrap(jnp.zeros((2, 3)), "a", "b"))
  assert encoded.tree["t"] == "named_array"
  encoded.tree["axes"][1][1] = 4
  with pytest.raises(errors.ManifestError, match="axis names disagree"):
    decode.decode(encoded.tree, [], [jnp.zeros((2, 3))])


@dataclasses.dataclass(frozen=True)
class Positive:
  x: int

  def __post_init__(self):
    if self.x <= 0:
      raise ValueError("x must be positive")


def test_a_value_that_could_not_be_loaded_is_refused_at_save(ckpt):
  value = Positive(1)
  object.__setattr__(value, "x", -1)  # Past its own check, as tree_map can.
  with pytest.raises(errors.EncodingError, match="never loaded"):
    pzp.save(ckpt, {"v": value}, allow_modules=["test_optimizers"])
  assert not ckpt.exists()


@dataclasses.dataclass(frozen=True)
class Normalized:
  x: np.ndarray

  def __post_init__(self):
    if not np.isclose(np.asarray(self.x).sum(), 1.0):
      raise ValueError("x must sum to 1")


def test_the_save_time_check_sees_the_saved_arrays(ckpt):
  """The check rebuilds classes from the real arrays, as a load does (a
  class that reads its arrays must not be refused)."""
  value = {"v": Normalized(np.full(4, 0.25, np.float32))}
  pzp.save(ckpt, value, allow_modules=["test_optimizers"])
  loaded = pzp.load(ckpt, allow_modules=["test_optimizers"])["v"]
  assert type(loaded) is Normalized and loaded.x.tobytes() == value["v"].x.tobytes()


# Resuming with another optimizer.


def _adam_state(optimizer=None):
  params = _params()
  optimizer = optimizer or optax.adam(1e-3)
  state = optimizer.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  return params, optimizer.update(grads, state, params)[1]


@pytest.mark.parametrize(
    "other, expected",
    [
        (
            optax.adabelief(1e-3),
            r"has ScaleByBeliefState at state\[0\], the restored state has"
            r" ScaleByAdamState\.",
        ),
        (
            optax.adamw(1e-3),
            r"has tuple \(ScaleByAdamState, EmptyState, EmptyState\) at state,"
            r" the restored state has tuple \(ScaleByAdamState, EmptyState\)\.",
        ),
        (
            optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
            r"has EmptyState at state\[0\], the restored state has ScaleByAdamState\.",
        ),
    ],
    ids=["adabelief", "adamw", "chain_clip_adam"],
)
def test_another_optimizer_is_refused_by_name(other, expected):
  params, state = _adam_state()
  with pytest.raises(errors.OptimizerMismatchError) as raised:
    pzp.training.trainer.optimizers.check_state(state, other, params, where="ckpt")
  message = str(raised.value)
  assert len(message) < 500, message
  assert message.startswith("ckpt: ") and re.search(expected, message), message
  assert raised.value.expected == jax.tree.structure(other.init(params))
  assert raised.value.found == jax.tree.structure(state)  # Full detail kept.


def test_a_trainer_built_with_another_optimizer_is_refused_by_name(tmp_path):
  build = lambda optimizer: basic_training.StatefulTrainer.build(  # pylint: disable=g-long-lambda
      jax.random.key(3), training_run.model(), optimizer, training_run.loss_fn
  )
  trainer = build(optax.adam(1e-3))
  trainer.step(**training_run.batch(0))
  with pzp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, **pzp.trainer_items(trainer))
    manager.wait_until_finished()
    other = build(optax.adabelief(1e-3))
    before = jax.tree.leaves(other.state.value)
    with pytest.raises(errors.OptimizerMismatchError) as raised:
      pzp.restore_trainer(other, manager.restore())
  message = str(raised.value)
  assert len(message) < 500 and re.search(
      r"StatefulTrainer\.state\.opt_state: this optimizer's state has"
      r" ScaleByBeliefState at state\[0\], the restored state has ScaleByAdamState",
      message,
  ), message
  after = jax.tree.leaves(other.state.value)
  assert len(after) == len(before) and all(a is b for a, b in zip(after, before))  # Untouched.


def test_the_same_optimizer_is_accepted_and_rebuilt():
  params, state = _adam_state()
  checked = pzp.training.trainer.optimizers.check_state(state, optax.adam(1e-3), params, where="ckpt")
  assert_identical(checked, state)
