"""Every optimizer optax exports, run over Penzai parameters (round-trip test).

`tests/test_optimizers.py` runs this file twice in fresh interpreters:

  python tests/optax_zoo.py save DIR    builds every optimizer's state over the
                                        parameters of each model, takes a step,
                                        saves the states with pz_persist and
                                        prints, as JSON, what they and the next
                                        step hold (digests of every leaf)
  python tests/optax_zoo.py check DIR   loads the states, prints the same
                                        digests for what was loaded and for one
                                        more step taken from it

(``--all`` runs every optimizer over the transformer too, not a sample;
``--compilation-cache=DIR`` keeps JAX's compiled programs in DIR, see
`use_compilation_cache`.)

so a test compares the two, bit for bit, without trusting pz_persist for the
reference. The optimizers are found by enumerating ``optax`` and
``optax.contrib``: a new optimizer is tested as soon as optax exports it, and
one that cannot be built here must be listed in `UNBUILT`, with the reason.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import warnings
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
from penzai import pz

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model_zoo  # pylint: disable=g-import-not-at-top,wrong-import-position

warnings.filterwarnings("ignore")

DEFAULT_ARGS: dict[str, Any] = {
    "learning_rate": 1e-3,
    "step_size": 1e-3,
    "max_delta": 1.0,
    "threshold": 1.0,
    "max_norm": 1.0,
    "clipping": 0.1,
    "eta": 0.01,
    "gamma": 0.55,
    "decay": 0.9,
    "l2_norm_clip": 1.0,
    "noise_multiplier": 0.1,
    "seed": 0,
    "max_backtracking_steps": 3,
    "max_linesearch_steps": 3,
}
"""Values for the required arguments of optax's optimizer factories."""


def _trainable(label: str) -> bool:
  """Which parameters a LoRA-style run trains (the others are frozen)."""
  return "Linear_0" in label or "Affine_0" in label or "query" in label


def _labels(params: dict[str, Any]) -> dict[str, str]:
  return {k: "train" if _trainable(k) else "frozen" for k in params}


def _mask(params: dict[str, Any]) -> dict[str, bool]:
  return {k: _trainable(k) for k in params}


def _adam() -> optax.GradientTransformation:
  return optax.adam(1e-3)


def _split() -> dict[str, optax.GradientTransformation]:
  return {"train": _adam(), "frozen": optax.set_to_zero()}


WRAPPERS: dict[str, Callable[[Any], optax.GradientTransformation]] = {
    "apply_if_finite": lambda p: optax.apply_if_finite(_adam(), 2),
    "chain": lambda p: optax.chain(optax.clip_by_global_norm(1.0), _adam()),
    "named_chain": lambda p: optax.named_chain(
        ("clip", optax.clip_by_global_norm(1.0)), ("adam", _adam())
    ),
    "conditionally_mask": lambda p: optax.conditionally_mask(_adam(), lambda n: n >= 1),
    "conditionally_transform": lambda p: optax.conditionally_transform(
        _adam(), lambda n: n >= 1
    ),
    "flatten": lambda p: optax.flatten(_adam()),
    "freeze": lambda p: optax.freeze({k: not v for k, v in _mask(p).items()}),
    "inject_hyperparams": lambda p: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    "inject_stateful_hyperparams": lambda p: optax.inject_stateful_hyperparams(
        optax.adam
    )(learning_rate=optax.exponential_decay(1e-3, 10, 0.5)),
    "lookahead": lambda p: optax.lookahead(optax.sgd(1e-3), 2, 0.5),
    "masked": lambda p: optax.masked(_adam(), _mask(p)),
    # Measures the updates themselves: an EMA of every update, over the params.
    "measure_with_ema": lambda p: optax.measure_with_ema(lambda u: u, 0.9),
    "multi_transform": lambda p: optax.multi_transform(_split(), _labels(p)),
    "partition": lambda p: optax.partition(_split(), _labels(p)),
    "scale_by_schedule": lambda p: optax.scale_by_schedule(
        optax.exponential_decay(1e-3, 10, 0.5)
    ),
    "selective_transform": lambda p: optax.selective_transform(
        _adam(), freeze_mask={k: not v for k, v in _mask(p).items()}
    ),
    "snapshot": lambda p: optax.snapshot("norm", optax.tree.norm),
    "stateless": lambda p: optax.stateless(lambda g, _: g),
    "stateless_with_tree_map": lambda p: optax.stateless_with_tree_map(lambda g, _: g),
    "with_extra_args_support": lambda p: optax.with_extra_args_support(_adam()),
    "contrib.mechanize": lambda p: optax.contrib.mechanize(_adam()),
    "contrib.sam": lambda p: optax.contrib.sam(optax.sgd(1e-3), optax.sgd(1e-3)),
    # Muon orthogonalizes matrices only: masked to them, as optax's muon does.
    "contrib.scale_by_muon": lambda p: optax.masked(
        optax.contrib.scale_by_muon(weight_dimension_numbers=lambda updates: jax.tree.map(
            lambda _: optax.contrib.MuonDimensionNumbers(), updates
        )),
        jax.tree.map(lambda x: x.ndim == 2, p),
    ),
    "contrib.schedule_free": lambda p: optax.contrib.schedule_free(optax.sgd(1e-3), 1e-3),
    "contrib.split_real_and_imaginary": lambda p: optax.contrib.split_real_and_imaginary(
        _adam()
    ),
}
"""Factories that wrap another transformation, built around Adam or SGD."""

