"""Stored views (`pz_persist.pretrained.hf.weights.stacked` / `decoded`):
tensors a family's plan computes from several stored ones, checked against
the headers before anything is read, read into one buffer, and written back
by export as the parts they came from (stacked) or dense (decoded)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from penzai import pz

from pz_persist.pretrained import errors
from pz_persist.pretrained import safetensors_io
from pz_persist.pretrained.hf import folder_writer
from pz_persist.pretrained.hf import weights as weights_lib
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec


def _folder(tmp_path, tensors, files=1):
  """A checkpoint folder holding ``tensors`` spread over ``files`` files."""
  names = sorted(tensors)
  weight_map = {}
  for i in range(files):
    filename = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
    part = {n: tensors[n] for n in names[i::files]}
    safetensors_io.write_safetensors(tmp_path / filename, part)
    weight_map.update(dict.fromkeys(part, filename))
  import json
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return str(tmp_path)


def _experts(rng, n=4, dtype=np.float32):
  return {f"m.experts.{e}.w": rng.normal(size=(3, 5)).astype(dtype) for e in range(n)}


@pytest.fixture
def rng():
  return np.random.default_rng(1)


def test_stacked_reads_parts_into_one_buffer_and_casts(tmp_path, rng):
  parts = _experts(rng)
  folder = _folder(tmp_path, parts, files=2)
  names = [f"m.experts.{e}.w" for e in range(4)]
  with weights_lib.Weights(folder, None) as weights:
    weights.add_views([weights_lib.stacked("m.experts.w", names)])
    file = weights.where["m.experts.w"]
    assert file.entries["m.experts.w"][:2] == (np.dtype(np.float32), (4, 3, 5))
    np.testing.assert_array_equal(file.get("m.experts.w"), np.stack([parts[n] for n in names]))
    as_bf16 = file.get("m.experts.w", jnp.bfloat16)
    assert as_bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(as_bf16, np.stack([parts[n] for n in names]).astype(
        jnp.bfloat16))


@pytest.mark.parametrize("bad", ["shape", "dtype", "missing", "collision"])
def test_stacked_refused_from_headers(tmp_path, rng, bad):
  parts = _experts(rng)
  if bad == "shape":
    parts["m.experts.2.w"] = rng.normal(size=(3, 4)).astype(np.float32)
  elif bad == "dtype":
    parts["m.experts.2.w"] = parts["m.experts.2.w"].astype(ml_dtypes.bfloat16)
  elif bad == "missing":
    del parts["m.experts.2.w"]
  else:
    parts["m.experts.w"] = np.zeros((4, 3, 5), np.float32)
  folder = _folder(tmp_path, parts)
  with weights_lib.Weights(folder, None) as weights:
    with pytest.raises(errors.SafetensorsFormatError,
                       match="m.experts.2.w" if bad != "collision" else "one layout"):
      weights.add_views([weights_lib.stacked("m.experts.w",
                                             [f"m.experts.{e}.w" for e in range(4)])])


def test_decoded_view(tmp_path, rng):
  """A view decoded from two stored tensors (a scale per row here), checked
  for the declared shape and dtype."""
  q = rng.integers(-8, 8, size=(4, 6)).astype(np.int8)
  s = rng.uniform(size=(4, 1)).astype(np.float32)
  folder = _folder(tmp_path, {"w.q": q, "w.s": s})

  def decode(arrays):
    return arrays["w.q"].astype(np.float32) * arrays["w.s"]

  with weights_lib.Weights(folder, None) as weights:
    weights.add_views([weights_lib.decoded("w", ["w.q", "w.s"], (4, 6), np.float32, decode,
                                           "int8 rows", working_bytes=4 * 7 * 4)])
    np.testing.assert_array_equal(weights.where["w"].get("w"), q * s)
    assert [v.name for v in weights.decoded()] == ["w"]
    from pz_persist.pretrained.hf import load  # pylint: disable=import-outside-toplevel
    with pytest.warns(errors.DequantizedWeightsWarning, match="1 tensors were stored quantised"
                      r" \(int8 rows\)"):
      load._say_decoded(weights, folder)  # pylint: disable=protected-access
  with weights_lib.Weights(folder, None) as weights:
    weights.add_views([weights_lib.decoded("w", ["w.q", "w.s"], (4, 7), np.float32, decode,
                                           "int8 rows", working_bytes=4 * 7 * 4)])
    with pytest.raises(errors.SafetensorsFormatError, match="declared"):
      weights.where["w"].get("w")


def test_export_writes_stacked_parts_bit_for_bit(tmp_path, rng):
  parts = _experts(rng, dtype=ml_dtypes.bfloat16)
  names = [f"m.experts.{e}.w" for e in range(4)]
  stacked = np.stack([parts[n] for n in names])
  spec = TensorSpec("experts.weights", "m.experts.w", (4, 3, 5), ("experts", "a", "b"))
  plan = Plan(lambda: None, (spec,), views=(weights_lib.stacked("m.experts.w", names),))
  value = pz.nx.wrap(jnp.asarray(stacked)).tag("experts", "a", "b")
  tensors = folder_writer.stored_tensors(plan, {spec.label: spec.label}, {spec.label: value})
  assert [name for name, _ in tensors] == names
  safetensors_io.write_safetensors(tmp_path / "out.safetensors", tensors)
  back = safetensors_io.SafetensorsFile(tmp_path / "out.safetensors")
  for n in names:
    got = back.get(n)
    assert got.dtype == parts[n].dtype
    np.testing.assert_array_equal(got.view(np.uint16), parts[n].view(np.uint16))
  back.close()


def test_export_like_a_quantised_config_warns_and_writes_it_dense(tmp_path):
  """``like=`` a quantised folder's config: the model holds dequantised
  values, so export says so and writes no ``quantization_config``."""
  import json  # pylint: disable=import-outside-toplevel

  from hostile.test_pretrained_hostile import MIXTRAL  # pylint: disable=import-outside-toplevel
  from hostile.test_pretrained_hostile import hf_folder  # pylint: disable=import-outside-toplevel
  from hostile.test_pretrained_hostile import mixtral_tensors  # pylint: disable=import-outside-toplevel

  import pz_persist as pzp  # pylint: disable=import-outside-toplevel

  model = pzp.pretrained.load_hf(hf_folder(tmp_path / "hf", MIXTRAL, mixtral_tensors()))
  like = dict(MIXTRAL, quantization_config={"quant_method": "fp8", "weight_block_size": [128,
                                                                                          128]})
  with pytest.warns(errors.DequantizedWeightsWarning, match="quant_method='fp8'"):
    pzp.export_hf(model, tmp_path / "out", like=like)
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert "quantization_config" not in config and config["model_type"] == "mixtral"


def test_read_stack_into_checks_rows_before_reading(tmp_path, rng):
  """`SafetensorsFile.read_stack_into` reads each part into its row, and
  refuses rows of another shape, a row out of the buffer or an unknown
  tensor before reading any part."""
  parts = _experts(rng)
  path = tmp_path / "x.safetensors"
  safetensors_io.write_safetensors(path, parts)
  names = [f"m.experts.{e}.w" for e in (2, 0)]
  with safetensors_io.SafetensorsFile(path) as file:
    out = np.full((3, 3, 5), -1.0, np.float32)
    file.read_stack_into(names, [0, 2], out)
    np.testing.assert_array_equal(out[0], parts[names[0]])
    np.testing.assert_array_equal(out[2], parts[names[1]])
    assert (out[1] == -1).all()
    before = out.copy()
    for bad_names, indices, buffer, match in [
        (names, [0, 1], np.zeros((2, 5, 3), np.float32), "rows of shape"),
        (names, [0, 3], out, r"row 3 of 3"),
        ([names[0], "m.experts.9.w"], [0, 1], out, "no tensor 'm.experts.9.w'"),
        (names, [0], out, "an index per name"),
    ]:
      with pytest.raises((ValueError, errors.SafetensorsFormatError), match=match):
        file.read_stack_into(bad_names, indices, buffer)
    np.testing.assert_array_equal(out, before)  # Nothing read by a refused call.
