"""``config.json`` of a Hugging Face checkpoint, read field by field.

Every family's mapping (`pz_persist.pretrained.hf.families`) reads the config
through `Config`, which checks each field against `SCHEMA` and records what
was read; `Config.check_all_used` then refuses any field no mapping read that
is not known to be harmless (`IGNORED_FIELDS`), so a new Hugging Face option
is an error rather than a silently different model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from pz_persist.nn.scaled_rope import SCALING_KEYS
from pz_persist.pretrained import errors

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


def _non_negative_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _string_list(value: Any) -> bool:
  return isinstance(value, list) and all(isinstance(item, str) for item in value)


POSITIVE_INT = (_positive_int, "a positive integer")
POSITIVE_NUMBER = (_positive_number, "a positive finite number")
_FRACTION = (_fraction, "a number in (0, 1]")
BOOLEAN = (lambda value: isinstance(value, bool), "true or false")
STRING = (lambda value: isinstance(value, str), "a string")
OBJECT = (lambda value: isinstance(value, dict), "a JSON object")
NON_NEGATIVE_INT = (_non_negative_int, "a non-negative integer")
_STRING_LIST = (_string_list, "a list of strings")
NON_NEGATIVE_NUMBER = (lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)
                       and 0 <= value < float("inf"), "a non-negative finite number")
ANY = (lambda value: True, "anything")
"""The field checks above are shared by the families' own ``fields``: a check
and what it says a value must be."""

SCHEMA: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model_type": STRING,
    "hidden_size": POSITIVE_INT,
    "num_attention_heads": POSITIVE_INT,
    "num_key_value_heads": POSITIVE_INT,
    "head_dim": POSITIVE_INT,
    "intermediate_size": POSITIVE_INT,
    "num_hidden_layers": POSITIVE_INT,
    "vocab_size": POSITIVE_INT,
    "sliding_window": POSITIVE_INT,
    "rms_norm_eps": POSITIVE_NUMBER,
    "layer_norm_eps": POSITIVE_NUMBER,
    "rope_theta": POSITIVE_NUMBER,
    "rotary_emb_base": POSITIVE_NUMBER,
    "rotary_pct": _FRACTION,
    "partial_rotary_factor": _FRACTION,
    "tie_word_embeddings": BOOLEAN,
    "attention_bias": BOOLEAN,
    "mlp_bias": BOOLEAN,
    "use_parallel_residual": BOOLEAN,
    "hidden_act": STRING,
    "rope_scaling": OBJECT,
    "rope_parameters": OBJECT,
    "rope_type": STRING,
    "type": STRING,
    "use_sliding_window": BOOLEAN,
    "max_window_layers": NON_NEGATIVE_INT,
    "layer_types": _STRING_LIST,
    "use_mrope": BOOLEAN,
    # Gemma / Gemma 2.
    "hidden_activation": STRING,
    "use_bidirectional_attention": BOOLEAN,
    "query_pre_attn_scalar": POSITIVE_NUMBER,
    "attn_logit_softcapping": POSITIVE_NUMBER,
    "final_logit_softcapping": POSITIVE_NUMBER,
    "sliding_window_size": POSITIVE_INT,
    # RoPE scaling (the keys of `scaled_rope.SCALING_KEYS`).
    "max_position_embeddings": POSITIVE_INT,
    "factor": POSITIVE_NUMBER,
    "original_max_position_embeddings": POSITIVE_INT,
    "low_freq_factor": POSITIVE_NUMBER,
    "high_freq_factor": POSITIVE_NUMBER,
    "attention_factor": POSITIVE_NUMBER,
    "beta_fast": POSITIVE_NUMBER,
    "beta_slow": POSITIVE_NUMBER,
    "mscale": POSITIVE_NUMBER,
    "mscale_all_dim": POSITIVE_NUMBER,
    "truncate": BOOLEAN,
}
"""What each ``config.json`` field the builders read must be (a JSON null
means "absent, use the default"). Sizes are positive integers: a float is
refused, never truncated, and a zero never reaches a division."""


FROM_TABLE: Any = type("FromTable", (), {"__repr__": lambda self: "FROM_TABLE"})()
"""A `Config.get` default meaning "the family's row of
`pz_persist.pretrained.hf.families.DEFAULTS` has it"."""


DERIVED = frozenset({"num_key_value_heads", "head_dim"})
"""Fields whose absence transformers' config classes fill from other fields
(as many key/value heads as heads; ``hidden_size // num_attention_heads``),
as the mappings do, unless the family's row of the table has a fixed value."""


