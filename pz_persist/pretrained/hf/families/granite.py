"""IBM Granite 3 checkpoints (``model_type`` ``granite``).

Granite is Llama's layout (`pz_persist.pretrained.hf.building.decoder`) with
four constants, each a `ConstantScale` layer holding the config's number:
``embedding_multiplier`` after the embedding lookup, ``residual_multiplier``
at the end of each residual branch (attention and MLP), ``attention_multiplier``
instead of Llama's ``1 / sqrt(head_dim)`` query scaling, and the logits
divided by ``logits_scaling``. The layers are there even when a constant is
1, so that the structure says "Granite" to ``export_hf``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist.nn.constant_scale import ConstantScale
from pz_persist.pretrained.errors import ExportError
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention as first_attention
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                "logits_scaling")


def granite_plan(cfg: Config, weights: Weights) -> Plan:
  """Llama's mapping (biases from ``attention_bias`` / ``mlp_bias``) with
  Granite's four constants (each defaults to 1, as in transformers)."""
  scales = {name: float(cfg.get(name, 1.0)) for name in _MULTIPLIERS}
  plan = llama_plan(cfg, weights)
  return Plan(lambda: with_granite_scales(plan.build(), **scales), plan.tensors)


def with_granite_scales(
    model: model_parts.TransformerLM,
    embedding_multiplier: float,
    residual_multiplier: float,
    attention_multiplier: float,
    logits_scaling: float,
) -> model_parts.TransformerLM:
  """A llama-like ``model`` with Granite's constants in place."""
  body = model.body.sublayers
  lookup = next(i for i, layer in enumerate(body) if isinstance(layer, pz.nn.EmbeddingLookup))
  body = [*body[:lookup + 1], ConstantScale(embedding_multiplier), *body[lookup + 1:],
          ConstantScale(logits_scaling, divide=True)]
  model = dataclasses.replace(model, body=dataclasses.replace(model.body, sublayers=body))
  model = (pz.select(model).at_instances_of(model_parts.TransformerBlock)
           .at_instances_of(pz.nn.Residual)
           .apply(lambda residual: dataclasses.replace(residual, delta=pz.nn.Sequential(
               [*residual.delta.sublayers, ConstantScale(residual_multiplier)]))))
  return (pz.select(model).at_instances_of(pz.nn.Attention).at(lambda a: a.input_to_query)
          .at_instances_of(pz.nn.ConstantRescale).set(ConstantScale(attention_multiplier)))


def _detect(model: pz.nn.Layer) -> str | None:
  """A `ConstantScale` right after the embedding lookup."""
  body = getattr(getattr(model, "body", None), "sublayers", ())
  return "granite" if any(
      isinstance(a, pz.nn.EmbeddingLookup) and isinstance(b, ConstantScale)
      for a, b in zip(body, body[1:])) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only granite.
  body = model.body.sublayers
  lookup = next(i for i, layer in enumerate(body) if isinstance(layer, pz.nn.EmbeddingLookup))
  block = next(iter(all_layers(model, model_parts.TransformerBlock)))
  residual = all_layers(block, pz.nn.Residual)[0].delta.sublayers[-1]
  query = all_layers(first_attention(model).input_to_query, ConstantScale)
  biases = model_biases(model)
  return without_default_head_dim({
      **llamalike_fields(model, like),
      "attention_bias": biases.query_key_value or biases.output,
      "mlp_bias": biases.mlp,
      "embedding_multiplier": _scale(body[lookup + 1], "after the embedding lookup"),
      "residual_multiplier": _scale(residual, "at the end of the first residual branch"),
      "attention_multiplier": _scale(query[0] if query else None, "in the query projection"),
      "logits_scaling": _scale(body[-1], "after the output head"),
  })


def _scale(layer: pz.nn.Layer, where: str) -> float:
  """The number of Granite's `ConstantScale` ``layer``; the model is not
  Granite's layout if it is not one."""
  if not isinstance(layer, ConstantScale):
    raise ExportError(f"the model has no ConstantScale {where} (it has {type(layer).__name__}),"
                      " so it is not Granite's layout; name the right family with like=, or"
                      " undo the edit that removed it.")
  return layer.by


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "granite": {
        "defaults": {**LLAMA_LIKE, "mlp_bias": False, "embedding_multiplier": 1.0,
                     "logits_scaling": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
                     "max_position_embeddings": 2048},
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Granite 3",
    model_types={"granite": ModelType(granite_plan, "GraniteForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["granite"])},
    detect=_detect,
    write_config=_write_config,
    adds=("Llama's layout with `embedding_multiplier`, `residual_multiplier`,"
          " `attention_multiplier` and `logits_scaling` (`ConstantScale`)"),
    refuses="what Llama refuses; Granite MoE and hybrid models (other `model_type`s)",
    rank=12,
    fields=dict.fromkeys(_MULTIPLIERS, POSITIVE_NUMBER),
)
