"""MXFP4 weights, as gpt-oss checkpoints on the Hub store their experts.

OCP's microscaling format: values in blocks of 32, each value a 4-bit float
(FP4 E2M1: sign, two exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3,
4, 6 and their negatives), each block one shared power-of-two scale (E8M0:
an unsigned byte ``e`` meaning ``2 ** (e - 127)``). gpt-oss stores a weight
``W`` of shape ``[experts, rows, columns]`` as two tensors:

- ``<name>_blocks``: uint8 ``[experts, rows, columns / 32, 16]``, two values
  a byte, the value of even column index in the low nibble;
- ``<name>_scales``: uint8 ``[experts, rows, columns / 32]``.

transformers' ``GptOssExperts`` holds the transpose of that ``W``
(``gate_up_proj``: ``[experts, hidden, 2 * intermediate]``), so `dequantize`
returns ``[experts, columns, rows]``. Every FP4 value times a power of two
is exact in float32 (subnormal for the smallest scales), as
transformers' ``ldexp`` computes it; the scale byte 255 (E8M0's NaN) and a
product beyond float32's range are refused rather than read as NaN or inf.
"""

from __future__ import annotations

import numpy as np

from pz_persist.pretrained import errors

BLOCK = 32
"""Values per block (one scale each)."""

_FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
"""The 16 FP4 E2M1 values, by code (sign bit 8)."""

_NAN = 255
"""E8M0's one special value: not a number."""


def blocks_shape(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The stored ``(blocks, scales)`` shapes of a dense ``[experts, columns,
  rows]`` weight (transformers' layout)."""
  experts, columns, rows = shape
  return (experts, rows, columns // BLOCK, BLOCK // 2), (experts, rows, columns // BLOCK)


def dequantize(blocks: np.ndarray, scales: np.ndarray, where: str) -> np.ndarray:
  """The float32 weight ``[experts, columns, rows]`` that ``blocks`` and
  ``scales`` store (module docstring).

  Raises:
    SafetensorsFormatError: a NaN scale, a value beyond float32, or blocks and
      scales that do not fit (naming ``where``).
  """
  if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
    raise errors.SafetensorsFormatError(
        f"{where}: MXFP4 blocks and scales are uint8; found {blocks.dtype} and {scales.dtype}.")
  if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2 or blocks.ndim != 4:
    raise errors.SafetensorsFormatError(
        f"{where}: MXFP4 blocks {blocks.shape} and scales {scales.shape} do not fit"
        f" (blocks [experts, rows, groups, {BLOCK // 2}], scales [experts, rows, groups]).")
  if scales.size and scales.max() == _NAN:
    raise errors.SafetensorsFormatError(
        f"{where}: an MXFP4 scale byte is 255, E8M0's NaN; the tensor is damaged or not"
        " MXFP4.")
  experts, rows, groups, _ = blocks.shape
  values = np.empty((experts, rows, groups, BLOCK), np.float32)
  values[..., 0::2] = _FP4[blocks & 0x0F]
  values[..., 1::2] = _FP4[blocks >> 4]
  with np.errstate(over="ignore"):  # In place: `working_bytes` counts one float32 copy.
    np.ldexp(values, (scales.astype(np.int32) - 127)[..., None], out=values)
  if not np.isfinite(values).all():
    raise errors.SafetensorsFormatError(
        f"{where}: MXFP4 values times their scales exceed float32's range (scale bytes up to"
        f" {int(scales.max())}); the tensor is damaged or not MXFP4.")
  return np.ascontiguousarray(values.reshape(experts, rows, groups * BLOCK).transpose(0, 2, 1))


def working_bytes(shape: tuple[int, ...]) -> int:
  """At most what `dequantize` of a weight of ``shape`` (``[experts, columns,
  rows]``) allocates besides the load's own parameter, for the load's
  allocation check: the blocks and scales as read (17 bytes per 32 values),
  the float32 values and the float32 result they are transposed into (8 bytes
  a value; the smaller transients, a nibble lookup or the finiteness check,
  come and go before the transpose), and the scale exponents (4 bytes per
  block). The float32 result counts even when the load's dtype is float32:
  an upper bound is what the check needs."""
  count = int(np.prod(shape, dtype=np.int64))
  return count // BLOCK * (BLOCK // 2 + 1) + count * 8 + count // BLOCK * 4


def quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``(blocks, scales)`` storing ``weight`` (``[experts, columns, rows]``)
  in MXFP4, rounding each value to the nearest FP4 value of its block's scale
  (the largest magnitude of a block maps at most to 6). For tests, which
  build quantised folders as the Hub holds them."""
  experts, columns, rows = weight.shape
  grouped = weight.transpose(0, 2, 1).reshape(experts, rows, columns // BLOCK, BLOCK)
  top = np.abs(grouped).max(axis=-1)
  exponent = np.where(top > 0, np.ceil(np.log2(np.maximum(top, 1e-30) / 6.0)), 0)
  exponent = np.clip(exponent, -127, 127)
  scaled = grouped / np.exp2(exponent)[..., None]
  codes = np.abs(scaled[..., None] - _FP4).argmin(axis=-1).astype(np.uint8)
  blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
  return blocks, (exponent + 127).astype(np.uint8)
