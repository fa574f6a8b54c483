"""Partial rotary on Llama's layout (shared code, no record): GLM-4-0414
(``glm4``), GLM-4.5 (``glm4_moe``) and MiniMax-M2 (``minimax_m2``) rotate
only the first ``partial_rotary_factor`` of each head, a fraction their
configs hold at the top level (transformers 4) or inside the RoPE dict
(transformers 5); the default is the family's (one half for GLM)."""

from __future__ import annotations

from penzai import pz

from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import Config


def partial_rotary(cfg: Config) -> float:
  """``partial_rotary_factor`` (top level or in the RoPE dict; the
  defaults table's value when absent), taken out of the config so that
  Llama's reader, which refuses partial rotary, reads the rest."""
  found = [cfg.get("partial_rotary_factor")]
  for key in ("rope_parameters", "rope_scaling"):
    params = cfg.raw.get(key)
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
      found.append(cfg.checked(f"{key}.partial_rotary_factor", params["partial_rotary_factor"]))
      rope_type = params.get("rope_type", params.get("type", "default"))
      if rope_type != "default":
        raise cfg.unsupported(f"{key}.rope_type", rope_type, "partial rotary is read"
                              " with unscaled ('default') RoPE only")
      cfg.raw[key] = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
  values = {v for v in found if v is not None}
  if len(values) > 1:
    raise cfg.unsupported("partial_rotary_factor", sorted(values), "given twice, differently")
  # Llama's reader, which refuses partial rotary, sees a full one (not the
  # table's default, which is read here).
  cfg.raw["partial_rotary_factor"] = 1.0
  return values.pop() if values else cfg.default("partial_rotary_factor", FROM_TABLE)


def given(cfg: Config) -> bool:
  """Whether the config states ``partial_rotary_factor`` (top level or in
  its RoPE dict), rather than leaving it to the default."""
  nested = (cfg.raw.get(key) for key in ("rope_parameters", "rope_scaling"))
  return cfg.raw.get("partial_rotary_factor") is not None or any(
      isinstance(params, dict) and params.get("partial_rotary_factor") is not None
      for params in nested)


def with_rope_on_subset(model: pz.nn.Layer, subset: int, head_dim: int) -> pz.nn.Layer:
  """``model`` with each of Penzai's ``ApplyRoPE`` layers turning only the
  first ``subset`` of ``head_dim`` entries (``ApplyRoPEToSubset``, halves
  as Llama turns them); unchanged when ``subset`` is the whole head."""
  if subset == head_dim:
    return model
  return pz.select(model).at_instances_of(pz.nn.ApplyRoPE).apply(
      lambda rope: pz.nn.ApplyRoPEToSubset(
          embedding_axis=rope.embedding_axis, max_wavelength=rope.max_wavelength,
          rope_subset_size=subset, positions_input_name=rope.positions_input_name))
