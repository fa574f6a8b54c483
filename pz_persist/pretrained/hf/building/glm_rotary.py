"""GLM's partial rotary field (shared code, no record): GLM-4-0414 (``glm4``)
and GLM-4.5 (``glm4_moe``) rotate only the first ``partial_rotary_factor``
of each head, a fraction their configs hold at the top level (transformers
4) or inside the RoPE dict (transformers 5), default one half."""

from __future__ import annotations

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
        raise cfg.unsupported(f"{key}.rope_type", rope_type, "GLM's partial rotary is read"
                              " with unscaled ('default') RoPE only")
      cfg.raw[key] = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
  values = {v for v in found if v is not None}
  if len(values) > 1:
    raise cfg.unsupported("partial_rotary_factor", sorted(values), "given twice, differently")
  # Llama's reader, which refuses partial rotary, sees a full one (not the
  # table's GLM default of one half, which is read here).
  cfg.raw["partial_rotary_factor"] = 1.0
  return values.pop() if values else cfg.default("partial_rotary_factor", FROM_TABLE)
