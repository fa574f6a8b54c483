"""Shared code (no record): Granite's four constants (Granite 3, Granite 4),
each a `ConstantScale` layer holding the config's number: ``embedding_multiplier``
after the embedding lookup, ``residual_multiplier`` at the end of each residual
branch (attention or mixer, and MLP), ``attention_multiplier`` instead of
Llama's ``1 / sqrt(head_dim)`` query scaling, and the logits divided by
``logits_scaling``."""

from __future__ import annotations

import dataclasses

from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist.nn.constant_scale import ConstantScale
from pz_persist.pretrained.errors import ExportError

MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
               "logits_scaling")
"""The constants' ``config.json`` fields (each defaults to 1 in transformers)."""


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


def scale_fields(model: pz.nn.Layer) -> dict[str, float]:
  """The four constants of a model in Granite's layout (its first block's
  residual and, if it has attention, its first attention's query scale;
  ``attention_multiplier`` 1 when it has none, as it then changes nothing)."""
  body = model.body.sublayers
  lookup = next(i for i, layer in enumerate(body) if isinstance(layer, pz.nn.EmbeddingLookup))
  block = pz.select(model).at_instances_of(model_parts.TransformerBlock).get_sequence()[0]
  residual = pz.select(block).at_instances_of(pz.nn.Residual).get_sequence()[0].delta.sublayers[-1]
  attentions = pz.select(model).at_instances_of(pz.nn.Attention).get_sequence()
  fields = {
      "embedding_multiplier": _scale(body[lookup + 1], "after the embedding lookup"),
      "residual_multiplier": _scale(residual, "at the end of the first residual branch"),
      "logits_scaling": _scale(body[-1], "after the output head"),
      "attention_multiplier": 1.0,
  }
  if attentions:
    query = pz.select(attentions[0].input_to_query).at_instances_of(ConstantScale).get_sequence()
    fields["attention_multiplier"] = _scale(query[0] if query else None, "in the query projection")
  return fields


def _scale(layer: pz.nn.Layer | None, where: str) -> float:
  """The number of Granite's `ConstantScale` ``layer``; the model is not
  Granite's layout if it is not one."""
  if not isinstance(layer, ConstantScale):
    raise ExportError(f"the model has no ConstantScale {where} (it has {type(layer).__name__}),"
                      " so it is not Granite's layout; name the right family with like=, or"
                      " undo the edit that removed it.")
  return layer.by
