"""Gemma 4's per-layer inputs ("PLE"): a second embedding of the tokens,
one slice of it added into each decoder layer's residual stream.

The small Gemma 4 models (E2B, E4B) look each token up in a second table
(``embed_tokens_per_layer``: ``[vocabulary, layers * width]``, scaled by
``sqrt(width)``), add a projection of the main embedding (times
``hidden_size ** -0.5``, then an RMS norm over each layer's ``width``), and
scale the sum by ``2 ** -0.5``. Layer ``i`` then gates slice ``i`` with its
own hidden state (`GateByPerLayerInput`). The per-layer inputs depend on the
token ids, which no decoder layer sees, so `PerLayerInputs` computes them
next to the main embedding and hands them to every layer as the side input
``per_layer_inputs`` (axes ``ple_layers`` and ``ple_embedding``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from penzai import pz

SIDE_INPUT = "per_layer_inputs"
LAYERS_AXIS = "ple_layers"
EMBEDDING_AXIS = "ple_embedding"


@pz.pytree_dataclass
class PerLayerInputs(pz.nn.Layer):
  """Maps ``(tokens, embeddings)`` to the per-layer inputs of every layer.

  Attributes:
    table: The per-layer embedding table, over ``vocabulary`` and
      ``ple_layers`` x ``ple_embedding``.
    table_scale: ``sqrt(width)``, rounded to the activations' dtype as
      transformers rounds it.
    projection: The ``Linear`` from ``embedding`` to ``ple_layers`` x
      ``ple_embedding`` (``per_layer_model_projection``).
    projection_scale: ``hidden_size ** -0.5``.
    norm: The RMS norm over ``ple_embedding`` (``per_layer_projection_norm``).
  """

  table: pz.nn.EmbeddingLookup
  projection: pz.nn.Layer
  norm: pz.nn.Layer
  table_scale: float = dataclasses.field(metadata={"pytree_node": False})
  projection_scale: float = dataclasses.field(metadata={"pytree_node": False})

  def __call__(self, inputs: tuple[pz.nx.NamedArray, pz.nx.NamedArray],
               **side_inputs) -> pz.nx.NamedArray:
    tokens, embeddings = inputs
    looked_up = self.table(tokens, **side_inputs)
    looked_up = looked_up * jnp.asarray(self.table_scale, looked_up.dtype)
    projected = self.projection(embeddings, **side_inputs)
    projected = projected * jnp.asarray(self.projection_scale, projected.dtype)
    projected = self.norm(projected, **side_inputs)
    return (projected + looked_up) * jnp.asarray(2.0 ** -0.5, projected.dtype)


@pz.pytree_dataclass
class MultiplyByPerLayerInput(pz.nn.Layer):
  """Multiplies its input (over ``ple_embedding``) by layer ``layer``'s
  slice of the ``per_layer_inputs`` side input."""

  layer: int = dataclasses.field(metadata={"pytree_node": False})

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    return inputs * side_inputs[SIDE_INPUT][{LAYERS_AXIS: self.layer}]


@pz.pytree_dataclass
class ScalarScale(pz.nn.Layer):
  """Multiplies its input by a learned scalar (Gemma 4's ``layer_scalar``,
  stored as a one-element tensor)."""

  weights: pz.ParameterLike[pz.nx.NamedArray]

  def __call__(self, inputs: pz.nx.NamedArray, **_unused_side_inputs) -> pz.nx.NamedArray:
    return inputs * self.weights.value.astype(inputs.dtype)

  def treescope_color(self) -> str:
    return "#65cfbc"


@pz.pytree_dataclass
class WithPerLayerInputs(pz.nn.Layer):
  """Embeds the tokens with ``embed``, computes their per-layer inputs with
  ``per_layer`` and runs ``body`` on the embeddings with the per-layer
  inputs as the side input ``per_layer_inputs``."""

  embed: pz.nn.Layer
  per_layer: PerLayerInputs
  body: pz.nn.Layer

  def __call__(self, tokens: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    embeddings = self.embed(tokens, **side_inputs)
    inputs = self.per_layer((tokens, embeddings), **side_inputs)
    return self.body(embeddings, **side_inputs, **{SIDE_INPUT: inputs})


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)
class PerLayerInputsInTable(PerLayerInputs):
  """`PerLayerInputs` where a token outside the per-layer table (Gemma 3n's
  image and audio tokens, past ``vocab_size_per_layer_input``) looks up
  row 0, as transformers' Gemma 3n does (an index past a table would
  otherwise be clamped to its last row).

  Example (the Gemma 3n loader builds it; a model loaded from a ``gemma3n``
  folder holds one)::

    model = pz_persist.pretrained.load_hf("gemma-3n-E2B")
    pz.select(model).at_instances_of(PerLayerInputsInTable).get()
  """

  def __call__(self, inputs: tuple[pz.nx.NamedArray, pz.nx.NamedArray],
               **side_inputs) -> pz.nx.NamedArray:
    tokens, embeddings = inputs
    size = self.table.table.embeddings.value.named_shape["vocabulary"]
    inside = pz.nx.nmap(lambda t: jnp.where((t >= 0) & (t < size), t, 0))(tokens)
    return super().__call__((inside, embeddings), **side_inputs)
