"""The Hugging Face ``config.json`` a Penzai transformer's structure says.

Export's first step (`pz_persist.pretrained.hf.export.export_hf`): sizes from
the parameter shapes, epsilons from the norm layers, RoPE wavelength and
scaling from the rotary layers, windows from the mask layers, biases, soft
caps, the activation and tied embeddings, one function per group of fields
(`FIELD_GROUPS`). What it derives is then checked by rebuilding the family's
own load plan from it (`pz_persist.pretrained.hf.structure_match`), so a
wrong guess here is refused there, never written.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist import errors
from pz_persist.pretrained.hf.config import IGNORED_FIELDS
from pz_persist.pretrained.hf.config import TANH_GELU
from pz_persist.pretrained.hf.families import gpt_neox
from pz_persist.pretrained.hf.families.gemma_native import NATIVE_BUILDERS
from pz_persist.pretrained.hf.families.llama import Biases
from pz_persist.pretrained.layers.scaled_rope import ApplyScaledRoPE

ExportError = errors.ExportError


GEMMA_FAMILIES = tuple(NATIVE_BUILDERS)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}


# --- what the model is ------------------------------------------------------


def all_layers(model: Any, cls: type) -> list[Any]:
  return list(pz.select(model).at_instances_of(cls).get_sequence())


def first_layer(model: Any, cls: type, what: str) -> Any:
  found = all_layers(model, cls)
  if not found:
    raise ExportError(f"the model has no {cls.__name__} layer ({what}); only Penzai"
                      " transformer language models can be exported to Hugging Face.")
  return found[0]


def _named_shape(layer: Any) -> dict[str, int]:
  """The named shape of a ``Linear`` / ``EmbeddingTable`` / scale parameter."""
  param = layer.weights if hasattr(layer, "weights") else layer.embeddings
  return dict(param.value.named_shape)


def _attention(model: Any) -> pz.nn.Attention:
  return first_layer(model, pz.nn.Attention, "attention")


def _projection(part: Any) -> dict[str, int]:
  return _named_shape(first_layer(part, pz.nn.Linear, "attention projection"))


def _head_count(shape: Mapping[str, int]) -> int:
  return math.prod(size for axis, size in shape.items()
                   if axis in ("heads", "head_groups", "query_heads"))


def _number(value: Any) -> float:
  """A float field as it was written: the shortest decimal that gives
  ``value`` back at its own precision (a float32 epsilon of 1e-06 is written
  1e-06, not 9.999999974752427e-07)."""
  return float(str(np.asarray(value)[()]))


def family_from_structure(model: Any) -> str:
  """The family whose layout the model has, when ``like`` does not say."""
  if all_layers(model, pz.nn.ApplyRoPEToSubset) or all_layers(model, pz.nn.Standardize):
    return "gpt_neox"
  if all_layers(model, pz.nn.EmbeddingDecode):  # Gemma 2 adds norms after attention and MLP.
    block = first_layer(model, model_parts.TransformerBlock, "decoder block")
    return "gemma2" if len(all_layers(block, pz.nn.RMSLayerNorm)) > 2 else "gemma"
  if _biases(model) == Biases(query_key_value=True):
    return "qwen2"
  return "mistral" if all_layers(model, pz.nn.ApplyCausalSlidingWindowAttentionMask) else "llama"


def _biases(model: Any) -> Biases:
  """Which projections of the first block add a bias (``AddBias`` layers,
  as `pz_persist.pretrained.hf.families.llama.Biases` places them); the
  other blocks are compared with the plan built from these."""
  attention = _attention(model)
  ffw = first_layer(model, model_parts.TransformerFeedForward, "MLP")
  return Biases(query_key_value=bool(all_layers(attention.input_to_query, pz.nn.AddBias)),
                output=bool(all_layers(attention.attn_value_to_output, pz.nn.AddBias)),
                mlp=bool(all_layers(ffw, pz.nn.AddBias)))


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

# The Hugging Face names the llama-like families read for Penzai activations:
# one spelling of ``like`` that computes the same is kept.
_LLAMALIKE_ACTIVATIONS = {"silu": "silu", **dict.fromkeys(TANH_GELU, "gelu_approx")}


def _activation(model: Any) -> str:
  """The name of the MLP's activation (an ``Elementwise`` layer)."""
  ffw = first_layer(model, model_parts.TransformerFeedForward, "MLP")
  fn = first_layer(ffw, pz.nn.Elementwise, "MLP activation").fn
  for name, known in _ACTIVATIONS.items():
    if fn is known or (isinstance(fn, functools.partial) and isinstance(known, functools.partial)
                       and fn.func is known.func and fn.args == known.args
                       and fn.keywords == known.keywords):
      return name
  raise ExportError(f"the MLP activation {fn!r} has no Hugging Face name; supported:"
                    f" {sorted(_ACTIVATIONS)}.")


