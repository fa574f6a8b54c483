"""Projections stored fused (shared code, no record): Phi-3's ``qkv_proj``
and ``gate_up_proj``, GLM-4-0414's ``gate_up_proj``. Each Penzai projection
reads its own range of rows of the fused tensor (`TensorSpec.rows`), so the
model stays Penzai's llama-like one and export writes the fused tensor back
bit for bit."""

from __future__ import annotations

from collections.abc import Mapping

from pz_persist.pretrained.hf.plan import TensorSpec


def fused_rows(specs: tuple[TensorSpec, ...],
               fused: Mapping[str, str]) -> tuple[TensorSpec, ...]:
  """``specs`` reading each module of ``fused`` (``gate_proj``) from its
  rows of the fused module it names (``gate_up_proj``), in the order the
  specs list them (gate rows, then up rows)."""
  out = []
  offsets: dict[str, int] = {}
  totals: dict[str, int] = {}
  for spec in specs:
    module = spec.source.rsplit(".", 2)[-2]
    if module in fused:
      source = spec.source.replace(module, fused[module])
      rows = (spec.stored or spec.shape)[0]
      totals[source] = totals.get(source, 0) + rows
  for spec in specs:
    module = spec.source.rsplit(".", 2)[-2]
    if module not in fused:
      out.append(spec)
      continue
    source = spec.source.replace(module, fused[module])
    stored = spec.stored or spec.shape
    start = offsets.get(source, 0)
    offsets[source] = start + stored[0]
    out.append(TensorSpec(spec.label, source, spec.shape, spec.axes,
                          stored=(totals[source], *stored[1:]), rows=(start, start + stored[0])))
  return tuple(out)
