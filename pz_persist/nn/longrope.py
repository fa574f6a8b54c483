"""LongRoPE (Hugging Face's ``rope_type: "longrope"``, Phi-3 and Phi-4 long
context), optionally on a prefix of the rotated axis (Phi-4-mini's
``partial_rotary_factor``).

LongRoPE divides each of the ``d / 2`` inverse frequencies of the original
rotary embedding by its own factor: ``short_factor[i]`` while the input's
largest position ``p`` has ``p + 1 <= original_max_position_embeddings``,
``long_factor[i]`` beyond, and multiplies cos and sin by one
``attention_factor`` (given, or ``sqrt(1 + ln(factor) / ln(original))`` for
``factor > 1``, with ``factor`` given or ``max_position_embeddings /
original_max_position_embeddings``), as transformers 5 computes them
(``transformers.modeling_rope_utils``, in float32, in the same order).

transformers' Phi-3.5-MoE (``PhimoeRotaryEmbedding``) differs in two ways,
which `ApplyPhimoeLongRoPE` expresses: it recomputes its frequencies without
the sequence length, so the short factors apply at every position
(``long_factor`` is then only the checkpoint's record, written back on
export), and it multiplies cos and sin by its own ``short_mscale`` within the
original context and ``long_mscale`` beyond (``attention_factor`` and
``long_attention_factor``). It is a class of its own, not two more fields of
`ApplyLongRoPE`, so that checkpoints holding an `ApplyLongRoPE` keep loading
field for field.

As transformers, the choice of factors is made per call from the call's
largest position, and keys already in a KV cache keep the rotation of the
step that wrote them. A generation that starts within the original context
and runs past it would so attend from long-rotated queries to short-rotated
keys; transformers' ``generate`` does not (``Phi3ForCausalLM.
prepare_inputs_for_generation``): at the step whose sequence first exceeds
``original_max_position_embeddings`` tokens it drops the cache and runs the
whole sequence again, every key and value then computed with the long
factors. `LongRopeKVCachingLM` (what `pz_persist.pretrained.kv_caching_lm`
returns for a model with these layers) does the same; Penzai's own
``KVCachingTransformerLM.from_uncached`` keeps the cache, as transformers'
model called with ``past_key_values`` outside ``generate`` does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz
from penzai.models.transformer import sampling_mode

from pz_persist import errors
from pz_persist.nn._fields import static


@pz.pytree_dataclass
class ApplyLongRoPE(pz.nn.Layer):
  """Rotary position embeddings with LongRoPE's per-frequency factors.

  Used like ``pz.nn.ApplyRoPE`` (rotate-half convention; positions from the
  side input ``positions_input_name``), on the first ``rotary_dim`` entries
  of ``embedding_axis`` (all of them when None), the rest passed through.

  Attributes:
    embedding_axis: The axis rotated (``"projection"``).
    max_wavelength: The base wavelength (``rope_theta``).
    positions_input_name: The side input holding each token's position.
    short_factor: One factor per rotated pair, for inputs within
      ``original_max_position_embeddings``.
    long_factor: One factor per rotated pair, beyond.
    original_max_position_embeddings: The pretraining context length.
    factor: The context-extension factor (None: derived from
      ``max_position_embeddings``); only sets the attention factor.
    attention_factor: What cos and sin are multiplied by (None: derived).
    max_position_embeddings: The config's top-level field, read only when
      ``factor`` is None.
    rotary_dim: How many leading entries of the axis are rotated (None: all).
  """

  embedding_axis: str = static()
  max_wavelength: float = static()
  positions_input_name: str = static()
  short_factor: tuple[float, ...] = static()
  long_factor: tuple[float, ...] = static()
  original_max_position_embeddings: int = static()
  factor: float | None = static(None)
  attention_factor: float | None = static(None)
  max_position_embeddings: int | None = static(None)
  rotary_dim: int | None = static(None)

  def uses_long_factors(self) -> bool:
    """Whether ``long_factor`` replaces ``short_factor`` beyond the original
    context (`ApplyPhimoeLongRoPE` keeps the short ones)."""
    return True

  def scaling_beyond(self) -> float | None:
    """What cos and sin are multiplied by beyond the original context (None:
    `attention_scaling`, as within it)."""
    return None

  def attention_scaling(self) -> float:
    """The factor cos and sin are multiplied by (within the original
    context, and beyond it unless `scaling_beyond` says otherwise)."""
    if self.attention_factor is not None:
      return float(self.attention_factor)
    factor = self.factor
    if factor is None:
      if self.max_position_embeddings is None:
        raise errors.UnsupportedConfigError(
            "ApplyLongRoPE has neither factor nor max_position_embeddings, so its attention"
            " factor is undefined; set one of them (the checkpoint's rope_parameters.factor"
            " or top-level max_position_embeddings).")
      factor = self.max_position_embeddings / self.original_max_position_embeddings
    if factor <= 1.0:
      return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(self.original_max_position_embeddings))

  def inverse_frequencies(self, dim: int, max_position: jax.Array) -> jax.Array:
    """The ``dim // 2`` inverse frequencies (float32) for a rotated size
    ``dim``, given the current input's largest position."""
    if len(self.short_factor) != dim // 2 or len(self.long_factor) != dim // 2:
      raise errors.UnsupportedConfigError(
          f"ApplyLongRoPE has {len(self.short_factor)} short and {len(self.long_factor)} long"
          f" factors but rotates {dim} entries of {self.embedding_axis!r}, which needs"
          f" {dim // 2} of each; the layer does not fit this model.")
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    powers = np.float32(self.max_wavelength) ** exponents
    short = np.float32(1.0) / (np.asarray(self.short_factor, np.float32) * powers)
    if not self.uses_long_factors():
      return jnp.asarray(short)
    long = np.float32(1.0) / (np.asarray(self.long_factor, np.float32) * powers)
    return jnp.where(self.beyond(max_position), jnp.asarray(long), jnp.asarray(short))

  def beyond(self, max_position: jax.Array) -> jax.Array:
    """Whether an input whose largest position is ``max_position`` runs past
    the original context (transformers: ``max(position_ids) + 1 >
    original_max_position_embeddings``)."""
    return max_position.astype(jnp.int32) + 1 > self.original_max_position_embeddings

  def scaling(self, max_position: jax.Array) -> jax.Array:
    """What cos and sin are multiplied by (float32), given the current
    input's largest position."""
    within = np.float32(self.attention_scaling())
    beyond = self.scaling_beyond()
    if beyond is None:
      return jnp.asarray(within)
    return jnp.where(self.beyond(max_position), np.float32(beyond), within)

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    positions = side_inputs[self.positions_input_name]
    if self.embedding_axis in positions.named_shape or positions.positional_shape:
      raise errors.ArgumentError(
          f"ApplyLongRoPE: the positions side input must have only named axes, not"
          f" {self.embedding_axis!r}; got {positions.named_shape}.")
    size = inputs.named_shape[self.embedding_axis]
    dim = size if self.rotary_dim is None else self.rotary_dim
    max_position = jnp.max(positions.unwrap(*positions.named_shape))
    inv_freq = self.inverse_frequencies(dim, max_position)
    scaling = self.scaling(max_position)

    def rotate(vector: jax.Array, position: jax.Array) -> jax.Array:
      rotated, passed = vector[:dim], vector[dim:]
      angles = position.astype(jnp.float32) * inv_freq
      cos, sin = jnp.cos(angles) * scaling, jnp.sin(angles) * scaling
      cos, sin = cos.astype(vector.dtype), sin.astype(vector.dtype)
      first, second = jnp.split(rotated, 2)
      return jnp.concatenate([first * cos - second * sin, second * cos + first * sin, passed])

    out = pz.nx.nmap(rotate)(inputs.untag(self.embedding_axis), positions)
    return out.tag(self.embedding_axis).astype(inputs.dtype)