# --- the config, one function per group of fields ----------------------------
#
# Each takes the model, the family and the ``like`` config and returns the
# fields it derives. The plan run on the result rebuilds the model's skeleton,
# which is compared with the model, so a field derived wrongly is refused,
# never written.


def _size_fields(model: Any, family: str, like: Mapping[str, Any]) -> dict[str, Any]:
  embed = _named_shape(first_layer(model, pz.nn.EmbeddingTable, "token embeddings"))
  attention = _attention(model)
  query, key = _projection(attention.input_to_query), _projection(attention.input_to_key)
  ffw = first_layer(model, model_parts.TransformerFeedForward, "MLP")
  fields = {
      "hidden_size": embed["embedding"],
      "vocab_size": embed["vocabulary"],
      "num_attention_heads": _head_count(query),
      "intermediate_size": _named_shape(first_layer(ffw, pz.nn.Linear, "MLP"))["neurons"],
      "num_hidden_layers": len(all_layers(model, model_parts.TransformerBlock)),
  }
  if family != "gpt_neox":
    fields["num_key_value_heads"] = _head_count(key) or 1
    fields["head_dim"] = query["projection"]
  # transformers' Qwen2 config has no head_dim field (its attention falls back
  # to hidden_size // heads): written only when it is another size.
  if family == "qwen2" and fields["head_dim"] * fields["num_attention_heads"] == fields["hidden_size"]:
    del fields["head_dim"]
  return fields


def _norm_fields(model: Any, family: str, like: Mapping[str, Any]) -> dict[str, Any]:
  if family == "gpt_neox":
    return {"layer_norm_eps": _number(first_layer(model, pz.nn.Standardize, "layer norm").epsilon)}
  return {"rms_norm_eps": _number(first_layer(model, pz.nn.RMSStandardize, "RMS norm").epsilon)}


def _rope_fields(model: Any, family: str, like: Mapping[str, Any]) -> dict[str, Any]:
  """``rope_parameters`` as transformers 5 writes them: ``rope_theta`` and
  ``rope_type``, and for a scaled RoPE (`ApplyScaledRoPE`) the layer's own
  scaling keys (and ``max_position_embeddings``, which ``dynamic`` reads)."""
  scaled = all_layers(model, ApplyScaledRoPE)
  if scaled:
    fields = scaled[0].config_fields()
    scaling = {"rope_theta": float(fields.pop("rope_theta")), **fields.pop("rope_scaling")}
    return {"rope_parameters": scaling, **fields}
  rope = (all_layers(model, pz.nn.ApplyRoPE) + all_layers(model, pz.nn.ApplyRoPEToSubset))
  if not rope:
    raise ExportError("the model has no rotary position embedding layer (ApplyRoPE);"
                      " every family export_hf writes uses RoPE.")
  params: dict[str, Any] = {"rope_theta": float(rope[0].max_wavelength), "rope_type": "default"}
  if isinstance(rope[0], pz.nn.ApplyRoPEToSubset):
    head_dim = _projection(_attention(model).input_to_query)["projection"]
    params["partial_rotary_factor"] = rope[0].rope_subset_size / head_dim
  return {"rope_parameters": params}


def _attention_fields(model: Any, family: str, like: Mapping[str, Any]) -> dict[str, Any]:
  """The attention window(s), and Gemma 2's soft cap and query scaling."""
  blocks = all_layers(model, model_parts.TransformerBlock)
  windows = [
      masks[0].sliding_window_size if (
          masks := all_layers(block, pz.nn.ApplyCausalSlidingWindowAttentionMask)) else None
      for block in blocks
  ]
  window = next((w for w in windows if w is not None), None)
  types = ["full_attention" if w is None else "sliding_attention" for w in windows]
  if family == "mistral":
    return {"sliding_window": windows[0]}
  if family == "qwen2":
    return _qwen2_window_fields(window, types, like)
  if family != "gemma2":
    return {}
  fields = {
      "sliding_window": like.get("sliding_window", 4096) if window is None else window,
      "layer_types": types,
      "query_pre_attn_scalar": _query_pre_attn_scalar(model),
  }
  # Written when absent too: a null cap is "off", an absent one a default.
  caps = all_layers(_attention(model), pz.nn.TanhSoftCap)
  fields["attn_logit_softcapping"] = _number(caps[0].soft_cap) if caps else None
  return fields


