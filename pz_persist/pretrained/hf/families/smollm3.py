"""SmolLM3 checkpoints (``model_type`` ``smollm3``).

SmolLM3 is Llama's layout (`pz_persist.pretrained.hf.building.decoder`) where
some layers use no rotary embedding at all (``no_rope_layers[i] == 0``;
without the list, every ``no_rope_layer_interval``-th layer, 4 by default):
their query and key projections have no ``ApplyRoPE`` layer. Its optional
sliding window applies to the layers ``layer_types`` marks
``"sliding_attention"`` when ``use_sliding_window`` is set; without
``layer_types``, transformers marks the layers without RoPE. Its defaults
differ from Llama's: tied embeddings and a RoPE base of 2,000,000.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.scaled_rope import ApplyScaledRoPE
from pz_persist.pretrained.hf.building.decoder import Attention
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import layer_types
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_LAYER_TYPES = ("full_attention", "sliding_attention")
_ROPE_LAYERS = (pz.nn.ApplyRoPE, ApplyScaledRoPE)


def _flags(value: Any) -> bool:
  return isinstance(value, list) and all(item in (0, 1) and not isinstance(item, float)
                                         for item in value)


def smollm3_plan(cfg: Config, weights: Weights) -> Plan:
  """Llama's mapping without RoPE in the layers ``no_rope_layers`` says."""
  layers = cfg.require("num_hidden_layers")
  interval = cfg.get("no_rope_layer_interval", 4)
  flags = cfg.get("no_rope_layers")
  if flags is not None and len(flags) != layers:
    raise cfg.unsupported("no_rope_layers", _shown(flags),
                          f"expected {layers} entries (num_hidden_layers), each 0 or 1")
  attention = _attention(cfg, layers, flags, interval)
  plan = llama_plan(cfg, weights, attention=attention, max_positions_default=32768)

  def build() -> model_parts.TransformerLM:
    # Called once llama_plan has checked the layer count against the weights.
    uses = flags if flags is not None else [int((i + 1) % interval != 0) for i in range(layers)]
    return without_rope(plan.build(), [i for i, use in enumerate(uses) if not use])

  return Plan(build, plan.tensors)


def _attention(cfg: Config, layers: int, flags: list[int] | None, interval: int):
  """Each layer's attention, as transformers' ``SmolLM3Config`` decides."""
  use_window = cfg.get("use_sliding_window", False)
  window = cfg.nullable("sliding_window", None)
  types = cfg.get("layer_types")
  if types is not None and (len(types) != layers or not set(types) <= set(_LAYER_TYPES)):
    raise cfg.unsupported("layer_types", _shown(types),
                          f"expected {layers} entries (num_hidden_layers), each one of"
                          f" {list(_LAYER_TYPES)}")
  if types is not None and "sliding_attention" in types and (not use_window or window is None):
    raise cfg.unsupported(
        "layer_types", _shown(types),
        f"layers are marked sliding_attention but use_sliding_window={use_window} and"
        f" sliding_window={window!r}; transformers' mask and attention disagree on this config")

  def per_layer(count: int) -> Attention:
    if types is not None:
      kinds = types
    else:
      uses = flags if flags is not None else [int((i + 1) % interval != 0) for i in range(count)]
      kinds = ["sliding_attention" if use_window and window is not None and not use
               else "full_attention" for use in uses]
    attention = tuple(
        llamalike_common.AttentionTypeSlidingWindowCausal(window) if kind == "sliding_attention"
        else llamalike_common.AttentionTypeGlobalCausal() for kind in kinds)
    return attention[0] if len(set(attention)) == 1 else attention

  return per_layer


def without_rope(model: model_parts.TransformerLM, layers: list[int]) -> model_parts.TransformerLM:
  """``model`` with the rotary layers of blocks ``layers`` removed."""
  for i in layers:
    model = (pz.select(model).at_instances_of(model_parts.TransformerBlock).pick_nth_selected(i)
             .at_instances_of(_ROPE_LAYERS).remove_from_parent())
  return model


def _uses_rope(model: pz.nn.Layer) -> list[int]:
  return [int(any(all_layers(block, cls) for cls in (*_ROPE_LAYERS, pz.nn.ApplyRoPEToSubset)))
          for block in blocks(model)]


def _shown(values: list[Any]) -> list[Any]:
  return values if len(values) <= 8 else [*values[:8], "..."]


def _detect(model: pz.nn.Layer) -> str | None:
  """An attention block without rotary layers (Llama's layout has them in
  every block; a block with no ``Attention`` at all, such as a
  linear-attention block, is not a NoPE layer)."""
  attends = [bool(all_layers(block, pz.nn.Attention)) for block in blocks(model)]
  return "smollm3" if any(a and not r for a, r in zip(attends, _uses_rope(model))) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only smollm3.
  found = windows(model)
  window = next((w for w in found if w is not None), None)
  biases = model_biases(model)
  return without_default_head_dim({
      **llamalike_fields(model, like),
      "no_rope_layers": _uses_rope(model),
      "use_sliding_window": window is not None,
      "sliding_window": window,
      "layer_types": layer_types(found),
      "attention_bias": biases.query_key_value or biases.output,
      "mlp_bias": biases.mlp,
  })


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "smollm3": {
        "defaults": {**LLAMA_LIKE, "rope_theta": 2_000_000.0, "tie_word_embeddings": True,
                     "mlp_bias": False, "use_sliding_window": False, "sliding_window": None,
                     "no_rope_layer_interval": 4, "max_position_embeddings": 32768},
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="SmolLM3",
    model_types={"smollm3": ModelType(smollm3_plan, "SmolLM3ForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["smollm3"],
                     ignored_fields={
                         "written by transformers 4's SmolLM3Config (copied from Qwen2's);"
                         " transformers 5 reads layer_types instead": ("max_window_layers",),
                     }, foreign_fields=frozenset({"max_window_layers"}))},
    detect=_detect,
    write_config=_write_config,
    adds=("Llama's layout with layers without RoPE (`no_rope_layers`), per-layer sliding"
          " windows (`layer_types`), Llama's biases, scaled RoPE"),
    refuses="what Llama refuses; a layer marked sliding without a window",
    rank=250,
    fields={"no_rope_layers": (_flags, "a list of 0 and 1"),
            "no_rope_layer_interval": POSITIVE_INT},
)
