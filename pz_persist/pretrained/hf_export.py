"""Penzai models back to Hugging Face folders, by running the load plan backwards.

`export_hf` writes ``config.json``, ``model-0000x-of-0000y.safetensors`` and
``model.safetensors.index.json`` with the family's own tensor names, for
``transformers``, vLLM and the llama.cpp converters to read.

There is no second mapping to keep in step with `load_hf`: the Hugging Face
config is derived from the model's structure (sizes from parameter shapes,
epsilons from the norm layers, the RoPE wavelength and scaling from
``ApplyRoPE`` / `ApplyScaledRoPE`, the attention windows from the mask
layers, biases from ``AddBias`` layers, ...), then the family's own load plan
(`pz_persist.pretrained.hf_families`) is run on that config and its skeleton
is compared with the model, layer by layer and field by field. Only a model
the plan would rebuild exactly is written, each tensor through
`pz_persist.pretrained.hf_plan.stored_layout`, the inverse of what
``load_hf`` reads through. So whatever the config says, ``load_hf`` of the
folder gives this model back, and what transformers computes from it is what
``load_hf``'s tests check against.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import sys
import tempfile
import uuid
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist import errors
from pz_persist import progress as progress_lib
from pz_persist.pretrained import hf
from pz_persist.pretrained import safetensors_io
from pz_persist.pretrained.hf_config import IGNORED_FIELDS
from pz_persist.pretrained.hf_config import TANH_GELU
from pz_persist.pretrained.hf_config import Config
from pz_persist.pretrained.hf_families import BUILDERS
from pz_persist.pretrained.hf_families import gpt_neox
from pz_persist.pretrained.hf_families.gemma_native import NATIVE_BUILDERS
from pz_persist.pretrained.hf_families.llama import Biases
from pz_persist.pretrained.hf_plan import LAYER_PREFIXES
from pz_persist.pretrained.hf_plan import Plan
from pz_persist.pretrained.hf_plan import TensorSpec
from pz_persist.pretrained.hf_plan import stored_layout
from pz_persist.pretrained.layers.scaled_rope import ApplyScaledRoPE
from pz_persist.safety import safe_io

ExportError = errors.ExportError

DEFAULT_SHARD_BYTES = 5 * 2**30
"""transformers' own default shard size (5 GB) for ``save_pretrained``."""

_LLAMALIKE = ("llama", "mistral")
_GEMMA = tuple(NATIVE_BUILDERS)

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}

# What a plan checks the weights hold before it builds anything: layers
# under the prefixes `check_layers` counts under (`LAYER_PREFIXES`), and the
# untied output heads `lm_head_source` asks for. The stand-in weights answer
# with these, for as many layers as the model has.
_HEAD_NAMES = ("lm_head.weight", "embed_out.weight")


def _plans() -> dict[str, list[Callable[..., Plan]]]:
  """Every family export can write, with the plans that may describe a
  model of it: what `load_hf` reads, then Penzai's own Gemma (as
  `load_gemma` builds it) for ``gemma`` / ``gemma2``."""
  plans: dict[str, list[Callable[..., Plan]]] = {}
  for table in (BUILDERS, NATIVE_BUILDERS):
    for family, plan in table.items():
      plans.setdefault(family, []).append(plan)
  return plans


# --- what the model is ------------------------------------------------------


def _all(model: Any, cls: type) -> list[Any]:
  return list(pz.select(model).at_instances_of(cls).get_sequence())


def _first(model: Any, cls: type, what: str) -> Any:
  found = _all(model, cls)
  if not found:
    raise ExportError(f"the model has no {cls.__name__} layer ({what}); only Penzai"
                      " transformer language models can be exported to Hugging Face.")
  return found[0]


def _named_shape(layer: Any) -> dict[str, int]:
  """The named shape of a ``Linear`` / ``EmbeddingTable`` / scale parameter."""
  param = layer.weights if hasattr(layer, "weights") else layer.embeddings
  return dict(param.value.named_shape)


def _attention(model: Any) -> pz.nn.Attention:
  return _first(model, pz.nn.Attention, "attention")


def _projection(part: Any) -> dict[str, int]:
  return _named_shape(_first(part, pz.nn.Linear, "attention projection"))


