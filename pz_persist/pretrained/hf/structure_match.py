"""Does a Hugging Face family express a Penzai model? The family's own load
plan is built from the derived config and compared with the model, field by
field; the first difference is refused with `errors.ExportError` naming its place.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from penzai import pz

from pz_persist.pretrained import errors
from pz_persist.pretrained.hf import families
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.plan import Plan


def family_plans() -> dict[str, list[Callable[..., Plan]]]:
  """Every ``model_type`` export can write, with the plans that may describe
  a model of it: what `load_hf` reads, then the record's further layouts
  (Penzai's own Gemma, as `load_gemma` builds it, for ``gemma`` /
  ``gemma2``)."""
  return {name: [model_type.plan, *model_type.export_plans]
          for name, model_type in families.MODEL_TYPES.items() if model_type.exported}


# --- does the family express the model? ---------------------------------------


class ModelWeights:
  """Stands in for `pz_persist.pretrained.hf.weights.Weights`: the plan asks
  which tensors a folder holds and their dtype; the model answers.

  What a plan checks the weights hold before it builds anything: layers under
  the prefixes `check_layers` counts under, and the untied output heads
  `lm_head_source` asks for (every record's `layer_prefixes` and
  `head_names`); these answer with both, for as many layers as the model has.
  """

  stand_in = True
  """Not a folder's weights: checks against a folder's tensors (an expert
  count against the experts it holds) do not apply; the model is trusted."""

  def __init__(self, layers: int, dtype: np.dtype):
    self.path = "(the model being exported)"
    self.names = {f"{prefix}{i}.weight" for prefix in families.LAYER_PREFIXES
                  for i in range(layers)}
    self.names |= set(families.HEAD_NAMES)
    self.dtype = dtype


def _plain(value: Any) -> Any:
  """A comparable form of a leaf: arrays by dtype, shape and bits."""
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    host = np.asarray(value)
    return ("array", host.dtype.name, host.shape, host.tobytes())
  if isinstance(value, functools.partial):
    return ("partial", value.func, value.args, tuple(sorted(value.keywords.items())))
  return value


def _shown(value: Any) -> str:
  if hasattr(value, "shape"):
    return f"{value.dtype}{list(value.shape)} {np.asarray(value).ravel()[:4]}"
  return repr(value)


def _dtype_or_self(value: Any) -> Any:
  """A dtype however given (``jnp.float32``, ``np.dtype("float32")``) as
  ``np.dtype``: builders store either, meaning the same."""
  if isinstance(value, np.dtype) or (isinstance(value, type) and (
      issubclass(value, np.generic) or isinstance(getattr(value, "dtype", None), np.dtype))):
    return np.dtype(value)
  return value


def _is_number(value: object) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def first_difference(expected: Any, found: Any, path: str,
                     slots: dict[str, str]) -> tuple[str, str] | None:
  """Where the model (``found``) first differs from the plan's skeleton
  (``expected``) in anything but parameter values, and how; fills ``slots``
  with ``{plan label: model label}`` for the parameters met on the way."""
  expected, found = _dtype_or_self(expected), _dtype_or_self(found)
  if (type(expected) is not type(found) and not isinstance(expected, pz.ParameterSlot)
      and not (_is_number(expected) and _is_number(found))):  # 10_000 == 10_000.0
    return path, (f"the model has a {type(found).__name__} where the family's layout has a"
                  f" {type(expected).__name__}")
  if isinstance(expected, pz.ParameterSlot):
    if not isinstance(found, pz.ParameterValue):
      return path, (f"the model has a {type(found).__name__} where the family's layout has"
                    f" parameter {expected.label!r}")
    known = slots.setdefault(expected.label, found.label)
    if known != found.label:
      return path, (f"parameters {known!r} and {found.label!r} sit where the family has one"
                    f" shared parameter {expected.label!r}")
    return None
  if dataclasses.is_dataclass(expected):
    children = [(f".{f.name}", getattr(expected, f.name), getattr(found, f.name))
                for f in dataclasses.fields(expected)]
  elif isinstance(expected, (list, tuple)):
    if len(expected) != len(found):
      return path, f"{len(found)} entries where the family's layout has {len(expected)}"
    children = [(f"[{i}]", e, f) for i, (e, f) in enumerate(zip(expected, found))]
  elif isinstance(expected, dict):
    if list(expected) != list(found):
      return path, f"keys {list(found)} where the family's layout has {list(expected)}"
    children = [(f"[{k!r}]", expected[k], found[k]) for k in expected]
  elif _plain(expected) != _plain(found):
    return path, f"{_shown(found)} where the family's layout has {_shown(expected)}"
  else:
    return None
  for suffix, e, f in children:
    difference = first_difference(e, f, path + suffix, slots)
    if difference:
      return difference
  return None


def _check_structure(plan: Plan, model: pz.nn.Layer, family: str) -> dict[str, str]:
  """Refuses a model whose structure differs from what the family's plan
  builds; returns ``{plan label: model label}`` (labels may differ: a model
  with blocks cut keeps its original block numbers)."""
  skeleton = plan.build()
  slots: dict[str, str] = {}
  difference = first_difference(skeleton, model, "model", slots)
  if difference:
    where, what = difference
    raise errors.ExportError(
        f"{where}: {what}, so this model cannot be written as a Hugging Face"
        f" {family!r} folder (export_hf compares the model with what load_hf would"
        " build from the config it derives). Export a model with the family's"
        " structure (undo the edit at that place, or merge it into the weights),"
        " or name the right family with like=."
    )
  return slots


def matching_plan(candidates: list[Callable[..., Plan]], config: dict[str, Any],
                  weights: ModelWeights, model: pz.nn.Layer, family: str,
                  folder: str) -> tuple[Plan, dict[str, str]]:
  """The first of the family's plans that builds exactly the model's
  structure, and its ``{plan label: model label}``; else the first plan's
  refusal (a family may have two Penzai layouts: Gemma's norms hold ``w``
  when `load_hf` reads a Hub folder, ``1 + w`` when `load_gemma` builds it)."""
  refusal: errors.PzPersistError | None = None
  for candidate in candidates:
    try:
      plan = candidate(Config(config, f"config derived for {folder}",
                              families.FAMILY_OF[family].fields,
                              families.DEFAULTS[family],
                              families.MODEL_TYPES[family].ignored), weights)
      return plan, _check_structure(plan, model, family)
    except errors.UnsupportedConfigError as e:  # A field the family cannot take.
      refusal = refusal or errors.ExportError(
          f"this model cannot be written as a Hugging Face {family!r} folder: the config"
          f" derived from it is one {family!r} cannot express ({e}) Name the right"
          " family with like=, or undo the edit that gave the model this structure.")
    except errors.PzPersistError as e:
      refusal = refusal or e
  assert refusal is not None
  raise refusal
