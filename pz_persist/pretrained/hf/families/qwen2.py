"""Qwen2 and Qwen2.5 checkpoints (``model_type`` ``qwen2``).

Qwen2 is Llama's layout (`pz_persist.pretrained.hf.families.llama`) with a
bias on the query, key and value projections (none on the output projection
or in the MLP) and its own way of choosing which layers attend through a
sliding window.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config_from_model import layer_types
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.families.family_defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.families.family_defaults import NO_BIASES
from pz_persist.pretrained.hf.families.family_defaults import QWEN_WINDOW
from pz_persist.pretrained.hf.families.family_defaults import QWEN_WINDOW_WHY
from pz_persist.pretrained.hf.families.llama import Attention
from pz_persist.pretrained.hf.families.llama import Biases
from pz_persist.pretrained.hf.families.llama import llama_plan
from pz_persist.pretrained.hf.families.llama import model_biases
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
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


def window_fields(model: Any, like: Mapping[str, Any]) -> dict[str, Any]:
  """Qwen2's window and ``layer_types`` (which transformers 5 reads), with
  ``max_window_layers`` for readers of transformers 4 configs when the
  sliding layers are the last ones (as that field can say)."""
  found = windows(model)
  window = next((w for w in found if w is not None), None)
  types = layer_types(found)
  fields: dict[str, Any] = {
      "use_sliding_window": window is not None,
      "sliding_window": window,
      "layer_types": types,
  }
  if window is None:  # Then it changes nothing: like's, if any.
    if "max_window_layers" in like:
      fields["max_window_layers"] = like["max_window_layers"]
  elif "full_attention" not in types[(first := types.index("sliding_attention")):]:
    fields["max_window_layers"] = first
  return fields


def without_default_head_dim(fields: dict[str, Any]) -> dict[str, Any]:
  """transformers' Qwen2 config has no ``head_dim`` field (its attention
  falls back to hidden_size // heads): written only when it is another size."""
  if fields["head_dim"] * fields["num_attention_heads"] == fields["hidden_size"]:
    del fields["head_dim"]
  return fields


def _detect(model: Any) -> str | None:
  return "qwen2" if model_biases(model) == Biases(query_key_value=True) else None


def _write_config(model: Any, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only qwen2.
  return without_default_head_dim({**llamalike_fields(model, like), **window_fields(model, like)})


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": {
        "defaults": {**LLAMA_LIKE, **QWEN_WINDOW, "use_mrope": False,
                     "max_position_embeddings": 32768},
        "defaults_why": {
            **QWEN_WINDOW_WHY,
            "attention_bias": NO_BIASES,
            "use_mrope": (
                "Qwen2-VL's field, which transformers' Qwen2 does not have; pz_persist "
                'refuses true'),
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Qwen2, Qwen2.5",
    model_types={"qwen2": ModelType(qwen2_plan, "Qwen2ForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["qwen2"])},
    detect=_detect,
    write_config=_write_config,
    adds=("query/key/value biases; `use_sliding_window`, `sliding_window`, `max_window_layers`,"
          " `layer_types` per layer as transformers maps them; scaled RoPE"),
    refuses="`use_mrope` (Qwen2-VL)",
    rank=40,
)
