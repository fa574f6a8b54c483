"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention, from
Penzai's own ``pz.nn.Attention`` and a few small layers.

MLA compresses each token's keys and values into one low-rank latent
(``kv_lora_rank`` numbers, RMS-normalised) plus one rotary key shared by all
heads (``qk_rope_head_dim`` numbers); each head's keys (its no-RoPE part)
and values are up-projections of that latent. Queries are a low-rank
projection too (``q_lora_rank``, normalised), each head's query a no-RoPE
part and a RoPE part. A head's attention logit is the sum of the two parts'
dot products, times the softmax scale.

In Penzai (`pz_persist.pretrained.hf.families.deepseek_v3` builds it)::

  Residual(Sequential[
    RMSLayerNorm pre_attention_norm,
    WithLatent(compress = Sequential[          # x -> (x, latent)
      Linear kv_a  (embedding -> projection: kv_lora_rank + qk_rope_head_dim),
      ApplyToParts(projection = kv_latent | rotary:
                   [RMSLayerNorm kv_a_norm], [Deinterleave?, RoPE])]),
    Attention(
      input_to_query = Sequential[Pick(0), Linear q_a, RMSLayerNorm q_a_norm,
                                  Linear query (-> heads, projection),
                                  ApplyToParts(projection | rotary: [], [RoPE]),
                                  ConstantScale],
      input_to_key = Pick(1), input_to_value = Pick(1),   # the latent, cached
      query_key_to_attn = Sequential[LatentAttentionLogits(key_up), mask, Softmax],
      attn_value_to_output = Sequential[LatentAttentionValues(value_up),
                                        Linear output])])

Why the latent is what Penzai's KV cache holds: Penzai's sampling mode
(``penzai.models.transformer.sampling_mode``) caches whatever
``input_to_key`` and ``input_to_value`` return, in arrays of the shape
``{batch..., projection: projection_dim}`` it reads from the model's
metadata; MLA's keys (``qk_nope + qk_rope`` per head) and values
(``v_head_dim`` per head) differ in size, so they cannot both go there, but
the latent can: the cache then holds ``kv_lora_rank + qk_rope_head_dim``
numbers per token (576 for DeepSeek-V3, against 128 heads x 320 up-projected),
as DeepSeek's own inference code and transformers' cache do, and the per-head
keys and values are up-projected from it at each step. (The value cache holds
the same latent again: Penzai keeps two caches of one shape.) The latent
is on Penzai's cache axis name, ``projection``; inside the layers its two
parts are named ``kv_latent`` and ``rotary``, so treescope shows them.

Why ``Deinterleave``: DeepSeek's checkpoints hold each rotary pair as
neighbours ``(x0, x1), (x2, x3)...`` (``rope_interleave``, as transformers
reads them); reordering to ``(x0, x2, ..., x1, x3, ...)`` and rotating in
halves, Penzai's convention, is that rotation exactly (transformers' own
interleaved rotation returns the halves in that order), for queries and
keys alike, so their dot products are unchanged.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from penzai import pz

from pz_persist.nn._fields import static


def _renamed(array: pz.nx.NamedArray, old: str, new: str) -> pz.nx.NamedArray:
  return array if old == new else array.untag(old).tag(new)


@pz.pytree_dataclass
class WithLatent(pz.nn.Layer):
  """``x -> (x, compress(x))``: the input of an MLA ``Attention``, whose
  query reads ``x`` and whose keys and values are the latent (`Pick`).

  Attributes:
    compress: The key/value compression (``kv_a``, its norm and the shared
      rotary key).
  """

  compress: pz.nn.Layer

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs
               ) -> tuple[pz.nx.NamedArray, pz.nx.NamedArray]:
    return inputs, self.compress(inputs, **side_inputs)


@pz.pytree_dataclass
class Pick(pz.nn.Layer):
  """``inputs[index]`` of a tuple (`WithLatent`'s)."""

  index: int = static()

  def __call__(self, inputs: tuple[Any, ...], **_unused_side_inputs) -> Any:
    return inputs[self.index]


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # Pick's fields, then ours.
class SizedPick(Pick):
  """A `Pick` of the latent that states its axes besides the sequence, for
  `pz_persist.pretrained.kv_caching_lm`, which sizes this layer's cache from
  them rather than from the model's one ``projection_dim``: in GLM-5 the
  layers that reuse an earlier layer's sparse-attention choice cache the
  latent alone, the others the latent and their indexer's keys
  (`pz_persist.nn.sparse_attention`).

  Attributes:
    axes: The picked array's named axes besides the sequence and batch.
  """

  axes: tuple[tuple[str, int], ...] = static()


