"""Model surgery as users do it in notebooks, for the tests to save and load."""

from __future__ import annotations

import functools

import jax
import model_zoo
from penzai import pz
from penzai.toolshed import lora


def edited_transformer() -> pz.nn.Layer:
  """A transformer after four kinds of surgery: LoRA adapters inserted, a
  block cut, an activation swapped, parameters relabeled."""
  model = model_zoo.llamalike_transformer()
  model = lora.loraify_linears_in_selection(
      pz.select(model).at(lambda m: m.body.sublayers[1]).at_instances_of(pz.nn.Linear),
      rank=2,
      init_base_rng=jax.random.key(7),
  )
  # Cut the second block (sublayers: embed, block 0, block 1, norm, head).
  model = pz.select(model).at(lambda m: m.body.sublayers).apply(
      lambda layers: [layer for i, layer in enumerate(layers) if i != 2]
  )
  # Swap the MLP activation for an approximate GELU.
  model = (
      pz.select(model)
      .at_instances_of(pz.nn.Elementwise)
      .apply(lambda _: pz.nn.Elementwise(functools.partial(jax.nn.gelu, approximate=True)))
  )
  # Relabel the parameters of block 0 (new variables: the originals may be
  # shared with other models).
  relabel = lambda label: label.replace("transformer/block_0/", "transformer/kept_block/")  # pylint: disable=unnecessary-lambda-assignment
  structure, params = pz.unbind_params(model, freeze=True)
  structure = (
      pz.select(structure)
      .at_instances_of(pz.ParameterSlot)
      .apply(lambda slot: pz.ParameterSlot(relabel(slot.label)))
  )
  params = [
      pz.ParameterValue(label=relabel(p.label), value=p.value, metadata=p.metadata)
      for p in params
  ]
  return pz.bind_variables(structure, params, unfreeze_as_copy=True)
