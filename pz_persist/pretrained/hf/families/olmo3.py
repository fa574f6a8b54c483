"""OLMo 3 checkpoints (``model_type`` ``olmo3``).

OLMo 3 is OLMo 2 (`pz_persist.pretrained.hf.building.post_norms`: post-norms,
query/key norms over the whole projection) with sliding-window layers: the
layers ``layer_types`` marks ``"sliding_attention"`` (by default all but
every fourth) attend through ``sliding_window`` (default 4096), and each
kind of layer has its own RoPE: ``rope_parameters`` holds one dict per
layer type (as transformers 5 writes it), or, in configs written before,
``rope_theta`` and ``rope_scaling`` for the full-attention layers only (OLMo
3's YaRN long context), the sliding ones keeping the default base 500,000,
exactly as transformers' ``Olmo3Config`` reads such a file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import with_scaled_rope
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.defaults import NO_BIASES
from pz_persist.pretrained.hf.building.post_norms import is_post_norm
from pz_persist.pretrained.hf.building.post_norms import olmo_blocks
from pz_persist.pretrained.hf.building.post_norms import olmo_fields
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import RopeScaling
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config import scaled_rope
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import layer_types
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_LAYER_TYPES = ("full_attention", "sliding_attention")
_DEFAULT_THETA = 500_000.0
_DEFAULT_POSITIONS = 2048  # Olmo3Config's max_position_embeddings.


def olmo3_plan(cfg: Config, weights: Weights) -> Plan:
  """OLMo 2's mapping with OLMo 3's windows and per-layer-type RoPE."""
  bool_field(cfg, "mlp_bias", False, False, "OLMo's MLP has no biases")
  layers = cfg.require("num_hidden_layers")
  window = cfg.nullable("sliding_window", 4096)
  types = cfg.get("layer_types")
  if types is not None and (len(types) != layers or not set(types) <= set(_LAYER_TYPES)):
    shown = types if len(types) <= 8 else [*types[:8], "..."]
    raise cfg.unsupported("layer_types", shown, f"expected {layers} entries (num_hidden_layers),"
                          f" each one of {list(_LAYER_TYPES)}")
  if window is None and (types is None or "sliding_attention" in types):
    raise cfg.unsupported("sliding_window", None, "layers are sliding_attention (layer_types:"
                          f" {'every one but each fourth' if types is None else 'some'}) but"
                          " the window is null")
  ropes = _ropes(cfg)

  def kinds(count: int) -> list[str]:
    return types if types is not None else [
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(count)]

  def attention(count: int):
    def one(kind: str) -> llamalike_common.AttentionType:
      if kind == "full_attention":
        return llamalike_common.AttentionTypeGlobalCausal()
      assert window is not None  # A sliding layer without a window was refused above.
      return llamalike_common.AttentionTypeSlidingWindowCausal(window)
    return tuple(one(kind) for kind in kinds(count))

  plan = olmo_blocks(llama_plan(cfg, weights, attention=attention),
                     float(cfg.get("rms_norm_eps", FROM_TABLE)))

  def build() -> model_parts.TransformerLM:
    model = plan.build()
    for i, kind in enumerate(kinds(layers)):  # The count is checked against the weights.
      theta, scaling = ropes[kind]
      block = pz.select(model).at_instances_of(model_parts.TransformerBlock).pick_nth_selected(i)
      model = block.apply(lambda b, theta=theta, scaling=scaling: _rope(b, theta, scaling))
    return model

  return Plan(build, plan.tensors)


def _rope(block: pz.nn.Layer, theta: float, scaling: RopeScaling | None) -> pz.nn.Layer:
  block = (pz.select(block).at_instances_of(pz.nn.ApplyRoPE)
           .apply(lambda layer: pz.nn.ApplyRoPE(embedding_axis=layer.embedding_axis,
                                                max_wavelength=theta,
                                                positions_input_name=layer.positions_input_name)))
  return block if scaling is None else with_scaled_rope(block, scaling)


def _ropes(cfg: Config) -> dict[str, tuple[float, RopeScaling | None]]:
  """Each layer type's RoPE base and scaling, read as transformers'
  ``Olmo3Config`` reads them; Llama's reader is then handed the unscaled
  base of the full-attention layers alone (the blocks get theirs at build)."""
  params = cfg.get("rope_parameters")
  legacy_scaling = cfg.get("rope_scaling")
  theta = cfg.get("rope_theta")
  nested = isinstance(params, dict) and set(params) <= set(_LAYER_TYPES) and params
  if params and not nested:
    raise cfg.unsupported("rope_parameters", params,
                          f"OLMo 3 reads one dict per layer type, {list(_LAYER_TYPES)}")
  if nested and legacy_scaling:
    raise cfg.unsupported("rope_scaling", legacy_scaling,
                          "rope_parameters holds each layer type's RoPE; keep one of them")
  max_positions = cfg.get("max_position_embeddings", _DEFAULT_POSITIONS)
  out = {}
  for kind in _LAYER_TYPES:
    if nested:
      own = params.get(kind) or {"rope_type": "default"}
    else:
      own = dict(legacy_scaling or {}) if kind == "full_attention" else {"rope_type": "default"}
    raw: dict[str, Any] = {"rope_parameters": own, "max_position_embeddings": max_positions}
    # transformers' Olmo3Config gives a legacy rope_theta to the full layers
    # only: the sliding ones keep the default base.
    if theta is not None and own.get("rope_theta") is None and kind == "full_attention":
      raw["rope_theta"] = theta
    sub = Config(raw, f"{cfg.where} (rope_parameters.{kind})", defaults=cfg.defaults)
    base, fraction, scaling = scaled_rope(sub, _DEFAULT_THETA, max_positions)
    if fraction != 1.0:
      raise cfg.unsupported(f"rope_parameters.{kind}.partial_rotary_factor", fraction,
                            "OLMo's RoPE covers every dimension")
    out[kind] = (base, scaling)
  for key in ("rope_scaling", "rope_theta"):
    cfg.raw.pop(key, None)
  cfg.raw["rope_parameters"] = {"rope_type": "default", "rope_theta": out["full_attention"][0]}
  return out


def _detect(model: pz.nn.Layer) -> str | None:
  """Post-norms with a sliding window."""
  return "olmo3" if is_post_norm(model) and any(w is not None for w in windows(model)) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only olmo3.
  found = windows(model)
  types = layer_types(found)
  window = next((w for w in found if w is not None), None)
  fields = olmo_fields(model, like)
  params: dict[str, Any] = {}
  for kind in _LAYER_TYPES:
    block = next((b for b, t in zip(blocks(model), types) if t == kind), None)
    if block is None:  # No layer of this kind: like's, else the full layers'.
      params[kind] = (like.get("rope_parameters") or {}).get(kind)
      continue
    own = rope_fields(block)
    params[kind] = own.pop("rope_parameters")
    fields.update(own)  # max_position_embeddings, for dynamic.
  if params["sliding_attention"] is None:
    params["sliding_attention"] = {"rope_type": "default",
                                   "rope_theta": params["full_attention"]["rope_theta"]}
  if params["full_attention"] is None:
    params["full_attention"] = {"rope_type": "default",
                                "rope_theta": params["sliding_attention"]["rope_theta"]}
  fields.update(rope_parameters=params, layer_types=types,
                sliding_window=window if window is not None else like.get("sliding_window", 4096))
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "olmo3": {
        "defaults": {**LLAMA_LIKE, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0, "mlp_bias": False,
                     "sliding_window": 4096, "max_position_embeddings": 2048},
        "defaults_why": {
            "mlp_bias": NO_BIASES,
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="OLMo 3",
    model_types={"olmo3": ModelType(olmo3_plan, "Olmo3ForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["olmo3"])},
    detect=_detect,
    write_config=_write_config,
    adds=("OLMo 2's blocks with sliding-window layers (`layer_types`) and each layer type's own"
          " RoPE (`rope_parameters` per type, or `rope_scaling` on full layers: YaRN...)"),
    refuses="what OLMo 2 refuses; partial rotary",
    rank=290,
)
