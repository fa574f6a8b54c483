"""Checking a restored optimizer state against the optimizer that will use it.

An optimizer state restores by itself (optax's state classes are named in the
checkpoint). But resuming with a different optimizer (AdaBelief instead of
Adam, another learning-rate schedule wrapper, a changed chain) would either
fail deep inside ``optimizer.update`` or, worse, run with a state that
silently means something else: Adam's ``nu`` read as AdaBelief's ``s``. Array
shapes cannot tell those apart, the state classes can. `check_state` compares
the restored state, node by node and class by class, with the state the
optimizer would build, ``jax.eval_shape(optimizer.init, params)``, and
rebuilds it in exactly that structure.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from typing import Any
from typing import Protocol

import jax
import numpy as np

from pz_persist import errors

_FIX = (
    "Was it saved with another optimizer? Resume with the optimizer that saved"
    " it, or start afresh from optimizer.init(params)."
)


class Optimizer(Protocol):
  """What `check_state` uses of an optimizer (an ``optax.GradientTransformation``)."""

  @property
  def init(self) -> Callable[..., object]: ...


def check_state(state: Any, optimizer: Optimizer, params: Any, *, where: str) -> Any:
  """``state`` in the structure ``optimizer.init(params)`` has; raises
  `pz_persist.errors.OptimizerMismatchError` if it does not fit (other state
  classes, other nesting, other shapes or dtypes of arrays).

  Example::

    opt_state = pzp.training.trainer.optimizers.check_state(restored, optimizer, params, where="ckpt")
  """
  template = jax.eval_shape(optimizer.init, params)
  check_structure(template, state, where=where)
  expected, expected_def = jax.tree_util.tree_flatten_with_path(template)
  found, found_def = jax.tree.flatten(state)
  for (path, want), got in zip(expected, found):
    dtype = getattr(got, "dtype", None) or np.result_type(got)
    if (np.shape(got), dtype) != (want.shape, want.dtype):
      raise errors.OptimizerMismatchError(
          f"{where}: state{jax.tree_util.keystr(path)} is"
          f" {dtype}{list(np.shape(got))}, but this optimizer expects"
          f" {want.dtype}{list(want.shape)}. {_FIX}",
          expected=expected_def,
          found=found_def,
      )
  return jax.tree.unflatten(expected_def, found)


def check_structure(expected: Any, found: Any, *, where: str) -> None:
  """Raises `pz_persist.errors.OptimizerMismatchError` naming the first state
  (class and path) where ``found`` departs from ``expected``'s structure.

  Arrays are not compared (``expected`` may hold ``jax.ShapeDtypeStruct``).
  """
  difference = _first_difference(expected, found, ())
  if difference is not None:
    raise errors.OptimizerMismatchError(
        f"{where}: {difference} {_FIX}",
        expected=jax.tree.structure(expected),
        found=jax.tree.structure(found),
    )


def _children(node: Any) -> list[tuple[jax.tree_util.KeyPath, Any]]:
  """The direct children of a pytree node, with their keys."""
  return jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]


def _first_difference(expected: Any, found: Any, path: jax.tree_util.KeyPath) -> str | None:
  """Where ``found`` first departs from ``expected``'s structure, in words
  (None if nowhere). Leaves are arrays on both sides; their shapes are
  checked separately."""
  expected_level = jax.tree_util.default_registry.flatten_one_level(expected)
  found_level = jax.tree_util.default_registry.flatten_one_level(found)
  if expected_level is None and found_level is None:
    return None
  expected_children, found_children = _children(expected), _children(found)
  same = (
      type(expected) is type(found)
      and expected_level is not None
      and found_level is not None
      and len(expected_children) == len(found_children)
      and _equal(expected_level[1], found_level[1])
  )
  if not same:
    return (
        f"this optimizer's state has {_describe(expected, expected_level)} at"
        f" state{jax.tree_util.keystr(path)}, the restored state has"
        f" {_describe(found, found_level)}."
    )
  for (key, e), (_, f) in zip(expected_children, found_children):
    difference = _first_difference(e, f, path + key)
    if difference is not None:
      return difference
  return None


def _equal(a: object, b: object) -> bool:
  try:
    return bool(a == b)
  except Exception:  # pylint: disable=broad-except
    return a is b  # Static data without a plain equality.


def _describe(node: object, level: tuple[Iterable[object], object] | None) -> str:
  """A short description of a node: its class, and what tells it apart."""
  if level is None:
    return "an array"
  name = type(node).__qualname__
  children, aux = level
  if type(node) in (tuple, list):  # A chain's states: name them.
    entries = ", ".join(type(child).__qualname__ for child in children)
    return f"{name} ({_short_repr(entries, bare=True)})"
  if aux is None or isinstance(aux, type):  # A NamedTuple's aux is its class.
    return name
  return f"{name} {_short_repr(aux)}"


def _short_repr(value: object, limit: int = 80, *, bare: bool = False) -> str:
  text = str(value) if bare else repr(value)
  return text if len(text) <= limit else text[: limit - 3] + "..."
