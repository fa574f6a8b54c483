"""Which dtype casts change values, decided from the values, in one place.

Every path that casts arrays on the way in or out goes through `check` (or
`cast`): ``load_model(dtype=)``, ``load_into(dtype=)``, plain Orbax
checkpoints bound into a model, ``migrate``, the pretrained loaders
(`load_hf` and `load_gemma` with ``dtype=``) and ``export_hf``'s norm offsets.
So one rule says what a lossy cast is, and no path can wrap a uint8 200 into
an int8 -56 while another refuses it.

The rule: a cast may round a float to a narrower float (that is what casting
bfloat16 weights is for) and nothing else. Refused, unless the caller passes
``allow_lossy=True``:

* a finite value that overflows the target (to inf, to NaN, or saturating at
  its largest value, as float4_e2m1fn does), or that the target cannot come
  near (a negative value or 0 in float8_e8m0fnu);
* inf in a dtype without inf (float8_e4m3fn makes it NaN), NaN in a dtype
  without NaN;
* an integer outside the target's range (two's complement would wrap it),
  or one a float cannot hold exactly (int32 16777217 in float32);
* a float with a fraction, inf or NaN, or out of range, into an integer;
* anything but 0 and 1 into bool;
* a non-zero imaginary part into a real dtype (complex to complex rounds
  each part like a float).

Pairs that can never lose anything (widening, bool to anything holding 0 and
1) are recognised from the dtypes alone and cost nothing; the others are
checked on the values, on the device the array is on (a ``jax.Array``) or on
the host (NumPy), without copying them between the two.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import TypeAlias
from typing import overload

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import numpy.typing as npt

from pz_persist import errors

Values: TypeAlias = "jax.Array | np.ndarray"
"""The arrays a cast is checked on and applied to: JAX's on their devices, NumPy's."""


def _kind(dtype: np.dtype) -> str:
  """``"b"`` (bool), ``"i"`` (any integer), ``"f"`` (real float), ``"c"``
  (complex); ml_dtypes' types included (their NumPy kind is ``"V"``)."""
  if dtype == np.bool_:
    return "b"
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return "c"
  if jnp.issubdtype(dtype, jnp.floating):
    return "f"
  if jnp.issubdtype(dtype, jnp.integer):
    return "i"
  raise errors.ArgumentError(f"dtype {dtype} is not a numeric dtype; it cannot be cast.")


def _component(dtype: np.dtype) -> np.dtype:
  """A complex dtype's real part dtype (float32 for complex64)."""
  return np.dtype(np.float64 if dtype.itemsize == 16 else np.float32)


@functools.cache
def _float_traits(dtype: np.dtype) -> tuple[float, float, float, bool, bool, bool]:
  """``(max, eps, smallest subnormal, has inf, has NaN, signed)`` of a float dtype."""
  info = ml_dtypes.finfo(dtype)
  with np.errstate(all="ignore"):
    special = np.array([np.inf, np.nan, -1.0], np.float32).astype(dtype).astype(np.float32)
  return (float(info.max), float(info.eps), float(info.smallest_subnormal),
          bool(np.isinf(special[0])), bool(np.isnan(special[1])), bool(special[2] == -1.0))


def _int_range(dtype: np.dtype) -> tuple[int, int]:
  info = ml_dtypes.iinfo(dtype)
  return int(info.min), int(info.max)


@functools.cache
def always_exact(source: np.dtype, target: np.dtype) -> bool:
  """Whether every value of ``source`` survives the cast to ``target``
  exactly, so no values need checking (widening casts, bool to a dtype
  holding 0 and 1)."""
  source, target = np.dtype(source), np.dtype(target)
  if source == target:
    return True
  s, t = _kind(source), _kind(target)
  if s == "b":  # 0 and 1: every integer and complex dtype holds them.
    return t != "f" or _exactly_zero_and_one(target)
  if t == "c":
    return s in "if" and always_exact(source, _component(target)) or (
        s == "c" and always_exact(_component(source), _component(target)))
  if s == "c" or t == "b":
    return False
  if s == "i" and t == "i":
    lo, hi = _int_range(source)
    tlo, thi = _int_range(target)
    return tlo <= lo and hi <= thi
  if s == "i" and t == "f":
    lo, hi = _int_range(source)
    tmax, _, _, _, _, signed = _float_traits(target)
    return (max(hi, -lo).bit_length() <= ml_dtypes.finfo(target).nmant + 1
            and float(max(hi, -lo)) <= tmax and (signed or lo == 0)
            and _exactly_zero_and_one(target))
  if s == "f" and t == "f":
    smax, _, ssub, sinf, snan, ssigned = _float_traits(source)
    tmax, _, tsub, tinf, tnan, tsigned = _float_traits(target)
    return (ml_dtypes.finfo(target).nmant >= ml_dtypes.finfo(source).nmant
            and tmax >= smax and tsub <= ssub and (tinf or not sinf)
            and (tnan or not snan) and (tsigned or not ssigned)
            and _exactly_zero_and_one(target))
  return False  # Float to integer.


