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

As transformers, the choice of factors is made per call from the call's
largest position: a fresh model's call, and each step of token-by-token
generation in Penzai's KV-cache sampling mode (keys already cached keep the
rotation of the step that wrote them, as in transformers' cache), agree with
transformers' ``generate``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from pz_persist import errors


def _static(default: Any = dataclasses.MISSING) -> Any:
  return dataclasses.field(default=default, metadata={"pytree_node": False})


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

  embedding_axis: str = _static()
  max_wavelength: float = _static()
  positions_input_name: str = _static()
  short_factor: tuple[float, ...] = _static()
  long_factor: tuple[float, ...] = _static()
  original_max_position_embeddings: int = _static()
  factor: float | None = _static(None)
  attention_factor: float | None = _static(None)
  max_position_embeddings: int | None = _static(None)
  rotary_dim: int | None = _static(None)

  def attention_scaling(self) -> float:
    """The factor cos and sin are multiplied by."""
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
    long = np.float32(1.0) / (np.asarray(self.long_factor, np.float32) * powers)
    use_long = max_position.astype(jnp.int32) + 1 > self.original_max_position_embeddings
    return jnp.where(use_long, jnp.asarray(long), jnp.asarray(short))

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    positions = side_inputs[self.positions_input_name]
    if self.embedding_axis in positions.named_shape or positions.positional_shape:
      raise errors.ArgumentError(
          f"ApplyLongRoPE: the positions side input must have only named axes, not"
          f" {self.embedding_axis!r}; got {positions.named_shape}.")
    size = inputs.named_shape[self.embedding_axis]
    dim = size if self.rotary_dim is None else self.rotary_dim
    inv_freq = self.inverse_frequencies(dim, jnp.max(positions.unwrap(*positions.named_shape)))
    scaling = np.float32(self.attention_scaling())

    def rotate(vector: jax.Array, position: jax.Array) -> jax.Array:
      rotated, passed = vector[:dim], vector[dim:]
      angles = position.astype(jnp.float32) * inv_freq
      cos, sin = jnp.cos(angles) * scaling, jnp.sin(angles) * scaling
      cos, sin = cos.astype(vector.dtype), sin.astype(vector.dtype)
      first, second = jnp.split(rotated, 2)
      return jnp.concatenate([first * cos - second * sin, second * cos + first * sin, passed])

    out = pz.nx.nmap(rotate)(inputs.untag(self.embedding_axis), positions)
    return out.tag(self.embedding_axis).astype(inputs.dtype)