class Config:
  """A ``config.json`` dict that records which fields were consulted.

  Builders read fields through `get` / `require`; `check_all_used` then
  refuses any field nobody read that is not known to be harmless, so a new
  Hugging Face option is an error rather than a silently different model.
  """

  def __init__(self, raw: Mapping[str, Any], where: str,
               fields: Mapping[str, tuple[Callable[[Any], bool], str]] | None = None,
               defaults: Mapping[str, Any] | None = None,
               ignored: frozenset[str] = frozenset()):
    """``fields``: the family's own fields, checked like `SCHEMA`'s
    (`pz_persist.pretrained.hf.record.Family.fields`). ``defaults``: the
    ``model_type``'s row of `pz_persist.pretrained.hf.families.DEFAULTS`,
    transformers' config class's value of each field a plan may find absent.
    ``ignored``: the fields its plan deliberately leaves unread
    (`pz_persist.pretrained.hf.record.ModelType.ignored`)."""
    self.raw = dict(raw)
    self.where = where
    self.used: set[str] = set()
    self.schema = {**SCHEMA, **(fields or {})}
    self.defaults = dict(defaults or {})
    self.ignored = ignored
    self.fallbacks: dict[str, Any] = {}
    """The absent fields a plan read with a default of its own, not the
    table's (none, for every family: a test loads each from a config.json
    of sizes alone and checks)."""

  def fill_absent(self, sizes: Mapping[str, Any]) -> None:
    """Sets each of ``sizes`` that the config lacks or holds as null, before
    anything reads it: sizes a family's config class fills in itself, which
    the plan then reads (and checks) like any field of the file."""
    for key, value in sizes.items():
      if self.raw.get(key) is None:
        self.raw[key] = value

  def get(self, key: str, default: Any = None) -> Any:
    """``key``'s checked value. If absent (or null): None when ``default``
    is None (the caller asks whether it is there), else the table's default
    (``defaults``), or ``default`` where the table has none."""
    self.used.add(key)
    value = self.raw.get(key)
    if value is not None:
      return self.checked(key, value)
    return None if default is None else self.default(key, default)

  def default(self, key: str, fallback: Any) -> Any:
    """What an absent ``key`` means: the table's value, else ``fallback``
    (recorded in `fallbacks` unless None)."""
    if key in self.defaults:
      return self.defaults[key]
    if fallback is FROM_TABLE:
      raise AssertionError(f"{key!r} has no default in families.DEFAULTS (its record's"
                           f" ModelType.defaults) for"
                           f" {self.where} (a bug: please report it)")
    if fallback is not None and key not in DERIVED:
      self.fallbacks[key] = fallback
    return fallback

  def nullable(self, key: str, default: Any) -> Any:
    """``key``'s value; ``default`` if the field is absent, None if it is an
    explicit null (transformers' configs say "off" that way: a window or a
    soft cap of null, where an absent one takes the family's default)."""
    if key in self.raw and self.raw[key] is None:
      self.used.add(key)
      return None
    return self.get(key, default)

  def require(self, key: str) -> Any:
    """``key``'s checked value; if absent, the table's default, or refused
    when the table has none (a size transformers' default would make huge)."""
    self.used.add(key)
    if self.raw.get(key) is None:
      if key in self.defaults:
        return self.defaults[key]
      raise errors.UnsupportedConfigError(f"{self.where}: required field {key!r} is missing.")
    return self.checked(key, self.raw[key])

  def checked(self, key: str, value: Any) -> Any:
    """``value`` if it is what `SCHEMA` says ``key`` (for a nested field
    such as ``rope_parameters.rope_theta``, its last part) must be."""
    valid, expected = self.schema[key.rsplit(".", 1)[-1]]
    if not valid(value):
      raise self.invalid(key, value, expected)
    return value

  def invalid(self, key: str, value: Any, expected: str, detail: str = "") -> errors.UnsupportedConfigError:
    return errors.UnsupportedConfigError(
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

  def unsupported(self, key: str, value: Any, why: str) -> errors.UnsupportedConfigError:
    return errors.UnsupportedConfigError(
        f"{self.where}: {key}={value!r} is not supported by pz_persist's"
        f" Hugging Face loader ({why}); nothing was loaded, rather than risk a"
        " converted model that computes something different."
    )

  def check_all_used(self) -> None:
    """Refuses the fields no plan read, unless harmless for every family
    (`IGNORED_FIELDS`) or declared ignored by this ``model_type``'s record
    (``ignored``, whose values are still checked against the schema)."""
    for key in sorted(self.ignored - self.used):
      if self.raw.get(key) is not None and key in self.schema:
        self.checked(key, self.raw[key])
    unknown = {
        k: v for k, v in self.raw.items()
        if k not in self.used and k not in IGNORED_FIELDS and k not in self.ignored
    }
    if unknown:
      key, value = next(iter(unknown.items()))
      raise self.unsupported(
          key, value,
          f"unknown configuration field{'s' if len(unknown) > 1 else ''}"
          f" {sorted(unknown)}; it may change the model's math",
      )


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A checkpoint's validated ``rope_scaling``.

  Attributes:
    rope_type: One of `scaled_rope.SCALING_KEYS` (never ``"default"``).
    fields: The other keys of the dict that the rope type reads, each
      checked against `SCHEMA`, with the values transformers derives when
      they are absent filled in (``original_max_position_embeddings`` from
      ``max_position_embeddings``; yarn's ``factor`` as their ratio), plus
      ``max_position_embeddings`` for ``dynamic``: exactly the keyword
      arguments of `scaled_rope.ApplyScaledRoPE` besides its first three.
  """

  rope_type: str
  fields: Mapping[str, int | float | bool]


_ROPE_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})


def rope(cfg: Config, default_theta: float) -> tuple[float, float]:
  """RoPE base wavelength and partial-rotary fraction, refusing scaled RoPE.

  For families whose Penzai layer implements only the original ("default")
  rotary embedding; `scaled_rope` reads scaling too.
  """
  theta, fraction, _ = _read_rope(cfg, default_theta, None)
  return theta, fraction


def scaled_rope(
    cfg: Config, default_theta: float, default_max_positions: int
) -> tuple[float, float, RopeScaling | None]:
  """RoPE base wavelength, partial-rotary fraction and scaling (None: unscaled).

  transformers < 5 writes ``rope_theta`` and ``rope_scaling`` (whose type is
  ``rope_type``, or ``type`` in older files); transformers 5 writes
  ``rope_parameters`` (``rope_type``, ``rope_theta``,
  ``partial_rotary_factor`` and the scaling keys). Either is read; each key
  the rope type does not read is refused, naming it, as is every value of
  the wrong type or range. ``max_position_embeddings`` (default
  ``default_max_positions``, the family's transformers default) is read only
  when the rope type needs it: ``dynamic``, or ``llama3`` / ``yarn``
  without ``original_max_position_embeddings``.
  """
  return _read_rope(cfg, default_theta, default_max_positions)


def _read_rope(
    cfg: Config, default_theta: float, default_max_positions: int | None
) -> tuple[float, float, RopeScaling | None]:
  """`scaled_rope`, or `rope` when ``default_max_positions`` is None."""
  key, params = _rope_dict(cfg)
  rope_type = _agreeing(cfg, key, params, "rope_type", "type", "default")
  if rope_type != "default" and (default_max_positions is None or rope_type not in SCALING_KEYS):
    why = (f"supported rope types: {['default', *sorted(SCALING_KEYS)]}"
           if default_max_positions is not None
           else "this family's Penzai layer implements only unscaled ('default') RoPE")
    raise cfg.unsupported(f"{key}.rope_type", rope_type, why)
  required, optional = SCALING_KEYS.get(rope_type, (frozenset(), frozenset()))
  unknown = sorted(set(params) - _ROPE_COMMON_KEYS - required - optional)
  if unknown:
    raise cfg.unsupported(
        f"{key}.{unknown[0]}", params[unknown[0]],
        f"rope_type {rope_type!r} reads only {sorted(_ROPE_COMMON_KEYS | required | optional)}",
    )
  theta = _agreeing(cfg, key, params, "rope_theta", "rope_theta", default_theta, top_level=True)
  fraction = _agreeing(cfg, key, params, "partial_rotary_factor", "partial_rotary_factor", 1.0,
                       top_level=True)
  if rope_type == "default":
    return float(theta), float(fraction), None
  assert default_max_positions is not None  # Refused above otherwise.
  return float(theta), float(fraction), _scaling(cfg, key, params, rope_type, default_max_positions)


def _scaling(cfg: Config, key: str, params: Mapping[str, Any], rope_type: str,
             default_max_positions: int) -> RopeScaling:
  """The scaling fields of ``params`` (whose keys are known), checked, with
  the values transformers derives for absent ones filled in."""
  required, optional = SCALING_KEYS[rope_type]
  fields = {
      field: cfg.checked(f"{key}.{field}", params[field])
      for field in sorted(required | optional) if params.get(field) is not None
  }

  def max_positions() -> int:
    return cfg.get("max_position_embeddings", default_max_positions)

  if "original_max_position_embeddings" in required:
    fields.setdefault("original_max_position_embeddings", max_positions())
  if rope_type == "yarn" and "factor" not in fields:
    fields["factor"] = max_positions() / fields["original_max_position_embeddings"]
  if rope_type == "dynamic":
    fields["max_position_embeddings"] = max_positions()
  for field in sorted(required):
    if field not in fields:
      raise cfg.unsupported(f"{key}.{field}", None, f"rope_type {rope_type!r} requires it")
  # Equal factors leave no band to blend (Llama 4 Scout's 1 and 1: every
  # wavelength beyond the original context divided by ``factor``, the rest
  # kept), which transformers computes and `ApplyScaledRoPE` too; a high
  # factor below the low one turns the band inside out (transformers warns).
  if rope_type == "llama3" and fields["high_freq_factor"] < fields["low_freq_factor"]:
    raise cfg.unsupported(
        f"{key}.high_freq_factor", fields["high_freq_factor"],
        f"must be at least low_freq_factor={fields['low_freq_factor']}",
    )
  return RopeScaling(rope_type, fields)


def _rope_dict(cfg: Config) -> tuple[str, dict[str, Any]]:
  """The RoPE dict (``rope_parameters`` or ``rope_scaling``) and its key;
  both are read, and refused if they disagree."""
  found = {key: cfg.get(key) for key in ("rope_parameters", "rope_scaling")}
  found = {key: value for key, value in found.items() if value}
  if len(found) == 2 and found["rope_parameters"] != found["rope_scaling"]:
    raise cfg.unsupported(
        "rope_scaling", found["rope_scaling"],
        f"rope_parameters={found['rope_parameters']!r:.200} says otherwise; keep one of them",
    )
  key = next(iter(found), "rope_scaling")
  return key, found.get(key, {})


def _agreeing(cfg: Config, key: str, params: Mapping[str, Any], name: str, other: str,
              default: Any, top_level: bool = False) -> Any:
  """``params[name]``, which must agree with ``params[other]`` (or, with
  ``top_level``, the config's own ``other`` field) when both are given."""
  value = params.get(name)
  value = None if value is None else cfg.checked(f"{key}.{name}", value)
  if top_level:
    second, where = cfg.get(other), other
  else:
    second, where = params.get(other), f"{key}.{other}"
    second = None if second is None else cfg.checked(where, second)
  if value is not None and second is not None and value != second:
    raise cfg.unsupported(where, second, f"{key}.{name}={value!r} says otherwise")
  found = next((v for v in (value, second) if v is not None), None)
  if found is not None:
    return found
  # A top-level field's absence means the family's default (the table's).
  return cfg.default(name, default) if top_level else default


TANH_GELU = frozenset({"gelu_pytorch_tanh", "gelu_fast", "gelu_new"})
"""``hidden_act`` names transformers computes with the same tanh formula,
0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) (``gelu_fast`` writes it
x·0.7978845608·(1 + 0.044715·x²)): Penzai's approximate GELU
(``jax.nn.gelu(approximate=True)``)."""


def bool_field(cfg: Config, key: str, default: bool, supported: bool, why: str) -> None:
  value = cfg.get(key, default)
  if value != supported:
    raise cfg.unsupported(key, value, why)


def lm_head_source(cfg: Config, tied: bool, weights: Any, head: str, embed: str) -> str:
  """The tensor holding the output projection: the stored head when there is
  one, else the embeddings if tied.

  transformers 5 ties the head to the embeddings only when the checkpoint
  lacks the head or holds it equal to the embeddings: a stored head that
  differs is kept untied even under ``tie_word_embeddings: true`` (with a
  warning). Reading the stored head whenever there is one gives exactly
  that, without comparing the two: equal, they are the same values.
  ``weights`` (a folder's `pz_persist.pretrained.hf.weights.Weights`, or
  export's stand-in, which holds every head name) gives the names stored.

  Penzai's ``tie_embedder_and_logits`` also rescales the input embeddings by
  sqrt(embedding_dim) (a Gemma convention), so tied Llama-style models are
  built untied, with the embedding table loaded a second time as the head.
  """
  if tied and getattr(weights, "stand_in", False):
    return embed  # Export: a tied model is written as the embeddings alone.
  if head in weights.names:
    return head
  if tied:
    return embed
  raise cfg.unsupported(
      "tie_word_embeddings", cfg.raw.get("tie_word_embeddings"),
      f"the checkpoint has no {head!r} tensor, so the output projection"
      " would be missing; set tie_word_embeddings=true if it is tied",
  )


def refuse_stored_head(cfg: Config, weights: Any, head: str, why: str) -> None:
  """Refuses a stored output head for a family whose Penzai model ties the
  head to the embeddings (Gemma; ``why`` says so). Called once the config
  is checked, as it reads the weights' names.

  Why: transformers 5 uses a stored head, untied, when it differs from the
  embeddings, which the tied Penzai model cannot hold; telling that from an
  equal copy would mean reading both tables before anything is checked.
  """
  if head in weights.names and not getattr(weights, "stand_in", False):
    raise cfg.unsupported(
        "tie_word_embeddings", cfg.raw.get("tie_word_embeddings", True),
        f"the checkpoint also stores {head!r}, which transformers 5 uses instead of the"
        f" embeddings when the two differ; {why}. Remove the tensor if it equals the"
        " embeddings")
