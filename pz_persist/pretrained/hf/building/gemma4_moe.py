"""Gemma 4's mixture of experts (26B-A4B), built from the shared
`pz_persist.nn.mixture_of_experts.MixtureOfExperts`; it runs
beside each layer's dense MLP rather than in its place.

Per token ``x`` (the residual stream entering the feed-forward part):

- the router's logits: ``x`` RMS-normalised (no learned scale), times the
  learned ``router.scale`` (over ``embedding``) and ``hidden_size ** -0.5``,
  then the ``Linear`` to ``experts`` (``router.proj``);
- the rule (`TopKRouter` fields): softmax over all experts, the ``top_k``
  largest renormalised to sum to one, each times its expert's learned
  ``router.per_expert_scale``;
- the experts see ``x`` through their own norm (``pre_feedforward_layernorm_2``,
  the layer's ``expert_input``), are GeGLU MLPs (tanh GELU) whose weights
  carry ``experts``, and their weighted sum goes through
  ``post_feedforward_layernorm_2``.

The Hub and transformers store the experts fused: ``experts.gate_up_proj``
``[experts, 2 * width, hidden]`` (gate first) and ``experts.down_proj``
``[experts, hidden, width]``; the specs split the first in halves.
"""

from __future__ import annotations

import jax.numpy as jnp
from penzai import pz
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn import mixture_of_experts as moe
from pz_persist.pretrained.hf.plan import TensorSpec


def build(name: str, config: llamalike_common.LlamalikeTransformerConfig, experts: int,
          top_k: int, width: int, eps: float) -> pz.nn.Sequential:
  """The skeleton (parameter slots) of block ``name``'s experts, with their
  output norm."""
  hidden, dtype = config.embedding_dim, config.parameter_dtype

  def norm(suffix: str) -> pz.nn.RMSLayerNorm:
    return pz.nn.RMSLayerNorm.from_config(
        name=f"{name}/{suffix}", init_base_rng=None, across_axes={"embedding": hidden},
        epsilon=config.rms_norm_eps, dtype=dtype)

  logits = pz.nn.Sequential([
      pz.nn.RMSStandardize(across=("embedding",), epsilon=eps),
      pz.nn.Linear.from_config(name=f"{name}/moe/router_scale", init_base_rng=None,
                               input_axes={}, output_axes={},
                               parallel_axes={"embedding": hidden}, dtype=dtype),
      pz.nn.ConstantRescale(by=jnp.array(hidden ** -0.5, dtype=config.activation_dtype)),
      moe.router_linear(f"{name}/moe/router", experts, hidden, dtype=dtype),
  ])
  router = moe.TopKRouter(
      logits=logits, num_experts=experts, top_k=top_k, score="softmax", normalize=True,
      expert_scale=moe.expert_vector(f"{name}/moe/per_expert_scale", experts))
  return pz.nn.Sequential([
      moe.MixtureOfExperts(
          router=router,
          experts=moe.experts_mlp(f"{name}/moe/experts", experts, hidden, width,
                                  activation="gelu_tanh", dtype=dtype),
          expert_input=norm("pre_ffw_norm_2")),
      norm("post_ffw_norm_2"),
  ])


def specs(p: str, s: str, hidden: int, experts: int, width: int) -> list[TensorSpec]:
  """Block ``p``'s expert tensors from layer ``s``."""
  fused = (experts, 2, width, hidden)
  axes = ("experts", "neurons", "embedding")
  stored = (experts, 2 * width, hidden)

  def norm(label: str, source: str) -> TensorSpec:
    return TensorSpec(p + label + "/scale.weights", s + source + ".weight", (hidden,),
                      ("embedding",))

  return [
      TensorSpec(p + "moe/router.weights", s + "router.proj.weight", (experts, hidden),
                 ("experts", "embedding")),
      TensorSpec(p + "moe/router_scale.weights", s + "router.scale", (hidden,), ("embedding",)),
      TensorSpec(p + "moe/per_expert_scale", s + "router.per_expert_scale", (experts,),
                 ("experts",)),
      TensorSpec(p + "moe/experts/gate.weights", s + "experts.gate_up_proj", fused, axes,
                 take=(1, 0), stored=stored),
      TensorSpec(p + "moe/experts/up.weights", s + "experts.gate_up_proj", fused, axes,
                 take=(1, 1), stored=stored),
      TensorSpec(p + "moe/experts/down.weights", s + "experts.down_proj", (experts, hidden, width),
                 ("experts", "embedding", "neurons")),
      norm("pre_ffw_norm_2", "pre_feedforward_layernorm_2"),
      norm("post_ffw_norm_1", "post_feedforward_layernorm_1"),
      norm("post_ffw_norm_2", "post_feedforward_layernorm_2"),
  ]
