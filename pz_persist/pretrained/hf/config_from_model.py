"""The Hugging Face ``config.json`` a Penzai transformer's structure says.

Export's first step (`pz_persist.pretrained.hf.export.export_hf`): each
family's record (`pz_persist.pretrained.hf.record.Family.write_config`)
derives its fields from the model with the shared pieces here (sizes from the
parameter shapes, epsilons from the norm layers, RoPE wavelength and scaling
from the rotary layers, windows from the mask layers, the activation, tied
embeddings); `derive_config` adds what every family writes. What it derives
is then checked by rebuilding the family's own load plan from it
(`pz_persist.pretrained.hf.structure_match`), so a wrong guess here is
refused there, never written.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist.nn.longrope import ApplyLongRoPE
from pz_persist.nn.longrope import ApplyPhimoeLongRoPE
from pz_persist.nn.scaled_rope import ApplyScaledRoPE
from pz_persist.pretrained import errors
from pz_persist.pretrained.hf.config import IGNORED_FIELDS
from pz_persist.pretrained.hf.config import TANH_GELU
from pz_persist.pretrained.hf.record import Family

# --- what the model is ------------------------------------------------------


def all_layers(model: pz.nn.Layer, cls: type) -> list[Any]:
  return list(pz.select(model).at_instances_of(cls).get_sequence())


def first_layer(model: pz.nn.Layer, cls: type, what: str) -> Any:
  found = all_layers(model, cls)
  if not found:
    raise errors.ExportError(f"the model has no {cls.__name__} layer ({what}); only Penzai"
                      " transformer language models can be exported to Hugging Face.")
  return found[0]


def named_shape(layer: Any) -> dict[str, int]:
  """The named shape of a ``Linear`` / ``EmbeddingTable`` / scale parameter."""
  param = layer.weights if hasattr(layer, "weights") else layer.embeddings
  return dict(param.value.named_shape)


def attention(model: pz.nn.Layer) -> pz.nn.Attention:
  """The first block's attention."""
  return first_layer(model, pz.nn.Attention, "attention")


def blocks(model: pz.nn.Layer) -> list[model_parts.TransformerBlock]:
  return all_layers(model, model_parts.TransformerBlock)


def projection(part: pz.nn.Layer) -> dict[str, int]:
  """The named shape of the first ``Linear`` in ``part``."""
  return named_shape(first_layer(part, pz.nn.Linear, "attention projection"))


def _head_count(shape: Mapping[str, int]) -> int:
  return math.prod(size for axis, size in shape.items()
                   if axis in ("heads", "head_groups", "query_heads"))


def number(value: object) -> float:
  """A float field as it was written: the shortest decimal that gives
  ``value`` back at its own precision (a float32 epsilon of 1e-06 is written
  1e-06, not 9.999999974752427e-07)."""
  return float(str(np.asarray(value)[()]))


_ACTIVATIONS = {  # Penzai's activation functions by the names its builders use.
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_approx": functools.partial(jax.nn.gelu, approximate=True),
}

# Hugging Face's name for each Penzai activation (the first of those the
# family's plan accepts; ``like`` may name another that maps to the same).
_HF_ACTIVATIONS = {
    "silu": "silu", "relu": "relu", "gelu_exact": "gelu", "gelu_approx": "gelu_pytorch_tanh",
}

LLAMALIKE_ACTIVATIONS = {"silu": "silu", **dict.fromkeys(TANH_GELU, "gelu_approx")}
"""The Hugging Face names the llama-like families read, by the Penzai
activation each computes: ``like``'s spelling is kept when it means the same."""


def activation(model: pz.nn.Layer) -> str:
  """The name of the MLP's activation (an ``Elementwise`` layer)."""
  ffw = first_layer(model, model_parts.TransformerFeedForward, "MLP")
  fn = first_layer(ffw, pz.nn.Elementwise, "MLP activation").fn
  for name, known in _ACTIVATIONS.items():
    if fn is known or (isinstance(fn, functools.partial) and isinstance(known, functools.partial)
                       and fn.func is known.func and fn.args == known.args
                       and fn.keywords == known.keywords):
      return name
  raise errors.ExportError(f"the MLP activation {fn!r} has no Hugging Face name; supported:"
                    f" {sorted(_ACTIVATIONS)}.")


