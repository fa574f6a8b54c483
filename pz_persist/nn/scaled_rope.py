"""Scaled rotary position embeddings, as Hugging Face's ``rope_scaling``.

Penzai's ``pz.nn.ApplyRoPE`` implements the original rotary embedding only;
Llama 3.x, long-context Mistral/Qwen and other checkpoints stretch it with
one of Hugging Face's "rope types". `ApplyScaledRoPE` is a drop-in
replacement (same ``embedding_axis`` / ``max_wavelength`` /
``positions_input_name`` interface, same rotate-half convention) whose other
fields are the fields of the checkpoint's ``rope_scaling`` dict, kept as
plain static values so that the dict can be written back from the layer
alone (`ApplyScaledRoPE.rope_scaling_config`, `ApplyScaledRoPE.config_fields`).

The inverse frequencies are computed as transformers 5 computes them
(``transformers.modeling_rope_utils``), in float32 and in the same order:

- ``linear``: every inverse frequency divided by ``factor``.
- ``llama3``: low frequencies (wavelength above ``original_max_position_
  embeddings / low_freq_factor``) divided by ``factor``, high frequencies
  (wavelength below ``original_max_position_embeddings / high_freq_factor``)
  kept, the band between blended smoothly.
- ``yarn``: a blend of the divided and undivided frequencies along a linear
  ramp between the dimensions set by ``beta_fast`` / ``beta_slow``
  (``truncate``: rounded outwards to whole dimensions, the default), and cos
  and sin multiplied by ``attention_factor`` (derived from ``factor``, and
  ``mscale`` / ``mscale_all_dim`` if both are set, when absent).
- ``dynamic`` (dynamic NTK): the base wavelength is recomputed from the
  current input's largest position ``p``: with ``L = max(p + 1,
  max_position_embeddings)``, ``base * (factor * L / max_position_embeddings
  - (factor - 1)) ** (d / (d - 2))``; unchanged while ``p + 1 <=
  max_position_embeddings``. transformers keeps the frequencies of the
  longest input seen so far instead (until an input shorter than
  ``max_position_embeddings`` resets them), so the two agree on every call
  whose largest position is at least that of every earlier call since the
  last reset: always for a fresh model's call, and for each step of a
  token-by-token generation (prefill, then one position more at a time),
  where keys already in the KV cache keep the rotation of the step that
  wrote them in both. They differ on a shorter input after a longer one.

In Penzai's KV-cache sampling mode
(``penzai.models.transformer.sampling_mode``) the positions side input holds
the absolute positions of the new tokens (``-1`` for padding, which never
raises the largest position), so all four types give the same result token
by token as on the whole sequence (``dynamic``: as transformers' generate).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any
from typing import TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from pz_persist import errors
from pz_persist.nn._fields import static

SCALING_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor"}), frozenset()),
    "llama3": (
        frozenset({"factor", "original_max_position_embeddings", "low_freq_factor",
                   "high_freq_factor"}),
        frozenset(),
    ),
    "yarn": (
        frozenset({"factor", "original_max_position_embeddings"}),
        frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                   "truncate"}),
    ),
}
"""For each supported ``rope_type``: the keys of Hugging Face's
``rope_scaling`` dict (besides ``rope_type``, ``rope_theta`` and
``partial_rotary_factor``) it requires and those it may have; each is a
field of `ApplyScaledRoPE` of the same name."""


@pz.pytree_dataclass
class ApplyScaledRoPE(pz.nn.Layer):
  """Rotary position embeddings with Hugging Face's ``rope_scaling``.

  Used like ``pz.nn.ApplyRoPE`` (which it replaces in models loaded by
  `pz_persist.pretrained.load_hf`): the input's ``embedding_axis`` is
  rotated in halves (first half against second half) by angles
  ``position * inverse_frequency``, the positions coming from the side input
  ``positions_input_name``.

  Attributes:
    embedding_axis: The axis rotated (``"projection"`` in Penzai's
      transformers).
    max_wavelength: The base wavelength (Hugging Face's ``rope_theta``).
    positions_input_name: The side input holding each token's position.
    rope_type: ``"linear"``, ``"dynamic"``, ``"llama3"`` or ``"yarn"``.
    factor: The context-extension factor.
    original_max_position_embeddings: ``llama3`` and ``yarn``: the context
      length the model was pretrained with.
    low_freq_factor: ``llama3``.
    high_freq_factor: ``llama3``.
    attention_factor: ``yarn``; None: derived from ``factor`` (and
      ``mscale`` / ``mscale_all_dim``).
    beta_fast: ``yarn``; None: 32.
    beta_slow: ``yarn``; None: 1.
    mscale: ``yarn``.
    mscale_all_dim: ``yarn``.
    truncate: ``yarn``; None: True.
    max_position_embeddings: ``dynamic``: the length up to which the base is
      unchanged (the config's top-level ``max_position_embeddings``, not a
      key of ``rope_scaling``).

  Optional fields are None when the checkpoint's dict lacks them, so that
  `rope_scaling_config` gives back the keys it had.
  """

  embedding_axis: str = static()
  max_wavelength: float = static()
  positions_input_name: str = static()
  rope_type: str = static()
  factor: float = static()
  original_max_position_embeddings: int | None = static(None)
  low_freq_factor: float | None = static(None)
  high_freq_factor: float | None = static(None)
  attention_factor: float | None = static(None)
  beta_fast: float | None = static(None)
  beta_slow: float | None = static(None)
  mscale: float | None = static(None)
  mscale_all_dim: float | None = static(None)
  truncate: bool | None = static(None)
  max_position_embeddings: int | None = static(None)

  def rope_scaling_config(self) -> dict[str, Any]:
    """The ``rope_scaling`` dict of a Hugging Face ``config.json`` (without
    ``rope_theta``, which is `max_wavelength`): ``rope_type`` and every key
    of `SCALING_KEYS` this layer's type has a value for."""
    required, optional = self._keys()
    config: dict[str, Any] = {"rope_type": self.rope_type}
    for key in sorted(required | optional):
      if getattr(self, key) is not None:
        config[key] = getattr(self, key)
    return config

  def config_fields(self) -> dict[str, Any]:
    """The top-level ``config.json`` fields this layer stands for, in
    transformers < 5 style (transformers 5 reads it too): ``rope_theta``,
    ``rope_scaling`` and, for ``dynamic``, ``max_position_embeddings``.
    (transformers 5 style: ``rope_parameters`` is ``rope_scaling`` plus
    ``rope_theta``.)"""
    fields: dict[str, Any] = {
        "rope_theta": self.max_wavelength,
        "rope_scaling": self.rope_scaling_config(),
    }
    if self.rope_type == "dynamic":
      fields["max_position_embeddings"] = self._required("max_position_embeddings")
    return fields

  def _keys(self) -> tuple[frozenset[str], frozenset[str]]:
    keys = SCALING_KEYS.get(self.rope_type)
    if keys is None:
      raise errors.UnsupportedConfigError(
          f"ApplyScaledRoPE.rope_type={self.rope_type!r:.80} is not one of"
          f" {sorted(SCALING_KEYS)}; the layer was built or saved with a rope type"
          " it does not implement."
      )
    return keys

  def _required(self, name: str) -> float:
    value = getattr(self, name)
    if value is None:
      raise errors.UnsupportedConfigError(
          f"ApplyScaledRoPE.{name} is None but rope_type={self.rope_type!r} needs it;"
          " set it to the checkpoint's rope_scaling value."
      )
    return value

  def attention_scaling(self) -> float:
    """The factor transformers multiplies cos and sin by (yarn's; else 1)."""
    if self.rope_type != "yarn":
      return 1.0
    if self.attention_factor is not None:
      return float(self.attention_factor)
    factor = self._required("factor")
    if self.mscale and self.mscale_all_dim:
      return float(_yarn_mscale(factor, self.mscale) / _yarn_mscale(factor, self.mscale_all_dim))
    return _yarn_mscale(factor)

  def inverse_frequencies(self, dim: int, max_position: jax.Array | None = None) -> jax.Array:
    """The ``dim // 2`` inverse frequencies (float32) for a rotated axis of
    size ``dim``; ``dynamic`` needs ``max_position``, the largest position
    of the current input."""
    self._keys()
    factor = self._required("factor")
    if self.rope_type == "linear":
      return jnp.asarray(_default_inverse_frequencies(self.max_wavelength, dim) / np.float32(factor))
    if self.rope_type == "llama3":
      return jnp.asarray(self._llama3(dim, factor))
    if self.rope_type == "yarn":
      return jnp.asarray(self._yarn(dim, factor))
    return self._dynamic(dim, factor, max_position)

  def _llama3(self, dim: int, factor: float) -> np.ndarray:
    inv_freq = _default_inverse_frequencies(self.max_wavelength, dim)
    old_context = self._required("original_max_position_embeddings")
    low = self._required("low_freq_factor")
    high = self._required("high_freq_factor")
    wavelength = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelength > old_context / low, inv_freq / np.float32(factor), inv_freq)
    # high == low (Llama 4 Scout): no band, so the blend is never selected
    # (it divides by zero) unless a wavelength is exactly the bound, where
    # transformers' is NaN too and `check_computable` refuses the model.
    with np.errstate(divide="ignore", invalid="ignore"):
      smooth = (np.float32(old_context) / wavelength - np.float32(low)) / np.float32(high - low)
      smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelength < old_context / high) & ~(wavelength > old_context / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)

  def _yarn(self, dim: int, factor: float) -> np.ndarray:
    base = self.max_wavelength
    original = self._required("original_max_position_embeddings")
    beta_fast = self.beta_fast or 32
    beta_slow = self.beta_slow or 1
    truncate = True if self.truncate is None else self.truncate

    def correction_dim(rotations: float) -> float:
      return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
      high += 0.001  # As transformers: no zero-width ramp.
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1)
    extrapolation = 1 - ramp
    frequencies = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    inv_extrapolated = np.float32(1.0) / frequencies
    inv_interpolated = np.float32(1.0) / (np.float32(factor) * frequencies)
    return (inv_interpolated * (1 - extrapolation)
            + inv_extrapolated * extrapolation).astype(np.float32)

  def _dynamic(self, dim: int, factor: float, max_position: jax.Array | None) -> jax.Array:
    unscaled = jnp.asarray(_default_inverse_frequencies(self.max_wavelength, dim))
    if max_position is None:
      return unscaled
    limit = self._required("max_position_embeddings")
    length = jnp.maximum(max_position.astype(jnp.int32) + 1, limit)
    growth = (factor * length.astype(jnp.float32) / limit) - (factor - 1)
    base = jnp.float32(self.max_wavelength) * growth ** (dim / (dim - 2))
    exponents = jnp.arange(0, dim, 2).astype(jnp.float32) / dim
    return jnp.where(length > limit, 1.0 / (base ** exponents), unscaled)

  def __call__(self, inputs: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    """Rotates ``inputs`` (checked as ``pz.nn.ApplyRoPE`` checks them)."""
    positions = side_inputs[self.positions_input_name]
    if self.embedding_axis in positions.named_shape:
      raise errors.ArgumentError(
          f"Embedding axis {self.embedding_axis} should not already be part of"
          " the positions side input."
      )
    if positions.positional_shape:
      raise errors.ArgumentError("Positions side input must have no positional axes.")
    if not all(axis in inputs.named_shape for axis in positions.named_shape):
      raise errors.ArgumentError(
          "Every axis of the positions should appear in the main input.\n"
          f"Positions has: {positions.named_shape}\n"
          f"Main input has: {inputs.named_shape}\n"
      )
    dim = inputs.named_shape[self.embedding_axis]
    max_position = None
    if self.rope_type == "dynamic":
      max_position = jnp.max(positions.unwrap(*positions.named_shape))
    inv_freq = self.inverse_frequencies(dim, max_position)
    scaling = self.attention_scaling()

    def rotate(vector: jax.Array, position: jax.Array) -> jax.Array:
      angles = position.astype(jnp.float32) * inv_freq
      cos, sin = jnp.cos(angles) * scaling, jnp.sin(angles) * scaling
      first, second = jnp.split(vector, 2)
      return jnp.concatenate([first * cos - second * sin, second * cos + first * sin])

    out = pz.nx.nmap(rotate)(inputs.untag(self.embedding_axis), positions)
    return out.tag(self.embedding_axis).astype(inputs.dtype)


def _default_inverse_frequencies(base: float, dim: int) -> np.ndarray:
  """Unscaled RoPE's inverse frequencies, in float32 as transformers has them."""
  exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
  return (np.float32(1.0) / (np.float32(base) ** exponents)).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


_RoPELayer: TypeAlias = pz.nn.ApplyRoPE | pz.nn.ApplyRoPEToSubset | ApplyScaledRoPE
"""The rotary layers `check_computable` evaluates."""


def check_computable(model: pz.nn.Layer, sizes: Mapping[str, set[int]], where: str) -> None:
  """Refuses RoPE layers whose tables cannot be computed, before any weight
  is read: a model that loads can be called.

  Why: ``config.json`` values each valid on their own can still break the
  math (yarn's ramp divides by ``log(rope_theta)``, so ``rope_theta: 1``
  raised ZeroDivisionError on the first call; dynamic NTK raises the base to
  ``d / (d - 2)``; a tiny ``rope_theta`` or ``factor`` or a huge ``mscale``
  makes the tables inf, and every output NaN). So every ``ApplyRoPE``,
  ``ApplyRoPEToSubset`` and `ApplyScaledRoPE` of ``model`` is evaluated
  here, as its call will evaluate it, for each size its rotated axis has
  (``sizes``: axis name to the sizes the weights give it): the rotated size
  must be even, and the frequencies (or timescales) and yarn's attention
  factor finite and usable.

  Raises:
    UnsupportedConfigError: naming ``where`` (the ``config.json``), the
      rope settings and the head size.
  """
  kinds = (pz.nn.ApplyRoPE, pz.nn.ApplyRoPEToSubset, ApplyScaledRoPE)
  # The outermost instances, as ``pz.select(model).at_instances_of(...)``
  # finds them, from one flatten (a selection rebuilds the whole tree).
  leaves = jax.tree_util.tree_leaves(model, is_leaf=lambda node: isinstance(node, kinds))
  layers = [leaf for leaf in leaves if isinstance(leaf, kinds)]
  for layer in dict.fromkeys(layers):  # Every block has the same two: once each.
    dims = sorted(sizes.get(layer.embedding_axis, ()))
    if isinstance(layer, pz.nn.ApplyRoPEToSubset):
      dims = [layer.rope_subset_size]
    for dim in dims:
      problem = _uncomputable(layer, dim)
      if problem:
        raise errors.UnsupportedConfigError(
            f"{where}: {_settings(layer)} cannot be computed for a rotated head size"
            f" of {dim}: {problem}; the model would fail or compute NaN when called."
            " Nothing was loaded; the file is damaged or not a Hugging Face config."
        )


def _settings(layer: _RoPELayer) -> str:
  """The config values behind ``layer``, as ``config.json`` names them."""
  text = f"rope_theta={layer.max_wavelength!r}"
  if isinstance(layer, ApplyScaledRoPE):
    text += f" with rope_scaling={layer.rope_scaling_config()!r}"
  return text


def _uncomputable(layer: _RoPELayer, dim: int) -> str | None:
  """Why ``layer`` cannot rotate an axis of size ``dim``; None if it can."""
  if dim % 2:
    return "the rotated size must be even (it is rotated in halves)"
  if dim == 0:
    return None  # Nothing rotated (a partial rotary of 0 dimensions).
  with np.errstate(all="ignore"):
    try:
      if not isinstance(layer, ApplyScaledRoPE):  # Penzai's: position / timescale.
        fraction = 2 * np.arange(0, dim // 2, dtype=np.float32) / np.float32(dim)
        timescale = np.float32(layer.max_wavelength) ** fraction
        if not np.all(timescale > 0) or np.any(np.isnan(timescale)):
          return "a timescale is 0 or NaN in float32, so the angles would be inf or NaN"
        return None
      if layer.rope_type == "dynamic" and dim <= 2:
        return "dynamic scaling raises the base to dim / (dim - 2)"
      tables = [np.asarray(layer.inverse_frequencies(dim))]
      if layer.rope_type == "dynamic":
        limit = layer._required("max_position_embeddings")  # pylint: disable=protected-access
        tables.append(np.asarray(layer.inverse_frequencies(dim, jnp.asarray(limit * 2))))
      scaling = layer.attention_scaling()
    except (ArithmeticError, ValueError) as e:
      return f"{type(e).__name__}: {e}"
  if not all(np.all(np.isfinite(table)) for table in tables):
    return "an inverse frequency is inf or NaN in float32"
  with np.errstate(all="ignore"):
    product = np.float32(scaling) ** 2 * np.float32(dim)
  if not (np.isfinite(product) and scaling > 0):
    return (f"the attention factor is {scaling!r} (cos and sin are multiplied by it, a"
            " query-key product by its square, in float32)")
  return None
