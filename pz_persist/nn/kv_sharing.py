"""Keys and values shared across layers (Gemma 4's ``num_kv_shared_layers``).

In Gemma 4 the last ``num_kv_shared_layers`` decoder layers compute no keys
or values of their own: each attends with its own queries over the keys and
values of the last earlier layer of its attention type (sliding or full).
In Penzai each layer stays a plain ``pz.nn.Attention``, so the KV-cache
sampling mode (``KVCachingTransformerLM.from_uncached``, or `pz_persist.pretrained.kv_caching_lm`
where layers differ in head sizes) converts every one of them as usual:

- the producing layer's key and value paths end in `PublishKV`, an identity
  that records the keys (or values) it computed under a slot name in a
  mailbox (a dict) passed down as the side input ``shared_kv``;
- a consuming layer's key and value paths are a `SharedKV`, which ignores
  its input and returns what the slot holds.

`SharesKV` wraps the decoder blocks and makes a fresh mailbox for each call,
so the mailbox lives only within one forward pass (one trace under
``jax.jit``). In sampling mode the consumer's cache receives, step by step,
the same keys and values as the producer's, so it holds the same contents:
the attention is the same, at the cost of a second copy of those caches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from penzai import pz

from pz_persist.nn.latent_attention import SizedPick

SIDE_INPUT = "shared_kv"


@pz.pytree_dataclass
class PublishKV(pz.nn.Layer):
  """Identity that records its input under ``slot`` in the ``shared_kv``
  mailbox, for the layers that reuse it (`SharedKV`)."""

  slot: str = dataclasses.field(metadata={"pytree_node": False})

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    side_inputs[SIDE_INPUT][self.slot] = inputs
    return inputs


@pz.pytree_dataclass
class SharedKV(pz.nn.Layer):
  """Ignores its input and returns what an earlier layer's `PublishKV`
  recorded under ``slot`` in this forward pass.

  Attributes:
    slot: The mailbox slot (``"sliding_attention/key"``...).
    axes: The named axes of what it returns besides the sequence (for
      `pz_persist.pretrained.kv_caching_lm`, which sizes this layer's cache from them).
  """

  slot: str = dataclasses.field(metadata={"pytree_node": False})
  axes: tuple[tuple[str, int], ...] = dataclasses.field(metadata={"pytree_node": False})

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    del inputs
    return side_inputs[SIDE_INPUT][self.slot]


@pz.pytree_dataclass
class SharesKV(pz.nn.Layer):
  """Runs ``body`` with a fresh ``shared_kv`` mailbox as a side input."""

  body: pz.nn.Layer

  def __call__(self, inputs: Any, **side_inputs) -> Any:
    return self.body(inputs, **side_inputs, **{SIDE_INPUT: {}})


def key_axes(attention: pz.nn.Attention) -> dict[str, int]:
  """The named axes (besides the sequence and batch) of ``attention``'s
  keys: its first key ``Linear``'s outputs, or a `SharedKV`'s or a
  `SizedPick`'s; empty where its keys come from no projection of its own
  (DeepSeek's latent attention caches the latent, which Penzai's metadata
  sizes)."""
  for layer in pz.select(attention.input_to_key).at_instances_of(
      pz.nn.Linear | SharedKV | SizedPick).get_sequence():
    if isinstance(layer, (SharedKV, SizedPick)):
      return dict(layer.axes)
    return {name: size for name, size in layer.weights.value.named_shape.items()
            if name in layer.out_axis_names} if not isinstance(
                layer.weights, pz.ParameterSlot) else {}
  return {}

