"""Shared code (no record): ``clip_qkv`` (OLMoE; OLMo and DBRX have it
too), the query, key and value clamped to ``[-clip_qkv, clip_qkv]`` after
their projections (and biases, and the query/key norms), before RoPE, as
transformers' ``OlmoeAttention`` does: a `pz_persist.nn.clip_values.ClipValues`
in each of Penzai's three input branches."""

from __future__ import annotations

import dataclasses
import math

from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist.nn.clip_values import ClipValues
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention

_BEFORE = (pz.nn.Linear, pz.nn.AddBias, pz.nn.RMSLayerNorm)
"""What comes before the clip in a branch: the projection, its bias, its norm."""


POSITIVE_NUMBER = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(v) and v > 0, "a positive number")
"""The schema of ``clip_qkv`` (a family's ``fields``); null means no clipping."""


def read_clip_qkv(cfg: Config) -> float | None:
  """``clip_qkv``: None (no clipping) or a positive number (checked by the
  family's schema, `POSITIVE_NUMBER`)."""
  return cfg.nullable("clip_qkv", FROM_TABLE)


def with_clipped_qkv(model: model_parts.TransformerLM, limit: float | None
                     ) -> model_parts.TransformerLM:
  """``model`` with a ``ClipValues(limit)`` in each attention's query, key
  and value branch after the projection, bias and norm (unchanged if
  ``limit`` is None)."""
  if limit is None:
    return model

  def clipped(branch: pz.nn.Sequential) -> pz.nn.Sequential:
    layers = list(branch.sublayers)
    at = next((i for i, layer in enumerate(layers) if not isinstance(layer, _BEFORE)),
              len(layers))
    return dataclasses.replace(branch, sublayers=[*layers[:at], ClipValues(limit=limit),
                                                  *layers[at:]])

  def add(attn: pz.nn.Attention) -> pz.nn.Attention:
    return dataclasses.replace(attn, input_to_query=clipped(attn.input_to_query),
                               input_to_key=clipped(attn.input_to_key),
                               input_to_value=clipped(attn.input_to_value))

  return pz.select(model).at_instances_of(pz.nn.Attention).apply(add)


def clip_qkv_field(model: pz.nn.Layer) -> dict[str, float | None]:
  """``clip_qkv`` of a model: its first attention's clip limit, or None."""
  found = all_layers(attention(model), ClipValues)
  return {"clip_qkv": found[0].limit if found else None}
