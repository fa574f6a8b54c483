"""EXAONE 4 checkpoints (``model_type`` ``exaone4``).

EXAONE 4 is Llama's layout (`pz_persist.pretrained.hf.building.decoder`)
with three changes, all read here as transformers' ``Exaone4ForCausalLM``
computes them:

- norms after the attention and the MLP, none before
  (`pz_persist.pretrained.hf.building.post_norms.post_norm_plan`: OLMo 2's
  ``post_attention_layernorm`` / ``post_feedforward_layernorm``);
- an RMS norm on each head's query and key before RoPE (``q_norm`` /
  ``k_norm``: `pz_persist.pretrained.hf.building.norms`);
- with a ``sliding_window``, the layers ``layer_types`` marks
  ``"sliding_attention"`` (by default all but every ``sliding_window_pattern``-th)
  attend through the window with RoPE, and the ``"full_attention"`` ones attend
  globally *without* RoPE (positions reach them only through the sliding
  layers). Without a window (``sliding_window: null``, EXAONE 4.0 1.2B) every
  layer is global and rotary.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.scaled_rope import ApplyScaledRoPE
from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.defaults import NO_BIASES
from pz_persist.pretrained.hf.building.norms import query_key_norm_specs
from pz_persist.pretrained.hf.building.norms import with_query_key_norms
from pz_persist.pretrained.hf.building.post_norms import is_post_norm
from pz_persist.pretrained.hf.building.post_norms import post_norm_plan
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import layer_types
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_LAYER_TYPES = ("full_attention", "sliding_attention")
_ROTARY = (pz.nn.ApplyRoPE, ApplyScaledRoPE)
"""The rotary layers a block may hold (scaled once ``rope_scaling`` is read)."""


def _pattern(value: Any) -> bool:
  if isinstance(value, int) and not isinstance(value, bool):
    return value >= 0
  return isinstance(value, str) and bool(value) and set(value) <= {"L", "G"}


_PATTERN = (_pattern, "a non-negative integer or a string of L and G (\"LLLG\")")


def _kinds(cfg: Config, layers: int, window: int | None) -> Callable[[int], list[str]]:
  """Each layer's type, given the layer count once it is checked against the
  weights: ``layer_types``, else every ``sliding_window_pattern``-th layer
  global, as ``Exaone4Config`` builds them (which fails for a null window or
  a string pattern: refused here, with the reason)."""
  pattern = cfg.get("sliding_window_pattern", FROM_TABLE)
  types = cfg.get("layer_types")
  if types is not None:
    if len(types) != layers or not set(types) <= set(_LAYER_TYPES):
      shown = types if len(types) <= 8 else [*types[:8], "..."]
      raise cfg.unsupported("layer_types", shown, f"expected {layers} entries"
                            f" (num_hidden_layers), each one of {list(_LAYER_TYPES)}")
    if window is None and "sliding_attention" in types:
      raise cfg.unsupported("sliding_window", None, "layer_types has sliding_attention layers"
                            " but the window is null")
    return lambda count: list(types)
  if window is None or not isinstance(pattern, int) or pattern == 0:
    raise cfg.unsupported(
        "layer_types", None, "it is needed when sliding_window is null or"
        f" sliding_window_pattern ({pattern!r}) is not a positive integer; transformers'"
        " Exaone4Config cannot build the layer types from them either")
  return lambda count: ["sliding_attention" if (i + 1) % pattern else "full_attention"
                        for i in range(count)]


def exaone4_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps an EXAONE 4 checkpoint: Llama's plan with post-norms, per-head
  query/key norms, sliding layers and RoPE-free global layers."""
  bool_field(cfg, "attention_bias", False, False, "EXAONE 4's attention has no biases")
  bool_field(cfg, "mlp_bias", False, False, "EXAONE 4's MLP has no biases")
  layers = cfg.require("num_hidden_layers")
  window = cfg.nullable("sliding_window", FROM_TABLE)
  kinds = _kinds(cfg, layers, window)  # Called only once the count is checked.

  def attention_types(count: int) -> tuple[llamalike_common.AttentionType, ...]:
    return tuple(llamalike_common.AttentionTypeGlobalCausal() if kind == "full_attention"
                 else llamalike_common.AttentionTypeSlidingWindowCausal(window)
                 for kind in kinds(count))

  def edit(model: model_parts.TransformerLM,
           config: llamalike_common.LlamalikeTransformerConfig) -> model_parts.TransformerLM:
    model = with_query_key_norms(model, config)
    if window is None:
      return model
    for i, kind in enumerate(kinds(config.num_decoder_blocks)):
      if kind == "full_attention":
        block = pz.select(model).at_instances_of(model_parts.TransformerBlock).pick_nth_selected(i)
        model = block.at_instances_of(_ROTARY).remove_from_parent()
    return model

  plan = llama_plan(cfg, weights, attention=attention_types, biases=Biases(),
                    block_extras=query_key_norm_specs, edit=edit)
  return post_norm_plan(plan, float(cfg.get("rms_norm_eps", FROM_TABLE)))


def _has_rope(block: pz.nn.Layer) -> bool:
  return any(all_layers(block, cls) for cls in _ROTARY)


def _detect(model: pz.nn.Layer) -> str | None:
  """Post-norms with a norm over each head's ``projection`` among the
  query's layers (OLMo's query norm spans every head)."""
  if not is_post_norm(model):
    return None
  norms = all_layers(attention(model).input_to_query, pz.nn.RMSLayerNorm)
  per_head = norms and set(norms[0].sublayers[1].weights.value.named_shape) == {"projection"}
  return "exaone4" if per_head else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only exaone4.
  found = windows(model)
  window = next((w for w in found if w is not None), None)
  ropeless = any(w is None and not _has_rope(b) for b, w in zip(blocks(model), found))
  if window is None and ropeless:  # Global layers without RoPE: a window is set, unused.
    window = like.get("sliding_window") or 4096
  fields = {**llamalike_fields(model, like), "layer_types": layer_types(found),
            "sliding_window": window}
  if like.get("sliding_window_pattern") is not None:  # Unread beside layer_types.
    fields["sliding_window_pattern"] = like["sliding_window_pattern"]
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, Any] = {
    "defaults": {**LLAMA_LIKE, "rms_norm_eps": 1e-5, "mlp_bias": False, "num_key_value_heads": 32,
                 "sliding_window": 4096, "sliding_window_pattern": 4,
                 "max_position_embeddings": 2048},
    "defaults_why": {"attention_bias": NO_BIASES, "mlp_bias": NO_BIASES},
}
"""What each absent field means (``Exaone4Config``'s value) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="EXAONE 4",
    model_types={"exaone4": ModelType(exaone4_plan, "Exaone4ForCausalLM",
                                      **_TRANSFORMERS_DEFAULTS)},
    detect=_detect,
    write_config=_write_config,
    adds=("norms after attention and MLP only (OLMo 2's), per-head query/key RMS norms before"
          " RoPE, sliding-window layers (`layer_types` or `sliding_window_pattern`) with RoPE"
          " and global layers without it; scaled RoPE"),
    refuses="biases; a null window or a string `sliding_window_pattern` without `layer_types`",
    rank=240,
    fields={"sliding_window_pattern": _PATTERN},
)
