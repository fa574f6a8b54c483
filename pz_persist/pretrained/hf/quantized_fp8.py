"""FP8 block-scaled weights (DeepSeek-V3's Hub format), dequantised on load.

The Hub's DeepSeek-V3 (and R1, V3.1, Kimi K2...) stores most linear weights
``W`` (``[out, in]``) as ``float8_e4m3fn`` with a float32
``weight_scale_inv`` of ``[ceil(out / b0), ceil(in / b1)]``, one number per
``b0 x b1`` block (``quantization_config.weight_block_size``, 128 x 128):
the real weight is ``W[i, j] * weight_scale_inv[i // b0, j // b1]``
(despite its name the scale multiplies), computed here in float32 and then
cast to the load's dtype like any other tensor. The embeddings, norms,
router and output head stay in bfloat16, unscaled.

``quantization_config`` is read and checked before anything else: only
``quant_method: "fp8"`` with ``fmt`` ``"e4m3"`` and a two-number
``weight_block_size`` is accepted; ``activation_scheme`` (how FP8 kernels
quantise activations at run time) is accepted as ``"dynamic"`` and has no
effect here (the model computes in the load's dtype with the dequantised
weights, as transformers' ``dequantize=True`` does);
``modules_to_not_convert`` / ``ignored_layers``, when given, must be lists of
names; DeepSeek-V3.1's ``scale_fmt: "ue8m0"`` (its scales are powers of two,
still stored as float32) is accepted. Which tensors are quantised is what the files say: an ``F8_E4M3``
weight needs its ``weight_scale_inv`` (header-checked: shape as above,
float32), a weight stored otherwise is read as it is.

`export_hf` writes the dequantised weights (the exported config has no
``quantization_config``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from pz_persist.pretrained.hf.config import Config

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE_SUFFIX = "_scale_inv"


@dataclasses.dataclass(frozen=True)
class BlockFp8:
  """A checked ``quantization_config`` of FP8 block-scaled weights.

  Attributes:
    block: ``weight_block_size``: rows and columns per scale.
  """

  block: tuple[int, int]

  def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of a weight of ``shape`` ([out, in])."""
    return (-(-shape[0] // self.block[0]), -(-shape[1] // self.block[1]))

  def describe(self) -> str:
    return (f"float8_e4m3fn with a float32 weight_scale_inv per {self.block[0]}x{self.block[1]}"
            " block, dequantised")


def read_quantization(cfg: Config) -> BlockFp8 | None:
  """The folder's FP8 quantisation (None if it has no ``quantization_config``);
  anything else is refused, naming the field."""
  config = cfg.get("quantization_config")
  if config is None:
    return None
  key = "quantization_config"
  method = config.get("quant_method")
  if method != "fp8":
    raise cfg.unsupported(f"{key}.quant_method", method,
                          "only DeepSeek's FP8 block-scaled weights ('fp8') are dequantised")
  fmt = config.get("fmt", "e4m3")
  if fmt != "e4m3":
    raise cfg.unsupported(f"{key}.fmt", fmt, "only float8_e4m3fn weights ('e4m3') are read")
  scheme = config.get("activation_scheme", "dynamic")
  if scheme != "dynamic":
    raise cfg.unsupported(f"{key}.activation_scheme", scheme,
                          "only 'dynamic' (no stored activation scales) is read")
  block = config.get("weight_block_size")
  if (not isinstance(block, list) or len(block) != 2
      or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= 2**16
                 for b in block)):
    raise cfg.unsupported(f"{key}.weight_block_size", block,
                          "expected two positive block sizes, rows then columns ([128, 128])")
  scale_fmt = config.get("scale_fmt")
  if scale_fmt not in (None, "ue8m0"):
    raise cfg.unsupported(f"{key}.scale_fmt", scale_fmt,
                          "only DeepSeek-V3.1's 'ue8m0' (scales that are powers of two, stored as"
                          " float32 like any other) is read")
  for names in ("modules_to_not_convert", "ignored_layers"):
    listed = config.get(names)
    if listed is not None and not (isinstance(listed, list)
                                   and all(isinstance(n, str) for n in listed)):
      raise cfg.unsupported(f"{key}.{names}", listed, "expected a list of module names")
  unknown = sorted(set(config) - {"quant_method", "fmt", "activation_scheme", "weight_block_size",
                                  "modules_to_not_convert", "ignored_layers", "scale_fmt"})
  if unknown:
    raise cfg.unsupported(f"{key}.{unknown[0]}", config[unknown[0]],
                          "not a field of FP8 block-scaled quantisation that pz_persist reads")
  return BlockFp8((block[0], block[1]))


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int],
               out: np.ndarray | None = None) -> np.ndarray:
  """``weight`` (float8_e4m3fn, 2-D) times its block's scale, computed in
  float32; into ``out`` (of ``weight``'s shape, any float dtype: each value
  rounded once, as ``.astype`` rounds) if given, else a new float32 array.

  Why one row of blocks at a time: the scales are spread over the weight's
  own columns, one row of blocks at a time, never over whole blocks. Spreading
  them over whole blocks (``np.repeat`` by the block size) allocated
  ``b0 x b1`` floats per scale: 16 GiB for a 48x32 weight under
  ``weight_block_size: [65536, 65536]``. Here nothing allocated depends on
  the block size beyond the weight's own shape (`working_bytes`).
  """
  rows, cols = weight.shape
  result = np.empty((rows, cols), np.float32) if out is None else out
  columns = np.arange(cols) // block[1]  # Each column's block.
  for i in range(-(-rows // block[0])):  # The scales' rows (header-checked).
    lo, hi = i * block[0], min((i + 1) * block[0], rows)
    chunk = weight[lo:hi].astype(np.float32)
    chunk *= scale_inv[i, columns].astype(np.float32)
    result[lo:hi] = chunk
    del chunk  # Before the next one is made: one row of blocks at a time.
  return result


def working_bytes(shape: tuple[int, int], block: tuple[int, int], count: int = 1) -> int:
  """At most what dequantising ``count`` weights of ``shape`` allocates
  besides the result: the parts as read (float8 weights, float32 scales) and
  `dequantize`'s intermediates (one row of blocks in float32, the columns'
  block indices and one row of scales), for the load's allocation check."""
  rows, cols = shape
  scales = -(-rows // block[0]) * -(-cols // block[1])
  parts = count * (rows * cols * FP8.itemsize + scales * 4)
  return parts + min(block[0], rows) * cols * 4 + cols * (8 + 4)


def _refuse(where: Any, name: str, what: str) -> Exception:
  from pz_persist.pretrained import safetensors_io  # pylint: disable=import-outside-toplevel
  return safetensors_io.SafetensorsFormatError(
      f"safetensors file {where[name].path}, tensor {name!r}: {what}; the folder's"
      " quantization_config says FP8 block-scaled weights (quant_method 'fp8'), so the file is"
      " damaged or not of this checkpoint.")


def source(weights: Any, quantization: BlockFp8 | None, names: list[str],
           shape: tuple[int, int], views: list[Any], stack: str | None = None) -> str:
  """The tensor a `TensorSpec` reads for the stored matrices ``names`` (each
  ``shape``): the one stored tensor itself; with ``stack`` (the name of the
  stack of several, per-expert ones) a `Weights.stacked` view of them; when
  they are stored FP8, a `Weights.decoded` view dequantising them (and
  stacking them with ``stack``). Views are appended to ``views``.

  Before anything is read, each FP8 part's shape and its
  ``weight_scale_inv``'s shape and dtype are checked against the headers.
  """
  from pz_persist.pretrained.hf import weights as weights_lib  # pylint: disable=import-outside-toplevel
  where = getattr(weights, "where", {})  # Export's stand-in has no files.
  quantized = [name for name in names if name in where and where[name].entries[name][0] == FP8]
  if not quantized:
    if stack is None:
      return names[0]
    views.append(weights_lib.stacked(stack, names))
    return stack
  if quantization is None:
    raise _refuse(where, quantized[0], "float8_e4m3fn, but config.json has no quantization_config")
  if len(quantized) != len(names):
    odd = next(name for name in names if name not in quantized)
    raise _refuse(where, quantized[0], f"float8_e4m3fn, while {odd!r} of the same stack is not")
  scale_shape = quantization.scale_shape(shape)
  parts = []
  for name in names:
    if where[name].entries[name][1] != shape:
      raise _refuse(where, name, f"shape {where[name].entries[name][1]}, expected {shape}")
    scale = name + SCALE_SUFFIX
    if scale not in where:
      raise _refuse(where, name, f"float8_e4m3fn without its {scale!r}")
    dtype, found = where[scale].entries[scale][:2]
    if dtype != np.float32 or found != scale_shape:
      raise _refuse(where, scale, f"{dtype}{list(found)}, expected float32{list(scale_shape)}"
                    f" (one scale per {quantization.block[0]}x{quantization.block[1]} block)")
    parts += [name, scale]
  target = weights.dtype if np.dtype(weights.dtype) != FP8 else np.dtype(np.float32)
  block = quantization.block

  full = shape if stack is None else (len(names), *shape)

  def decode(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    out = np.empty(full, target)  # Each matrix dequantised straight into it.
    for i, name in enumerate(names):
      dequantize(arrays[name], arrays[name + SCALE_SUFFIX], block,
                 out=out if stack is None else out[i])
    return out

  name = f"{stack or names[0]} (dequantised)"
  views.append(weights_lib.decoded(name, parts, full, target, decode, quantization.describe(),
                                   working_bytes(shape, block, len(names))))
  return name
