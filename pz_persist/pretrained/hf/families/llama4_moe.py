"""Llama 4's mixture-of-experts layers: config fields, tensors, the layer in
place of a block's MLP, and the fields export writes. (No ``RECORD``.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.plan import TensorSpec


@dataclasses.dataclass
class Llama4Moe:
  experts: int
  top_k: int
  width: int = 0

  def specs(self, p: str, s: str, config: llamalike_common.LlamalikeTransformerConfig
            ) -> list[TensorSpec]:
    e, h, n = self.experts, config.embedding_dim, self.width
    m, q = s + "feed_forward.", p + "moe/"
    return [
        TensorSpec(q + "router.weights", m + "router.weight", (e, h), ("experts", "embedding")),
        TensorSpec(q + "gating_linear.weights", m + "experts.gate_up_proj", (e, h, 2, n),
                   ("experts", "embedding", "neurons"), take=(2, 0), stored=(e, h, 2 * n)),
        TensorSpec(q + "value_linear.weights", m + "experts.gate_up_proj", (e, h, 2, n),
                   ("experts", "embedding", "neurons"), take=(2, 1), stored=(e, h, 2 * n)),
        TensorSpec(q + "out_linear.weights", m + "experts.down_proj", (e, n, h),
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
    del config
    q = f"transformer/block_{i}/moe/"
    names = ("router.weights", "gating_linear.weights", "value_linear.weights",
             "out_linear.weights", "shared/gating_linear.weights",
             "shared/value_linear.weights", "shared/out_linear.weights")
    moe = _PendingMoe(*(pz.ParameterSlot(q + name) for name in names), top_k=self.top_k)
    return pz.select(block).at_instances_of(model_parts.TransformerFeedForward).apply(
        lambda _: model_parts.TransformerFeedForward([moe]))


def read_config(cfg: Config) -> Llama4Moe:
  experts = cfg.get("num_local_experts", 16)
  top_k = cfg.get("num_experts_per_tok", 1)
  if top_k > experts:
    raise cfg.unsupported("num_experts_per_tok", top_k,
                          f"at most num_local_experts={experts} experts can be chosen")
  return Llama4Moe(experts, top_k)


def config_fields(model: Any) -> dict[str, Any]:
  raise NotImplementedError


def _dot(a: pz.nx.NamedArray, b: pz.nx.NamedArray, axis: str) -> pz.nx.NamedArray:
  return pz.nx.nmap(jnp.dot)(a.untag(axis), b.untag(axis))


@pz.pytree_dataclass
class _PendingMoe(pz.nn.Layer):
  router: pz.ParameterLike[pz.nx.NamedArray]
  gating: pz.ParameterLike[pz.nx.NamedArray]
  value: pz.ParameterLike[pz.nx.NamedArray]
  out: pz.ParameterLike[pz.nx.NamedArray]
  s_gating: pz.ParameterLike[pz.nx.NamedArray]
  s_value: pz.ParameterLike[pz.nx.NamedArray]
  s_out: pz.ParameterLike[pz.nx.NamedArray]
  top_k: int = dataclasses.field(metadata={"pytree_node": False})

  def __call__(self, x: pz.nx.NamedArray, **_unused) -> pz.nx.NamedArray:
    logits = _dot(self.router.value, x, "embedding")

    def route(row: jax.Array) -> jax.Array:
      top, idx = jax.lax.top_k(row, self.top_k)
      return jnp.zeros_like(row).at[idx].set(jax.nn.sigmoid(top))

    scores = pz.nx.nmap(route)(logits.untag("experts")).tag("experts")
    xs = x * scores
    act = pz.nx.nmap(jax.nn.silu)(_dot(xs, self.gating.value, "embedding"))
    hidden = act * _dot(xs, self.value.value, "embedding")
    out = pz.nx.nmap(jnp.sum)(_dot(hidden, self.out.value, "neurons").untag("experts"))
    shared = pz.nx.nmap(jax.nn.silu)(_dot(x, self.s_gating.value, "embedding")) * _dot(
        x, self.s_value.value, "embedding")
    return _dot(shared, self.s_out.value, "neurons") + out
