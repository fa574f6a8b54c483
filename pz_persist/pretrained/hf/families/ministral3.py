"""Ministral 3 checkpoints (``model_type`` ``ministral3``).

Ministral 3 is Mistral's layout (`pz_persist.pretrained.hf.building.decoder`,
no biases, untied or tied embeddings, an optional window; transformers'
default is none) with yarn-scaled RoPE and Llama 4's position-dependent
query scaling: after RoPE each query is multiplied by ``1 + beta * log(1 +
floor(p / original_max_position_embeddings))``
(`pz_persist.nn.position_query_scale.PositionQueryScale`),
with ``beta`` = ``rope_parameters.llama_4_scaling_beta``. transformers
reads both from ``rope_parameters`` and needs both there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.position_query_scale import PositionQueryScale
from pz_persist.nn.scaled_rope import ApplyScaledRoPE
from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.defaults import NO_BIASES
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_BETA = "llama_4_scaling_beta"


def ministral3_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Ministral 3 checkpoint (transformers' ``Ministral3Config``
  defaults: ``head_dim`` 128, 262144 positions, no window)."""
  params = cfg.raw.get("rope_parameters")
  if not isinstance(params, dict) or _BETA not in params:
    raise cfg.unsupported("rope_parameters", params, f"Ministral 3 needs {_BETA!r} (and"
                          " 'original_max_position_embeddings') in rope_parameters, where"
                          " transformers reads them")
  beta = cfg.checked(f"rope_parameters.{_BETA}", params[_BETA])
  # transformers ignores rope_parameters.max_position_embeddings (it reads the top-level one).
  cfg.raw["rope_parameters"] = {k: v for k, v in params.items()
                                if k not in (_BETA, "max_position_embeddings")}
  original = cfg.raw["rope_parameters"].get("original_max_position_embeddings")
  if original is None:
    raise cfg.unsupported("rope_parameters.original_max_position_embeddings", None,
                          "Ministral 3's query scaling divides positions by it")
  cfg.checked("rope_parameters.original_max_position_embeddings", original)
  for key in ("attention_bias", "mlp_bias"):
    if cfg.get(key):
      raise cfg.unsupported(key, True, "Ministral 3's projections have no biases")
  window = cfg.nullable("sliding_window", None)
  kind = (llamalike_common.AttentionTypeGlobalCausal() if window is None
          else llamalike_common.AttentionTypeSlidingWindowCausal(window))

  def edit(model: model_parts.TransformerLM,
           config: llamalike_common.LlamalikeTransformerConfig) -> model_parts.TransformerLM:
    del config
    scale = PositionQueryScale(beta=beta, original_max_position_embeddings=original)

    def add(attn: pz.nn.Attention) -> pz.nn.Attention:
      layers = list(attn.input_to_query.sublayers)
      at = next(i for i, layer in enumerate(layers)
                if isinstance(layer, (pz.nn.ApplyRoPE, ApplyScaledRoPE))) + 1
      return dataclasses.replace(attn, input_to_query=dataclasses.replace(
          attn.input_to_query, sublayers=[*layers[:at], scale, *layers[at:]]))

    return pz.select(model).at_instances_of(pz.nn.Attention).apply(add)

  return llama_plan(cfg, weights, attention=lambda layers: kind, biases=Biases(),
                    head_dim_default=128, max_positions_default=262_144, edit=edit)


def _detect(model: pz.nn.Layer) -> str | None:
  """Llama's layout with a position-dependent query scale."""
  return "ministral3" if all_layers(model, PositionQueryScale) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only ministral3.
  fields = llamalike_fields(model, like)
  scale = all_layers(model, PositionQueryScale)[0]
  fields["rope_parameters"] = {**fields["rope_parameters"], _BETA: scale.beta,
                               "original_max_position_embeddings":
                                   scale.original_max_position_embeddings}
  fields["sliding_window"] = windows(model)[0]
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "ministral3": {
        "defaults": {**LLAMA_LIKE, "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0,
                     "sliding_window": None, "head_dim": 128, "max_position_embeddings": 262_144},
        "defaults_why": {
            "attention_bias": NO_BIASES,
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Ministral 3",
    model_types={"ministral3": ModelType(ministral3_plan, "Ministral3ForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["ministral3"])},
    detect=_detect,
    write_config=_write_config,
    adds=("Mistral's layout with Llama 4's position-dependent query scaling"
          " (`rope_parameters.llama_4_scaling_beta`) and yarn-scaled RoPE"),
    refuses="biases; query scaling without `original_max_position_embeddings`",
    rank=800,
    fields={_BETA: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                    and v >= 0 and v < float("inf"), "a non-negative finite number")},
)
