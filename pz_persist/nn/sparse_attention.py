"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): a lightning indexer scores
every past token for each query and attention sees only the ``top_k`` best.

The indexer is a second, small attention beside multi-head latent attention
(`pz_persist.nn.latent_attention`): ``index_heads`` queries per token
(``wq_b`` of MLA's normalised query latent, RoPE on their first rotary
numbers), one key per token (``wk`` of the input, a LayerNorm, RoPE likewise,
in halves), and one weight per head and token (``weights_proj`` of the
input, times ``index_heads ** -0.5``). A token's score for a query is
``sum_h weight_h * relu(query_h . key * scale)``; past the causal mask the
``top_k`` best-scoring tokens are kept and every other attention logit is
masked out.

In Penzai (`pz_persist.pretrained.hf.families.deepseek_v32` builds it), the
MLA layout with three layers of this module::

  WithLatent(compress = AppendIndexKey(latent = <MLA's compression>,
                                       index_key = Sequential[Linear key,
                                         LayerNorm key_norm, ApplyToParts(RoPE)])),
  Attention(
    input_to_query = Sequential[Pick(0), IndexedQuery(
        latent = Sequential[Linear q_a, RMSLayerNorm q_a_norm],
        query = <MLA's query from the latent>,
        index_query = Sequential[Linear indexer/query, ApplyToParts(RoPE)],
        index_weights = Sequential[CastToDType(float32), Linear indexer/weights,
                                   ConstantScale])],
    input_to_key = Pick(1), input_to_value = Pick(1),
    query_key_to_attn = Sequential[
        SparseAttentionLogits(
            logits = Sequential[LatentAttentionLogits, ApplyCausalAttentionMask],
            index_scores = Sequential[IndexerScores, ApplyCausalAttentionMask(-inf)]),
        Softmax],
    attn_value_to_output = <MLA's>)

Why the indexer's keys ride in the latent: Penzai's sampling mode
(``penzai.models.transformer.sampling_mode``) caches what ``input_to_key``
returns, one array per layer over ``projection``; each token's indexer key
(``index_head_dim`` numbers) is appended to its latent there
(`AppendIndexKey`), so the cache holds what transformers' holds (the latent
and the indexer key of every past token) and a new token's indexer scores
every cached token, as transformers' ``update_indexer`` cache does.
`SparseAttentionLogits` splits the cached array back into the two
(`LatentAttentionValues` reads only the latent's first numbers). Both masks
are Penzai's causal mask layers, which sampling mode rewires to the cached
tokens' positions, so unwritten cache slots are never chosen.

GLM-5 (`pz_persist.pretrained.hf.families.glm_moe_dsa`) rotates the indexer's
numbers interleaved (a ``Deinterleave`` before its RoPE) and lets a layer
reuse the choice of the last earlier layer that ran an indexer (its
``indexer_types`` entry ``"shared"``): that earlier layer's
`PublishingSparseAttentionLogits` records which tokens it kept in the
forward pass's mailbox (`pz_persist.nn.kv_sharing.SharesKV`, around the
decoder blocks), and the reusing layer, plain MLA with no indexer, masks its
logits with it (`SharedChoiceLogits`). In sampling mode every layer sees the
same cached positions, so the choice fits the reusing layer's logits; its
cache holds the latent alone (`pz_persist.nn.latent_attention.SizedPick`).

Example:

  >>> import jax, jax.numpy as jnp
  >>> from penzai import pz
  >>> from pz_persist.nn import sparse_attention as dsa
  >>> scores = dsa.IndexerScores(scale=1.0)
  >>> q = pz.nx.ones({"seq": 3, "index_heads": 2, "projection": 4})
  >>> w = pz.nx.ones({"seq": 3, "index_heads": 2})
  >>> k = pz.nx.arange("seq", 3).astype(jnp.float32) * pz.nx.ones({"projection": 4})
  >>> scores(((q, w), k)).named_shape
  {'seq': 3, 'kv_seq': 3}

A layer reusing the choice an earlier layer recorded in the mailbox (GLM-5):

  >>> from pz_persist.nn import kv_sharing, latent_attention as mla
  >>> keep = pz.nx.wrap(jnp.array([[True, False], [False, True]]), "seq", "kv_seq")
  >>> reuse = dsa.SharedChoiceLogits(logits=mla.Pick(0), masked_out_value=jnp.array(-9.0))
  >>> mailbox = {kv_sharing.SIDE_INPUT: {dsa.CHOICE_SLOT: keep}}
  >>> reuse((pz.nx.zeros({"seq": 2, "kv_seq": 2}), None), **mailbox).unwrap("seq", "kv_seq").tolist()
  [[0.0, -9.0], [-9.0, 0.0]]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from penzai import pz