# --- the shared groups of fields ----------------------------------------------
#
# A family's `Family.write_config` combines these with its own. The plan run
# on the result rebuilds the model's skeleton, which is compared with the
# model, so a field derived wrongly is refused, never written.


def size_fields(model: pz.nn.Layer, grouped: bool = True) -> dict[str, Any]:
  """Sizes from the parameter shapes; with ``grouped``, also
  ``num_key_value_heads`` and ``head_dim`` (llama-like families)."""
  embed = named_shape(first_layer(model, pz.nn.EmbeddingTable, "token embeddings"))
  attn = attention(model)
  query, key = projection(attn.input_to_query), projection(attn.input_to_key)
  ffw = first_layer(model, model_parts.TransformerFeedForward, "MLP")
  fields = {
      "hidden_size": embed["embedding"],
      "vocab_size": embed["vocabulary"],
      "num_attention_heads": _head_count(query),
      "intermediate_size": named_shape(first_layer(ffw, pz.nn.Linear, "MLP"))["neurons"],
      "num_hidden_layers": len(blocks(model)),
  }
  if grouped:
    fields["num_key_value_heads"] = _head_count(key) or 1
    fields["head_dim"] = query["projection"]
  return fields


def rms_norm_fields(model: pz.nn.Layer) -> dict[str, Any]:
  """``rms_norm_eps``: the first RMS norm's epsilon, or the first LayerNorm's
  (Phi-3.5-MoE keeps its LayerNorms' epsilon under that name)."""
  norms = all_layers(model, pz.nn.RMSStandardize) or all_layers(model, pz.nn.Standardize)
  norm = norms[0] if norms else first_layer(model, pz.nn.RMSStandardize, "RMS norm")
  return {"rms_norm_eps": number(norm.epsilon)}


def rope_fields(model: pz.nn.Layer) -> dict[str, Any]:
  """``rope_parameters`` as transformers 5 writes them: ``rope_theta`` and
  ``rope_type``, and for a scaled RoPE (`ApplyScaledRoPE`) the layer's own
  scaling keys (and ``max_position_embeddings``, which ``dynamic`` reads);
  for LongRoPE, `longrope_fields`."""
  longrope = all_layers(model, ApplyLongRoPE)
  if longrope:
    return longrope_fields(model, longrope[0])
  scaled = all_layers(model, ApplyScaledRoPE)
  if scaled:
    fields = scaled[0].config_fields()
    scaling = {"rope_theta": float(fields.pop("rope_theta")), **fields.pop("rope_scaling")}
    return {"rope_parameters": scaling, **fields}
  rope = (all_layers(model, pz.nn.ApplyRoPE) + all_layers(model, pz.nn.ApplyRoPEToSubset))
  if not rope:
    raise errors.ExportError("the model has no rotary position embedding layer (ApplyRoPE);"
                      " every family export_hf writes uses RoPE.")
  params: dict[str, Any] = {"rope_theta": float(rope[0].max_wavelength), "rope_type": "default"}
  if isinstance(rope[0], pz.nn.ApplyRoPEToSubset):
    head_dim = projection(attention(model).input_to_query)["projection"]
    params["partial_rotary_factor"] = rope[0].rope_subset_size / head_dim
  return {"rope_parameters": params}


def longrope_fields(model: pz.nn.Layer, layer: ApplyLongRoPE) -> dict[str, Any]:
  """``rope_parameters`` and the top-level fields of `ApplyLongRoPE` ``layer``:
  Phi-3's (long factors beyond the original context, one attention factor)
  or, for a layer keeping the short factors everywhere, Phi-3.5-MoE's
  (``short_mscale`` / ``long_mscale``, the attention factors within and
  beyond, and the recorded ``long_factor``)."""
  head_dim = projection(attention(model).input_to_query)["projection"]
  params: dict[str, Any] = {
      "rope_type": "longrope", "rope_theta": float(layer.max_wavelength),
      "short_factor": list(layer.short_factor), "long_factor": list(layer.long_factor),
      "partial_rotary_factor": (layer.rotary_dim or head_dim) / head_dim,
      # Where transformers 5 writes it too (the top-level one wins on reading).
      "original_max_position_embeddings": layer.original_max_position_embeddings,
  }
  fields: dict[str, Any] = {
      "rope_parameters": params,
      "original_max_position_embeddings": layer.original_max_position_embeddings}
  if isinstance(layer, ApplyPhimoeLongRoPE):
    within = layer.attention_scaling()
    beyond = layer.scaling_beyond()
    params.update(short_mscale=within, long_mscale=within if beyond is None else beyond)
    return fields
  if layer.factor is not None:
    params["factor"] = layer.factor
  if layer.attention_factor is not None:
    params["attention_factor"] = layer.attention_factor
  if layer.max_position_embeddings is not None:
    fields["max_position_embeddings"] = layer.max_position_embeddings
  return fields


