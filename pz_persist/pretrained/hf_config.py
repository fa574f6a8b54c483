"""``config.json`` of a Hugging Face checkpoint, read field by field.

Every family's mapping (`pz_persist.pretrained.hf_families`) reads the config
through `Config`, which checks each field against `SCHEMA` and records what
was read; `Config.check_all_used` then refuses any field no mapping read that
is not known to be harmless (`IGNORED_FIELDS`), so a new Hugging Face option
is an error rather than a silently different model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from pz_persist import errors

UnsupportedConfigError = errors.UnsupportedConfigError



# Fields of a Hugging Face config that never change a causal LM's forward
# pass: bookkeeping, token ids, dropout (inactive at inference), generation
# defaults and the storage dtype (we use the tensors' own dtype).
IGNORED_FIELDS = frozenset({
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
    "cache_implementation",
})

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
_STRING_LIST = (lambda value: isinstance(value, list) and all(isinstance(v, str) for v in value),
                "a list of strings")

SCHEMA: dict[str, tuple[Callable[[Any], bool], str]] = {
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
    "hidden_activation": _STRING,
    "query_pre_attn_scalar": _POSITIVE_NUMBER,
    "attn_logit_softcapping": _POSITIVE_NUMBER,
    "final_logit_softcapping": _POSITIVE_NUMBER,
    "sliding_window_size": _POSITIVE_INT,
    "layer_types": _STRING_LIST,
    "use_bidirectional_attention": _BOOLEAN,
}
"""What each ``config.json`` field the builders read must be (a JSON null
means "absent, use the default"). Sizes are positive integers: a float is
refused, never truncated, and a zero never reaches a division."""


class Config:
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
    """``value`` if it is what `SCHEMA` says ``key`` (for a nested field
    such as ``rope_parameters.rope_theta``, its last part) must be."""
    valid, expected = SCHEMA[key.rsplit(".", 1)[-1]]
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
    if value not in allowed:  # Hashable: `SCHEMA` checked the type.
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
        k: v for k, v in self.raw.items() if k not in self.used and k not in IGNORED_FIELDS
    }
    if unknown:
      key, value = next(iter(unknown.items()))
      raise self.unsupported(
          key, value,
          f"unknown configuration field{'s' if len(unknown) > 1 else ''}"
          f" {sorted(unknown)}; it may change the model's math",
      )


def rope(cfg: Config, default_theta: float) -> tuple[float, float]:
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


def bool_field(cfg: Config, key: str, default: bool, supported: bool, why: str) -> None:
  value = cfg.get(key, default)
  if value != supported:
    raise cfg.unsupported(key, value, why)


def lm_head_source(cfg: Config, tied: bool, names: set[str], head: str, embed: str) -> str:
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
