"""What a pretrained load allocates while it dequantises is counted first.

The promise "the total a load allocates is checked before the first tensor is
read" covers the intermediates too: no intermediate may grow with a config
value beyond the checked shapes. FP8 block scales spread with ``np.repeat``
by ``weight_block_size`` once allocated 16 GiB for a 48x32 weight under
``[65536, 65536]`` (a size the config check accepts). Allocation is measured
with tracemalloc (NumPy reports its buffers to it), never by timing; the
load's own check is shown to count the dequantisation's working memory.
"""

from __future__ import annotations

import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import pz_persist as pzp
from hostile import test_pretrained_mxfp4_hostile as mxfp4_folders
from pz_persist.pretrained import errors
from pz_persist.pretrained.hf import families
from pz_persist.pretrained.hf import quantized_fp8
from pz_persist.pretrained.hf import quantized_mxfp4
from pz_persist.pretrained.hf import weights as weights_lib
from pz_persist.pretrained.hf.config import Config

_SLACK = 64 * 1024
"""NumPy's and Python's own small allocations around the arrays measured."""


def _peak(run) -> tuple[object, int]:
  """``run()`` and the most bytes traced at once while it ran."""
  tracemalloc.start()
  try:
    tracemalloc.reset_peak()
    result = run()
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  return result, peak


def _fp8(rng, rows: int, cols: int, block: tuple[int, int]):
  weight = rng.normal(size=(rows, cols)).astype(ml_dtypes.float8_e4m3fn)
  scales = rng.uniform(0.5, 2, size=quantized_fp8.BlockFp8(block).scale_shape((rows, cols)))
  return weight, scales.astype(np.float32)


def _reference(weight, scales, block):
  rows, cols = weight.shape
  index = np.arange(rows)[:, None] // block[0], np.arange(cols)[None, :] // block[1]
  return weight.astype(np.float32) * scales[index]


def test_a_block_larger_than_the_weight_allocates_no_more_than_the_weight():
  rng = np.random.default_rng(0)
  block = (65536, 65536)
  weight, scales = _fp8(rng, 48, 32, block)
  got, peak = _peak(lambda: quantized_fp8.dequantize(weight, scales, block))
  np.testing.assert_array_equal(got, _reference(weight, scales, block))
  result = 48 * 32 * 4
  assert peak <= result + quantized_fp8.working_bytes((48, 32), block) + _SLACK, peak
  assert peak < 2**20  # It was 16 GiB.


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 300), cols=st.integers(1, 300),
    block=st.tuples(st.integers(1, 2**16), st.integers(1, 2**16)),
    seed=st.integers(0, 2**16),
)
def test_dequantising_is_exact_and_bounded_by_the_weights_shape(rows, cols, block, seed):
  """Any accepted block size: NumPy's reference bit for bit, and at most the
  result plus `working_bytes`, which derives from the weight's shape."""
  weight, scales = _fp8(np.random.default_rng(seed), rows, cols, block)
  got, peak = _peak(lambda: quantized_fp8.dequantize(weight, scales, block))
  np.testing.assert_array_equal(got, _reference(weight, scales, block))
  bound = rows * cols * 4 + quantized_fp8.working_bytes((rows, cols), block)
  assert peak <= bound + _SLACK
  assert bound <= rows * cols * 4 * 3 + cols * 12 + scales.nbytes + _SLACK  # Shape-derived.


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def test_a_stack_of_experts_is_dequantised_into_one_buffer(dtype):
  """`source`'s decode (as `load_hf` runs it): the stack is the result, and
  nothing else as large is allocated (no list of matrices, no `np.stack`)."""
  rng = np.random.default_rng(1)
  block, shape, names = (128, 128), (256, 192), [f"experts.{e}.w" for e in range(8)]
  stored = {}
  for name in names:
    stored[name], stored[name + quantized_fp8.SCALE_SUFFIX] = _fp8(rng, *shape, block)

  class Headers:
    """What `source` reads of the safetensors files: each tensor's header."""

    def __init__(self, name):
      self.path = "model.safetensors"
      self.entries = {name: (stored[name].dtype, stored[name].shape)}

  class Folder:
    where = {name: Headers(name) for name in stored}

  Folder.dtype = np.dtype(dtype)
  views: list = []
  quantized_fp8.source(Folder, quantized_fp8.BlockFp8(block), names, shape, views, stack="w")
  (view,) = views
  got, peak = _peak(lambda: view.decode(stored))
  want = np.stack([_reference(stored[n], stored[n + "_scale_inv"], block) for n in names])
  np.testing.assert_array_equal(got, want.astype(dtype))
  assert got.dtype == np.dtype(dtype) and got.shape == (8, *shape)
  parts = sum(array.nbytes for array in stored.values())
  assert peak <= got.nbytes + view.working_bytes - parts + _SLACK, (peak, got.nbytes)


