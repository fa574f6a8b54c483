"""The pieces of Llama 4's attention that Penzai's llama-like attention lacks.

- `ApplyChunkedCausalAttentionMask`: most Llama 4 layers attend only within
  chunks of ``attention_chunk_size`` positions (a query at position ``q``
  sees keys ``k <= q`` with ``k // size == q // size``).
- `TemperatureTuning`: on its NoPE layers (no rotary embedding) the queries
  are multiplied by ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))``
  at position ``p``, sharpening attention far into long contexts.
- `ApplyInterleavedRoPE`: Llama 4 rotates adjacent pairs of each head's
  dimensions (``2i``, ``2i + 1``: a complex number each, as Meta's code does)
  where Penzai's ``ApplyRoPE`` rotates the first half against the second.

All read token positions from the ``token_positions`` side input, which
Penzai's KV-cache sampling mode provides for the new tokens (and, for the
mask, ``kv_token_positions`` for the cached keys: the mask subclasses
``pz.nn.ApplyCausalAttentionMask`` so that the sampling mode rewires it as it
rewires Penzai's own masks), so sampling token by token gives the logits of a
forward pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from pz_persist import errors
from pz_persist.nn.scaled_rope import ApplyScaledRoPE


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # Penzai's mask's fields, then ours.
class ApplyChunkedCausalAttentionMask(pz.nn.ApplyCausalAttentionMask):
  """A causal mask that also masks keys outside the query's chunk.

  Attributes:
    chunk_size: ``attention_chunk_size``: positions ``[n * size, (n + 1) *
      size)`` form chunk ``n``.
  """

  chunk_size: int = dataclasses.field(default=8192, metadata={"pytree_node": False})

  def __call__(self, x: pz.nx.NamedArray, **side_inputs: Any) -> pz.nx.NamedArray:
    query_positions = side_inputs[self.query_positions_input_name]
    kv_positions = (side_inputs[self.kv_positions_input_name]
                    .untag(self.seq_axis).tag(self.kv_seq_axis))
    mask = ((query_positions >= kv_positions)
            & (query_positions // self.chunk_size == kv_positions // self.chunk_size)
            & (kv_positions >= 0))
    return pz.nx.nmap(jnp.where)(mask, x, jnp.asarray(self.masked_out_value, dtype=x.dtype))


@pz.pytree_dataclass
class TemperatureTuning(pz.nn.Layer):
  """Multiplies the queries by ``1 + attn_scale * log1p(floor((p + 1) /
  floor_scale))`` at token position ``p`` (in float32, cast back), as
  transformers' ``Llama4TextAttention`` does on NoPE layers.

  Attributes:
    floor_scale: ``floor_scale``.
    attn_scale: ``attn_scale``.
    positions_input_name: The side input holding each token's position.
  """

  floor_scale: float = dataclasses.field(metadata={"pytree_node": False})
  attn_scale: float = dataclasses.field(metadata={"pytree_node": False})
  positions_input_name: str = dataclasses.field(default="token_positions",
                                                metadata={"pytree_node": False})

  def __call__(self, queries: pz.nx.NamedArray, **side_inputs: Any) -> pz.nx.NamedArray:
    positions = side_inputs[self.positions_input_name]

    def scale(position: jax.Array) -> jax.Array:
      steps = jnp.floor((position.astype(jnp.float32) + 1.0) / jnp.float32(self.floor_scale))
      return jnp.log1p(steps) * jnp.float32(self.attn_scale) + 1.0

    factor = pz.nx.nmap(scale)(positions)
    return (queries.astype(jnp.float32) * factor).astype(queries.dtype)


@pz.pytree_dataclass
class ApplyInterleavedRoPE(pz.nn.Layer):
  """Rotary embeddings on adjacent pairs of ``embedding_axis``.

  The frequencies (and scaling) are those of ``rope``, a ``pz.nn.ApplyRoPE``
  or an `ApplyScaledRoPE` (Llama 4 Scout's ``llama3`` scaling), kept as a
  field so that its settings are written back to ``config.json`` as for
  other families; only the pairing of dimensions differs.

  Attributes:
    rope: The rotary embedding whose frequencies, axis and positions input
      are used.
  """

  rope: pz.nn.ApplyRoPE | ApplyScaledRoPE

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs: Any) -> pz.nx.NamedArray:
    rope = self.rope
    positions = side_inputs[rope.positions_input_name]
    if rope.embedding_axis in positions.named_shape or positions.positional_shape:
      raise errors.ArgumentError(
          f"the positions side input {positions.named_shape} must be named and not hold the"
          f" embedding axis {rope.embedding_axis!r}.")
    dim = inputs.named_shape[rope.embedding_axis]
    if isinstance(rope, ApplyScaledRoPE):
      max_position = None
      if rope.rope_type == "dynamic":
        max_position = jnp.max(positions.unwrap(*positions.named_shape))
      inv_freq = rope.inverse_frequencies(dim, max_position)
      scaling = rope.attention_scaling()
    else:
      exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
      inv_freq = jnp.asarray(np.float32(1.0) / (np.float32(rope.max_wavelength) ** exponents))
      scaling = 1.0

    def rotate(vector: jax.Array, position: jax.Array) -> jax.Array:
      angles = position.astype(jnp.float32) * inv_freq
      cos, sin = jnp.cos(angles) * scaling, jnp.sin(angles) * scaling
      pairs = vector.astype(jnp.float32).reshape(-1, 2)
      real, imag = pairs[:, 0], pairs[:, 1]
      return jnp.stack([real * cos - imag * sin, real * sin + imag * cos], axis=-1).reshape(-1)

    out = pz.nx.nmap(rotate)(inputs.untag(rope.embedding_axis), positions)
    return out.tag(rope.embedding_axis).astype(inputs.dtype)
