"""Multiplication (or division) by a constant kept as the checkpoint's own
number, for Granite's ``embedding_multiplier``, ``residual_multiplier``,
``attention_multiplier`` and ``logits_scaling``.

Penzai's ``pz.nn.ConstantRescale`` holds its factor as an array (float32, or
the activation dtype): a value such as ``0.08838834764831845`` does not come
back from it exactly, so ``export_hf`` could not write the config it was
loaded from. `ConstantScale` keeps the Python float (a static field, saved as
such by `pz_persist.save_model`) and computes as transformers does: the
activations times (or divided by) the number, in the activations' dtype.
"""

from __future__ import annotations

import dataclasses

from penzai import pz


@pz.pytree_dataclass
class ConstantScale(pz.nn.Layer):
  """``inputs * by`` (``inputs / by`` when ``divide``).

  Attributes:
    by: The constant, exactly as ``config.json`` gives it.
    divide: Divide instead of multiplying (Granite's ``logits_scaling``
      divides the logits).
  """

  by: float = dataclasses.field(metadata={"pytree_node": False})
  divide: bool = dataclasses.field(default=False, metadata={"pytree_node": False})

  def __call__(self, inputs: pz.nx.NamedArray, **_unused_side_inputs) -> pz.nx.NamedArray:
    return inputs / self.by if self.divide else inputs * self.by
