"""Clipping activations to ``[-limit, limit]``, for ``clip_qkv`` (OLMoE,
OLMo, DBRX): the query, key and value projections' outputs clamped before
RoPE and attention.

Penzai's ``pz.nn.Elementwise`` could hold ``jnp.clip`` with its bounds, but
a bound function is not a number `pz_persist.save_model` can store and
``export_hf`` can read back; `ClipValues` keeps the limit as the config's own
float (a static field).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from penzai import pz


@pz.pytree_dataclass
class ClipValues(pz.nn.Layer):
  """``clip(inputs, -limit, limit)``, elementwise, in the inputs' dtype.

  Attributes:
    limit: The bound, exactly as ``config.json`` gives it (``clip_qkv``).

  Example:
    >>> import jax.numpy as jnp
    >>> from penzai import pz
    >>> from pz_persist.nn.clip_values import ClipValues
    >>> x = pz.nx.wrap(jnp.array([-3.0, 0.5, 8.0]), "projection")
    >>> ClipValues(limit=2.0)(x).unwrap("projection").tolist()
    [-2.0, 0.5, 2.0]
  """

  limit: float = dataclasses.field(metadata={"pytree_node": False})

  def __call__(self, inputs: pz.nx.NamedArray, **_unused_side_inputs) -> pz.nx.NamedArray:
    return pz.nx.nmap(lambda x: jnp.clip(x, -self.limit, self.limit).astype(x.dtype))(inputs)
