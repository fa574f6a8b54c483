"""Learned absolute position embeddings, added to the token embeddings.

Penzai's architectures position tokens with rotary embeddings only. OPT
(and GPT-2) instead learn one vector per position and add it to the token
embeddings before the first block. OPT's table also starts two rows late:
transformers' ``OPTLearnedPositionalEmbedding`` looks position ``p`` up at
row ``p + 2`` (a leftover of fairseq's padding rows), so the table holds
``max_position_embeddings + 2`` rows and the first two are never read for an
unpadded sequence. `AddLearnedPositions` keeps that offset as a static field,
so the same layer serves a table without one (``offset=0``).

The positions come from the ``token_positions`` side input Penzai's
``TransformerLM`` passes to its body (``arange`` over ``seq`` for a forward
pass, the cache's positions in `penzai.models.transformer.sampling_mode`), so
KV-cache sampling needs nothing of its own. A position the table lacks (past
``max_position_embeddings``) gives NaN, never another position's row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from penzai import pz

from pz_persist.nn._fields import static


@pz.pytree_dataclass
class AddLearnedPositions(pz.nn.Layer):
  """Adds ``embeddings[token_positions + offset]`` to its input.

  Attributes:
    embeddings: The position table, a parameter over ``positions`` and the
      embedding axis (Hugging Face's ``embed_positions.weight``, whole).
    offset: The row of position 0 (2 for OPT).
    positions_input_name: The side input holding each token's position.

  Example::

    layer = AddLearnedPositions(
        embeddings=pz.Parameter(label="positions",
                                value=pz.nx.zeros({"positions": 16, "embedding": 8})),
        offset=2)
    out = layer(pz.nx.zeros({"seq": 4, "embedding": 8}),
                token_positions=pz.nx.arange("seq", 4))
  """

  embeddings: pz.ParameterLike[pz.nx.NamedArray]
  offset: int = static(0)
  positions_input_name: str = static("token_positions")

  def __call__(self, value: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    positions = side_inputs[self.positions_input_name]
    table = self.embeddings.value.untag("positions")
    rows = pz.nx.nmap(self._row)(table, positions)
    return value + rows.astype(value.dtype)

  def _row(self, table: jax.Array, position: jax.Array) -> jax.Array:
    """Row ``position + offset``, or NaN for a position the table lacks.

    Why NaN: JAX's gather would clamp an out-of-range index to the last row
    (and wrap a negative one), silently computing a different model where
    transformers fails; NaN logits cannot be mistaken for an answer, and a
    check inside a compiled step could not raise.
    """
    index = position + self.offset
    held = (index >= 0) & (index < table.shape[0])
    return jnp.where(held, table[jnp.clip(index, 0, table.shape[0] - 1)], jnp.nan)

  def treescope_color(self) -> str:
    return "#65cfbc"  # Penzai's colour for its own learned additions (AddBias).