@pytest.mark.parametrize("block", [
    [0, 128], [-128, 128], [128], [128, 128, 128], [True, 128], [1.5, 128], "128",
    [2**16 + 1, 128], [128, 2**40], None,
], ids=repr)
def test_nonsensical_block_sizes_are_refused_naming_the_field(block):
  config = Config({"quantization_config": {"quant_method": "fp8", "weight_block_size": block}},
                  "config.json", families.FAMILY_OF["deepseek_v3"].fields)
  with pytest.raises(errors.UnsupportedConfigError,
                     match=r"config\.json: quantization_config\.weight_block_size="):
    quantized_fp8.read_quantization(config)


def test_mxfp4_dequantising_stays_within_its_working_bytes():
  rng = np.random.default_rng(2)
  shape = (4, 256, 96)  # [experts, columns, rows]
  blocks, scales = quantized_mxfp4.quantize(rng.normal(size=shape).astype(np.float32))
  got, peak = _peak(lambda: quantized_mxfp4.dequantize(blocks, scales, "test"))
  assert got.shape == shape
  parts = blocks.nbytes + scales.nbytes
  assert peak <= quantized_mxfp4.working_bytes(shape) - parts + _SLACK, peak


def _params_bytes(model) -> int:
  from penzai import pz  # pylint: disable=import-outside-toplevel

  return sum(p.value.data_array.nbytes for p in pz.unbind_params(model)[1])


def test_the_load_checks_the_dequantising_working_memory_first(tmp_path, monkeypatch):
  """Through `load_hf`: the limit it checks counts the largest working set
  beside the parameters; just below that total nothing is read or decoded."""
  folder = mxfp4_folders.folder(tmp_path / "gpt-oss")
  with pytest.warns(errors.DequantizedWeightsWarning):
    model = pzp.pretrained.load_hf(folder)
  views = [f"model.layers.0.mlp.experts.{n}" for n in ("gate_up_proj", "down_proj")]
  shapes = {views[0]: (mxfp4_folders.E, mxfp4_folders.H, 2 * mxfp4_folders.N),
            views[1]: (mxfp4_folders.E, mxfp4_folders.N, mxfp4_folders.H)}
  working = max(quantized_mxfp4.working_bytes(shape) for shape in shapes.values())
  total = _params_bytes(model) + working

  decoded = []
  real_get = weights_lib._ViewFile.get  # pylint: disable=protected-access

  def counted(self, *args, **kwargs):
    decoded.append(self.view.name)
    return real_get(self, *args, **kwargs)

  monkeypatch.setattr(weights_lib._ViewFile, "get", counted)  # pylint: disable=protected-access
  with pzp.limits(max_allocation_bytes=total - 1):
    with pytest.raises(errors.UnsafeCheckpointError,
                       match=r"working memory of dequantising one tensor"):
      pzp.pretrained.load_hf(folder)
  assert decoded == []  # Refused before any tensor was read.
  with pzp.limits(max_allocation_bytes=total), pytest.warns(errors.DequantizedWeightsWarning):
    pzp.pretrained.load_hf(folder)
  assert decoded
