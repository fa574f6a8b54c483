"""No lossy cast without ``allow_lossy``: on every path that casts.

`pz_persist.format.casts` decides, from the values, whether a cast changes
them beyond rounding a float. Here it is held to an oracle written in exact
arithmetic (Python ints and `fractions.Fraction`) over a matrix of dtype
pairs, NumPy and JAX alike; then every entry point that casts is shown to
refuse the casts the issue found wrapping or turning inf into NaN (uint8 200
into int8 -56, int8 into uint8, uint16 into int16, int32 <-> uint32, inf into
float8_e4m3fn), naming where and the value, and to cast them with
``allow_lossy=True``: ``load_model(into=, dtype=)``, ``load_model(dtype=)``,
a plain Orbax checkpoint bound into a model, ``migrate``, ``load_hf``,
`SafetensorsFile.get`, ``load_gemma`` and ``pz-persist convert``.
"""

from __future__ import annotations

import fractions
import math

import hypothesis
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import run_python
from hypothesis import strategies as st
from penzai import pz

import pz_persist as pzp
from hostile.test_pretrained_hostile import hf_folder
from hostile.test_pretrained_hostile import llama_tensors
from pz_persist import errors
from pz_persist.format import casts
from pz_persist.pretrained import safetensors_io

INTS = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
        ml_dtypes.int4, ml_dtypes.uint4]
FLOATS = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, ml_dtypes.float8_e4m3fn,
          ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz,
          ml_dtypes.float8_e4m3b11fnuz, ml_dtypes.float8_e8m0fnu, ml_dtypes.float4_e2m1fn]
COMPLEX = [np.complex64, np.complex128]
DTYPES = [np.dtype(d) for d in [np.bool_, *INTS, *FLOATS, *COMPLEX]]

SPECIAL = [0, 1, -1, 2, 7, 8, 127, 128, 200, 255, 256, -56, -128, -129, 32767, 40000,
           65504, 65520, 2**24 + 1, 2**31 - 1, 2**31, 3_000_000_000, 2**32, 2**53 + 1,
           2**63 - 1, 2**64 - 1, 0.5, 1.5, -2.5, 1e-10, 1e-45, 448.0, 449.0, 470.0, 6.0, 7.0,
           1000.0, 1e30, 3e38, 1e300, math.inf, -math.inf, math.nan, -0.0]


def _kind(dtype):
  return casts._kind(np.dtype(dtype))  # pylint: disable=protected-access


def _python(value):
  """An array element as an exact Python number (int, Fraction, inf, nan)."""
  if isinstance(value, (bool, np.bool_)):
    return int(value)
  if isinstance(value, (int, np.integer)) or type(value).__name__ in ("int4", "uint4"):
    return int(value)
  value = float(value)
  return fractions.Fraction(value) if math.isfinite(value) else value


def _kept(v, r, target) -> bool:
  """Whether the cast of one value ``v`` to ``r`` (in ``target``) keeps it, as
  the saving-and-loading guide promises: exactly, except a float may round to a narrower float."""
  if _kind(target) != "f" or isinstance(v, int):
    return r == v  # Exact (Fraction, int and float compare exactly; nan != nan).
  if isinstance(v, float):  # inf or nan.
    return (math.isnan(v) and isinstance(r, float) and math.isnan(r)) or r == v
  if not isinstance(r, fractions.Fraction):
    return False  # A finite value became inf or NaN.
  info = ml_dtypes.finfo(target)
  bound = max(abs(v) * fractions.Fraction(float(info.eps)),
              fractions.Fraction(float(info.smallest_subnormal)))
  return abs(r - v) <= bound


def _oracle(x: np.ndarray, target: np.dtype) -> bool:
  """Whether casting every element of ``x`` to ``target`` keeps it."""
  y = casts.astype(x, target)
  for v, r in zip(x.ravel().tolist() if x.dtype.kind in "biufc" else x.ravel(), y.ravel()):
    if _kind(x.dtype) == "c" or _kind(target) == "c":
      vc, rc = complex(v), complex(r)
      real = _python(v) if _kind(x.dtype) in "bi" else _python(vc.real)  # Ints stay exact.
      parts = [(real, _python(rc.real)), (_python(vc.imag), _python(rc.imag))]
      component = casts._component(target) if _kind(target) == "c" else target  # pylint: disable=protected-access
      if _kind(target) != "c":
        if vc.imag != 0:
          return False
        parts = parts[:1]
      if not all(_kept(a, b, component) for a, b in parts):
        return False
      continue
    if not _kept(_python(v), _python(r), target):
      return False
  return True