EXTRA: dict[str, Callable[[Any], optax.GradientTransformation]] = {
    # Training only LoRA adapters: the frozen weights get no state at all.
    "lora.masked_set_to_zero": lambda p: optax.chain(
        optax.masked(_adam(), _mask(p)),
        optax.masked(optax.set_to_zero(), {k: not v for k, v in _mask(p).items()}),
    ),
    "lora.multi_transform_adamw": lambda p: optax.multi_transform(
        {"train": optax.adamw(optax.exponential_decay(1e-3, 10, 0.5)),
         "frozen": optax.set_to_zero()},
        _labels(p),
    ),
    # Labels as a full tree: NamedArrays around MaskedNode in the state.
    "lora.multi_transform_full_tree": lambda p: optax.multi_transform(
        _split(), lambda params: jax.tree.map(
            lambda x: "train" if x.ndim == 2 else "frozen", params
        ),
    ),
    "lora.masked_full_tree": lambda p: optax.masked(
        _adam(), lambda params: jax.tree.map(lambda x: x.ndim == 2, params)
    ),
    "contrib.muon.masked": lambda p: optax.contrib.muon(
        1e-3, weight_decay_mask=_mask(p)
    ),
}
"""More states worth testing: the usual ways to freeze weights."""

PARAMS_FOR: dict[str, Callable[[Any], Any]] = {
    "lookahead": optax.LookaheadParams.init_synced,
}
"""Optimizers that take their parameters in a wrapper of their own."""

UNBUILT: dict[str, str] = {}
"""Exported factories not run here, and why (the test checks this list)."""


def _required(func: Callable[..., Any]) -> list[str]:
  return [
      p.name for p in inspect.signature(func).parameters.values()
      if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
  ]


def _annotated_factory(func: Callable[..., Any]) -> bool:
  return "GradientTransformation" in str(inspect.signature(func).return_annotation)


def _build(full_name: str, func: Any, params: Any) -> optax.GradientTransformation | None:
  """The optimizer ``func`` builds, or None if it is not an optimizer factory.

  A function annotated to return a GradientTransformation must be built (or
  listed in `UNBUILT`); an unannotated one is an optimizer if it builds one
  from the default arguments.
  """
  if not callable(func) or isinstance(func, type) or full_name in UNBUILT:
    return None
  try:
    annotated, required = _annotated_factory(func), _required(func)
  except (TypeError, ValueError):
    return None
  name = full_name.removeprefix("optax.")
  if name in WRAPPERS:
    return WRAPPERS[name](params)
  missing = [r for r in required if r not in DEFAULT_ARGS]
  if missing:
    if annotated:
      raise AssertionError(f"{full_name} needs {missing}: add it to WRAPPERS or UNBUILT.")
    return None
  try:
    built = func(**{r: DEFAULT_ARGS[r] for r in required})
  except Exception:  # pylint: disable=broad-except
    if annotated:
      raise
    return None
  return built if isinstance(built, optax.GradientTransformation) else None


def optimizers(params: Any) -> dict[str, optax.GradientTransformation]:
  """Every optimizer to test, by name: all that ``optax`` and ``optax.contrib``
  export, then `EXTRA`."""
  found = {}
  for module in (optax, optax.contrib):
    for name in sorted(dir(module)):
      if name.startswith("_"):
        continue
      full_name = f"{module.__name__}.{name}"
      tx = _build(full_name, getattr(module, name), params)
      if tx is not None:
        found[full_name.removeprefix("optax.")] = tx
  for name, factory in EXTRA.items():
    found[name] = factory(params)
  return found


MODELS: dict[str, Callable[[], Any]] = {
    "mlp": model_zoo.mlp,
    "transformer": model_zoo.llamalike_transformer,
}

TRANSFORMER_SAMPLE: tuple[str, ...] = (
    "adafactor", "adam", "adamw", "contrib.galore", "contrib.muon",
    "contrib.muon.masked", "contrib.prodigy", "contrib.schedule_free_adamw",
    "freeze", "inject_hyperparams", "lion", "lookahead", "lora.masked_set_to_zero",
    "lora.multi_transform_adamw", "lora.multi_transform_full_tree",
    "lora.masked_full_tree", "masked", "multi_transform", "novograd",
    "partition", "scale_by_factored_rms", "selective_transform", "sm3",
)
"""The optimizers run over the transformer by default (all of them with
``--all``): the states whose shape follows the parameters' (factored,
per-parameter scalars, lists, masks, matrices only), plus the common ones."""


def cases(run_all: bool) -> dict[str, tuple[str, ...] | None]:
  """Which optimizers to run over each model (None: all of them)."""
  return {"mlp": None, "transformer": None if run_all else TRANSFORMER_SAMPLE}


