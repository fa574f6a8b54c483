"""Every private Penzai name pz_persist touches.

Why one module: Penzai's underscored names carry no compatibility promise,
so each release may move or change them. Gathered here, each with what
pz_persist relies on (its docstring) and a contract test
(``tests/test_penzai_seam.py``) that fails, naming the symbol, when a Penzai
release changes it, a new Penzai is checked in one place; and
``tests/test_layout.py`` fails if any other module of the package names a
private Penzai attribute. Everything else pz_persist uses of Penzai is
public (``penzai.pz``, ``penzai.models.transformer``, ...). The same rule,
for Orbax, is `pz_persist.storage.orbax_seam`.

What is private today is all `pz_persist.pretrained.gemma`'s: Penzai's Gemma
converter reads its presets from two module-level tables, and `load_gemma`
reads them (to infer a preset from a checkpoint's shapes, and to report
where each setting came from) and gives the converter a custom preset
without writing into them.

This module imports no other pz_persist module.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import penzai
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import gemma as _pz_gemma

SUPPORTED_PENZAI = ">=0.2.3,<0.3"
"""The penzai versions pz_persist is tested with (as pyproject.toml says):
what a failing private name's message asks for."""

_PRESETS = "_GEMMA_PRESETS"
_GATING = "_NEEDS_GATING_TRANSPOSE"


def _table(name: str) -> dict[str, Any]:
  """Penzai's Gemma table ``name``, or an AttributeError that says what to install."""
  table = getattr(_pz_gemma, name, None)
  if not isinstance(table, dict):
    raise AttributeError(
        f"pz_persist needs {_pz_gemma.__name__}.{name} (a dict), which this penzai"
        f" ({penzai.__version__}) does not have; install a version pz_persist"
        f" supports: pip install 'penzai{SUPPORTED_PENZAI}'."
    )
  return table


def gemma_presets() -> Mapping[str, Mapping[str, Any]]:
  """Penzai's Gemma presets (``gemma.py``'s private ``_GEMMA_PRESETS``), read
  now: preset name to keyword arguments of ``LlamalikeTransformerConfig``.

  Relied on by `pz_persist.pretrained.gemma` (``preset="auto"``, the preset
  names it accepts, its reports): Penzai lists its presets nowhere public.
  A read-only view of Penzai's own table, read at each call, so a preset
  added to it later (as tests do) is seen; each preset's keywords are
  read-only views too, since they are Penzai's own dicts (a caller editing
  one would change every later Gemma load of the process).

  Example:
    >>> from pz_persist import penzai_seam
    >>> penzai_seam.gemma_presets()["gemma2_2b"]["num_decoder_blocks"]
    26
  """
  return types.MappingProxyType({
      name: types.MappingProxyType(kwargs) if isinstance(kwargs, dict) else kwargs
      for name, kwargs in _table(_PRESETS).items()
  })


def gemma_gating_transposed() -> Mapping[str, bool]:
  """Whether each of Penzai's Gemma presets stores its MLP gating weights
  transposed (``gemma.py``'s private ``_NEEDS_GATING_TRANSPOSE``), read now.

  Relied on by `pz_persist.pretrained.gemma` for a square MLP, whose
  shapes do not show the layout: the ``like`` preset's is used.

  Example:
    >>> from pz_persist import penzai_seam
    >>> penzai_seam.gemma_gating_transposed()["gemma2_9b"]
    True
  """
  return types.MappingProxyType(_table(_GATING))


def gemma_converter_with_preset(
    name: str, kwargs: Mapping[str, Any], transposed: bool
) -> Callable[..., model_parts.TransformerLM]:
  """Penzai's ``gemma_from_pretrained_checkpoint``, knowing one more preset.

  Relied on by `pz_persist.pretrained.gemma` for custom presets (models of
  other sizes). Why not Penzai's function with the preset written into its
  tables: that changes Penzai's module state for the whole process (another
  thread, or Penzai's own ``"auto"``, would see it). The converter reads its
  presets from the two module-level tables by their global names, so this is
  a copy of the function whose globals are a copy of the module's namespace
  with the two tables extended: the same conversion code, and nothing of
  Penzai's is written.

  Args:
    name: The preset's name (``preset_name=`` of the call).
    kwargs: Keyword arguments of ``LlamalikeTransformerConfig``.
    transposed: Whether the MLP gating weights are stored transposed.

  Raises:
    AttributeError: this Penzai keeps its presets elsewhere (a version
      pz_persist is not tested with).
  """
  convert = _pz_gemma.gemma_from_pretrained_checkpoint
  namespace = dict(vars(_pz_gemma))
  namespace[_PRESETS] = {**_table(_PRESETS), name: dict(kwargs)}
  namespace[_GATING] = {**_table(_GATING), name: transposed}
  return types.FunctionType(
      convert.__code__, namespace, convert.__name__, convert.__defaults__,
      convert.__closure__,
  )
