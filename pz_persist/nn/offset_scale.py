"""The scale of Gemma's RMS norms, stored as Hugging Face stores it.

Hugging Face's Gemma and Gemma 2 keep each RMS norm's weight as an offset
``w`` from one and compute ``x * (1 + w)`` in float32 (``Gemma2RMSNorm``):
``(1.0 + self.weight.float())``, the product taken in float32, then cast back
to the activations' dtype. Penzai's own Gemma converter instead stores
``1 + w`` in a plain ``Linear``. That is the same function in exact
arithmetic, but not in the parameter's dtype: near one, bfloat16 keeps 8
significant bits, so a trained offset of ``0.0123`` becomes ``1.015625``
(``w`` read back as ``0.015625``), and even in float32 ``(1 + w) - 1`` is not
``w``. A model loaded that way neither computes what transformers computes
nor gives the checkpoint's tensors back when exported to Hugging Face again.
`OffsetScale` keeps ``w`` itself and adds the one at call time, in float32,
so loading is exact and an HF -> Penzai -> HF round trip is bit for bit.
"""

from __future__ import annotations

import jax.numpy as jnp
from penzai import pz


@pz.pytree_dataclass
class OffsetScale(pz.nn.Layer):
  """Multiplies its input by ``1 + weights``, computed in float32.

  It takes the place of the scale ``Linear`` inside each of Penzai's
  ``RMSLayerNorm`` in a Gemma model read from Hugging Face (same parameter
  label, ``.../scale.weights``), for the reasons in this module's docstring.
  The result has the input's dtype, as transformers' ``output.type_as(x)``.

  Attributes:
    weights: The offsets ``w`` (Hugging Face's RMS norm ``weight``), a
      parameter over the normalized axes (``embedding``).
  """

  weights: pz.ParameterLike[pz.nx.NamedArray]

  def __call__(self, value: pz.nx.NamedArray, **_unused_side_inputs) -> pz.nx.NamedArray:
    scale = 1.0 + self.weights.value.astype(jnp.float32)
    return (value.astype(jnp.float32) * scale).astype(value.dtype)

  def treescope_color(self) -> str:
    return "#65cfbc"  # Penzai's colour for its own learned rescalings (AddBias).
