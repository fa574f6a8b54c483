"""Small Penzai models the tests save and load, built deterministically.

Builders are cached: building and first running a model compiles many small
ops, which dominates test time. Tests must not mutate the models they get.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from penzai import pz
from penzai.models import simple_mlp
from penzai.models.transformer import sampling_mode
from penzai.models.transformer.variants import llamalike_common as llamalike


@functools.cache
def mlp() -> pz.nn.Layer:
  return simple_mlp.MLP.from_config(
      name="mlp", init_base_rng=jax.random.key(0), feature_sizes=[8, 16, 8]
  )


def mlp_input() -> pz.nx.NamedArray:
  return pz.nx.wrap(jnp.linspace(-1.0, 1.0, 24).reshape(3, 8), "batch", "features")


def llamalike_config(*, layer_stack: bool) -> llamalike.LlamalikeTransformerConfig:
  return llamalike.LlamalikeTransformerConfig(
      num_kv_heads=2,
      query_head_multiplier=2,
      embedding_dim=32,
      projection_dim=8,
      mlp_hidden_dim=64,
      num_decoder_blocks=2,
      vocab_size=64,
      mlp_variant="swiglu",
      tie_embedder_and_logits=False,
      use_layer_stack=layer_stack,
  )


@functools.cache
def llamalike_transformer(*, layer_stack: bool = False) -> pz.nn.Layer:
  return llamalike.build_llamalike_transformer(
      llamalike_config(layer_stack=layer_stack),
      init_base_rng=jax.random.key(1),
      name="transformer",
  )


@functools.cache
def gemma_style_transformer() -> pz.nn.Layer:
  """A tiny model with Gemma 2's features: GeGLU, tied embeddings, soft caps,
  post-norms, alternating local/global attention and bfloat16 parameters."""
  config = llamalike.LlamalikeTransformerConfig(
      num_kv_heads=2,
      query_head_multiplier=2,
      embedding_dim=32,
      projection_dim=8,
      mlp_hidden_dim=64,
      num_decoder_blocks=2,
      vocab_size=64,
      mlp_variant="geglu_approx",
      tie_embedder_and_logits=True,
      attention_type=(
          llamalike.AttentionTypeSlidingWindowCausal(4),
          llamalike.AttentionTypeGlobalCausal(),
      ),
      use_post_attn_norm=True,
      use_post_ffw_norm=True,
      final_logit_softcap=30.0,
      attn_logits_soft_cap=50.0,
      query_scaling_factor=8**-0.5,
      parameter_dtype=jnp.bfloat16,
      activation_dtype=jnp.float32,
  )
  return llamalike.build_llamalike_transformer(
      config, init_base_rng=jax.random.key(2), name="gemma"
  )


def tokens(length: int = 6, offset: int = 0) -> pz.nx.NamedArray:
  return pz.nx.wrap(
      (jnp.arange(2 * length).reshape(2, length) * 7 + offset) % 64, "batch", "seq"
  )


def sampling_model(base: pz.nn.Layer) -> sampling_mode.KVCachingTransformerLM:
  """A KV-caching model that has already consumed a prompt (non-zero caches)."""
  model = sampling_mode.KVCachingTransformerLM.from_uncached(
      base, cache_len=16, batch_axes={"batch": 2}
  )
  model(tokens())
  return model
