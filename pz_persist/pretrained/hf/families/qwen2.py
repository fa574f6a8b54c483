"""Qwen2 and Qwen2.5 checkpoints (``model_type`` ``qwen2``).

Qwen2 is Llama's layout (`pz_persist.pretrained.hf.families.llama`) with a
bias on the query, key and value projections (none on the output projection
or in the MLP) and its own way of choosing which layers attend through a
sliding window.
"""

from __future__ import annotations

from collections.abc import Callable

from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.families.llama import Attention
from pz_persist.pretrained.hf.families.llama import Biases
from pz_persist.pretrained.hf.families.llama import llama_plan
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.weights import Weights

_LAYER_TYPES = ("full_attention", "sliding_attention")


def qwen2_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Qwen2 / Qwen2.5 checkpoint to Penzai (Llama's mapping, with
  query/key/value biases and Qwen2's per-layer attention)."""
  bool_field(cfg, "use_mrope", False, False,
             "multimodal RoPE belongs to Qwen2-VL (model_type qwen2_vl), whose"
             " text model this loader does not build")
  return llama_plan(cfg, weights, attention=qwen2_attention(cfg),
                    biases=Biases(query_key_value=True))


def qwen2_attention(cfg: Config) -> Callable[[int], Attention]:
  """Each layer's attention, exactly as transformers' ``Qwen2Config`` decides,
  as a function of the layer count (called by `llama_plan` once the count is
  checked against the weights; the fields are read and checked here).

  The window is ``sliding_window`` (default 4096) only if
  ``use_sliding_window`` is true; it applies to the layers ``layer_types``
  marks ``"sliding_attention"``; without ``layer_types`` (configs written by
  transformers 4), to layers ``max_window_layers`` (default 28) and above.
  A layer marked sliding with no window is refused, as transformers fails
  on it. (Windows apply in full-sequence calls and in Penzai's KV-cache
  sampling mode alike.)
  """
  layers = cfg.require("num_hidden_layers")
  use_window = cfg.get("use_sliding_window", False)
  # Absent: transformers' default window; an explicit null: no window.
  window = cfg.nullable("sliding_window", 4096)
  if not use_window:
    window = None
  first_sliding = cfg.get("max_window_layers", 28)
  types = cfg.get("layer_types")
  if types is not None:
    if len(types) != layers or not set(types) <= set(_LAYER_TYPES):
      raise cfg.unsupported(
          "layer_types", _shown(types),
          f"expected {layers} entries (num_hidden_layers), each one of {list(_LAYER_TYPES)}",
      )
  if types is not None and "sliding_attention" in types and window is None:
    raise cfg.unsupported(
        "layer_types", _shown(types),
        "layers are marked sliding_attention but no window is set (use_sliding_window"
        f"={use_window}, sliding_window={cfg.raw.get('sliding_window')!r});"
        " transformers fails on this config too",
    )

  def per_layer(count: int) -> Attention:
    kinds = types if types is not None else [
        "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
        for i in range(count)]
    attention = tuple(
        llamalike_common.AttentionTypeGlobalCausal() if kind == "full_attention"
        else llamalike_common.AttentionTypeSlidingWindowCausal(window)
        for kind in kinds
    )
    return attention[0] if len(set(attention)) == 1 else attention

  return per_layer


def _shown(types: list[str]) -> list[str]:
  """``layer_types`` as an error message shows it (a forged one may be long)."""
  return types if len(types) <= 8 else [*types[:8], "..."]
