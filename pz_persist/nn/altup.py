"""Gemma 3n's alternating updates (AltUp), learned augmented residual
(Laurel) and Gaussian top-k activation sparsity, as Penzai layers.

AltUp widens the residual stream without widening the layers: the model
carries ``altup_num_inputs`` copies ("streams", the named axis ``altup``) of
it. `AltUpExpand` makes them from the embeddings (each extra stream a
projection of the embeddings, rescaled to their RMS); each decoder layer
(`AltUpLayer`) *predicts* every stream as a learned, input-dependent mix of
all of them, runs the ordinary decoder layer on one of them only (the
active stream), and *corrects* every stream by the layer's change to the
active one; `AltUpCollapse` projects the streams back and averages them
before the final norm. The mixing coefficients come from a small router
(`AltUpRouter`): an RMS norm, a scale of ``1 / hidden_size``, a ``Linear``
onto ``altup_router`` (one value per stream) and a tanh.

Laurel (`LaurelResidual`) adds beside the attention a low-rank linear map of
the normed input (``linear_left`` then ``linear_right``, normed) and scales
the sum by ``2 ** -0.5``. `GaussianTopK` keeps, in Gemma 3n's first MLPs,
only the gate activations above ``mean + std * Phi^-1(sparsity)`` over the
``neurons`` axis (shifted down by that cutoff), as transformers does.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special
from penzai import pz

STREAMS_AXIS = "altup"
"""The axis of AltUp's streams in the residual stream."""
SOURCE_AXIS = "altup_source"
"""The streams a prediction mixes (the prediction coefficients' input side)."""
ROUTER_AXIS = "altup_router"
"""The router's output: one coefficient per stream."""
_EMBEDDING = "embedding"


def _rms(x: pz.nx.NamedArray) -> pz.nx.NamedArray:
  return pz.nx.nmap(lambda v: jnp.mean(v ** 2) ** 0.5)(x.untag(_EMBEDDING))


def _to_magnitude(x: pz.nx.NamedArray, target: pz.nx.NamedArray) -> pz.nx.NamedArray:
  """``x`` rescaled to RMS ``target`` over ``embedding`` (its own RMS
  floored at ``sqrt(1e-5)``), in transformers' order of operations."""
  magnitude = pz.nx.nmap(lambda v: jnp.sqrt(jnp.maximum(jnp.mean(v ** 2), 1e-5)))(
      x.untag(_EMBEDDING))
  return x * target / magnitude


@pz.pytree_dataclass
class AltUpExpand(pz.nn.Layer):
  """Embeddings to AltUp's streams: stream 0 is the embeddings, stream
  ``i`` is ``projections[i - 1]`` of them rescaled to their RMS.

  Example::

    embeddings = pz.nx.ones({"seq": 3, "embedding": 4})
    streams = AltUpExpand(projections=[pz.nn.Identity()])(embeddings)
    assert streams.named_shape == {"seq": 3, "embedding": 4, STREAMS_AXIS: 2}
    assert AltUpCollapse(projections=[pz.nn.Identity()])(streams).named_shape == {
        "seq": 3, "embedding": 4}
  """

  projections: list[pz.nn.Layer]

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    target = _rms(inputs)
    streams = [inputs] + [_to_magnitude(p(inputs, **side_inputs), target)
                          for p in self.projections]
    return pz.nx.stack(streams, STREAMS_AXIS)


@pz.pytree_dataclass
class AltUpCollapse(pz.nn.Layer):
  """AltUp's streams to one: stream ``i > 0`` through ``projections[i - 1]``
  rescaled to stream 0's RMS, then the mean of all streams."""

  projections: list[pz.nn.Layer]

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    first = inputs[{STREAMS_AXIS: 0}]
    target = _rms(first)
    streams = [first] + [
        _to_magnitude(p(inputs[{STREAMS_AXIS: i + 1}], **side_inputs), target)
        for i, p in enumerate(self.projections)]
    return pz.nx.nmap(jnp.mean)(pz.nx.stack(streams, STREAMS_AXIS).untag(STREAMS_AXIS))


@pz.pytree_dataclass
class AltUpRouter(pz.nn.Layer):
  """One stream to its routing coefficients over ``altup_router``:
  ``tanh(router(norm(x) / hidden_size))``, the tanh in float32."""

  norm: pz.nn.Layer
  router: pz.nn.Layer

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    normed = self.norm(inputs, **side_inputs)
    scale = jnp.asarray(1.0 / normed.named_shape[_EMBEDDING], normed.dtype)
    routed = self.router(normed * scale, **side_inputs)
    return pz.nx.nmap(lambda v: jnp.tanh(v.astype(jnp.float32)).astype(v.dtype))(routed)


