"""Gemma 4's "proportional" rotary embedding: only a fraction of each
head's dimensions rotate, the frequencies still spaced over the whole head.

Gemma 4's global (full-attention) layers use transformers' ``proportional``
rope type: with ``head_dim`` ``d`` and ``partial_rotary_factor`` ``f``, the
first ``a = int(f * d // 2)`` inverse frequencies are ``base ** (-2i / d)``
(the spacing of a full-width rotation, not of an ``f * d``-wide one) and the
other ``d / 2 - a`` are zero, then all are divided by ``factor``. The
rotation is the usual rotate-half one over the whole head, so the zero
frequencies leave their pairs ``(x_j, x_{j + d/2})`` unchanged. Neither
Penzai's ``ApplyRoPE`` (frequencies spaced over the rotated width) nor its
``ApplyRoPEToSubset`` (a contiguous prefix rotates) computes that.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from penzai import pz


@pz.pytree_dataclass
class ApplyProportionalRoPE(pz.nn.Layer):
  """Rotates ``embedding_axis`` by the positions side input, with only the
  first ``int(rotated_fraction * d // 2)`` frequency pairs non-zero.

  Attributes:
    embedding_axis: The axis rotated (``projection``).
    max_wavelength: The base (``rope_theta``).
    rotated_fraction: ``partial_rotary_factor``, exactly as the config says.
    factor: The divisor of every frequency (``factor``, 1 by default).
    positions_input_name: The side input holding each token's position.
  """

  embedding_axis: str = dataclasses.field(metadata={"pytree_node": False})
  max_wavelength: float = dataclasses.field(metadata={"pytree_node": False})
  rotated_fraction: float = dataclasses.field(metadata={"pytree_node": False})
  factor: float = dataclasses.field(default=1.0, metadata={"pytree_node": False})
  positions_input_name: str = dataclasses.field(default="token_positions",
                                                metadata={"pytree_node": False})

  def inverse_frequencies(self, dim: int) -> jnp.ndarray:
    """The ``dim / 2`` inverse frequencies, as transformers computes them
    (float32)."""
    rotated = int(self.rotated_fraction * dim // 2)
    exponents = jnp.arange(0, 2 * rotated, 2, dtype=jnp.float32) / dim
    inv = 1.0 / (jnp.float32(self.max_wavelength) ** exponents)
    inv = jnp.concatenate([inv, jnp.zeros((dim // 2 - rotated,), jnp.float32)])
    return inv / jnp.float32(self.factor)

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    positions = side_inputs[self.positions_input_name]
    dim = inputs.named_shape[self.embedding_axis]
    inv = self.inverse_frequencies(dim)

    def rotate(x: jnp.ndarray, position: jnp.ndarray) -> jnp.ndarray:
      angles = position.astype(jnp.float32) * inv
      angles = jnp.concatenate([angles, angles])
      cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
      half = dim // 2
      rotated = jnp.concatenate([-x[half:], x[:half]])
      return x * cos + rotated * sin

    out = pz.nx.nmap(rotate)(inputs.untag(self.embedding_axis), positions)
    return out.tag(self.embedding_axis).astype(inputs.dtype)