def model_params(model_name: str) -> dict[str, Any]:
  _, params = pz.unbind_params(MODELS[model_name](), freeze=True)
  return {p.label: p for p in params}


def _loss(params: Any) -> jax.Array:
  return sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(params))


PER_EXAMPLE = frozenset({"contrib.dpsgd", "contrib.differentially_private_aggregate"})
"""Optimizers that take per-example gradients (a leading batch axis)."""

NEEDS_OBJ_FN = frozenset({"contrib.sophia", "contrib.hutchinson_estimator_diag_hessian"})
"""Optimizers that take the loss function as ``obj_fn`` (others refuse it)."""


def step(
    name: str, tx: optax.GradientTransformation, state: Any, params: Any, k: int
) -> tuple[Any, Any]:
  """One deterministic update: the new state and the new parameters."""
  trained = params.fast if isinstance(params, optax.LookaheadParams) else params
  grads = jax.tree.map(lambda x: jnp.cos(x * (k + 1.0)).astype(x.dtype), trained)
  if name in PER_EXAMPLE:
    grads = jax.tree.map(lambda g: jnp.stack([g, 0.5 * g]), grads)
  extra = {"value": _loss(trained), "grad": grads, "value_fn": _loss}
  if name in NEEDS_OBJ_FN:
    extra["obj_fn"] = _loss
  accepted = inspect.signature(tx.update).parameters
  if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
    extra = {k: v for k, v in extra.items() if k in accepted}
  updates, state = tx.update(grads, state, params, **extra)
  return state, optax.apply_updates(params, updates)


def _digest(leaf: Any) -> list[Any]:
  """What a leaf is, bit for bit: type, dtype, shape, weak type, bytes."""
  data = leaf
  if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(leaf)
  array = np.asarray(data)
  return [
      type(leaf).__name__,
      str(getattr(leaf, "dtype", array.dtype)),
      list(array.shape),
      bool(getattr(leaf, "weak_type", False)),
      hashlib.sha256(array.tobytes()).hexdigest()[:16],
  ]


def describe(tree: Any) -> dict[str, Any]:
  leaves, treedef = jax.tree.flatten(tree)
  return {"treedef": str(treedef), "leaves": [_digest(x) for x in leaves]}


def _selected(params: Any, names: tuple[str, ...] | None) -> dict[str, Any]:
  found = optimizers(params)
  return found if names is None else {name: found[name] for name in names}


def _committed(tree: Any) -> Any:
  """``tree`` with its JAX arrays placed on the first device, as loading places
  them: the save process then compiles the very programs the check process
  runs, and `use_compilation_cache` shares them (uncommitted arrays compile to
  other programs). Other leaves are left as they are."""
  device = jax.devices()[0]
  return jax.tree.map(
      lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) else x, tree
  )


def save(directory: str, run_all: bool) -> dict[str, Any]:
  import pz_persist as pzp  # pylint: disable=g-import-not-at-top
  report = {}
  for model_name, names in cases(run_all).items():
    params = _committed(model_params(model_name))
    states = {}
    for name, tx in _selected(params, names).items():
      own_params = PARAMS_FOR.get(name, lambda p: p)(params)
      initial = _committed(tx.init(own_params))
      state, new_params = step(name, tx, initial, own_params, 0)
      states[name] = {"state": state, "params": new_params}
      after = step(name, tx, state, new_params, 1)
      report[f"{model_name}/{name}"] = {
          "saved": describe(state), "next": describe(after),
      }
    pzp.save(os.path.join(directory, model_name), states)
  return report


def check(directory: str, run_all: bool) -> dict[str, Any]:
  import pz_persist as pzp  # pylint: disable=g-import-not-at-top
  report = {}
  for model_name, names in cases(run_all).items():
    loaded = pzp.load(os.path.join(directory, model_name))
    for name, tx in _selected(model_params(model_name), names).items():
      state, params = loaded[name]["state"], loaded[name]["params"]
      template = jax.eval_shape(tx.init, params)
      report[f"{model_name}/{name}"] = {
          "saved": describe(state),
          "next": describe(step(name, tx, state, params, 1)),
          "init_treedef": str(jax.tree.structure(template)),
      }
  return report


def use_compilation_cache(directory: str) -> None:
  """Keeps every program JAX compiles in ``directory``, however fast it compiled.

  Why: the steps run eagerly, and compiling dominates the run (about 900
  programs for the MLP alone). Much of it is the same program compiled again:
  ``lax.scan`` and ``fori_loop`` bodies (Muon's Newton-Schulz iterations) are
  new closures at every call, so JAX's in-memory caches miss where this cache,
  keyed by the program itself, hits; and the check process takes the same steps
  as the save process. A cached program computes what a fresh compile of it
  would: the states and steps compared are unchanged.
  """
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


if __name__ == "__main__":
  mode, target, *flags = sys.argv[1:]
  for flag in flags:
    if flag.startswith("--compilation-cache="):
      use_compilation_cache(flag.removeprefix("--compilation-cache="))
  print(json.dumps({"save": save, "check": check}[mode](target, "--all" in flags)))