from pz_persist.nn import kv_sharing
from pz_persist.nn._fields import static

CHOICE_SLOT = "index_top_k"
"""The mailbox slot (`pz_persist.nn.kv_sharing`) of the indexer's choice of
key tokens that GLM-5's ``"shared"`` layers reuse."""


def _renamed(array: pz.nx.NamedArray, old: str, new: str) -> pz.nx.NamedArray:
  return array if old == new else array.untag(old).tag(new)


@pz.pytree_dataclass
class AppendIndexKey(pz.nn.Layer):
  """``x -> latent(x) ++ index_key(x)`` along ``axis``: MLA's cached latent
  with each token's indexer key after it, so Penzai's KV cache holds both
  (module docstring).

  Attributes:
    latent: MLA's key/value compression (the latent and the shared rotary
      key).
    index_key: The indexer's key of each token (``wk``, ``k_norm``, RoPE).
    axis: The axis both are on, and joined along (Penzai's cache axis).
  """

  latent: pz.nn.Layer
  index_key: pz.nn.Layer
  axis: str = static(default="projection")

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    return pz.nx.concatenate([self.latent(inputs, **side_inputs),
                              self.index_key(inputs, **side_inputs)], self.axis)


@pz.pytree_dataclass
class IndexedQuery(pz.nn.Layer):
  """``x -> (query, (index_queries, index_weights))``: MLA's query and the
  indexer's, both read from one query latent, and the indexer's per-head
  weights, read from ``x``.

  Attributes:
    latent: ``x`` to the normalised query latent (``q_a``, ``q_a_norm``).
    query: The latent to MLA's (scaled, rotated) queries.
    index_query: The latent to the indexer's queries (``wq_b``, RoPE), over
      ``index_heads`` and ``projection``.
    index_weights: ``x`` to the indexer's weights over ``index_heads``
      (``weights_proj`` times ``index_heads ** -0.5``).
  """

  latent: pz.nn.Layer
  query: pz.nn.Layer
  index_query: pz.nn.Layer
  index_weights: pz.nn.Layer

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs
               ) -> tuple[pz.nx.NamedArray, tuple[pz.nx.NamedArray, pz.nx.NamedArray]]:
    latent = self.latent(inputs, **side_inputs)
    return (self.query(latent, **side_inputs),
            (self.index_query(latent, **side_inputs), self.index_weights(inputs, **side_inputs)))


@pz.pytree_dataclass
class IndexerScores(pz.nn.Layer):
  """The lightning indexer's score of each key token for each query token:
  ``sum_h weight_h * relu(scale * query_h . key)``, in float32 (as
  transformers scores, whatever the model's dtype).

  Input ``((queries, weights), keys)``: queries over ``seq``,
  ``index_heads`` and ``projection``; weights over ``seq`` and
  ``index_heads``; keys over ``seq`` and ``projection`` (renamed
  ``kv_seq``). Output over ``seq`` and ``kv_seq``.

  Attributes:
    scale: ``index_head_dim ** -0.5``.
    heads_axis: The axis of the indexer's heads.
  """

  scale: float = static()
  heads_axis: str = static(default="index_heads")

  def __call__(self, inputs: tuple[tuple[pz.nx.NamedArray, pz.nx.NamedArray], pz.nx.NamedArray],
               **_unused_side_inputs) -> pz.nx.NamedArray:
    (queries, weights), keys = inputs
    keys = _renamed(keys, "seq", "kv_seq").astype(jnp.float32)
    dots = pz.nx.nmap(jnp.dot)(queries.astype(jnp.float32).untag("projection"),
                               keys.untag("projection"))
    scores = pz.nx.nmap(jax.nn.relu)(dots * self.scale)
    return pz.nx.nmap(jnp.sum)((scores * weights.astype(jnp.float32)).untag(self.heads_axis))


def _top_k_mask(scores: jax.Array, k: int) -> jax.Array:
  """True at the ``k`` best of a vector of scores (ties to the first)."""
  _, chosen = jax.lax.top_k(scores, k)
  return jnp.zeros(scores.shape, dtype=bool).at[chosen].set(True)


