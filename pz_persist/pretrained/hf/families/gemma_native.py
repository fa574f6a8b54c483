"""Hugging Face Gemma / Gemma 2 folders as Penzai's own Gemma builds them.

Penzai's Gemma (``penzai.models.transformer.variants.gemma``, the structure
`pz_persist.pretrained.load_gemma` returns) keeps ``1 + w`` in each RMS
norm's scale where Hugging Face stores ``w``; otherwise it is the structure
`pz_persist.pretrained.hf.families.gemma` builds. These plans are that
family's plan with norms of ``offset=1`` (added in float32), so
`pz_persist.pretrained.hf.export.export_hf` can write such a model back as a
Hugging Face folder by running the plan backwards. They are not in
`pz_persist.pretrained.hf.families.BUILDERS`: ``load_hf`` reads Gemma
folders into its own layout, whose norms hold the raw ``w`` (bit-exact).
"""

from __future__ import annotations

from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.families.gemma import gemma_layout_plan
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.weights import Weights


def gemma_native_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Gemma folder to Penzai's Gemma."""
  return gemma_layout_plan(cfg, weights, gemma2=False, native=True)


def gemma2_native_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Gemma 2 folder to Penzai's Gemma 2."""
  return gemma_layout_plan(cfg, weights, gemma2=True, native=True)


NATIVE_BUILDERS = {"gemma": gemma_native_plan, "gemma2": gemma2_native_plan}
"""The Gemma ``model_type`` values as Penzai's own Gemma structure holds them."""