def _exactly_zero_and_one(dtype: np.dtype) -> bool:
  with np.errstate(all="ignore"):
    return bool(np.all(np.array([0.0, 1.0], np.float32).astype(dtype).astype(np.float32)
                       == [0.0, 1.0]))


def _wide(*dtypes: np.dtype) -> np.dtype:
  """A float dtype holding every value of ``dtypes`` exactly enough to
  compare them (float64 where a 64-bit type is involved)."""
  return np.dtype(np.float64 if max(d.itemsize for d in dtypes) >= 8 else np.float32)


_CHUNK = 2**22
"""Elements of a NumPy array checked at once (bounds the temporaries)."""


def check(x: Values | jax.ShapeDtypeStruct, target: npt.DTypeLike) -> str | None:
  """Why casting the array ``x`` to ``target`` would change values beyond
  rounding a float, as a phrase naming them ("uint8 values outside int8's
  range [-128, 127] ... (e.g. 200)"); None if the cast is exact or only rounds.

  ``x`` is a NumPy or JAX array, checked where it is: a ``jax.Array`` by one
  compiled reduction on its own devices (no full-size temporaries; only a few
  flags come back to the host), a NumPy array piece by piece. An abstract
  array (``jax.ShapeDtypeStruct``) has no values: None.
  """
  source, target = np.dtype(x.dtype), np.dtype(target)
  if isinstance(x, jax.ShapeDtypeStruct) or always_exact(source, target) or x.size == 0:
    return None
  if isinstance(x, jax.Array):
    reduce, messages = _on_device(source, target)
    fired, examples = jax.device_get(reduce(x))
    for message, hit, example in zip(messages, fired, examples):
      if hit:
        return f"{message} (e.g. {np.asarray(example)[()]!s})"
    return None
  flat = np.reshape(x, -1)
  for start in range(0, flat.size, _CHUNK):
    piece = flat[start : start + _CHUNK]
    for message, mask, values in _rules(np, piece, source, target):
      if mask.any():
        return f"{message} (e.g. {np.reshape(values, -1)[np.argmax(mask)]!s})"
  return None


@functools.cache
def _on_device(
    source: np.dtype, target: np.dtype
) -> tuple[Callable[[jax.Array], tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]], list[str]]:
  """A compiled ``x -> (flags, examples)`` of `_rules` for JAX arrays of
  ``source``, and the messages of the flags (set when it is traced)."""
  messages: list[str] = []

  def reduce(x: jax.Array) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    rules = _rules(jnp, x, source, target)
    messages[:] = [message for message, _, _ in rules]
    return (tuple(jnp.any(mask) for _, mask, _ in rules),
            tuple(jnp.reshape(values, -1)[jnp.argmax(jnp.reshape(mask, -1))]
                  for _, mask, values in rules))

  return jax.jit(reduce), messages


Rule = tuple[str, Values, Values]
"""``(what the values are, mask of them, the array to show one from)``."""


def _rules(xp: types.ModuleType, x: Values, source: np.dtype, target: np.dtype) -> list[Rule]:
  """The kinds of values that casting ``source`` to ``target`` would change,
  most telling first, each with its mask over ``x``; any hit refuses."""
  s, t = _kind(source), _kind(target)
  if s == "c":
    part = _component(source)
    real, imag = xp.real(x), xp.imag(x)
    if t != "c":
      return [(f"{source} values with imaginary parts, which {target} would drop",
               imag != 0, x), *_real(xp, real, part, target, str(source))]
    return [*_real(xp, real, part, _component(target), f"{source} real"),
            *_real(xp, imag, part, _component(target), f"{source} imaginary")]
  if t == "c":
    return _real(xp, x, source, _component(target), str(source))
  return _real(xp, x, source, target, str(source))


