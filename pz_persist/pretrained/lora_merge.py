"""LoRA adapters (``penzai.toolshed.lora``) merged into their ``Linear``
layers, and refused where a format cannot hold them (Hugging Face folders).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
import jax.numpy as jnp
from penzai import pz

from pz_persist.pretrained import errors


def refuse_lora(model: Any) -> None:
  """Refuses a model holding LoRA adapters, saying to `merge_lora` first."""
  # Looked up, not imported (`import pz_persist` leaves it unimported): a
  # model holding an adapter has imported it.
  lora = sys.modules.get("penzai.toolshed.lora")
  if lora is None:
    return
  adapters = pz.select(model).at_instances_of(lora.LowRankAdapter)
  if adapters.count():
    path = jax.tree_util.keystr(next(iter(adapters.selected_by_path)))
    raise errors.ExportError(
        f"the model holds {adapters.count()} unmerged LoRA adapter(s)"
        f" (penzai.toolshed.lora.LowRankAdapter, the first at model{path}), which"
        " Hugging Face's architectures cannot express. Merge them first:"
        " model = pz_persist.pretrained.merge_lora(model) (each adapter becomes its"
        " Linear layer with weights W + A @ B), then export."
    )


def merge_lora(model: Any) -> Any:
  """Replaces each LoRA adapter (``penzai.toolshed.lora.LowRankAdapter``) by
  the ``Linear`` layer it adapts, with weights ``W + A @ B``.

  The merged layer keeps the pretrained layer's parameter (label, kind,
  metadata) with its new value, computed in the pretrained weights' dtype
  (float32 arithmetic when that is narrower), so the model then has the
  structure of the one LoRA was applied to and can be exported.
  """
  from penzai.toolshed import lora  # pylint: disable=import-outside-toplevel

  def merged(adapter: lora.LowRankAdapter) -> pz.nn.Linear:
    branches = adapter.sublayers[0].branches
    linear = branches[0].sublayers[0]
    a_layer, b_layer = branches[1].sublayers
    lowrank = set(a_layer.out_axis_names)
    w, a, b = (layer.weights.value for layer in (linear, a_layer, b_layer))
    update = pz.nx.nmap(jnp.sum)((a.astype(jnp.float32) * b.astype(jnp.float32))
                                 .untag(*lowrank))
    value = (w.astype(jnp.float32) + update).astype(w.dtype).order_like(w)
    param = linear.weights
    if isinstance(param, pz.Parameter):  # A variable: a new one, same label and metadata.
      param = pz.Parameter(value=value, label=param.label, metadata=param.metadata)
    else:
      param = dataclasses.replace(param, value=value)
    return dataclasses.replace(linear, weights=param)

  return pz.select(model).at_instances_of(lora.LowRankAdapter).apply(merged)
