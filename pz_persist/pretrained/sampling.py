"""Penzai's KV-cache sampling for every model `load_hf` builds.

Why not ``KVCachingTransformerLM.from_uncached`` alone: Penzai sizes every
layer's cache from the model's metadata (one head count, one head size) and
converts only `pz.nn.Attention` layers. Gemma 4's global layers have larger
heads, and may have fewer, than its sliding ones, and Qwen3.5's gated DeltaNet
layers (and LFM2's short convolutions) carry a state instead of keys and
values; either would sample wrongly or not at all. A model with LongRoPE (Phi-3's long context)
must also recompute its cache where the sequence crosses the original
context, as transformers' ``generate`` does (`LongRopeKVCachingLM`).
`kv_caching_lm` is ``from_uncached`` with all three mended, and equals it for
every other model.
"""

from __future__ import annotations

import dataclasses

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer import sampling_mode

from pz_persist.nn.gated_delta_net import CachingGatedDeltaNet
from pz_persist.nn.gated_delta_net import GatedDeltaNet
from pz_persist.nn.kimi_delta_attention import CachingKimiDeltaAttention
from pz_persist.nn.kimi_delta_attention import KimiDeltaAttention
from pz_persist.nn.kv_sharing import key_axes
from pz_persist.nn.longrope import ApplyLongRoPE
from pz_persist.nn.longrope import LongRopeKVCachingLM
from pz_persist.nn.mamba import CachingMamba
from pz_persist.nn.mamba import Mamba
from pz_persist.nn.mamba2 import CachingMamba2
from pz_persist.nn.mamba2 import Mamba2
from pz_persist.nn.short_conv import CachingShortConv
from pz_persist.nn.short_conv import ShortConv
from pz_persist.pretrained import errors

_STATEFUL = ((KimiDeltaAttention, CachingKimiDeltaAttention, "kda_state"),
             (GatedDeltaNet, CachingGatedDeltaNet, "delta_state"),
             (Mamba2, CachingMamba2, "mamba_state"),
             (Mamba, CachingMamba, "mamba1_state"),
             (ShortConv, CachingShortConv, "conv_state"))
"""The layers whose past rides in a state of their own, not in keys and
values: each kind, its sampling form and the label of its state. A layer
takes the sampling form of the listed class nearest to its own
(`_stateful_kind`): `KimiDeltaAttention` is a `GatedDeltaNet` and becomes its
own sampling form, once; `FalconH1Mamba2`, not listed, is sampled as the
`Mamba2` it is."""


def _stateful_kind(node: object) -> type | None:
  """The class of `_STATEFUL` nearest to ``node``'s own in its ancestry."""
  listed = {uncached for uncached, _, _ in _STATEFUL}
  return next((kind for kind in type(node).__mro__ if kind in listed), None)


def kv_caching_lm(model: model_parts.TransformerLM, cache_len: int, batch_axes: dict[str, int],
                  pad_id: int = 0, variable_name_prefix: str = "sampler"
                  ) -> sampling_mode.KVCachingTransformerLM:
  """``model`` in Penzai's KV-cache sampling mode (the arguments of
  ``KVCachingTransformerLM.from_uncached``).

  Each attention layer's cache is sized from that layer's own keys; each
  `GatedDeltaNet` layer becomes a `CachingGatedDeltaNet` carrying its
  convolution and recurrent state (a `KimiDeltaAttention` a
  `CachingKimiDeltaAttention`), each `Mamba2` layer a `CachingMamba2`
  and each `Mamba` (Jamba) a `CachingMamba` (their convolution and
  state-space state), each `ShortConv` (LFM2) a
  `CachingShortConv` carrying its convolution's last inputs. Padding tokens
  (``pad_id``) are skipped by the attention layers' masks but, as in
  transformers without an attention mask, still pass through a recurrence
  or a convolution: sample such models without padding inside a sequence.
  With `ApplyLongRoPE` layers, the sampler is a
  `LongRopeKVCachingLM`: the call crossing the original context recomputes
  every cache with the long factors, as transformers' ``generate`` does.

  Example::

    from penzai.models.transformer import simple_decoding_loop
    sampler = pz_persist.pretrained.kv_caching_lm(model, cache_len=64, batch_axes={"batch": 1})
    tokens = simple_decoding_loop.temperature_sample_pyloop(
        sampler, prompt=prompt, rng=jax.random.key(0), max_sampling_steps=16)
  """
  sizes = [key_axes(attention) for attention in
           pz.select(model.body).at_instances_of(pz.nn.Attention).get_sequence()]
  sampler = sampling_mode.KVCachingTransformerLM.from_uncached(
      model, cache_len=cache_len, batch_axes=batch_axes, pad_id=pad_id,
      variable_name_prefix=variable_name_prefix)
  caches = pz.select(sampler.body).at_instances_of(pz.nn.KVCachingAttention).get_sequence()
  dtype = model.metadata.activation_dtype
  for cache, axes in zip(caches, sizes):
    if axes:
      shape = {**batch_axes, "seq": cache_len, **axes}
      cache.kv_cache.value = (pz.nx.zeros(shape, dtype=dtype), pz.nx.zeros(shape, dtype=dtype))
  caching: dict = {}
  for uncached, cached, name in _STATEFUL:
    layers = pz.select(sampler.body).at_subtrees_where(
        lambda node, kind=uncached: _stateful_kind(node) is kind)
    converted = {
        path: cached.from_uncached(layer, batch_axes, label=f"{variable_name_prefix}/{name}_{i}")
        for i, (path, layer) in enumerate(layers.selected_by_path.items())}
    sampler = dataclasses.replace(sampler, body=layers.set_by_path(converted))
    caching.update(converted)
  longrope = pz.select(model.body).at_instances_of(ApplyLongRoPE).get_sequence()
  if longrope and caching:
    # The recomputation rewinds the caches' end; a recurrent state has none.
    raise errors.ArgumentError(
        "kv_caching_lm: this model has both LongRoPE layers, whose cache is recomputed where"
        " the sequence crosses the original context, and gated DeltaNet or short convolution"
        " layers, whose state cannot be rewound to recompute; no family pz_persist loads has"
        " both, so the model was edited into one that cannot be sampled this way.")
  if longrope:
    return LongRopeKVCachingLM.wrapping(
        sampler, tuple(layer.original_max_position_embeddings for layer in longrope))
  return sampler
