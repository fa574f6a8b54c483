"""Llama 4's mixture-of-experts layers: their tensors, the layer in place of
a block's MLP, and the fields export writes back. (Shared code of the llama4
family: no ``RECORD``.)

A block of ``moe_layers`` gets a
`pz_persist.nn.mixture_of_experts.MixtureOfExperts`
(``transformer/block_{i}/moe/...``): a bias-free router ``Linear`` from
``embedding`` to ``experts``; the top ``num_experts_per_tok`` logits chosen
and their sigmoid (``score="sigmoid"``: sigmoid is increasing, so choosing by
it chooses by the logits) multiplying each chosen expert's *input*
(``weight_inputs``), the others' input zero (bias-free SwiGLU experts give
zero for it); plus the shared expert, a SwiGLU MLP of the experts' width
(``intermediate_size``), always added.

transformers keeps the experts' gate and up projections in one tensor
``feed_forward.experts.gate_up_proj`` ``[experts, hidden, 2 *
intermediate]``, gate first then up (``chunk(2, dim=-1)``), and
``down_proj`` ``[experts, intermediate, hidden]``: read as they are (the
gate and up halves by `TensorSpec.take`), as the Hub's folders and
transformers 5's ``save_pretrained`` both hold them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn import mixture_of_experts as moe_lib
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.plan import TensorSpec


@dataclasses.dataclass
class Llama4Moe:
  """Llama 4's experts as the config describes them (``width``:
  ``intermediate_size``, set once read)."""

  experts: int
  top_k: int
  width: int = 0

  def specs(self, p: str, s: str, config: llamalike_common.LlamalikeTransformerConfig
            ) -> list[TensorSpec]:
    """Block ``p``'s router, experts and shared expert, from layer ``s``."""
    e, h, n = self.experts, config.embedding_dim, self.width
    m, q = s + "feed_forward.", p + "moe/"
    axes = ("experts", "embedding", "neurons")
    return [
        TensorSpec(q + "router.weights", m + "router.weight", (e, h), ("experts", "embedding")),
        TensorSpec(q + "experts/gate.weights", m + "experts.gate_up_proj", (e, h, 2, n), axes,
                   take=(2, 0), stored=(e, h, 2 * n)),
        TensorSpec(q + "experts/up.weights", m + "experts.gate_up_proj", (e, h, 2, n), axes,
                   take=(2, 1), stored=(e, h, 2 * n)),
        TensorSpec(q + "experts/down.weights", m + "experts.down_proj", (e, n, h),
                   ("experts", "neurons", "embedding")),
        TensorSpec(q + "shared/gating_linear.weights", m + "shared_expert.gate_proj.weight",
                   (n, h), ("neurons", "embedding")),
        TensorSpec(q + "shared/value_linear.weights", m + "shared_expert.up_proj.weight",
                   (n, h), ("neurons", "embedding")),
        TensorSpec(q + "shared/out_linear.weights", m + "shared_expert.down_proj.weight",
                   (h, n), ("embedding", "neurons")),
    ]

  def edit_block(self, block: model_parts.TransformerBlock, i: int,
                 config: llamalike_common.LlamalikeTransformerConfig
                 ) -> model_parts.TransformerBlock:
    """``block`` (number ``i``) with its MLP replaced by the experts."""
    name = f"transformer/block_{i}/moe"
    dtype = config.parameter_dtype
    router = moe_lib.TopKRouter(
        logits=moe_lib.router_linear(f"{name}/router", self.experts, config.embedding_dim,
                                     dtype=dtype),
        num_experts=self.experts, top_k=self.top_k, score="sigmoid")
    experts = moe_lib.experts_mlp(
        f"{name}/experts", self.experts, config.embedding_dim, self.width,
        activation="silu" if config.mlp_variant == "swiglu" else "gelu_tanh",
        inputs_have_experts=True, dtype=dtype)
    shared = llamalike_common.build_llamalike_feedforward(
        f"{name}/shared", None, dataclasses.replace(config, mlp_hidden_dim=self.width))
    layer = moe_lib.MixtureOfExperts(router=router, experts=experts, weight_inputs=True,
                                     shared=shared)
    return pz.select(block).at_instances_of(model_parts.TransformerFeedForward).apply(
        lambda _: model_parts.TransformerFeedForward([layer]))


def read_config(cfg: Config) -> Llama4Moe:
  experts = cfg.get("num_local_experts", 16)
  top_k = cfg.get("num_experts_per_tok", 1)
  if top_k > experts:
    raise cfg.unsupported("num_experts_per_tok", top_k,
                          f"at most num_local_experts={experts} experts can be chosen")
  return Llama4Moe(experts, top_k)


def moe_layers(model: pz.nn.Layer) -> list[moe_lib.MixtureOfExperts | None]:
  """Each block's mixture of experts, or None for a dense block."""
  from pz_persist.pretrained.hf.config_from_model import blocks  # pylint: disable=import-outside-toplevel
  return [next(iter(all_layers(block, moe_lib.MixtureOfExperts)), None)
          for block in blocks(model)]


def config_fields(model: pz.nn.Layer) -> dict[str, Any]:
  """``moe_layers``, the experts' count, choice and width (None-free only
  when some block has experts)."""
  layers = moe_layers(model)
  found = [layer for layer in layers if layer is not None]
  fields: dict[str, Any] = {"moe_layers": [i for i, layer in enumerate(layers) if layer]}
  if found:
    router = found[0].router
    down = all_layers(found[0].experts, pz.nn.Linear)[-1].weights.value.named_shape
    fields.update(num_local_experts=router.num_experts, num_experts_per_tok=router.top_k,
                  intermediate_size=down["neurons"])
  return fields