def _head_count(shape: Mapping[str, int]) -> int:
  return math.prod(size for axis, size in shape.items()
                   if axis in ("heads", "head_groups", "query_heads"))


def _number(value: Any) -> float:
  """A float field as it was written: the shortest decimal that gives
  ``value`` back at its own precision (a float32 epsilon of 1e-06 is written
  1e-06, not 9.999999974752427e-07)."""
  return float(str(np.asarray(value)[()]))


def _family_from_structure(model: Any) -> str:
  """The family whose layout the model has, when ``like`` does not say."""
  if _all(model, pz.nn.ApplyRoPEToSubset) or _all(model, pz.nn.Standardize):
    return "gpt_neox"
  if _all(model, pz.nn.EmbeddingDecode):  # Gemma 2 adds norms after attention and MLP.
    block = _first(model, model_parts.TransformerBlock, "decoder block")
    return "gemma2" if len(_all(block, pz.nn.RMSLayerNorm)) > 2 else "gemma"
  if _biases(model) == Biases(query_key_value=True):
    return "qwen2"
  return "mistral" if _all(model, pz.nn.ApplyCausalSlidingWindowAttentionMask) else "llama"


def _biases(model: Any) -> Biases:
  """Which projections of the first block add a bias (``AddBias`` layers,
  as `pz_persist.pretrained.hf_families.llama.Biases` places them); the
  other blocks are compared with the plan built from these."""
  attention = _attention(model)
  ffw = _first(model, model_parts.TransformerFeedForward, "MLP")
  return Biases(query_key_value=bool(_all(attention.input_to_query, pz.nn.AddBias)),
                output=bool(_all(attention.attn_value_to_output, pz.nn.AddBias)),
                mlp=bool(_all(ffw, pz.nn.AddBias)))


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
  fn = _first(_first(model, model_parts.TransformerFeedForward, "MLP"), pz.nn.Elementwise,
              "MLP activation").fn
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
  embed = _named_shape(_first(model, pz.nn.EmbeddingTable, "token embeddings"))
  attention = _attention(model)
  query, key = _projection(attention.input_to_query), _projection(attention.input_to_key)
  ffw = _first(model, model_parts.TransformerFeedForward, "MLP")
  fields = {
      "hidden_size": embed["embedding"],
      "vocab_size": embed["vocabulary"],
      "num_attention_heads": _head_count(query),
      "intermediate_size": _named_shape(_first(ffw, pz.nn.Linear, "MLP"))["neurons"],
      "num_hidden_layers": len(_all(model, model_parts.TransformerBlock)),
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
    return {"layer_norm_eps": _number(_first(model, pz.nn.Standardize, "layer norm").epsilon)}
  return {"rms_norm_eps": _number(_first(model, pz.nn.RMSStandardize, "RMS norm").epsilon)}


def _rope_fields(model: Any, family: str, like: Mapping[str, Any]) -> dict[str, Any]:
  """``rope_parameters`` as transformers 5 writes them: ``rope_theta`` and
  ``rope_type``, and for a scaled RoPE (`ApplyScaledRoPE`) the layer's own
  scaling keys (and ``max_position_embeddings``, which ``dynamic`` reads)."""
  scaled = _all(model, ApplyScaledRoPE)
  if scaled:
    fields = scaled[0].config_fields()
    scaling = {"rope_theta": float(fields.pop("rope_theta")), **fields.pop("rope_scaling")}
    return {"rope_parameters": scaling, **fields}
  rope = (_all(model, pz.nn.ApplyRoPE) + _all(model, pz.nn.ApplyRoPEToSubset))
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
  blocks = _all(model, model_parts.TransformerBlock)
  windows = [
      masks[0].sliding_window_size if (
          masks := _all(block, pz.nn.ApplyCausalSlidingWindowAttentionMask)) else None
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
  caps = _all(_attention(model), pz.nn.TanhSoftCap)
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
  rescale = _first(_attention(model).input_to_query, pz.nn.ConstantRescale, "query scaling")
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
  if family in _GEMMA:
    return {"tie_word_embeddings": True}
  embeddings = _first(model, pz.nn.EmbeddingTable, "token embeddings").embeddings.value
  linears = _all(model, pz.nn.Linear)
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
  if family in _GEMMA:
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
    config["architectures"] = [_ARCHITECTURES.get(family, "ForCausalLM")]
  embeddings = _first(model, pz.nn.EmbeddingTable, "token embeddings").embeddings.value
  config.pop("torch_dtype", None)
  config["dtype"] = np.dtype(embeddings.dtype).name
  return dict(sorted(config.items()))


# --- does the family express the model? ---------------------------------------


class _ModelWeights:
  """Stands in for `pz_persist.pretrained.hf_weights.Weights`: the plan asks
  which tensors a folder holds and their dtype; the model answers."""

  def __init__(self, layers: int, dtype: np.dtype):
    self.path = "(the model being exported)"
    self.names = {f"{prefix}{i}.weight" for prefix in LAYER_PREFIXES for i in range(layers)}
    self.names |= set(_HEAD_NAMES)
    self.dtype = dtype


def _refuse_lora(model: Any) -> None:
  # Looked up, not imported (`import pz_persist` leaves it unimported): a
  # model holding an adapter has imported it.
  lora = sys.modules.get("penzai.toolshed.lora")
  if lora is None:
    return
  adapters = pz.select(model).at_instances_of(lora.LowRankAdapter)
  if adapters.count():
    path = jax.tree_util.keystr(next(iter(adapters.selected_by_path)))
    raise ExportError(
        f"the model holds {adapters.count()} unmerged LoRA adapter(s)"
        f" (penzai.toolshed.lora.LowRankAdapter, the first at model{path}), which"
        " Hugging Face's architectures cannot express. Merge them first:"
        " model = pz_persist.pretrained.merge_lora(model) (each adapter becomes its"
        " Linear layer with weights W + A @ B), then export."
    )


def merge_lora(model: Any) -> Any:
  """Replaces each LoRA adapter (``penzai.toolshed.lora.LowRankAdapter``) by
  the ``Linear`` layer it adapts, with weights ``W + A @ B``.

  The merged layer keeps the pretrained layer's parameter (label, kind,
  metadata) with its new value, computed in the pretrained weights' dtype
  (float32 arithmetic when that is narrower), so the model then has the
  structure of the one LoRA was applied to and can be exported.
  """
  from penzai.toolshed import lora  # pylint: disable=import-outside-toplevel

  def merged(adapter: lora.LowRankAdapter) -> pz.nn.Linear:
    branches = adapter.sublayers[0].branches
    linear = branches[0].sublayers[0]
    a_layer, b_layer = branches[1].sublayers
    lowrank = set(a_layer.out_axis_names)
    w, a, b = (layer.weights.value for layer in (linear, a_layer, b_layer))
    update = pz.nx.nmap(jnp.sum)((a.astype(jnp.float32) * b.astype(jnp.float32))
                                 .untag(*lowrank))
    value = (w.astype(jnp.float32) + update).astype(w.dtype).order_like(w)
    param = linear.weights
    if isinstance(param, pz.Parameter):  # A variable: a new one, same label and metadata.
      param = pz.Parameter(value=value, label=param.label, metadata=param.metadata)
    else:
      param = dataclasses.replace(param, value=value)
    return dataclasses.replace(linear, weights=param)

  return pz.select(model).at_instances_of(lora.LowRankAdapter).apply(merged)


def _plain(value: Any) -> Any:
  """A comparable form of a leaf: arrays by dtype, shape and bits."""
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    host = np.asarray(value)
    return ("array", host.dtype.name, host.shape, host.tobytes())
  if isinstance(value, functools.partial):
    return ("partial", value.func, value.args, tuple(sorted(value.keywords.items())))
  return value


def _shown(value: Any) -> str:
  if hasattr(value, "shape"):
    return f"{value.dtype}{list(value.shape)} {np.asarray(value).ravel()[:4]}"
  return repr(value)


def _dtype_or_self(value: Any) -> Any:
  """A dtype however given (``jnp.float32``, ``np.dtype("float32")``) as
  ``np.dtype``: builders store either, meaning the same."""
  if isinstance(value, np.dtype) or (isinstance(value, type) and (
      issubclass(value, np.generic) or isinstance(getattr(value, "dtype", None), np.dtype))):
    return np.dtype(value)
  return value


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _first_difference(expected: Any, found: Any, path: str,
                      slots: dict[str, str]) -> tuple[str, str] | None:
  """Where the model (``found``) first differs from the plan's skeleton
  (``expected``) in anything but parameter values, and how; fills ``slots``
  with ``{plan label: model label}`` for the parameters met on the way."""
  expected, found = _dtype_or_self(expected), _dtype_or_self(found)
  if (type(expected) is not type(found) and not isinstance(expected, pz.ParameterSlot)
      and not (_is_number(expected) and _is_number(found))):  # 10_000 == 10_000.0
    return path, (f"the model has a {type(found).__name__} where the family's layout has a"
                  f" {type(expected).__name__}")
  if isinstance(expected, pz.ParameterSlot):
    if not isinstance(found, pz.ParameterValue):
      return path, (f"the model has a {type(found).__name__} where the family's layout has"
                    f" parameter {expected.label!r}")
    known = slots.setdefault(expected.label, found.label)
    if known != found.label:
      return path, (f"parameters {known!r} and {found.label!r} sit where the family has one"
                    f" shared parameter {expected.label!r}")
    return None
  if dataclasses.is_dataclass(expected):
    children = [(f".{f.name}", getattr(expected, f.name), getattr(found, f.name))
                for f in dataclasses.fields(expected)]
  elif isinstance(expected, (list, tuple)):
    if len(expected) != len(found):
      return path, f"{len(found)} entries where the family's layout has {len(expected)}"
    children = [(f"[{i}]", e, f) for i, (e, f) in enumerate(zip(expected, found))]
  elif isinstance(expected, dict):
    if list(expected) != list(found):
      return path, f"keys {list(found)} where the family's layout has {list(expected)}"
    children = [(f"[{k!r}]", expected[k], found[k]) for k in expected]
  elif _plain(expected) != _plain(found):
    return path, f"{_shown(found)} where the family's layout has {_shown(expected)}"
  else:
    return None
  for suffix, e, f in children:
    difference = _first_difference(e, f, path + suffix, slots)
    if difference:
      return difference
  return None


def _check_structure(plan: Plan, model: Any, family: str) -> dict[str, str]:
  """Refuses a model whose structure differs from what the family's plan
  builds; returns ``{plan label: model label}`` (labels may differ: a model
  with blocks cut keeps its original block numbers)."""
  skeleton = plan.build()
  slots: dict[str, str] = {}
  difference = _first_difference(skeleton, model, "model", slots)
  if difference:
    where, what = difference
    raise ExportError(
        f"{where}: {what}, so this model cannot be written as a Hugging Face"
        f" {family!r} folder (export_hf compares the model with what load_hf would"
        " build from the config it derives). Export a model with the family's"
        " structure (undo the edit at that place, or merge it into the weights),"
        " or name the right family with like=."
    )
  return slots


def _matching_plan(candidates: list[Callable[..., Plan]], config: dict[str, Any],
                  weights: _ModelWeights, model: Any, family: str,
                  folder: str) -> tuple[Plan, dict[str, str]]:
  """The first of the family's plans that builds exactly the model's
  structure, and its ``{plan label: model label}``; else the first plan's
  refusal (a family may have two Penzai layouts: Gemma's norms hold ``w``
  when `load_hf` reads a Hub folder, ``1 + w`` when `load_gemma` builds it)."""
  refusal: errors.PzPersistError | None = None
  for candidate in candidates:
    try:
      plan = candidate(Config(config, f"config derived for {folder}"), weights)
      return plan, _check_structure(plan, model, family)
    except errors.UnsupportedConfigError as e:  # A field the family cannot take.
      refusal = refusal or ExportError(
          f"this model cannot be written as a Hugging Face {family!r} folder: the config"
          f" derived from it is one {family!r} cannot express ({e}) Name the right"
          " family with like=, or undo the edit that gave the model this structure.")
    except errors.PzPersistError as e:
      refusal = refusal or e
  assert refusal is not None
  raise refusal


# --- the folder -----------------------------------------------------------------


def _like_config(like: Any) -> dict[str, Any]:
  """``like`` as a config dict: a family name, a folder or a dict."""
  if like is None:
    return {}
  if isinstance(like, Mapping):
    return dict(like)
  if isinstance(like, str) and like in _plans():
    return {"model_type": like}
  if isinstance(like, (str, os.PathLike)) and os.path.isdir(like):
    return hf._read_config(os.fspath(like))  # pylint: disable=protected-access
  raise errors.ArgumentError(
      f"like={like!r} is neither a family ({sorted(_plans())}), a Hugging Face"
      " folder nor a config dict."
  )


class _Stored:
  """One stored tensor, laid out only when the writer asks for its bytes, so
  that the host holds one tensor at a time."""

  def __init__(self, specs: list[TensorSpec], values: list[Any]):
    self.specs, self.values = specs, values
    spec = specs[0]
    self.shape = spec.stored or spec.shape
    self.dtype = np.dtype(values[0].dtype)
    self.nbytes = math.prod(self.shape) * self.dtype.itemsize

  def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
    hosts = [np.asarray(v.unwrap(*spec.axes)) for spec, v in zip(self.specs, self.values)]
    try:
      return stored_layout(self.specs, hosts)
    except ValueError as e:
      raise ExportError(f"{e}; they cannot be written as one Hugging Face tensor.") from None


def _tensors(plan: Plan, slots: Mapping[str, str], values: Mapping[str, Any]) -> list[tuple[str, _Stored]]:
  """``(Hugging Face name, tensor)`` in plan order, each value checked
  against its spec's shape first."""
  by_source: dict[str, list[TensorSpec]] = collections.defaultdict(list)
  for spec in plan.tensors:
    by_source[spec.source].append(spec)
  out = []
  for source, specs in by_source.items():
    found = []
    for spec in specs:
      label = slots[spec.label]
      value = values[label]
      shape = list(spec.shape)
      if spec.take is not None:
        del shape[spec.take[0]]
      expected = dict(zip(spec.axes, shape))
      if dict(value.named_shape) != expected or value.positional_shape:
        raise ExportError(
            f"parameter {label!r} has shape {dict(value.named_shape)} where the config"
            f" derived from the model needs {expected} for {source!r}; the model's"
            " layers disagree about its sizes."
        )
      found.append(value)
    out.append((source, _Stored(specs, found)))
  return out


def _shards(tensors: list[tuple[str, _Stored]], shard_size: int) -> list[list[tuple[str, _Stored]]]:
  """Consecutive groups of at most ``shard_size`` bytes (a larger tensor alone)."""
  shards: list[list[tuple[str, _Stored]]] = [[]]
  size = 0
  for name, tensor in tensors:
    if shards[-1] and size + tensor.nbytes > shard_size:
      shards.append([])
      size = 0
    shards[-1].append((name, tensor))
    size += tensor.nbytes
  return shards


def _check_destination(folder: str, overwrite: bool) -> None:
  if os.path.islink(folder) or (os.path.exists(folder) and not os.path.isdir(folder)):
    raise errors.CheckpointExistsError(
        f"{folder} exists and is not a folder; choose another destination.")
  if os.path.isdir(folder) and os.listdir(folder) and not overwrite:
    raise errors.CheckpointExistsError(
        f"{folder} exists and is not empty; pass overwrite=True (CLI: --overwrite)"
        " to replace it."
    )


def _write_folder(folder: str, config: Mapping[str, Any], tensors: list[tuple[str, _Stored]],
                  shard_size: int, overwrite: bool, progress: progress_lib.Progress) -> None:
  """Writes the files into a new folder beside ``folder``, then renames it
  into place: an interrupted export leaves ``folder`` as it was."""
  parent, name = os.path.split(os.path.abspath(folder))
  os.makedirs(parent, exist_ok=True)
  # Not mkdtemp: its 0o700 would be the exported folder's mode; this follows the umask.
  tmp = os.path.join(parent, f".{name}.{uuid.uuid4().hex}.export.tmp")
  os.mkdir(tmp)
  try:
    shards = _shards(tensors, shard_size)
    weight_map = {}
    total = sum(t.nbytes for _, t in tensors)
    with progress_lib.tracking(progress, f"writing {folder}", total) as tracker:
      for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors_io.write_safetensors(os.path.join(tmp, filename), shard,
                                         metadata={"format": "pt"})
        weight_map.update(dict.fromkeys((n for n, _ in shard), filename))
        tracker.advance(sum(t.nbytes for _, t in shard))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    safe_io.write_small_file(os.path.join(tmp, "model.safetensors.index.json"),
                             json.dumps(index, indent=2).encode())
    safe_io.write_small_file(os.path.join(tmp, "config.json"),
                             (json.dumps(config, indent=2) + "\n").encode())
    _check_destination(folder, overwrite)  # Again: it may have appeared meanwhile.
    if os.path.isdir(folder):
      trash = tempfile.mkdtemp(prefix=f".{name}.", suffix=".replaced.tmp", dir=parent)
      os.rename(folder, os.path.join(trash, name))
      os.rename(tmp, folder)
      safe_io.remove_tree(trash, strict=True)
    else:
      os.rename(tmp, folder)
  except BaseException:
    safe_io.remove_tree(tmp)
    raise


def export_hf(
    model: Any,
    folder: str | os.PathLike[str],
    *,
    like: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    shard_size: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    progress: progress_lib.Progress = None,
) -> str:
  """Writes a Penzai transformer as a Hugging Face folder.

  Example::

    model = pzp.pretrained.load_hf("Llama-3.2-1B")
    ...  # fine-tune, merge LoRA, cut layers
    pzp.export_hf(model, "my-llama", like="Llama-3.2-1B")
    # transformers.AutoModelForCausalLM.from_pretrained("my-llama")

  Args:
    model: A ``TransformerLM`` with the structure of a family `load_hf`
      reads (``llama``, ``mistral``, ``qwen2``, ``gpt_neox``, ``gemma``,
      ``gemma2``; with RoPE scaling and biases as `load_hf` builds them),
      or of Penzai's Gemma as `load_gemma` builds it (also written as
      ``gemma`` / ``gemma2``; its norms hold ``1 + w``, so ``w`` is written
      as ``value - 1`` computed in float32, which is not bit-exact in
      bfloat16). Layers may have been cut: ``num_hidden_layers`` follows
      the model.
    folder: The folder to write (created; its parent too).
    like: The family (``"llama"``, ``"mistral"``, ``"qwen2"``,
      ``"gpt_neox"``, ``"gemma"``, ``"gemma2"``), or a Hugging Face folder or config dict
      whose family is used and whose fields that do not change the math
      (token ids, ``architectures``, ``max_position_embeddings``...) are
      copied. Default: the family the structure shows.
    shard_size: Most bytes per safetensors file (a larger tensor gets a file
      of its own).
    overwrite: Replace ``folder`` if it exists and is not empty.
    progress: As for `load_hf`, in bytes written.

  Returns:
    ``folder``.

  Raises:
    ExportError: the model's structure is not one the family can express
      (naming the first difference, e.g. an unmerged LoRA adapter), before
      anything is written.
    CheckpointExistsError: ``folder`` exists, is not empty and
      ``overwrite`` is False.
  """
  folder = os.fspath(folder)
  if not isinstance(shard_size, int) or shard_size <= 0:
    raise errors.ArgumentError(f"shard_size={shard_size!r} must be a positive number of bytes.")
  _check_destination(folder, overwrite)
  if not isinstance(model, model_parts.TransformerLM):
    raise ExportError(f"export_hf writes Penzai TransformerLM models, not {type(model).__name__}.")
  _refuse_lora(model)
  pz.nn.assert_no_parameter_slots(model)
  model = pz.freeze_params(model)  # Parameter values, mutable or not, in place.
  like_config = _like_config(like)
  family = like_config.get("model_type") or _family_from_structure(model)
  plans = _plans()
  if family not in plans:
    raise ExportError(f"family {family!r} cannot be exported; supported: {sorted(plans)}.")
  config = derive_config(model, family, like_config)
  embeddings = _first(model, pz.nn.EmbeddingTable, "token embeddings").embeddings.value
  weights = _ModelWeights(config["num_hidden_layers"], np.dtype(embeddings.dtype))
  plan, slots = _matching_plan(plans[family], config, weights, model, family, folder)
  values = {p.label: p.value for p in _all(model, pz.ParameterValue)}
  _write_folder(folder, config, _tensors(plan, slots, values), shard_size, overwrite, progress)
  return folder