@pz.pytree_dataclass
class SparseAttentionLogits(pz.nn.Layer):
  """Attention logits masked to the ``top_k`` key tokens the indexer scores
  best for each query (DeepSeek Sparse Attention).

  Input ``((query, index_query), cached)``, ``cached`` over ``seq`` and
  ``projection``: its first ``key_size`` numbers are MLA's latent (what
  ``logits`` reads with ``query``), the others the indexer's keys (what
  ``index_scores`` reads with ``index_query``). Both sublayers end in the
  causal mask, so a masked token scores ``-inf`` and is never chosen before
  a visible one; with ``top_k`` or fewer tokens visible every one is kept.
  Output: the logits over ``seq``, the heads and ``kv_seq``, those of the
  tokens not chosen replaced by ``masked_out_value``.

  Attributes:
    logits: ``(query, latent)`` to the masked attention logits.
    index_scores: ``(index_query, index_keys)`` to the masked scores over
      ``seq`` and ``kv_seq`` (`IndexerScores`, then a causal mask of
      ``-inf``).
    key_size: The latent's size along ``projection``.
    top_k: How many key tokens each query attends to (``index_topk``).
    masked_out_value: The logit of a token not chosen.
  """

  logits: pz.nn.Layer
  index_scores: pz.nn.Layer
  key_size: int = static()
  top_k: int = static()
  masked_out_value: jax.typing.ArrayLike

  def logits_and_choice(self, inputs: tuple[tuple[Any, Any], pz.nx.NamedArray], **side_inputs
                        ) -> tuple[pz.nx.NamedArray, pz.nx.NamedArray | None]:
    """The unmasked-by-choice logits, and which key tokens each query keeps
    (over ``seq`` and ``kv_seq``; None when ``top_k`` keeps every one)."""
    (query, index_query), cached = inputs
    width = cached.named_shape["projection"]
    latent = cached[{"projection": pz.slice[:self.key_size]}]
    index_keys = cached[{"projection": pz.slice[self.key_size:width]}]
    logits = self.logits((query, latent), **side_inputs)
    tokens = logits.named_shape["kv_seq"]
    if self.top_k >= tokens:
      return logits, None
    scores = self.index_scores((index_query, index_keys), **side_inputs)
    keep = pz.nx.nmap(lambda s: _top_k_mask(s, self.top_k))(scores.untag("kv_seq")).tag("kv_seq")
    return logits, keep

  def __call__(self, inputs: tuple[tuple[Any, Any], pz.nx.NamedArray],
               **side_inputs) -> pz.nx.NamedArray:
    return _chosen(*self.logits_and_choice(inputs, **side_inputs), self.masked_out_value)


def _chosen(logits: pz.nx.NamedArray, keep: pz.nx.NamedArray | None,
            masked_out_value: jax.typing.ArrayLike) -> pz.nx.NamedArray:
  """``logits`` where ``keep`` (all of them when None), else ``masked_out_value``."""
  return logits if keep is None else pz.nx.nmap(jnp.where)(keep, logits, masked_out_value)


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # Its parent's fields, then ours.
class PublishingSparseAttentionLogits(SparseAttentionLogits):
  """`SparseAttentionLogits` that also records its choice of key tokens in
  the forward pass's mailbox (`pz_persist.nn.kv_sharing.SharesKV`) under
  ``slot``, for the later layers that reuse it (`SharedChoiceLogits`:
  GLM-5's ``"shared"`` indexer layers; module docstring).

  Attributes:
    slot: The mailbox slot.
  """

  slot: str = static(default=CHOICE_SLOT)

  def __call__(self, inputs: tuple[tuple[Any, Any], pz.nx.NamedArray],
               **side_inputs) -> pz.nx.NamedArray:
    logits, keep = self.logits_and_choice(inputs, **side_inputs)
    side_inputs[kv_sharing.SIDE_INPUT][self.slot] = keep
    return _chosen(logits, keep, self.masked_out_value)


@pz.pytree_dataclass
class SharedChoiceLogits(pz.nn.Layer):
  """Attention logits masked to the key tokens the last earlier
  `PublishingSparseAttentionLogits` chose in this forward pass: a layer
  with no indexer of its own (GLM-5's ``"shared"`` indexer layers; module
  docstring).

  Input ``(query, latent)``, what ``logits`` reads. Output: its logits,
  those of the tokens not chosen replaced by ``masked_out_value``.

  Attributes:
    logits: ``(query, latent)`` to the (causally) masked attention logits.
    masked_out_value: The logit of a token not chosen.
    slot: The mailbox slot the choice is read from.
  """

  logits: pz.nn.Layer
  masked_out_value: jax.typing.ArrayLike
  slot: str = static(default=CHOICE_SLOT)

  def __call__(self, inputs: Any, **side_inputs) -> pz.nx.NamedArray:
    mailbox = side_inputs.get(kv_sharing.SIDE_INPUT)
    if mailbox is None or self.slot not in mailbox:
      raise ValueError(
          f"SharedChoiceLogits reuses the key tokens an earlier layer chose (slot {self.slot!r}),"
          " but none was recorded in this forward pass: run it inside a"
          " kv_sharing.SharesKV after a PublishingSparseAttentionLogits (a model edited so that"
          " no indexer layer comes first cannot run).")
    return _chosen(self.logits(inputs, **side_inputs), mailbox[self.slot],
                   self.masked_out_value)
