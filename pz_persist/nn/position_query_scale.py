"""Llama 4's position-dependent query scaling, as Ministral 3 uses it.

Past ``original_max_position_embeddings`` tokens, Ministral 3 (like Llama
4's NoPE layers) multiplies each query by ``1 + beta * log(1 + floor(p /
original_max_position_embeddings))`` for its position ``p``, after RoPE:
attention sharpens slowly with distance. Penzai has no such layer; this one
reads the positions side input as RoPE does, so the KV-cache sampling mode
scales each new query by its own position.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from penzai import pz


@pz.pytree_dataclass
class PositionQueryScale(pz.nn.Layer):
  """``queries * (1 + beta * log(1 + floor(p / original_max_position_embeddings)))``.

  Positions below zero (Penzai's padding) are taken as zero, so a padding
  token's query stays finite.

  Attributes:
    beta: ``llama_4_scaling_beta``, as ``rope_parameters`` gives it.
    original_max_position_embeddings: The period, as ``rope_parameters`` gives it.
    positions_input_name: The side input holding each token's position.
  """

  beta: float = dataclasses.field(metadata={"pytree_node": False})
  original_max_position_embeddings: int = dataclasses.field(metadata={"pytree_node": False})
  positions_input_name: str = dataclasses.field(default="token_positions",
                                                metadata={"pytree_node": False})

  def __call__(self, queries: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    positions = side_inputs[self.positions_input_name]

    def scale(p: jnp.ndarray) -> jnp.ndarray:
      periods = jnp.floor(jnp.maximum(p, 0).astype(jnp.float32)
                          / jnp.float32(self.original_max_position_embeddings))
      return 1.0 + jnp.float32(self.beta) * jnp.log(1.0 + periods)

    return (queries * pz.nx.nmap(scale)(positions).astype(queries.dtype)).astype(queries.dtype)