@pz.pytree_dataclass
class AltUpLayer(pz.nn.Layer):
  """One decoder layer over AltUp's streams (``altup`` axis).

  Predicts each stream ``j`` as ``x_j + sum_i c_ji x_i`` (``c`` from
  ``prediction`` of the router's output on the active stream: axes ``altup``
  x ``altup_source``), runs ``layer`` on the active prediction, corrects
  each stream by ``(1 + correction(router(out))_j) * (out - prediction)``,
  and adds ``per_layer`` of the corrected active stream (after
  ``output_scale``) to every stream but the first.

  Attributes:
    router: The `AltUpRouter` (one, used by the prediction and correction).
    prediction: ``altup_router`` to ``altup`` x ``altup_source``.
    correction: ``altup_router`` to ``altup``.
    layer: The decoder layer proper, on the active stream.
    output_scale: What scales the corrected active stream before
      ``per_layer`` (a learned vector, ``correct_output_scale``).
    per_layer: The per-layer input path (its output is added to streams
      ``1..``).
    active: The active stream's index (``altup_active_idx``).
    scale_output: Whether ``output_scale`` applies (``altup_correct_scale``;
      where it does not, its parameter is still kept, as checkpoints hold it).
  """

  router: AltUpRouter
  prediction: pz.nn.Layer
  correction: pz.nn.Layer
  layer: pz.nn.Layer
  output_scale: pz.nn.Layer
  per_layer: pz.nn.Layer
  active: int = dataclasses.field(metadata={"pytree_node": False})
  scale_output: bool = dataclasses.field(default=True, metadata={"pytree_node": False})

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    coefs = self.prediction(self.router(inputs[{STREAMS_AXIS: self.active}], **side_inputs),
                            **side_inputs)
    sources = inputs.untag(STREAMS_AXIS).tag(SOURCE_AXIS)
    mixed = pz.nx.nmap(lambda x, c: jnp.dot(x, c, preferred_element_type=jnp.float32))(
        sources.untag(SOURCE_AXIS), coefs.untag(SOURCE_AXIS))
    predictions = mixed.astype(inputs.dtype) + inputs
    active = predictions[{STREAMS_AXIS: self.active}]
    out = self.layer(active, **side_inputs)
    innovation = out - active
    scales = self.correction(self.router(out, **side_inputs), **side_inputs) + 1.0
    corrected = innovation * scales + predictions
    first = corrected[{STREAMS_AXIS: self.active}]
    if self.scale_output:
      first = self.output_scale(first, **side_inputs)
    extra = self.per_layer(first, **side_inputs)
    later = pz.nx.wrap(jnp.arange(inputs.named_shape[STREAMS_AXIS]) > 0).tag(STREAMS_AXIS)
    return pz.nx.nmap(jnp.where)(later, corrected + extra, corrected)


@pz.pytree_dataclass
class LaurelResidual(pz.nn.Layer):
  """The attention half of a Gemma 3n layer with Laurel beside it:
  ``((x + branch(n)) + (n + laurel(n))) / sqrt(2)`` where ``n = norm(x)``
  (the division in at least float32, as transformers rounds it).

  Example::

    half = LaurelResidual(norm=pz.nn.Identity(), branch=pz.nn.Identity(),
                          laurel=pz.nn.Identity())
    out = half(pz.nx.ones({"embedding": 2}))  # (1 + 1 + 1 + 1) / sqrt(2) each.
  """

  norm: pz.nn.Layer
  branch: pz.nn.Layer
  laurel: pz.nn.Layer

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    normed = self.norm(inputs, **side_inputs)
    attended = inputs + self.branch(normed, **side_inputs)
    augmented = normed + self.laurel(normed, **side_inputs)
    both = attended + augmented
    def halve(v: jax.Array) -> jax.Array:
      wide = jnp.promote_types(v.dtype, jnp.float32)
      return (v.astype(wide) / math.sqrt(2)).astype(v.dtype)

    return pz.nx.nmap(halve)(both)


def _std_multiplier(sparsity: float) -> np.float32:
  """torch's ``Normal(0, 1).icdf`` of the float32 ``sparsity``, bit for bit:
  ``erfinv(2p - 1)`` rounded to float32, times float32 ``sqrt(2)``. XLA's
  float32 erfinv is 2 ulps off at 0.95 (Gemma 3n's value), which moved the
  logits of the Hub's 10 sparse layers three times further from
  transformers' than its own float32 rounding; the multiplier depends on the
  config alone, so it is computed once, in float64."""
  p = np.float32(sparsity)
  argument = np.float32(np.float32(2) * p - np.float32(1))
  return np.float32(np.float32(scipy.special.erfinv(np.float64(argument)))
                    * np.float32(np.sqrt(2)))


@pz.pytree_dataclass
class GaussianTopK(pz.nn.Layer):
  """Activation sparsity: ``relu(x - (mean + std * Phi^-1(sparsity)))``
  over ``axis`` (Gemma 3n's ``_gaussian_topk``; ``std`` is the population
  one). Keeps about ``1 - sparsity`` of the activations where they are
  Gaussian.

  Example::

    sparse = GaussianTopK(sparsity=0.5)  # Phi^-1(0.5) = 0: keeps what is above the mean.
    out = sparse(pz.nx.wrap(jnp.array([1.0, 2.0, 3.0])).tag("neurons"))  # [0, 0, 1]
  """

  sparsity: float = dataclasses.field(metadata={"pytree_node": False})
  axis: str = dataclasses.field(default="neurons", metadata={"pytree_node": False})

  def __call__(self, inputs: pz.nx.NamedArray, **_unused_side_inputs) -> pz.nx.NamedArray:
    multiplier = jnp.asarray(_std_multiplier(self.sparsity), inputs.dtype)

    def cut(v: jax.Array) -> jax.Array:
      return jax.nn.relu(v - (jnp.mean(v) + jnp.std(v) * multiplier))

    return pz.nx.nmap(cut)(inputs.untag(self.axis)).tag(self.axis)