def windows(model: pz.nn.Layer) -> list[int | None]:
  """Each block's attention window (None: global attention)."""
  return [
      masks[0].sliding_window_size if (
          masks := all_layers(block, pz.nn.ApplyCausalSlidingWindowAttentionMask)) else None
      for block in blocks(model)
  ]


def layer_types(found: list[int | None]) -> list[str]:
  """transformers' ``layer_types`` for the `windows` of the blocks."""
  return ["full_attention" if w is None else "sliding_attention" for w in found]


def activation_field(model: pz.nn.Layer, like: Mapping[str, Any], key: str = "hidden_act",
                     spellings: Mapping[str, str] = LLAMALIKE_ACTIVATIONS) -> dict[str, Any]:
  """The MLP's activation under ``key``; ``like``'s own spelling when it
  means the same (``gelu_fast`` / ``gelu_pytorch_tanh``)."""
  found = activation(model)
  name = _HF_ACTIVATIONS[found]
  if spellings.get(like.get(key, "")) == found:
    name = like[key]
  return {key: name}


def tied_field(model: pz.nn.Layer, like: Mapping[str, Any]) -> dict[str, Any]:
  """``tie_word_embeddings`` of a model with an untied head (a last
  ``Linear``): tied when it holds exactly the embeddings (unless ``like``
  says ``tie_word_embeddings: false``)."""
  embeddings = first_layer(model, pz.nn.EmbeddingTable, "token embeddings").embeddings.value
  linears = all_layers(model, pz.nn.Linear)
  head = linears[-1].weights.value if linears else None
  tied = (head is not None and like.get("tie_word_embeddings", True) is not False
          and head.named_shape == embeddings.named_shape and head.dtype == embeddings.dtype
          and bool(jnp.array_equal(head.unwrap("vocabulary", "embedding"),
                                   embeddings.unwrap("vocabulary", "embedding"))))
  return {"tie_word_embeddings": tied}


def llamalike_fields(model: pz.nn.Layer, like: Mapping[str, Any]) -> dict[str, Any]:
  """The fields every family on Llama's layout writes the same way: sizes,
  ``rms_norm_eps``, RoPE, ``hidden_act`` and ``tie_word_embeddings``."""
  return {**size_fields(model), **rms_norm_fields(model), **rope_fields(model),
          **activation_field(model, like), **tied_field(model, like)}


def derive_config(model: pz.nn.Layer, model_type: str, family: Family,
                  like: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """The ``config.json`` of ``model`` as ``model_type`` of ``family``.

  The fields that do not change the math (`IGNORED_FIELDS`: token ids,
  ``architectures``, ``max_position_embeddings``...) are copied from
  ``like``; every other field is derived from the model by the family's
  record.
  """
  like = dict(like or {})
  config = {k: v for k, v in like.items() if k in IGNORED_FIELDS}
  # transformers sizes nn.Embedding's padding_idx from pad_token_id, and some
  # config classes default it to an id of their tokenizer (Phi-3's 32000,
  # SmolLM3's 128004) that a smaller vocabulary does not hold: a folder
  # written without like= would not load. The model knows no pad id; null
  # says so (and changes no logit).
  config.setdefault("pad_token_id", None)
  config.update(family.write_config(model, model_type, like))
  config["model_type"] = model_type
  if like.get("model_type") != model_type or "architectures" not in config:
    config["architectures"] = [family.model_types[model_type].architecture]
  embeddings = first_layer(model, pz.nn.EmbeddingTable, "token embeddings").embeddings.value
  config.pop("torch_dtype", None)
  config["dtype"] = np.dtype(embeddings.dtype).name
  return dict(sorted(config.items()))
