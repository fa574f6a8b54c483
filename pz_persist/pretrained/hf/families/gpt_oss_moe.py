"""gpt-oss's mixture of experts: its config fields, its tensors (dense or
MXFP4), the layer in place of each block's MLP, and the fields export writes.

The module of `pz_persist.pretrained.hf.families.gpt_oss` holds the rest of
the family; this one has no ``RECORD``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.weights import Weights

_log = logging.getLogger("pz_persist.pretrained.hf")


@dataclasses.dataclass
class GptOssMoe:
  """gpt-oss's experts as a checkpoint's config describes them."""

  experts: int
  top_k: int
  alpha: float
  limit: float
  quantized: bool
  dequantised: list[str] = dataclasses.field(default_factory=list)

  def specs(self, p: str, s: str, config: llamalike_common.LlamalikeTransformerConfig
            ) -> list[TensorSpec]:
    e, h, n = self.experts, config.embedding_dim, config.mlp_hidden_dim
    m = s + "mlp."
    q = p + "moe/"
    return [
        TensorSpec(q + "router.weights", m + "router.weight", (e, h), ("experts", "embedding")),
        TensorSpec(q + "router_bias.bias", m + "router.bias", (e,), ("experts",)),
        TensorSpec(q + "gating_linear.weights", m + "experts.gate_up_proj", (e, h, n, 2),
                   ("experts", "embedding", "neurons"), take=(3, 0), stored=(e, h, 2 * n)),
        TensorSpec(q + "value_linear.weights", m + "experts.gate_up_proj", (e, h, n, 2),
                   ("experts", "embedding", "neurons"), take=(3, 1), stored=(e, h, 2 * n)),
        TensorSpec(q + "gating_bias.bias", m + "experts.gate_up_proj_bias", (e, n, 2),
                   ("experts", "neurons"), take=(2, 0), stored=(e, 2 * n)),
        TensorSpec(q + "value_bias.bias", m + "experts.gate_up_proj_bias", (e, n, 2),
                   ("experts", "neurons"), take=(2, 1), stored=(e, 2 * n)),
        TensorSpec(q + "out_linear.weights", m + "experts.down_proj", (e, n, h),
                   ("experts", "neurons", "embedding")),
        TensorSpec(q + "out_bias.bias", m + "experts.down_proj_bias", (e, h),
                   ("experts", "embedding")),
    ]

  def edit(self, model: model_parts.TransformerLM,
           config: llamalike_common.LlamalikeTransformerConfig) -> model_parts.TransformerLM:
    selected = pz.select(model).at_instances_of(model_parts.TransformerBlock)

    def block(layer: model_parts.TransformerBlock, i: int) -> model_parts.TransformerBlock:
      q = f"transformer/block_{i}/moe/"
      names = ("router.weights", "router_bias.bias", "gating_linear.weights",
               "value_linear.weights", "gating_bias.bias", "value_bias.bias",
               "out_linear.weights", "out_bias.bias")
      moe = _PendingMoe(*(pz.ParameterSlot(q + name) for name in names), top_k=self.top_k,
                        alpha=self.alpha, limit=self.limit)
      return pz.select(layer).at_instances_of(model_parts.TransformerFeedForward).apply(
          lambda _: model_parts.TransformerFeedForward([moe]))

    return selected.set_sequence([block(b, i) for i, b in enumerate(selected.get_sequence())])

  def report(self, weights: Weights) -> None:
    del weights


def read_config(cfg: Config, weights: Weights) -> GptOssMoe:
  del weights
  experts = cfg.get("num_local_experts", 128)
  top_k = cfg.get("num_experts_per_tok", 4)
  if top_k > experts:
    raise cfg.unsupported("num_experts_per_tok", top_k,
                          f"at most num_local_experts={experts} experts can be chosen")
  cfg.get("router_aux_loss_coef")  # Training only.
  cfg.get("output_router_logits")  # Training only.
  return GptOssMoe(experts, top_k, float(cfg.get("swiglu_alpha", 1.702)),
                   float(cfg.get("swiglu_limit", 7.0)), quantized=False)


def config_fields(model: Any) -> dict[str, Any]:
  moe = pz.select(model).at_instances_of(_PendingMoe).get_sequence()[0]
  shape = moe.gating.value.named_shape
  return {"num_local_experts": shape["experts"], "num_experts_per_tok": moe.top_k,
          "intermediate_size": shape["neurons"], "swiglu_alpha": moe.alpha,
          "swiglu_limit": moe.limit}


@pz.pytree_dataclass
class _PendingMoe(pz.nn.Layer):
  router: pz.ParameterLike[pz.nx.NamedArray]
  router_bias: pz.ParameterLike[pz.nx.NamedArray]
  gating: pz.ParameterLike[pz.nx.NamedArray]
  value: pz.ParameterLike[pz.nx.NamedArray]
  gating_bias: pz.ParameterLike[pz.nx.NamedArray]
  value_bias: pz.ParameterLike[pz.nx.NamedArray]
  out: pz.ParameterLike[pz.nx.NamedArray]
  out_bias: pz.ParameterLike[pz.nx.NamedArray]
  top_k: int = dataclasses.field(metadata={"pytree_node": False})
  alpha: float = dataclasses.field(metadata={"pytree_node": False})
  limit: float = dataclasses.field(metadata={"pytree_node": False})

  def __call__(self, x: pz.nx.NamedArray, **_unused) -> pz.nx.NamedArray:
    logits = pz.nx.nmap(jnp.dot)(self.router.value.untag("embedding"), x.untag("embedding"))
    logits = logits + self.router_bias.value

    def route(row: jax.Array) -> jax.Array:
      top, idx = jax.lax.top_k(row, self.top_k)
      weights = jax.nn.softmax(top)
      return jnp.zeros_like(row).at[idx].set(weights)

    weights = pz.nx.nmap(route)(logits.untag("experts")).tag("experts")
    gate = pz.nx.nmap(jnp.dot)(x.untag("embedding"), self.gating.value.untag("embedding"))
    up = pz.nx.nmap(jnp.dot)(x.untag("embedding"), self.value.value.untag("embedding"))
    gate = gate + self.gating_bias.value
    up = up + self.value_bias.value
    gate = pz.nx.nmap(lambda g: jnp.minimum(g, self.limit))(gate)
    up = pz.nx.nmap(lambda u: jnp.clip(u, -self.limit, self.limit))(up)
    act = (up + 1) * gate * pz.nx.nmap(jax.nn.sigmoid)(gate * self.alpha)
    out = pz.nx.nmap(jnp.dot)(act.untag("neurons"), self.out.value.untag("neurons"))
    out = out + self.out_bias.value
    return pz.nx.nmap(jnp.sum)((out * weights).untag("experts"))
