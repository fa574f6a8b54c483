"""Qwen's choice of which layers attend through a sliding window
(``use_sliding_window``, ``sliding_window``, ``max_window_layers``,
``layer_types``), read for a plan (`qwen2_attention`) and written back
(`window_fields`): Qwen2's rule, which its successors keep."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained.hf.building.decoder import Attention
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import layer_types
from pz_persist.pretrained.hf.config_from_model import windows

_LAYER_TYPES = ("full_attention", "sliding_attention")


def qwen2_sliding(layer: int, max_window_layers: int) -> bool:
  """Qwen2's layers with a window when ``layer_types`` is absent: from
  ``max_window_layers`` on."""
  return layer >= max_window_layers


def qwen2_moe_sliding(layer: int, max_window_layers: int) -> bool:
  """Qwen2-MoE's (transformers' ``Qwen2MoeConfig``): every other layer from
  the first, below ``max_window_layers``."""
  return layer % 2 == 0 and layer < max_window_layers


def qwen2_attention(cfg: Config, sliding: Callable[[int, int], bool] = qwen2_sliding,
                    zero_is_no_window: bool = False) -> Callable[[int], Attention]:
  """Each layer's attention, exactly as transformers' ``Qwen2Config`` decides,
  as a function of the layer count (called by `llama_plan` once the count is
  checked against the weights; the fields are read and checked here).

  The window is ``sliding_window`` (default 4096) only if
  ``use_sliding_window`` is true; it applies to the layers ``layer_types``
  marks ``"sliding_attention"``; without ``layer_types`` (configs written by
  transformers 4), to the layers ``sliding(layer, max_window_layers)``
  picks (`qwen2_sliding`: ``max_window_layers``, default 28, and above).
  A layer marked sliding with no window is refused, as transformers fails
  on it. ``zero_is_no_window``: a ``sliding_window`` of 0 beside a false
  ``use_sliding_window`` means no window (Qwen2-MoE's config class writes
  it); elsewhere it is refused as a window of no tokens. (Windows apply in full-sequence calls and in Penzai's KV-cache
  sampling mode alike.)
  """
  layers = cfg.require("num_hidden_layers")
  use_window = cfg.get("use_sliding_window", False)
  # Absent: transformers' default window; an explicit null: no window.
  if zero_is_no_window and not use_window and cfg.raw.get("sliding_window") == 0:
    cfg.used.add("sliding_window")  # Qwen2-MoE's class writes 0 for "no window".
    window = None
  else:
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
        "sliding_attention" if window is not None and sliding(i, first_sliding)
        else "full_attention"
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


def window_fields(model: pz.nn.Layer, like: Mapping[str, Any], derive_first: bool = True
                  ) -> dict[str, Any]:
  """Qwen2's window and ``layer_types`` (which transformers 5 reads), with
  ``max_window_layers`` for readers of transformers 4 configs when the
  sliding layers are the last ones (as that field can say; not
  ``derive_first``: like's alone, for a family whose rule differs)."""
  found = windows(model)
  window = next((w for w in found if w is not None), None)
  types = layer_types(found)
  fields: dict[str, Any] = {
      "use_sliding_window": window is not None,
      "sliding_window": window,
      "layer_types": types,
  }
  if window is None or not derive_first:  # Then it changes nothing: like's, if any.
    if "max_window_layers" in like:
      fields["max_window_layers"] = like["max_window_layers"]
  elif "full_attention" not in types[(first := types.index("sliding_attention")):]:
    fields["max_window_layers"] = first
  return fields
