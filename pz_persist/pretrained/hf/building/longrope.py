"""LongRoPE read from a config (Phi-3's ``longrope`` and Phi-3.5-MoE's, with
its ``short_mscale`` / ``long_mscale``), shared by the families whose
transformers class reads it: the RoPE dict, its type and keys, the factor
lists and the original context, each refused by name when hostile.

Llama's reader (`pz_persist.pretrained.hf.building.decoder.llama_plan`)
refuses ``longrope``; a family reads it here first and hands Llama's reader
the unscaled base alone (`base_only`), then swaps Penzai's ``ApplyRoPE``
layers for `pz_persist.nn.longrope.ApplyLongRoPE`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any
from typing import Literal

from pz_persist.pretrained.hf.config import Config

COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
"""The keys of a RoPE dict every rope type reads."""


def numbers(value: Any) -> bool:
  """Whether ``value`` is a list of positive finite numbers (a factor list)."""
  return isinstance(value, list) and all(
      isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
      for v in value)


def rope_params(cfg: Config, kinds: tuple[str, ...], keys: frozenset[str], family: str
                ) -> tuple[str, dict[str, Any], str]:
  """The RoPE dict's key (``rope_parameters`` or ``rope_scaling``; both are
  read and refused if they differ), a copy of the dict, and its rope type:
  ``"default"`` or one of ``kinds`` (the longrope names ``family``'s
  transformers class reads, whose keys beyond `COMMON_KEYS` are ``keys``).
  Any other type, and any key the type does not read, is refused by name."""
  found: dict[str, dict[str, Any]] = {
      key: value for key in ("rope_parameters", "rope_scaling") if (value := cfg.get(key))}
  if len(found) == 2 and found["rope_parameters"] != found["rope_scaling"]:
    raise cfg.unsupported("rope_scaling", found["rope_scaling"],
                          "rope_parameters says otherwise; keep one of them")
  key, params = next(iter(found.items()), ("rope_parameters", {}))
  params = dict(params)  # (A JSON object: `Config.get` checked it.)
  named = {params.get(name) for name in ("rope_type", "type")} - {None}
  kind = next(iter(named), "default")
  if len(named) > 1 or kind not in ("default", *kinds):
    raise cfg.unsupported(f"{key}.rope_type", params.get("rope_type", params.get("type")),
                          f"{family}'s rope types are 'default' and 'longrope' ({kinds})")
  allowed = COMMON_KEYS | (keys if kind != "default" else frozenset())
  unknown = sorted(set(params) - allowed)
  if unknown:
    raise cfg.unsupported(f"{key}.{unknown[0]}", params[unknown[0]],
                          f"rope_type {kind!r} reads only {sorted(allowed)}")
  return key, params, kind


def agreeing(cfg: Config, key: str, params: Mapping[str, Any], name: str, default: Any) -> Any:
  """``params[name]``, which must agree with the top-level field ``name``."""
  inner = params.get(name)
  inner = None if inner is None else cfg.checked(f"{key}.{name}", inner)
  outer = cfg.get(name)
  if inner is not None and outer is not None and inner != outer:
    raise cfg.unsupported(name, outer, f"{key}.{name}={inner!r} says otherwise")
  return next((v for v in (inner, outer) if v is not None), default)


def factor_lists(cfg: Config, key: str, params: Mapping[str, Any], pairs: int
                 ) -> dict[str, tuple[float, ...]]:
  """``short_factor`` and ``long_factor``, each ``pairs`` positive numbers
  (one per rotated pair of each head)."""
  factors = {}
  for name in ("short_factor", "long_factor"):
    value = params.get(name)
    if not isinstance(value, list) or not numbers(value) or len(value) != pairs:
      shown = f"a list of {len(value)}" if isinstance(value, list) else value
      raise cfg.unsupported(f"{key}.{name}", shown,
                            f"longrope needs {pairs} positive numbers, one per rotated pair of"
                            " each head")
    factors[name] = tuple(float(v) for v in value)
  return factors


def original_context(cfg: Config, key: str, params: Mapping[str, Any], used: int,
                     other: Literal["inner", "outer"]) -> int:
  """``used``, the original context transformers uses, which the config's
  other place for it (``other``: ``"inner"`` the RoPE dict's,
  ``"outer"`` the top-level ``original_max_position_embeddings``; whichever
  transformers ignores) must not contradict."""
  name = "original_max_position_embeddings"
  value = (params.get(name) if other == "inner" else cfg.get(name))
  where = f"{key}.{name}" if other == "inner" else name
  if value is not None and cfg.checked(where, value) != used:
    raise cfg.unsupported(where, value, f"the original_max_position_embeddings={used} that"
                          " transformers uses says otherwise; make them agree")
  return used


def base_only(cfg: Config, theta: float) -> None:
  """Leaves Llama's reader the unscaled base alone (the family read the
  rest: its RoPE dict, the partial rotary fraction)."""
  cfg.raw.pop("rope_scaling", None)
  cfg.raw.pop("partial_rotary_factor", None)
  cfg.raw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