def _source_array(values, source: np.dtype) -> np.ndarray:
  """``values`` as an array of ``source`` (whatever the conversion gives)."""
  out = []
  for v in values:
    if _kind(source) in "bi":
      if isinstance(v, float) and not math.isfinite(v):
        v = 0
      info = ml_dtypes.iinfo(source) if _kind(source) == "i" else None
      v = int(v)
      if info is not None:
        v = min(max(v, int(info.min)), int(info.max))
      out.append(np.array(v).astype(source) if info is not None else np.bool_(v))
    else:
      with np.errstate(all="ignore"):
        out.append(np.array(float(v) if not isinstance(v, complex) else v).astype(source))
  return np.array(out, dtype=source)


@hypothesis.settings(max_examples=1000, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(
    source=st.sampled_from(DTYPES), target=st.sampled_from(DTYPES),
    values=st.lists(st.one_of(st.sampled_from(SPECIAL),
                              st.floats(allow_nan=True, allow_infinity=True),
                              st.integers(-(2**64), 2**64)), min_size=1, max_size=6),
    imaginary=st.sampled_from([0.0, 0.0, 1.0, math.nan]),
)
def test_the_check_is_the_oracle_for_every_dtype_pair(source, target, values, imaginary):
  """Refused exactly when some value would change beyond float rounding."""
  x = _source_array(values, source)
  if _kind(source) == "c":
    x = x + np.asarray(imaginary * 1j, source)
  reason = casts.check(x, target)
  assert (reason is None) == _oracle(x, target), (x, target, reason)
  if casts.always_exact(source, target):
    assert reason is None


def test_the_issue_cases_are_refused_in_numpy():
  cases = [
      (np.array([1, 200], np.uint8), np.int8, "200"),
      (np.array([3, -1], np.int8), np.uint8, "-1"),
      (np.array([40000], np.uint16), np.int16, "40000"),
      (np.array([-5], np.int32), np.uint32, "-5"),
      (np.array([3_000_000_000], np.uint32), np.int32, "3000000000"),
      (np.array([1.0, np.inf], np.float32), ml_dtypes.float8_e4m3fn, "inf"),
  ]
  for x, target, value in cases:
    reason = casts.check(x, target)
    assert reason is not None and f"e.g. {value}" in reason, (x, target, reason)


# JAX arrays are checked where they are, with JAX's own ops: the same answer
# as NumPy's on every pair JAX holds without 64-bit mode.
JAX_DTYPES = [d for d in DTYPES if d.itemsize < 8 and d.name not in ("complex64",)]
# (Without 1e-45: XLA on CPU flushes float32 subnormals to zero, in comparisons too.)
JAX_SAMPLE = [v for v in SPECIAL if v != 1e-45]


def _subnormal(row: np.ndarray) -> bool:
  if _kind(row.dtype) != "f":
    return False
  value = abs(float(row[0]))
  return 0 < value < float(ml_dtypes.finfo(row.dtype).smallest_normal)


def _jax_pairs(every: int):
  pairs = [(s, t) for s in JAX_DTYPES for t in JAX_DTYPES if s != t]
  return pairs[::every]


def _agree(source, target):
  rows = [_source_array([v], source) for v in JAX_SAMPLE]
  rows = [row for row in rows if not _subnormal(row)]
  for row in rows:  # One value at a time: each reason stands alone.
    expected = casts.check(row, target)
    got = casts.check(jnp.asarray(row), target)
    assert (got is None) == (expected is None), (row, source, target, expected, got)


@pytest.mark.parametrize("source, target", _jax_pairs(every=11),
                         ids=lambda d: getattr(d, "name", str(d)))
def test_jax_arrays_get_the_numpy_answer(source, target):
  _agree(source, target)


@pytest.mark.slow
@pytest.mark.parametrize("source, target", _jax_pairs(every=1),
                         ids=lambda d: getattr(d, "name", str(d)))
def test_jax_arrays_get_the_numpy_answer_for_every_pair(source, target):
  _agree(source, target)


# --- every entry point ---------------------------------------------------------

ISSUE = [
    (np.array([1, 200], np.uint8), jnp.int8, "200", -56),
    (np.array([3, -1], np.int8), jnp.uint8, "-1", 255),
    (np.array([1, 40000], np.uint16), jnp.int16, "40000", 40000 - 65536),
    (np.array([1, -5], np.int32), jnp.uint32, "-5", 2**32 - 5),
    (np.array([1, 3_000_000_000], np.uint32), jnp.int32, "3000000000", 3_000_000_000 - 2**32),
    (np.array([1.0, np.inf], np.float32), jnp.float8_e4m3fn, "inf", math.nan),
]
ISSUE_IDS = ["uint8-int8", "int8-uint8", "uint16-int16", "int32-uint32", "uint32-int32",
             "inf-float8_e4m3fn"]


def _model(dtype, size=2):
  return pz.nn.Sequential([pz.nn.AddBias(
      bias=pz.Parameter(label="w", value=jnp.zeros(size, dtype)), new_axis_names=())])


def _holding(stored):
  """`_model` holding the values ``stored``."""
  return pz.bind_variables(pz.unbind_params(_model(stored.dtype))[0], [
      pz.ParameterValue(label="w", value=jnp.asarray(stored))], unfreeze_as_copy=True)


def _loaded(model):
  return np.asarray(model.sublayers[0].bias.value)


def _wrapped(loaded, expected_last):
  last = loaded[-1].item() if loaded.dtype.kind in "iu" else float(loaded[-1])
  return math.isnan(last) if isinstance(expected_last, float) and math.isnan(expected_last) \
      else last == expected_last


@pytest.mark.parametrize("stored, target, value, wrapped", ISSUE, ids=ISSUE_IDS)
def test_load_model_into_a_model(tmp_path, stored, target, value, wrapped):
  path = tmp_path / "ckpt"
  pzp.save(path, [pz.ParameterValue(label="w", value=jnp.asarray(stored))])
  model = _model(target)
  with pytest.raises(pzp.BindingError, match=rf"w: casting to .*would change.*e\.g\. {value}"):
    pzp.load_into(path, model, dtype=target)
  assert not _loaded(model).any()  # The model passed in is unchanged.
  with pytest.raises(pzp.BindingError, match=rf"e\.g\. {value}"):  # A {glob: dtype} rule too.
    pzp.load_into(path, model, dtype={"w": target})
  loaded = pzp.load_into(path, model, dtype=target, allow_lossy=True)
  assert _wrapped(_loaded(loaded), wrapped)


@pytest.mark.parametrize("stored, target, value, wrapped", ISSUE, ids=ISSUE_IDS)
def test_load_model_whole(tmp_path, stored, target, value, wrapped):
  path = tmp_path / "ckpt"
  pzp.save_model(path, _holding(stored))
  with pytest.raises(pzp.BindingError, match=rf"casting the loaded model(.|\n)*e\.g\. {value}"):
    pzp.load_model(path, dtype={"*": target})
  loaded = pzp.load_model(path, dtype={"*": target}, allow_lossy=True)
  assert _wrapped(_loaded(loaded), wrapped)


@pytest.mark.parametrize("stored, target, value, wrapped", ISSUE[::2], ids=ISSUE_IDS[::2])
def test_plain_orbax_checkpoint_and_migrate(tmp_path, stored, target, value, wrapped):
  plain = tmp_path / "plain"
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(plain, pz.unbind_params(_holding(stored), freeze=True)[1])
  with pytest.raises(pzp.BindingError, match=rf"e\.g\. {value}"):
    pzp.load_into(plain, _model(target), dtype=target)
  with pytest.raises(pzp.BindingError, match=rf"e\.g\. {value}"):
    pzp.migrate(plain, tmp_path / "native", _model(target), dtype=target)
  assert not (tmp_path / "native").exists()
  pzp.migrate(plain, tmp_path / "native", _model(target), dtype=target, allow_lossy=True)
  assert _wrapped(_loaded(pzp.load_model(tmp_path / "native")), wrapped)


def _tensors_with(name, value):
  tensors = llama_tensors()
  tensors[name] = tensors[name].copy()
  tensors[name].flat[-1] = value
  return tensors


NORM = "model.layers.1.post_attention_layernorm.weight"


@pytest.mark.parametrize("value, target", [(1e30, jnp.float16), (np.inf, jnp.float8_e4m3fn),
                                           (1000.0, jnp.float8_e4m3fn)])
def test_load_hf(tmp_path, value, target):
  folder = hf_folder(tmp_path / "f", tensors=_tensors_with(NORM, value))
  with pytest.raises(errors.LossyCastError, match=(
      rf"model\.safetensors, tensor '{NORM}'.*float32 to {jnp.dtype(target).name}.*allow_lossy")):
    pzp.pretrained.load_hf(folder, dtype=target)
  pzp.pretrained.load_hf(folder, dtype=target, allow_lossy=True)
  pzp.pretrained.load_hf(folder, dtype=jnp.bfloat16)  # Rounding is what a cast is for.


def test_safetensors_reads_check_every_piece(tmp_path, monkeypatch):
  """A cast read streams piece by piece; a value in the last piece is found."""
  monkeypatch.setattr(safetensors_io, "CAST_BUFFER_BYTES", 64)
  x = np.ones(100, np.float32)
  x[-1] = 1e30
  path = tmp_path / "t.safetensors"
  safetensors_io.write_safetensors(path, {"t": x})
  file = safetensors_io.SafetensorsFile(path)
  with pytest.raises(errors.LossyCastError, match=r"t\.safetensors, tensor 't'.*e\.g\. 1e\+30"):
    file.get("t", dtype=np.float16)
  assert np.isinf(file.get("t", dtype=np.float16, allow_lossy=True)[-1])
  np.testing.assert_array_equal(file.get("t", dtype=np.float64), x)  # Widening: no check.


def test_load_gemma(tmp_path):
  from pretrained import test_gemma  # pylint: disable=import-outside-toplevel

  params = test_gemma.official_params(test_gemma.GEMMA1, gemma2=False)
  params["transformer/final_norm"]["scale"][-1] = 1e30
  path = test_gemma.write(tmp_path / "g", params)
  with pytest.raises(errors.LossyCastError, match=r"transformer/final_norm/scale.*e\.g\. 1e\+30"):
    pzp.pretrained.load_gemma(path, preset={"like": "gemma_2b"}, dtype=jnp.float16)
  model = pzp.pretrained.load_gemma(path, preset={"like": "gemma_2b"}, dtype=jnp.float16,
                                    allow_lossy=True)
  assert {p.value.dtype for p in pz.unbind_params(model)[1]} == {jnp.dtype(jnp.float16)}
  pzp.pretrained.load_gemma(path, preset={"like": "gemma_2b"}, dtype=jnp.float32)  # Widening.


def test_cli_convert(tmp_path):
  folder = hf_folder(tmp_path / "f", tensors=_tensors_with(NORM, 1e30))
  out = run_python(f"""
      import sys
      from pz_persist.tools import cli
      sys.stderr = sys.stdout
      args = ["convert", "hf", {str(folder)!r}, {str(tmp_path / 'out')!r}, "--quiet",
              "--dtype", "float16"]
      print("EXIT", cli.main(args))
      print("EXIT", cli.main(args + ["--allow-lossy"]))
      """, timeout=300)
  assert out.count("EXIT") == 2 and "EXIT 2" in out and "EXIT 0" in out, out
  assert "allow_lossy" in out and NORM in out
  assert (tmp_path / "out").exists()


@pytest.mark.parametrize("logical", ["uint4", "uint2"])
def test_stored_substitutes_out_of_range_are_damage(logical):
  """uint4 and uint2 are stored as uint8 and cast back on load; a stored byte
  past their range (damage a load with verify=False does not see) would
  wrap around silently: it is an IntegrityError naming the array instead."""
  from pz_persist.format import array_specs  # pylint: disable=import-outside-toplevel

  spec = array_specs.ArraySpec(key="00000_w", shape=(2,), dtype=logical, kind="numpy", label="w")
  good = np.array([1, 3], np.uint8)
  np.testing.assert_array_equal(array_specs.from_storage(good, spec), good.astype(logical))
  for stored in (np.array([1, 200], np.uint8), jnp.array([1, 200], jnp.uint8)):
    with pytest.raises(errors.IntegrityError, match=rf"w: the stored uint8 .*{logical}.*e\.g\. 200"):
      array_specs.from_storage(stored, spec)
