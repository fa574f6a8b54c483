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
KV-cache sampling needs nothing of its own.
"""

from __future__ import annotations

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
  """

  embeddings: pz.ParameterLike[pz.nx.NamedArray]
  offset: int = static(0)
  positions_input_name: str = static("token_positions")

  def __call__(self, value: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    positions = side_inputs[self.positions_input_name]
    table = self.embeddings.value.untag("positions")
    # A position past the table would be clamped by JAX's gather, silently
    # reusing the last row; transformers fails instead. Callers keep inputs
    # within max_position_embeddings (the loader's docs say so).
    rows = pz.nx.nmap(lambda t, p: t[p + self.offset])(table, positions)
    return value + rows.astype(value.dtype)

  def treescope_color(self) -> str:
    return "#65cfbc"  # Penzai's colour for its own learned additions (AddBias).
