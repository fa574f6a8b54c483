"""Hugging Face checkpoints (Llama, Mistral, GPT-NeoX) into Penzai, without torch.

Penzai's own converters (``llama_from_huggingface_model`` and friends) take a
*torch* model: loading a 7B checkpoint that way needs torch, transformers, and
the whole model in torch memory before the first array reaches JAX. `load_hf`
reads the checkpoint folder directly instead: ``config.json`` is mapped to
Penzai's config objects (``LlamalikeTransformerConfig``,
``GPTNeoXTransformerConfig``), the model skeleton comes from Penzai's own
builders, and each safetensors tensor is read on its own, reshaped to its
Penzai layout, cast, placed on its devices and dropped before the next one is
read, so host memory never holds a second copy of the model.

Configuration fields that change the model's math in ways Penzai's builders
cannot express (``rope_scaling``, biases in Llama attention, a non-SiLU
activation...) are refused with `UnsupportedConfigError` naming the field and
its value; fields that do not change the math (token ids, dropout, the
transformers version...) are ignored, and any field this module does not know
is refused too, rather than silently producing a different model.

A checkpoint folder may come from anyone, so nothing in it is trusted before
it is checked, and the checks come in an order that builds nothing large:
``config.json`` is read with a byte and nesting limit and every field the
builders use is checked against `_SCHEMA` (sizes are positive integers, never
floats or strings); then the safetensors headers are read (their byte ranges
must tile each file, as the reference implementation requires); then
``num_hidden_layers`` must match the layers the weights hold and every tensor
the config calls for must be present with the right size; then the total
allocation is compared with `pz_persist.safety.limits.allocation_limit`; only then
is the skeleton built and the first tensor read. Only regular files are read,
and a symlink in the folder must stay inside it or, for a ``huggingface_hub``
snapshot, inside its cache entry (`pz_persist.pretrained._files`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import gpt_neox
from penzai.models.transformer.variants import llamalike_common

from pz_persist import errors
from pz_persist import progress as progress_lib
from pz_persist.pretrained import _files
from pz_persist.pretrained import safetensors_io
from pz_persist.storage import sharding as sharding_lib

# Documented here too (defined in errors, with every error class).
UnsupportedConfigError = errors.UnsupportedConfigError
CheckpointFolderError = errors.CheckpointFolderError


# Fields of a Hugging Face config that never change a causal LM's forward
# pass: bookkeeping, token ids, dropout (inactive at inference), generation
# defaults and the storage dtype (we use the tensors' own dtype).
_IGNORED_FIELDS = frozenset({
    "_attn_implementation_autoset", "_name_or_path", "add_cross_attention",
    "architectures", "attention_dropout", "bad_words_ids", "begin_suppress_tokens",
    "bos_token_id", "chunk_size_feed_forward", "classifier_dropout",
    "cross_attention_hidden_size", "decoder_start_token_id", "diversity_penalty",
    "do_sample", "dtype", "early_stopping", "embd_pdrop", "encoder_no_repeat_ngram_size",
    "eos_token_id", "exponential_decay_length_penalty", "finetuning_task",
    "forced_bos_token_id", "forced_eos_token_id", "hidden_dropout", "id2label",
    "initializer_range", "is_decoder", "is_encoder_decoder", "label2id",
    "length_penalty", "max_length", "max_position_embeddings", "min_length",
    "model_type", "no_repeat_ngram_size", "num_beam_groups", "num_beams",
    "num_return_sequences", "output_attentions", "output_hidden_states",
    "output_scores", "pad_token_id", "prefix", "pretraining_tp", "problem_type",
    "pruned_heads", "remove_invalid_values", "repetition_penalty", "return_dict",
    "return_dict_in_generate", "sep_token_id", "suppress_tokens", "task_specific_params",
    "temperature", "tf_legacy_loss", "tie_encoder_decoder", "tokenizer_class",
    "top_k", "top_p", "torch_dtype", "torchscript", "transformers_version",
    "typical_p", "use_bfloat16", "use_cache", "attn_implementation",
})


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
  """How one Penzai parameter is made from one Hugging Face tensor.

  Attributes:
    label: The Penzai parameter label (``transformer/...``).
    source: The Hugging Face tensor name.
    shape: The shape to reshape the tensor to (Penzai's layout).
    axes: The axis names of the reshaped tensor, in order.
    take: ``(dimension, index)`` to select one slice of the reshaped tensor
      (GPT-NeoX stores query, key and value fused); that dimension is removed
      from ``shape``/``axes`` afterwards, so ``axes`` describes the result.
    stored: The tensor's shape in the checkpoint, when it is not ``shape``
      (Hugging Face keeps attention heads fused into one dimension); checked
      against the safetensors header before anything is read.
  """

  label: str
  source: str
  shape: tuple[int, ...]
  axes: tuple[str, ...]
  take: tuple[int, int] | None = None
  stored: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class _Plan:
  """How to build the model skeleton (parameter slots) and fill each slot.

  The skeleton is built only once every tensor of ``tensors`` has been
  checked against the safetensors headers (`_check_tensors`): its size comes
  from ``config.json``, which must not be trusted until the weights agree.
  """

  build: Callable[[], model_parts.TransformerLM]
  tensors: tuple[_TensorSpec, ...]


def _positive_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_number(value: Any) -> bool:
  return (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and value > 0)


def _fraction(value: Any) -> bool:
  return _positive_number(value) and value <= 1


_POSITIVE_INT = (_positive_int, "a positive integer")
_POSITIVE_NUMBER = (_positive_number, "a positive finite number")
_FRACTION = (_fraction, "a number in (0, 1]")
_BOOLEAN = (lambda value: isinstance(value, bool), "true or false")
_STRING = (lambda value: isinstance(value, str), "a string")
_OBJECT = (lambda value: isinstance(value, dict), "a JSON object")

_SCHEMA: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model_type": _STRING,
    "hidden_size": _POSITIVE_INT,
    "num_attention_heads": _POSITIVE_INT,
    "num_key_value_heads": _POSITIVE_INT,
    "head_dim": _POSITIVE_INT,
    "intermediate_size": _POSITIVE_INT,
    "num_hidden_layers": _POSITIVE_INT,
    "vocab_size": _POSITIVE_INT,
    "sliding_window": _POSITIVE_INT,
    "rms_norm_eps": _POSITIVE_NUMBER,
    "layer_norm_eps": _POSITIVE_NUMBER,
    "rope_theta": _POSITIVE_NUMBER,
    "rotary_emb_base": _POSITIVE_NUMBER,
    "rotary_pct": _FRACTION,
    "partial_rotary_factor": _FRACTION,
    "tie_word_embeddings": _BOOLEAN,
    "attention_bias": _BOOLEAN,
    "mlp_bias": _BOOLEAN,
    "use_parallel_residual": _BOOLEAN,
    "hidden_act": _STRING,
    "rope_scaling": _OBJECT,
    "rope_parameters": _OBJECT,
    "rope_type": _STRING,
    "type": _STRING,
}
"""What each ``config.json`` field the builders read must be (a JSON null
means "absent, use the default"). Sizes are positive integers: a float is
refused, never truncated, and a zero never reaches a division."""


class _Config:
  """A ``config.json`` dict that records which fields were consulted.

  Builders read fields through `get` / `require`; `check_all_used` then
  refuses any field nobody read that is not known to be harmless, so a new
  Hugging Face option is an error rather than a silently different model.
  """

  def __init__(self, raw: Mapping[str, Any], where: str):
    self.raw = dict(raw)
    self.where = where
    self.used: set[str] = set()

  def get(self, key: str, default: Any = None) -> Any:
    self.used.add(key)
    value = self.raw.get(key)
    return default if value is None else self.checked(key, value)

  def require(self, key: str) -> Any:
    self.used.add(key)
    if self.raw.get(key) is None:
      raise UnsupportedConfigError(f"{self.where}: required field {key!r} is missing.")
    return self.checked(key, self.raw[key])

  def checked(self, key: str, value: Any) -> Any:
    """``value`` if it is what `_SCHEMA` says ``key`` (for a nested field
    such as ``rope_parameters.rope_theta``, its last part) must be."""
    valid, expected = _SCHEMA[key.rsplit(".", 1)[-1]]
    if not valid(value):
      raise self.invalid(key, value, expected)
    return value

  def invalid(self, key: str, value: Any, expected: str, detail: str = "") -> UnsupportedConfigError:
    return UnsupportedConfigError(
        f"{self.where}: {key} must be {expected}, got {value!r:.80}{detail};"
        " the file is damaged or not a Hugging Face config."
    )

  def expect(self, key: str, allowed: Any, default: Any = None, why: str = "") -> Any:
    """Reads ``key`` and refuses any value not in ``allowed``."""
    value = self.get(key, default)
    if value not in allowed:  # Hashable: `_SCHEMA` checked the type.
      supported = ", ".join(sorted(map(repr, allowed)))
      raise self.unsupported(key, value, f"supported: {supported}" + why)
    return value

  def unsupported(self, key: str, value: Any, why: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(
        f"{self.where}: {key}={value!r} is not supported by pz_persist's"
        f" Hugging Face loader ({why}); nothing was loaded, rather than risk a"
        " converted model that computes something different."
    )

  def check_all_used(self) -> None:
    unknown = {
        k: v for k, v in self.raw.items() if k not in self.used and k not in _IGNORED_FIELDS
    }
    if unknown:
      key, value = next(iter(unknown.items()))
      raise self.unsupported(
          key, value,
          f"unknown configuration field{'s' if len(unknown) > 1 else ''}"
          f" {sorted(unknown)}; it may change the model's math",
      )


def _rope(cfg: _Config, default_theta: float) -> tuple[float, float]:
  """RoPE base wavelength and partial-rotary fraction, refusing scaled RoPE.

  transformers < 5 writes ``rope_theta`` and ``rope_scaling``; transformers 5
  writes ``rope_parameters`` (``rope_type``, ``rope_theta``,
  ``partial_rotary_factor``). Penzai's ``ApplyRoPE`` implements only the
  original ("default") rotary embedding, so any other rope type (linear,
  dynamic, yarn, llama3...) is an error.
  """
  for key in ("rope_scaling", "rope_parameters"):
    params = cfg.get(key)
    if params is None:
      continue
    rope_type = params.get("rope_type", params.get("type", "default"))
    extra = set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if rope_type != "default" or extra:
      raise cfg.unsupported(
          key, params, "Penzai implements only unscaled ('default') RoPE"
      )
    for field in ("rope_type", "type", "rope_theta", "partial_rotary_factor"):
      if params.get(field) is not None:
        cfg.checked(f"{key}.{field}", params[field])
  params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
  theta = params.get("rope_theta")
  theta = cfg.get("rope_theta", default_theta) if theta is None else theta
  fraction = params.get("partial_rotary_factor")
  fraction = cfg.get("partial_rotary_factor", 1.0) if fraction is None else fraction
  return float(theta), float(fraction)


def _bool_field(cfg: _Config, key: str, default: bool, supported: bool, why: str) -> None:
  value = cfg.get(key, default)
  if value != supported:
    raise cfg.unsupported(key, value, why)


def _lm_head_source(cfg: _Config, tied: bool, names: set[str], head: str, embed: str) -> str:
  """The tensor holding the output projection, honouring tied embeddings.

  Penzai's ``tie_embedder_and_logits`` also rescales the input embeddings by
  sqrt(embedding_dim) (a Gemma convention), so tied Llama-style models are
  built untied, with the embedding table loaded a second time as the head.
  """
  if tied:
    return embed
  if head not in names:
    raise cfg.unsupported(
        "tie_word_embeddings", cfg.raw.get("tie_word_embeddings"),
        f"the checkpoint has no {head!r} tensor, so the output projection"
        " would be missing; set tie_word_embeddings=true if it is tied",
    )
  return head


def llama_plan(cfg: _Config, weights: _Weights, sliding: bool = False) -> _Plan:
  """Maps a Llama (or, with ``sliding``, Mistral) checkpoint to Penzai.

  Penzai's llama-like transformer splits attention heads into
  ``head_groups`` (the key/value heads) and ``query_heads`` (query heads per
  group), dropping an axis of size one, so the fused ``q_proj`` /``k_proj``
  /``v_proj``/``o_proj`` matrices are reshaped accordingly; Hugging Face's
  grouped-query attention uses key/value head ``h // group_size`` for query
  head ``h``, which is exactly a (groups, per-group) row-major split.
  """
  hidden = cfg.require("hidden_size")
  heads = cfg.require("num_attention_heads")
  kv_heads = cfg.get("num_key_value_heads", heads)
  if heads % kv_heads:
    raise cfg.unsupported(
        "num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}"
    )
  head_dim = cfg.get("head_dim", hidden // heads)
  theta, fraction = _rope(cfg, 10_000.0)
  if fraction != 1.0:
    raise cfg.unsupported(
        "partial_rotary_factor", fraction, "Llama-style RoPE covers every dimension"
    )
  cfg.expect("hidden_act", {"silu"}, "silu", why="; Penzai's llama-like MLP is SwiGLU")
  _bool_field(cfg, "attention_bias", False, False, "Penzai's llama-like attention has no biases")
  _bool_field(cfg, "mlp_bias", False, False, "Penzai's llama-like MLP has no biases")
  tied = cfg.get("tie_word_embeddings", False)
  if sliding:
    # transformers' MistralConfig defaults to a 4096-token window when the
    # field is absent; an explicit null means global attention.
    window = cfg.get("sliding_window") if "sliding_window" in cfg.raw else 4096
    attention = (
        llamalike_common.AttentionTypeGlobalCausal()
        if window is None
        else llamalike_common.AttentionTypeSlidingWindowCausal(window)
    )
  else:
    attention = llamalike_common.AttentionTypeGlobalCausal()
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=kv_heads,
      query_head_multiplier=heads // kv_heads,
      embedding_dim=hidden,
      projection_dim=head_dim,
      mlp_hidden_dim=cfg.require("intermediate_size"),
      num_decoder_blocks=cfg.require("num_hidden_layers"),
      vocab_size=cfg.require("vocab_size"),
      mlp_variant="swiglu",
      tie_embedder_and_logits=False,
      rope_wavelength=theta,
      rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      attention_type=attention,
      parameter_dtype=None,
      activation_dtype=None,
  )
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  _check_layers(cfg, weights.names, "model.layers.", config.num_decoder_blocks)
  head_source = _lm_head_source(cfg, tied, weights.names, "lm_head.weight",
                                "model.embed_tokens.weight")
  config = dataclasses.replace(config, parameter_dtype=weights.dtype,
                               activation_dtype=weights.dtype)

  groups, per_group = kv_heads, heads // kv_heads
  if per_group == 1:
    q_heads: dict[str, int] = {"heads": kv_heads}
    kv_axes: dict[str, int] = {"heads": kv_heads}
  elif kv_heads == 1:
    q_heads, kv_axes = {"query_heads": per_group}, {}
  else:
    q_heads, kv_axes = {"head_groups": groups, "query_heads": per_group}, {"head_groups": groups}

  def proj(label: str, source: str, head_axes: dict[str, int], output: bool = False) -> _TensorSpec:
    """An attention matrix: (heads..., projection, embedding) or its transpose."""
    shape = (*head_axes.values(), head_dim)
    axes = (*head_axes, "projection")
    fused = math.prod(shape)
    if output:
      return _TensorSpec(label, source, (hidden, *shape), ("embedding", *axes),
                         stored=(hidden, fused))
    return _TensorSpec(label, source, (*shape, hidden), (*axes, "embedding"),
                       stored=(fused, hidden))

  mlp = config.mlp_hidden_dim
  vocab = config.vocab_size
  specs = [
      _TensorSpec("transformer/embedder.embeddings", "model.embed_tokens.weight",
                  (vocab, hidden), ("vocabulary", "embedding")),
      _TensorSpec("transformer/final_norm/scale.weights", "model.norm.weight",
                  (hidden,), ("embedding",)),
      _TensorSpec("transformer/lm_head.weights", head_source,
                  (vocab, hidden), ("vocabulary", "embedding")),
  ]
  for i in range(config.num_decoder_blocks):
    p, s = f"transformer/block_{i}/", f"model.layers.{i}."
    specs += [
        _TensorSpec(p + "pre_attention_norm/scale.weights", s + "input_layernorm.weight",
                    (hidden,), ("embedding",)),
        _TensorSpec(p + "pre_ffw_norm/scale.weights", s + "post_attention_layernorm.weight",
                    (hidden,), ("embedding",)),
        _TensorSpec(p + "mlp/gating_linear.weights", s + "mlp.gate_proj.weight",
                    (mlp, hidden), ("neurons", "embedding")),
        _TensorSpec(p + "mlp/value_linear.weights", s + "mlp.up_proj.weight",
                    (mlp, hidden), ("neurons", "embedding")),
        _TensorSpec(p + "mlp/out_linear.weights", s + "mlp.down_proj.weight",
                    (hidden, mlp), ("embedding", "neurons")),
        proj(p + "attention/query.weights", s + "self_attn.q_proj.weight", q_heads),
        proj(p + "attention/key.weights", s + "self_attn.k_proj.weight", kv_axes),
        proj(p + "attention/value.weights", s + "self_attn.v_proj.weight", kv_axes),
        proj(p + "attention/output.weights", s + "self_attn.o_proj.weight", q_heads, output=True),
    ]
  return _Plan(
      lambda: llamalike_common.build_llamalike_transformer(config, init_base_rng=None),
      tuple(specs),
  )


def mistral_plan(cfg: _Config, weights: _Weights) -> _Plan:
  """Maps a Mistral checkpoint: Llama's layout plus sliding-window attention.

  Penzai's ``ApplyCausalSlidingWindowAttentionMask`` masks keys ``window`` or
  more positions back, as Hugging Face does. (Penzai's KV-cache sampling does
  not apply the window; full-sequence calls do.)
  """
  return llama_plan(cfg, weights, sliding=True)


_NEOX_ACTIVATIONS = {
    "gelu": "gelu_exact",
    "gelu_new": "gelu_approx",
    "gelu_pytorch_tanh": "gelu_approx",
    "relu": "relu",
    "silu": "silu",
}


def gpt_neox_plan(cfg: _Config, weights: _Weights) -> _Plan:
  """Maps a GPT-NeoX (Pythia) checkpoint to Penzai.

  GPT-NeoX fuses query, key and value into one ``query_key_value`` matrix
  whose rows are ordered (head, q/k/v, projection): it is reshaped that way
  and sliced three times. Penzai's builder uses a default epsilon for the
  final layer norm; it is set to ``layer_norm_eps`` here, as Hugging Face
  does.
  """
  hidden = cfg.require("hidden_size")
  heads = cfg.require("num_attention_heads")
  head_dim = hidden // heads
  if "head_dim" in cfg.raw and cfg.get("head_dim") not in (None, head_dim):
    raise cfg.unsupported(
        "head_dim", cfg.raw["head_dim"],
        f"GPT-NeoX uses hidden_size // num_attention_heads = {head_dim}",
    )
  theta, fraction = _rope(cfg, float(cfg.get("rotary_emb_base", 10_000.0)))
  fraction = float(cfg.get("rotary_pct", fraction))
  act = cfg.expect("hidden_act", set(_NEOX_ACTIVATIONS), "gelu")
  _bool_field(cfg, "use_parallel_residual", True, True,
              "Penzai's GPT-NeoX block is the parallel-residual formulation")
  _bool_field(cfg, "attention_bias", True, True,
              "Penzai's GPT-NeoX attention always has biases")
  eps = float(cfg.get("layer_norm_eps", 1e-5))
  tied = cfg.get("tie_word_embeddings", False)
  config = gpt_neox.GPTNeoXTransformerConfig(
      num_attention_heads=heads,
      embedding_dim=hidden,
      projection_dim=head_dim,
      mlp_hidden_dim=cfg.require("intermediate_size"),
      num_decoder_blocks=cfg.require("num_hidden_layers"),
      vocab_size=cfg.require("vocab_size"),
      activation_fn=_NEOX_ACTIVATIONS[act],
      rope_subset_size=int(fraction * head_dim),
      rope_wavelength=theta,
      layernorm_epsilon=eps,
      parameter_dtype=None,
      activation_dtype=None,
  )
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  _check_layers(cfg, weights.names, "gpt_neox.layers.", config.num_decoder_blocks)
  head_source = _lm_head_source(cfg, tied, weights.names, "embed_out.weight",
                                "gpt_neox.embed_in.weight")
  config = dataclasses.replace(config, parameter_dtype=weights.dtype,
                               activation_dtype=weights.dtype)

  def build() -> model_parts.TransformerLM:
    skeleton = gpt_neox.build_gpt_neox_transformer(config, init_base_rng=None)
    return (
        pz.select(skeleton)
        .at_instances_of(pz.nn.Standardize)
        .apply(lambda s: dataclasses.replace(s, epsilon=eps))
    )

  mlp, vocab = config.mlp_hidden_dim, config.vocab_size
  specs = [
      _TensorSpec("transformer/embedder.embeddings", "gpt_neox.embed_in.weight",
                  (vocab, hidden), ("vocabulary", "embedding")),
      _TensorSpec("transformer/final_norm/scale.weights", "gpt_neox.final_layer_norm.weight",
                  (hidden,), ("embedding",)),
      _TensorSpec("transformer/final_norm/shift.bias", "gpt_neox.final_layer_norm.bias",
                  (hidden,), ("embedding",)),
      _TensorSpec("transformer/lm_head.weights", head_source,
                  (vocab, hidden), ("vocabulary", "embedding")),
  ]
  for i in range(config.num_decoder_blocks):
    p, s = f"transformer/block_{i}/", f"gpt_neox.layers.{i}."
    specs += [
        _TensorSpec(p + "pre_attention_norm/scale.weights", s + "input_layernorm.weight",
                    (hidden,), ("embedding",)),
        _TensorSpec(p + "pre_attention_norm/shift.bias", s + "input_layernorm.bias",
                    (hidden,), ("embedding",)),
        _TensorSpec(p + "pre_ffw_norm/scale.weights", s + "post_attention_layernorm.weight",
                    (hidden,), ("embedding",)),
        _TensorSpec(p + "pre_ffw_norm/shift.bias", s + "post_attention_layernorm.bias",
                    (hidden,), ("embedding",)),
        _TensorSpec(p + "mlp/in/Linear.weights", s + "mlp.dense_h_to_4h.weight",
                    (mlp, hidden), ("neurons", "embedding")),
        _TensorSpec(p + "mlp/in/AddBias.bias", s + "mlp.dense_h_to_4h.bias",
                    (mlp,), ("neurons",)),
        _TensorSpec(p + "mlp/out/Linear.weights", s + "mlp.dense_4h_to_h.weight",
                    (hidden, mlp), ("embedding", "neurons")),
        _TensorSpec(p + "mlp/out/AddBias.bias", s + "mlp.dense_4h_to_h.bias",
                    (hidden,), ("embedding",)),
        _TensorSpec(p + "attention/output/Linear.weights", s + "attention.dense.weight",
                    (hidden, heads, head_dim), ("embedding", "heads", "projection"),
                    stored=(hidden, heads * head_dim)),
        _TensorSpec(p + "attention/output/AddBias.bias", s + "attention.dense.bias",
                    (hidden,), ("embedding",)),
    ]
    for index, which in enumerate(("query", "key", "value")):
      specs += [
          _TensorSpec(p + f"attention/{which}/Linear.weights",
                      s + "attention.query_key_value.weight",
                      (heads, 3, head_dim, hidden), ("heads", "projection", "embedding"),
                      take=(1, index), stored=(heads * 3 * head_dim, hidden)),
          _TensorSpec(p + f"attention/{which}/AddBias.bias",
                      s + "attention.query_key_value.bias",
                      (heads, 3, head_dim), ("heads", "projection"), take=(1, index),
                      stored=(heads * 3 * head_dim,)),
      ]
  return _Plan(build, tuple(specs))


Builder = Callable[[_Config, "_Weights"], _Plan]

BUILDERS: dict[str, Builder] = {
    "llama": llama_plan,
    "mistral": mistral_plan,
    "gpt_neox": gpt_neox_plan,
}
"""The supported ``model_type`` values of ``config.json`` and their mappings."""


def _read_config(path: str) -> dict[str, Any]:
  """``config.json``, read with the limits of `_files.read_json`."""
  config_path = _files.check_folder_file(path, "config.json")
  if config_path is None:
    raise CheckpointFolderError(
        f"{path} is not a Hugging Face checkpoint folder: it has no config.json."
    )

  def error(what: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"{config_path} {what}.")

  raw_config = _files.read_json(config_path, _files.MAX_CONFIG_BYTES, error)
  if not isinstance(raw_config, dict):
    raise error("is not a JSON object")
  return raw_config


def _open_weights(path: str) -> dict[str, safetensors_io.SafetensorsFile]:
  """Opens the safetensors files (headers only): ``{tensor name: file}``.

  A sharded checkpoint's ``model.safetensors.index.json`` says which file
  holds which tensor; every tensor it names must really be in that file.
  Every file is checked by `_files.check_folder_file` before it is opened.
  """
  index_path = _files.check_folder_file(path, "model.safetensors.index.json")
  single = _files.check_folder_file(path, "model.safetensors")
  where: dict[str, safetensors_io.SafetensorsFile] = {}
  if index_path is not None:
    def error(what: str) -> safetensors_io.SafetensorsFormatError:
      return safetensors_io.SafetensorsFormatError(f"{index_path} {what}.")

    index = _files.read_json(index_path, _files.MAX_INDEX_BYTES, error)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
      raise error("is malformed: it needs a 'weight_map' object")
    files: dict[str, safetensors_io.SafetensorsFile] = {}
    for name, filename in weight_map.items():
      if not isinstance(filename, str) or os.path.basename(filename) != filename:
        raise safetensors_io.SafetensorsFormatError(
            f"{index_path}: tensor {name!r} maps to {filename!r}, which is not"
            " a file name in the checkpoint folder."
        )
      if filename not in files:
        file_path = _files.check_folder_file(path, filename)
        if file_path is None:
          raise CheckpointFolderError(
              f"{index_path} names {filename}, which is missing from {path}."
          )
        files[filename] = safetensors_io.SafetensorsFile(file_path)
      if name not in files[filename].entries:
        raise safetensors_io.SafetensorsFormatError(
            f"{index_path} puts tensor {name!r} in {files[filename].path}, which"
            " does not hold it."
        )
      where[name] = files[filename]
  elif single is not None:
    file = safetensors_io.SafetensorsFile(single)
    where = dict.fromkeys(file.entries, file)
  else:
    raise _no_weights(path)
  return where


def _no_weights(path: str) -> CheckpointFolderError:
  return CheckpointFolderError(
      f"{path} has no model.safetensors nor model.safetensors.index.json"
      " (only safetensors checkpoints are supported; PyTorch .bin files"
      " would need torch to read)."
  )


def _check_has_weights(path: str) -> None:
  """Says early that the weights are missing, before ``config.json`` is
  checked in detail (their files are opened, and checked, only after)."""
  if not any(os.path.exists(os.path.join(path, name))
             for name in ("model.safetensors.index.json", "model.safetensors")):
    raise _no_weights(path)


class _Weights:
  """The folder's safetensors files, opened (headers only) when a builder
  first asks for their tensor names or dtype: after ``config.json`` has been
  validated on its own, so a broken config is reported as such first."""

  def __init__(self, path: str, dtype: Any):
    self.path = path
    self._dtype = dtype

  @functools.cached_property
  def where(self) -> dict[str, safetensors_io.SafetensorsFile]:
    return _open_weights(self.path)

  @property
  def names(self) -> set[str]:
    return set(self.where)

  @functools.cached_property
  def dtype(self) -> np.dtype:
    """The requested dtype, or the checkpoint's own floating dtype."""
    return self._dtype if self._dtype is not None else _stored_float_dtype(self.where)


_LAYER_NUMBER = re.compile(r"(\d{1,9})\.")


def _check_layers(cfg: _Config, names: set[str], prefix: str, layers: int) -> None:
  """Refuses a ``num_hidden_layers`` other than the layers the weights hold.

  Why: the skeleton and the list of tensors to read grow with it, so a
  forged config (``10**9`` layers in 200 bytes) would take hours before the
  first missing tensor is noticed; the weights' own names bound it.
  """
  held = sorted({
      int(match.group(1)) for name in names if name.startswith(prefix)
      and (match := _LAYER_NUMBER.match(name, len(prefix)))
  })
  if len(held) == layers and held[-1] == layers - 1:  # Sorted and distinct: 0..layers-1.
    return
  if not held:
    found = "no layers"
  elif held[-1] == len(held) - 1:
    found = f"layers 0..{held[-1]}"
  else:
    found = f"layers {held[:10]}{'...' if len(held) > 10 else ''}"
  raise cfg.invalid("num_hidden_layers", layers, "a positive integer matching the weights",
                    f" but the safetensors hold {found}")


def _check_tensors(plan: _Plan, weights: _Weights) -> None:
  """Refuses weights missing a tensor the config calls for, or holding one
  of another size, before the skeleton is built or anything is read; then
  refuses a load larger than `pz_persist.safety.limits.allocation_limit`."""
  where = weights.where
  planned = []
  for spec in plan.tensors:
    file = where.get(spec.source)
    if file is None:
      files = sorted({f.path for f in where.values()})
      raise safetensors_io.SafetensorsFormatError(
          f"tensor {spec.source!r} (for Penzai parameter {spec.label!r}) is in"
          f" none of the checkpoint's files {files}."
      )
    stored_shape = file.entries[spec.source][1]
    expected = spec.stored or spec.shape
    if stored_shape != expected:
      raise safetensors_io.SafetensorsFormatError(
          f"safetensors file {file.path}, tensor {spec.source!r}: shape"
          f" {stored_shape} does not fit the config (expected {expected}"
          f" for {spec.label!r})."
      )
    shape = list(spec.shape)
    if spec.take is not None:
      del shape[spec.take[0]]
    planned.append(_files.PlannedArray(spec.label, weights.dtype, tuple(shape)))
  _files.check_planned_allocation(planned, where=weights.path)


def _placement(sharding: sharding_lib.Target):
  """A function giving the sharding of an array from its axis names."""
  if isinstance(sharding, sharding_lib.AxisRules):
    return lambda axes, shape, label: sharding.sharding(tuple(axes), tuple(shape), what=label)
  target = sharding or sharding_lib.default_sharding()
  return lambda axes, shape, label: target


def load_hf(
    path: str | os.PathLike[str],
    *,
    dtype: Any = None,
    sharding: sharding_lib.Target = None,
    progress: progress_lib.Progress = None,
) -> model_parts.TransformerLM:
  """Loads a Hugging Face Llama, Mistral or GPT-NeoX checkpoint as a Penzai model.

  Needs neither torch nor transformers: ``config.json`` is read as JSON and
  the weights with a safetensors parser. Tensors are read one at a time
  (straight into a new array), reshaped to Penzai's named-axis layout, cast, put on their
  devices and dropped, so the host never holds a second copy of the model.
  The result is the same model Penzai's ``*_from_huggingface_model``
  converters build (labels ``transformer/...``), with mutable parameters.

  Example::

    path = huggingface_hub.snapshot_download("EleutherAI/pythia-70m")
    model = pzp.pretrained.load_hf(path, dtype=jnp.bfloat16)
    tokens = pz.nx.wrap(jnp.array([[1, 2, 3]]), "batch", "seq")
    logits = model(tokens)  # named axes: batch, seq, vocabulary

  Args:
    path: A checkpoint folder: ``config.json`` plus ``model.safetensors``, or
      ``model-0000x-of-0000y.safetensors`` files with
      ``model.safetensors.index.json``.
    dtype: Cast every parameter to this dtype, which is also the activation
      dtype (default: the checkpoint's own floating dtype).
    sharding: Where each array goes: a ``jax.sharding.Sharding`` for all
      arrays, or `pz_persist.AxisRules` mapping Penzai axis names
      (``embedding``, ``heads``, ``head_groups``, ``query_heads``,
      ``projection``, ``neurons``, ``vocabulary``) to mesh axes. Default: the
      first local device.
    progress: None (default): a bar on stderr if it is a terminal or in a
      notebook; True: always; False: never; or a function called as
      ``progress(done, total)`` with the bytes of the tensors read so far
      (`pz_persist.progress`).

  Returns:
    A ``penzai.models.transformer.model_parts.TransformerLM``.

  Raises:
    UnsupportedConfigError: an unsupported ``model_type`` (the message lists
      the supported ones) or a configuration field that would change the
      model's math, naming the field and its value. Raised before any tensor
      is read.
    UnsupportedConfigError: also for a malformed ``config.json`` (not a JSON
      object, too large or too deep, a field of the wrong type or range, or a
      ``num_hidden_layers`` other than the layers the weights hold).
    CheckpointFolderError: ``config.json`` or the weight files are missing.
    SafetensorsFormatError: a weight file is truncated or malformed (byte
      ranges that overlap, leave gaps or leave the file), or lacks a tensor
      the model needs or has one of the wrong shape (naming the file and the
      tensor); all found before any tensor is read.
    UnsafeCheckpointError: a file read is a symlink leading out of the folder
      (and out of its Hugging Face cache entry), a FIFO or a device, or the
      model would allocate more than `pz_persist.safety.limits.allocation_limit`.
  """
  path = os.fspath(path)
  raw_config = _read_config(path)
  _check_has_weights(path)
  model_type = raw_config.get("model_type")
  if not isinstance(model_type, str) or model_type not in BUILDERS:
    raise UnsupportedConfigError(
        f"{os.path.join(path, 'config.json')}: model_type={model_type!r:.80} is not"
        f" supported; pz_persist.pretrained.load_hf supports {sorted(BUILDERS)}"
        " (use pz_persist.pretrained.load_gemma for Gemma's Flax checkpoints)."
    )
  if dtype is not None:
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise UnsupportedConfigError(f"dtype={dtype} is not a floating dtype.")
  weights = _Weights(path, dtype)
  cfg = _Config(raw_config, os.path.join(path, "config.json"))
  plan = BUILDERS[model_type](cfg, weights)
  _check_tensors(plan, weights)

  place = _placement(sharding)
  params = []
  sizes = [_stored_bytes(spec, weights.where) for spec in plan.tensors]
  with progress_lib.tracking(progress, f"loading {path}", sum(sizes)) as tracker:
    for spec, size in zip(plan.tensors, sizes):
      params.append(pz.Parameter(
          value=_read(spec, weights.where, weights.dtype, place), label=spec.label))
      tracker.advance(size)
  model = pz.bind_variables(plan.build(), params)
  pz.nn.assert_no_parameter_slots(model)
  return model


def _stored_bytes(spec: _TensorSpec, where: Mapping[str, safetensors_io.SafetensorsFile]) -> int:
  """Bytes of the stored tensor ``spec`` reads (for progress)."""
  _, _, begin, end = where[spec.source].entries[spec.source]
  return end - begin


def _stored_float_dtype(where: Mapping[str, safetensors_io.SafetensorsFile]) -> np.dtype:
  """The checkpoint's floating dtype (of its first floating tensor)."""
  for name, file in where.items():
    stored = file.entries[name][0]
    if jnp.issubdtype(stored, jnp.floating):
      return stored
  return np.dtype(np.float32)


def _read(
    spec: _TensorSpec,
    where: Mapping[str, safetensors_io.SafetensorsFile],
    dtype: np.dtype,
    place: Callable[[tuple[str, ...], tuple[int, ...], str], jax.sharding.Sharding],
) -> pz.nx.NamedArray:
  """Reads one tensor, lays it out for Penzai, casts it and places it."""
  file = where[spec.source]  # `_check_tensors` made sure it is there, of this size.
  # Cast while reading unless a slice is taken after (then only the slice is cast).
  host = file.get(spec.source, dtype=dtype if spec.take is None else None)
  host = host.reshape(spec.shape)
  if spec.take is not None:
    dim, index = spec.take
    host = np.take(host, index, axis=dim)
  host = host.astype(dtype, copy=False)
  data = jax.device_put(host, place(spec.axes, host.shape, spec.label))
  del host
  return pz.nx.NamedArray.wrap(data).tag(*spec.axes)
