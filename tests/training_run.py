"""Training runs the resume, kill and SIGTERM tests start in fresh processes.

Usage: python tests/training_run.py MODE DIRECTORY [options]; prints one JSON
line per event on stdout ("step", then "done" with results).

Modes:
  optax     a plain optax loop over frozen Penzai parameters
  trainer   penzai's StatefulTrainer
  counting  a large state whose values are a known function of the step
            (for kill tests: every saved step can be checked exactly)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from penzai import pz
from penzai.models import simple_mlp
from penzai.toolshed import basic_training

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pz_persist as pzp  # noqa: E402  pylint: disable=wrong-import-position


def emit(**event) -> None:
  print(json.dumps(event), flush=True)


def optimizer() -> optax.GradientTransformation:
  return optax.adam(optax.exponential_decay(3e-2, transition_steps=4, decay_rate=0.5))


def model() -> pz.nn.Layer:
  return simple_mlp.MLP.from_config(
      name="mlp", init_base_rng=jax.random.key(0), feature_sizes=[4, 32, 4]
  )


def batch(step: int) -> dict[str, pz.nx.NamedArray]:
  x = jax.random.normal(jax.random.key(1000 + step), (16, 4))
  return {"x": pz.nx.wrap(x, "batch", "features"), "y": pz.nx.wrap(jnp.sin(x), "batch", "features")}


def loss_fn(*, model, state, rng, x, y):
  dropout_like = 1.0 + 0.01 * jax.random.normal(rng, ())  # Uses the step's RNG.
  loss = jnp.mean(((model(x) - y) * dropout_like).data_array ** 2)
  return loss, state, {"loss": loss}


def digest(tree) -> str:
  leaves = jax.tree.leaves(tree)
  return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()


def run_optax(args) -> None:
  opt = optimizer()
  unbound, params = pz.unbind_params(model(), freeze=True)
  opt_state = opt.init(params)
  rng = jax.random.key(7)
  start, losses = 0, []
  manager = pzp.CheckpointManager(args.directory)
  if args.resume:
    restored = manager.restore(optimizer=opt)
    params, opt_state, rng = restored["params"], restored["opt_state"], restored["rng"]
    start, losses = restored["data"]["next_step"], restored["data"]["losses"]

  @jax.jit
  def train_step(params, opt_state, rng, x, y):
    rng, step_rng = jax.random.split(rng)

    def loss_of(params):
      return loss_fn(model=pz.bind_variables(unbound, params), state=None, rng=step_rng, x=x, y=y)[0]

    loss, grads = jax.value_and_grad(loss_of)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, rng, loss

  for step in range(start, args.steps):
    params, opt_state, rng, loss = train_step(params, opt_state, rng, **batch(step))
    losses.append(float(loss))
    if step + 1 == args.stop_after:
      manager.save(step + 1, params=params, opt_state=opt_state, rng=rng,
                   data={"next_step": step + 1, "losses": losses})
      break
  manager.close()
  emit(event="done", losses=losses, params=digest(params), count=int(opt_state[1].count))


def run_trainer(args) -> None:
  trainer = basic_training.StatefulTrainer.build(jax.random.key(3), model(), optimizer(), loss_fn)
  losses = []
  manager = pzp.CheckpointManager(args.directory)
  if args.resume:
    restored = manager.restore()
    trainer = pzp.restore_trainer(trainer, restored)
    losses = list(restored["log"]["losses"])
  while (step := int(trainer.state.value.step)) < args.steps:
    losses.append(float(trainer.step(**batch(step))["loss"]))
    if step + 1 == args.stop_after:
      manager.save(step + 1, **pzp.trainer_items(trainer), log={"losses": losses})
      break
  manager.close()
  _, params = pz.unbind_params(trainer.model, freeze=True)
  emit(event="done", losses=losses, params=digest(params),
       count=int(trainer.state.value.opt_state[1].count))


def counting_state(step: int, megabytes: int):
  """A large state whose every value is a known function of ``step``."""
  n = megabytes * 2**20 // 4 // 4
  base = jnp.arange(n, dtype=jnp.float32)
  return {
      "params": [pz.ParameterValue(label=f"w{i}", value=pz.nx.wrap(base + step + i, "x"))
                 for i in range(4)],
      "step": step,
  }


def run_counting(args) -> None:
  manager = pzp.CheckpointManager(
      args.directory, max_to_keep=args.max_to_keep, save_on_sigterm=args.sigterm,
      save_interval_steps=args.interval,
  )
  start = (manager.latest_step() or 0)
  for step in range(start + 1, args.steps + 1):
    state = counting_state(step, args.megabytes)
    emit(event="step", step=step, time=time.time())
    manager.save(step, state=state)
    time.sleep(args.step_seconds)
  manager.close()
  emit(event="done")


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("mode", choices=["optax", "trainer", "counting"])
  parser.add_argument("directory")
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--stop-after", type=int, default=None)
  parser.add_argument("--resume", action="store_true")
  parser.add_argument("--megabytes", type=int, default=64)
  parser.add_argument("--max-to-keep", type=int, default=None)
  parser.add_argument("--interval", type=int, default=1)
  parser.add_argument("--step-seconds", type=float, default=0.0)
  parser.add_argument("--sigterm", action="store_true")
  args = parser.parse_args()
  {"optax": run_optax, "trainer": run_trainer, "counting": run_counting}[args.mode](args)


if __name__ == "__main__":
  main()