@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # ApplyLongRoPE's, then its own.
class ApplyPhimoeLongRoPE(ApplyLongRoPE):
  """Phi-3.5-MoE's LongRoPE, as transformers computes it: the short factors
  at every position (``long_factor`` kept only as the checkpoint's record),
  cos and sin multiplied by ``attention_factor`` (``short_mscale``) within
  the original context and by ``long_attention_factor`` (``long_mscale``)
  beyond.

  Example:
    >>> from pz_persist.nn.longrope import ApplyPhimoeLongRoPE
    >>> rope = ApplyPhimoeLongRoPE(
    ...     embedding_axis="projection", max_wavelength=10_000.0,
    ...     positions_input_name="token_positions", short_factor=(1.0, 1.0),
    ...     long_factor=(4.0, 4.0), original_max_position_embeddings=8,
    ...     attention_factor=1.0, long_attention_factor=1.2)
    >>> rope.uses_long_factors(), rope.scaling_beyond()
    (False, 1.2)

  Attributes:
    long_attention_factor: What cos and sin are multiplied by beyond the
      original context.
  """

  long_attention_factor: float | None = static(None)

  def uses_long_factors(self) -> bool:
    return False

  def scaling_beyond(self) -> float | None:
    return self.long_attention_factor

@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # Penzai's sampler's fields, then ours.
class LongRopeKVCachingLM(sampling_mode.KVCachingTransformerLM):
  """Penzai's KV-cache sampler that, like transformers' ``generate`` for
  Phi-3, recomputes the cache when the sequence crosses LongRoPE's original
  context.

  transformers (``Phi3ForCausalLM.prepare_inputs_for_generation``) drops the
  cache on the call whose sequence (cached tokens plus new ones, padding
  included) first holds more than ``original_max_position_embeddings``
  tokens while the cache holds at most that many, and runs the whole
  sequence again: the keys and values of every position are then those of
  the long factors. This sampler does the same on such a call: it runs the
  tokens so far and the new ones from position 0, rewriting every cache, and
  returns the logits of the new tokens. Other calls are Penzai's.

  Works called eagerly (the crossing decided in Python) and inside
  ``jax.jit`` (the two paths under ``jax.lax.cond``); the recomputation runs
  ``max(recompute_at) + len(tokens)`` positions (at most ``cache_len``),
  where the cache slots past the sequence get values that later calls
  overwrite before they can be attended to (their positions lie ahead of
  every query until then).

  Attributes:
    recompute_at: The ``original_max_position_embeddings`` of the model's
      `ApplyLongRoPE` layers.
  """

  recompute_at: tuple[int, ...] = static(())

  @classmethod
  def wrapping(cls, sampler: sampling_mode.KVCachingTransformerLM,
               recompute_at: tuple[int, ...]) -> LongRopeKVCachingLM:
    """``sampler`` (Penzai's, with its caches and state) recomputing at
    ``recompute_at``."""
    fields = {f.name: getattr(sampler, f.name) for f in dataclasses.fields(sampler)}
    return cls(**fields, recompute_at=tuple(sorted(set(recompute_at))))

  def crosses(self, start: jax.Array | int, length: int) -> jax.Array | bool:
    """Whether a call of ``length`` tokens after ``start`` cached ones
    crosses an original context (as transformers decides it: the cache holds
    at most that many tokens, the sequence more)."""
    crossing: jax.Array | bool = False
    for limit in self.recompute_at:
      crossing = crossing | ((start > 0) & (start <= limit) & (start + length > limit))
    return crossing

  def __call__(self, tokens: pz.nx.NamedArray, **extra_side_inputs) -> pz.nx.NamedArray:
    start = self.cache_end_index.value
    crossing = self.crosses(start, tokens.named_shape["seq"])
    if not isinstance(crossing, jax.core.Tracer):
      if bool(crossing):
        return self._recompute(tokens, extra_side_inputs)
      return super().__call__(tokens, **extra_side_inputs)
    slots, variables = pz.unbind_state_vars(self)

    def path(recompute: bool):
      def run(frozen, tokens):
        state = [value.unfreeze_as_copy() for value in frozen]
        sampler = pz.bind_variables(slots, state)
        if recompute:
          out = sampler._recompute(tokens, extra_side_inputs)  # pylint: disable=protected-access
        else:
          out = sampling_mode.KVCachingTransformerLM.__call__(sampler, tokens,
                                                              **extra_side_inputs)
        return out, [variable.freeze() for variable in state]
      return run

    out, frozen = jax.lax.cond(crossing, path(True), path(False),
                               [variable.freeze() for variable in variables], tokens)
    for variable, value in zip(variables, frozen):
      variable.value = value.value
    return out

  def _recompute(self, tokens: pz.nx.NamedArray, extra_side_inputs: dict[str, Any]
                 ) -> pz.nx.NamedArray:
    """Runs the sequence so far plus ``tokens`` from position 0 (every cache
    rewritten) and returns the logits of ``tokens``."""
    start = self.cache_end_index.value
    length = tokens.named_shape["seq"]
    span = min(self.cache_len, max(self.recompute_at) + length)
    sequence = pz.nx.nmap(jax.lax.dynamic_update_slice)(
        self.previous_tokens.value.untag("seq"), tokens.untag("seq"), (start,)).tag("seq")
    self.cache_end_index.value = 0
    out = super().__call__(sequence[{"seq": pz.slice[:span]}], **extra_side_inputs)
    self.cache_end_index.value = start + length
    new = pz.nx.nmap(lambda logits: jax.lax.dynamic_slice_in_dim(logits, start, length))(
        out.untag("seq")).tag("seq")
    return new.order_like(out)  # Penzai's order of axes, as a call without recomputing.