def _real(
    xp: types.ModuleType, x: Values, source: np.dtype, target: np.dtype, what: str
) -> list[Rule]:
  """`_rules` for real ``source`` and ``target`` (``what`` names the values)."""
  if always_exact(source, target):
    return []
  s, t = _kind(source), _kind(target)
  if s == "b":
    x, source, s = x.astype(np.uint8), np.dtype(np.uint8), "i"
  if t == "b":
    return [(f"{what} values other than 0 and 1, which bool cannot hold",
             (x != 0) & (x != 1), x)]
  if t == "i":
    lo, hi = _int_range(target)
    if s == "f":
      xw = x.astype(_wide(source, target))
      finite = xp.isfinite(xw)
      return [
          (f"{what} inf or NaN values, which {target} cannot hold", ~finite, x),
          (f"{what} values outside {target}'s range [{lo}, {hi}]",
           (xw < float(lo)) | (xw >= float(hi) + 1), x),
          (f"{what} values with a fraction, which {target} would truncate",
           finite & (xp.floor(xw) != xw), x),
      ]
    slo, shi = _int_range(source)
    bad = x != x  # All False, where x is.
    if lo > slo:
      bad = bad | (x < xp.asarray(lo, source))
    if hi < shi:
      bad = bad | (x > xp.asarray(hi, source))
    return [(f"{what} values outside {target}'s range [{lo}, {hi}], which it cannot hold"
             " exactly (a cast would wrap them around)", bad, x)]
  if s == "i":  # Integer to float: exact, or not at all.
    slo, shi = _int_range(source)
    back = astype(x, target).astype(_wide(source, target))
    in_range = (back >= float(slo)) & (back < float(shi) + 1)
    exact = in_range & (xp.where(in_range, back, 0).astype(source) == x)
    return [(f"{what} values that {target} cannot hold exactly", ~exact, x)]
  # Float to float: rounding only.
  wide = _wide(source, target)
  tmax, eps, tiny, has_inf, has_nan, signed = _float_traits(target)
  if has_inf and has_nan and signed and _exactly_zero_and_one(target):
    # An IEEE-like target (bfloat16, float16, float8_e5m2...) rounds every
    # value but those from half an ulp above its largest, which become inf:
    # one comparison, no cast (the common case: float32 weights to bfloat16).
    xw = x.astype(wide) if np.dtype(x.dtype) != wide else x
    limit = tmax * (1 + 2.0 ** -(ml_dtypes.finfo(target).nmant + 1))
    return [(f"finite {what} values that overflow to inf in {target} (largest finite value"
             f" {tmax:g})", xp.isfinite(xw) & (xp.abs(xw) >= limit), x)]
  xw, back = x.astype(wide), astype(x, target).astype(wide)
  finite = xp.isfinite(xw)
  with np.errstate(all="ignore"):
    error = xp.where(finite, xp.abs(back - xw), 0)
  lost = finite & (~xp.isfinite(back) | (error > xp.maximum(xp.abs(xw) * eps, tiny)))
  into = "inf" if has_inf else "NaN" if has_nan else f"{tmax:g} (saturating)"
  return [
      (f"{what} NaN values, which {target} has no NaN for", xp.isnan(xw) & ~xp.isnan(back), x),
      (f"{what} inf values, which {target} cannot hold"
       + ("" if has_inf else f" (it has no inf; they would become"
          f" {'NaN' if has_nan else 'its largest value'})"),
       xp.isinf(xw) & (back != xw), x),
      (f"finite {what} values that overflow to {into} in {target} (largest finite value"
       f" {tmax:g})", lost & (xp.abs(xw) > tmax), x),
      (f"finite {what} values that {target} cannot hold within rounding", lost, x),
  ]


def astype(x: Values, target: np.dtype) -> Values:
  """``x.astype(target)``, quietly (NumPy warns of what was allowed), and
  through float32 (or float64) where ml_dtypes has no direct NumPy cast
  between two of its float types (float8_e5m2fnuz to float8_e8m0fnu)."""
  with np.errstate(all="ignore"):
    try:
      return x.astype(target)
    except TypeError:
      if isinstance(x, jax.Array):
        raise
      return x.astype(_wide(np.dtype(x.dtype), np.dtype(target))).astype(target)


@overload
def cast(x: jax.Array, target: npt.DTypeLike, *, allow_lossy: bool, where: str) -> jax.Array: ...


@overload
def cast(x: np.ndarray, target: npt.DTypeLike, *, allow_lossy: bool, where: str) -> np.ndarray: ...


def cast(x: Values, target: npt.DTypeLike, *, allow_lossy: bool, where: str) -> Values:
  """``x`` cast to ``target`` after `check` (skipped with ``allow_lossy``).

  Raises:
    LossyCastError: naming ``where`` (file and tensor, label...), the values
      and how to cast anyway.
    ArgumentTypeError: ``allow_lossy`` is not a bool (``"no"`` is truthy:
      it would have allowed what it says to refuse).
  """
  lossy = lossy_allowed(allow_lossy, where)
  target = np.dtype(target)
  if np.dtype(x.dtype) == target:
    return x
  if not lossy:
    refuse(x, target, where)
  return astype(x, target)


def lossy_allowed(allow_lossy: object, where: str) -> bool:
  """``allow_lossy``, refused unless it is a bool: every cast asks here.

  Why: ``allow_lossy="no"`` (or ``"false"`` from a config file) is truthy,
  so it allowed exactly the casts it meant to refuse.

  Raises:
    ArgumentTypeError: naming ``where`` and the value given.
  """
  if not isinstance(allow_lossy, (bool, np.bool_)):
    raise errors.ArgumentTypeError(
        f"{where}: allow_lossy={allow_lossy!r:.100} must be True or False, not a"
        f" {type(allow_lossy).__name__}.")
  return bool(allow_lossy)


def refuse(x: Values, target: npt.DTypeLike, where: str) -> None:
  """Raises `LossyCastError` if casting ``x`` to ``target`` would change values.

  Raises:
    LossyCastError: naming ``where``, the values and how to cast anyway.
  """
  reason = check(x, target)
  if reason:
    raise errors.LossyCastError(
        f"{where}: casting {x.dtype} to {np.dtype(target)} would change values: it"
        f" holds {reason}. Pass allow_lossy=True to cast anyway."
    )
