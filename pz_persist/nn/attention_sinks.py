"""The softmax of an attention with sinks (gpt-oss).

gpt-oss gives each query head a learned logit, its *sink*, that joins the
softmax over the keys as one more column and is then dropped: the weights of
the real keys sum to less than one, so a head can attend to nothing. Penzai's
llama-like attention ends its query-key sequence with ``pz.nn.Softmax``;
`SoftmaxWithSinks` takes its place, with the sinks as a parameter over the
query head axes (``heads``, or ``head_groups`` and ``query_heads``), so
treescope shows them beside the projections and ``AxisRules`` shards them as
it shards the heads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from penzai import pz


@pz.pytree_dataclass
class SoftmaxWithSinks(pz.nn.Layer):
  """Softmax over ``axis`` with one extra logit per head in the denominator.

  For logits ``x`` (axes ``seq``, the head axes, ``kv_seq``) and sink ``s``
  of the head, the weight of key ``j`` is
  ``exp(x_j - m) / (exp(s - m) + sum_k exp(x_k - m))`` with ``m`` the largest
  of the ``x_k`` and ``s`` (as transformers subtracts the maximum of the
  joined row), computed in the logits' dtype. Masked keys hold a large
  negative value and get weight zero, so Penzai's KV-cache sampling (which
  masks the unwritten cache) gives the same weights as a full forward pass.

  Attributes:
    sinks: The per-head sink logits, a parameter over the query head axes.
    axis: The axis the softmax runs over (``kv_seq``).
  """

  sinks: pz.ParameterLike[pz.nx.NamedArray]
  axis: str = dataclasses.field(default="kv_seq", metadata={"pytree_node": False})

  def __call__(self, logits: pz.nx.NamedArray, **_unused_side_inputs) -> pz.nx.NamedArray:
    sinks = self.sinks.value.astype(logits.dtype)

    def softmax(row: jax.Array, sink: jax.Array) -> jax.Array:
      top = jnp.maximum(jnp.max(row), sink)
      exps = jnp.exp(row - top)
      return exps / (jnp.sum(exps) + jnp.exp(sink - top))

    return pz.nx.nmap(softmax)(logits.untag(self.axis), sinks).tag(self.axis)

  def treescope_color(self) -> str:
    return "#65cfbc"  # Penzai's colour for its own learned parameters (AddBias).