def _qwen2_window_fields(window: int | None, types: list[str],
                         like: Mapping[str, Any]) -> dict[str, Any]:
  """Qwen2's window and ``layer_types`` (which transformers 5 reads), with
  ``max_window_layers`` for readers of transformers 4 configs when the
  sliding layers are the last ones (as that field can say)."""
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


def _query_pre_attn_scalar(model: Any) -> int | float:
  """Gemma 2 scales queries by ``query_pre_attn_scalar ** -0.5``."""
  rescale = first_layer(_attention(model).input_to_query, pz.nn.ConstantRescale, "query scaling")
  scalar = float(np.asarray(rescale.by, np.float64)) ** -2
  return round(scalar) if abs(scalar - round(scalar)) < 1e-3 * scalar else scalar


def _mlp_fields(model: Any, family: str, like: Mapping[str, Any]) -> dict[str, Any]:
  activation = _activation(model)
  key = "hidden_activation" if family == "gemma2" else "hidden_act"
  name = _HF_ACTIVATIONS[activation]
  # ``like``'s own spelling when it means the same (gelu_fast / gelu_pytorch_tanh).
  spellings = (gpt_neox._NEOX_ACTIVATIONS if family == "gpt_neox"  # pylint: disable=protected-access
               else _LLAMALIKE_ACTIVATIONS)
  if spellings.get(like.get(key, "")) == activation:
    name = like[key]
  return {key: name}


def _head_fields(model: Any, family: str, like: Mapping[str, Any]) -> dict[str, Any]:
  """``tie_word_embeddings``: Penzai's Gemma decodes with its embedding table;
  the others are tied when their output head holds exactly the embeddings
  (unless ``like`` says ``tie_word_embeddings: false``)."""
  if family in GEMMA_FAMILIES:
    return {"tie_word_embeddings": True}
  embeddings = first_layer(model, pz.nn.EmbeddingTable, "token embeddings").embeddings.value
  linears = all_layers(model, pz.nn.Linear)
  head = linears[-1].weights.value if linears else None
  tied = (head is not None and like.get("tie_word_embeddings", True) is not False
          and head.named_shape == embeddings.named_shape and head.dtype == embeddings.dtype
          and bool(jnp.array_equal(head.unwrap("vocabulary", "embedding"),
                                   embeddings.unwrap("vocabulary", "embedding"))))
  return {"tie_word_embeddings": tied}


def _gemma_fields(model: Any, family: str, like: Mapping[str, Any]) -> dict[str, Any]:
  if family != "gemma2":
    return {}
  top = [layer for layer in model.body.sublayers if isinstance(layer, pz.nn.TanhSoftCap)]
  return {"final_logit_softcapping": _number(top[-1].soft_cap) if top else None}


def _fixed_fields(model: Any, family: str, like: Mapping[str, Any]) -> dict[str, Any]:
  """Llama's biases (``AddBias`` layers after the projections), and the
  fields the other families' Penzai structure fixes (none in Mistral's and
  Qwen2's configs; no biases in Gemma; GPT-NeoX's parallel residual and
  attention biases)."""
  if family == "llama":
    biases = _biases(model)
    return {"attention_bias": biases.query_key_value or biases.output, "mlp_bias": biases.mlp}
  if family in ("mistral", "qwen2"):
    return {}
  if family in GEMMA_FAMILIES:
    return {"attention_bias": False}
  return {"attention_bias": True, "use_parallel_residual": True}


FIELD_GROUPS: tuple[Callable[[Any, str, Mapping[str, Any]], dict[str, Any]], ...] = (
    _size_fields, _norm_fields, _rope_fields, _attention_fields, _mlp_fields,
    _head_fields, _gemma_fields, _fixed_fields,
)
"""The functions deriving ``config.json`` from the model, one per group of fields."""


def derive_config(model: Any, family: str, like: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """The ``config.json`` of ``model`` as family ``family``.

  The fields that do not change the math (`IGNORED_FIELDS`: token ids,
  ``architectures``, ``max_position_embeddings``...) are copied from
  ``like``; every other field is derived from the model.
  """
  like = dict(like or {})
  config = {k: v for k, v in like.items() if k in IGNORED_FIELDS}
  for group in FIELD_GROUPS:
    config.update(group(model, family, like))
  config["model_type"] = family
  if like.get("model_type") != family or "architectures" not in config:
    config["architectures"] = [ARCHITECTURES.get(family, "ForCausalLM")]
  embeddings = first_layer(model, pz.nn.EmbeddingTable, "token embeddings").embeddings.value
  config.pop("torch_dtype", None)
  config["dtype"] = np.dtype(embeddings.dtype).name
  return dict(sorted(config.items()))
