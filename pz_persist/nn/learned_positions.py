"""Learned absolute position embeddings (GPT-2's ``wpe``, OPT's
``embed_positions``), added to the token embeddings.

Penzai's transformers carry each token's position as the ``token_positions``
side input (`penzai.models.transformer.model_parts.TransformerLM` makes it
``0..seq-1``; the KV-cache sampler makes it from the cache's end), which its
rotary layers read. A learned table indexed by that same side input is
therefore right in a forward pass and in KV-cache sampling alike, with
nothing else to thread through.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from penzai import pz


@pz.pytree_dataclass
class AddLearnedPositions(pz.nn.Layer):
  """``inputs + table[token_positions + offset]``.

  Attributes:
    table: The position embeddings; its vocabulary axis indexes positions
      (``max_position_embeddings`` rows, plus ``offset``).
    positions_input_name: The side input holding each token's position. A
      position without a row gives NaN embeddings rather than a clamped row.
    offset: Added to each position before the lookup (OPT's table keeps two
      rows before position 0; GPT-2's keeps none).

  Example::

    table = pz.nn.EmbeddingTable.from_config(
        name="wpe", init_base_rng=jax.random.key(0), vocab_size=16,
        embedding_axes={"embedding": 8}, vocabulary_axis="positions")
    layer = AddLearnedPositions(table)
    out = layer(pz.nx.zeros({"seq": 4, "embedding": 8}),
                token_positions=pz.nx.arange("seq", 4))
  """

  table: pz.nn.EmbeddingTable
  positions_input_name: str = dataclasses.field(
      default="token_positions", metadata={"pytree_node": False})
  offset: int = dataclasses.field(default=0, metadata={"pytree_node": False})

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    positions = side_inputs[self.positions_input_name] + self.offset
    table = self.table.embeddings.value.untag(self.table.vocabulary_axis)
    # A position past the table reads NaN (JAX would clamp it to the last
    # row: a silently different model; transformers raises).
    rows = pz.nx.nmap(lambda t, i: t.at[i].get(mode="fill", fill_value=jnp.nan))(
        table, positions)
    return inputs + rows.astype(inputs.dtype)