@pz.pytree_dataclass
class ApplyToParts(pz.nn.Layer):
  """Splits ``axis`` into consecutive parts, gives each (its axis renamed to
  its name) to its layers, and joins the results back along ``axis``.

  MLA's query is a no-RoPE part then a RoPE part of one projection; its
  latent a normalised part then a rotary key: one ``Linear`` each in the
  checkpoint, two treatments.

  Attributes:
    parts: One layer per part (an empty ``Sequential`` leaves it as it is).
    names: The axis name each part has inside its layer.
    sizes: Each part's size along ``axis``, in order; they add up to it.
    axis: The axis split.
  """

  parts: list[pz.nn.Layer]
  names: tuple[str, ...] = static()
  sizes: tuple[int, ...] = static()
  axis: str = static()

  def split(self, inputs: pz.nx.NamedArray) -> list[pz.nx.NamedArray]:
    """The parts of ``inputs``, each on its own axis name."""
    out, start = [], 0
    for name, size in zip(self.names, self.sizes):
      out.append(_renamed(inputs[{self.axis: pz.slice[start:start + size]}], self.axis, name))
      start += size
    return out

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    results = [_renamed(layer(part, **side_inputs), name, self.axis)
               for layer, name, part in zip(self.parts, self.names, self.split(inputs))]
    return pz.nx.concatenate(results, self.axis)


@pz.pytree_dataclass
class Deinterleave(pz.nn.Layer):
  """Reorders ``axis`` as its even positions then its odd ones: pairs held
  as neighbours (DeepSeek's rotary layout) become halves (Penzai's)."""

  axis: str = static()

  def __call__(self, inputs: pz.nx.NamedArray, **_unused_side_inputs) -> pz.nx.NamedArray:
    return pz.nx.nmap(lambda v: jnp.concatenate([v[0::2], v[1::2]]))(
        inputs.untag(self.axis)).tag(self.axis)


def _dot(first: pz.nx.NamedArray, second: pz.nx.NamedArray, axis: str) -> pz.nx.NamedArray:
  """The dot product over ``axis``, batched over every other axis."""
  return pz.nx.nmap(jnp.dot)(first.untag(axis), second.untag(axis))


@pz.pytree_dataclass
class LatentAttentionLogits(pz.nn.Layer):
  """MLA's attention logits from the (scaled) queries and the cached latents.

  Input ``(queries, latents)``: queries over ``seq``, the heads and
  ``projection`` (``nope_size`` no-RoPE numbers then the rotated ones),
  latents over ``seq`` and ``projection`` (``latent_size`` normalised
  latent numbers then the rotated shared key). Each head's keys are
  ``key_up`` of the latent; the logit is the no-RoPE parts' dot product
  plus the rotary parts'. Output over ``seq``, the heads and ``kv_seq``.

  Attributes:
    key_up: ``Linear`` from ``kv_latent`` to the heads' no-RoPE keys
      (``kv_b_proj``'s key rows).
    latent_size: ``kv_lora_rank``.
    nope_size: ``qk_nope_head_dim``.
  """

  key_up: pz.nn.Layer
  latent_size: int = static()
  nope_size: int = static()

  def __call__(self, inputs: tuple[pz.nx.NamedArray, pz.nx.NamedArray],
               **side_inputs) -> pz.nx.NamedArray:
    queries, latents = inputs
    rotated = latents.named_shape["projection"] - self.latent_size
    latent, shared_key = ApplyToParts(parts=[], names=("kv_latent", "rotary"),
                                      sizes=(self.latent_size, rotated),
                                      axis="projection").split(latents)
    keys = _renamed(self.key_up(latent, **side_inputs), "seq", "kv_seq")
    shared_key = _renamed(shared_key, "seq", "kv_seq")
    head = queries.named_shape["projection"]
    query_nope, query_rotated = ApplyToParts(
        parts=[], names=("projection", "rotary"), sizes=(self.nope_size, head - self.nope_size),
        axis="projection").split(queries)
    return _dot(query_nope, keys, "projection") + _dot(query_rotated, shared_key, "rotary")


@pz.pytree_dataclass
class LatentAttentionValues(pz.nn.Layer):
  """MLA's attention output per head from the attention weights and the
  cached latents: each head's values are ``value_up`` of the latent.

  Input ``(weights, latents)``: weights over ``seq``, the heads and
  ``kv_seq``; latents as `LatentAttentionLogits` reads them. Output over
  ``seq``, the heads and ``projection`` (``v_head_dim``).

  Attributes:
    value_up: ``Linear`` from ``kv_latent`` to the heads' values
      (``kv_b_proj``'s value rows).
    latent_size: ``kv_lora_rank``.
  """

  value_up: pz.nn.Layer
  latent_size: int = static()

  def __call__(self, inputs: tuple[pz.nx.NamedArray, pz.nx.NamedArray],
               **side_inputs) -> pz.nx.NamedArray:
    weights, latents = inputs
    latent = _renamed(latents[{"projection": pz.slice[:self.latent_size]}], "projection",
                      "kv_latent")
    values = _renamed(self.value_up(latent, **side_inputs), "seq", "kv_seq")
    return _dot(weights, values, "kv_seq")
