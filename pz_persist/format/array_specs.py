"""How one array is described in the manifest and stored through Orbax.

Orbax stores arrays through TensorStore, which lacks a few dtypes that JAX and
ml_dtypes have (``uint4``, ``uint2``, ``float8_e4m3``, ``float6_*``). Those are stored in a
wider or bit-identical substitute dtype and converted back exactly on load; the
manifest records both, so the substitution never shows to the user and plain
Orbax still reads the stored bytes.

The manifest also records what a plain array cannot say about itself: whether
it was a ``jax.Array``, a ``numpy.ndarray`` or a NumPy scalar, and JAX's
``weak_type`` flag (which changes type promotion, so dropping it could change a
model's outputs).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any
from typing import Literal
from typing import TypeAlias

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import numpy.typing as npt

from pz_persist import errors
from pz_persist.format import casts
from pz_persist.format import checksum_records
from pz_persist.format import json_types

ArrayKind = Literal["jax", "numpy", "numpy_scalar"]
ARRAY_KINDS: tuple[str, ...] = ("jax", "numpy", "numpy_scalar")

Array: TypeAlias = "jax.Array | np.ndarray | np.generic"
"""An array leaf of a tree, of one of the three `ArrayKind`\\ s."""

StoredArray: TypeAlias = "jax.Array | np.ndarray"
"""An array as Orbax writes and reads it (a NumPy scalar as a 0-d array)."""

# dtype name -> (stored dtype name, how to convert). "cast" widens losslessly
# (every uint4 value fits in uint8); "bitcast" reinterprets the same bytes.
_SUBSTITUTES: dict[str, tuple[str, str]] = {
    "uint4": ("uint8", "cast"),
    "uint2": ("uint8", "cast"),
    "float8_e4m3": ("uint8", "bitcast"),
    "float6_e2m3fn": ("uint8", "bitcast"),
    "float6_e3m2fn": ("uint8", "bitcast"),
}

_NUMPY_DTYPES = (
    "bool",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
    "complex64", "complex128",
)  # fmt: skip
_ML_DTYPES = (
    "bfloat16",
    "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn",
    "int2", "int4", "uint2", "uint4",
)  # fmt: skip


def _build_dtype_table() -> dict[str, np.dtype]:
  table = {name: np.dtype(name) for name in _NUMPY_DTYPES}
  for name in _ML_DTYPES:
    if hasattr(ml_dtypes, name):  # Older ml_dtypes lack the newest types.
      table[name] = np.dtype(getattr(ml_dtypes, name))
  return table


SUPPORTED_DTYPES: dict[str, np.dtype] = _build_dtype_table()
"""Every dtype pz_persist saves, by the name stored in manifests."""

_KEY_HINT = re.compile(r"[^A-Za-z0-9_-]+")

CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
"""Characters a label may not hold: NUL and other control characters, which
would garble (or forge) the lines of messages and tables that print labels."""


def label_problem(label: object) -> str | None:
  """Why ``label`` cannot be a variable's label (``"is not hashable"``...), or None.

  Why one function: saving must never write a label that loading refuses,
  and the decoder, the variable listing (`manifest_queries`) and the arrays
  table must refuse the same ones; callers add where the label is and raise their own error class.
  """
  if isinstance(label, str) and CONTROL_CHARS.search(label):
    return "holds control characters"
  try:
    hash(label)
  except TypeError:
    return "is not hashable"
  return None

MAX_RANK = 32
"""Most dimensions an array may declare (NumPy 1's own limit)."""

MAX_ELEMENTS = 2**62
"""Most elements an array may declare, counting its non-zero dimensions only
(a zero-size array must still be made): more cannot even be addressed."""

MAX_ARRAY_BYTES = 2**63 - 1
"""Most bytes the non-zero dimensions of an array may declare: NumPy refuses
to make an array whose non-zero dimensions multiply, times the item size,
past this (a ``ValueError``), even one of zero size (``[0, 2**70]``)."""


def check_shape_size(shape: list[int], where: str) -> None:
  """Refuses shapes no array can have, before anything multiplies them.

  Why: shapes come from the checkpoint; a rank beyond NumPy's limit, or
  non-zero dimensions whose product is beyond 64-bit sizes (in a zero-size
  array too: ``[0, 2**70]``), would otherwise surface later as a NumPy
  ``ValueError`` or a silently wrapped size. Sizes that are merely too large
  for this machine are refused when read (`pz_persist.safety`).
  """
  if len(shape) > MAX_RANK:
    raise errors.ManifestError(
        f"{where}: {len(shape)} dimensions, over the limit of {MAX_RANK}."
    )
  elements = math.prod(d for d in shape if d)
  if elements > MAX_ELEMENTS:
    raise errors.UnsafeCheckpointError(
        f"{where}: shape {shape} declares {elements} elements{_NONZERO_TEXT[0 in shape]},"
        " more than any array can have (2**62); refusing it."
    )


_NONZERO_TEXT = {False: "", True: " in its non-zero dimensions (a zero-size array must still"
                                  " be made)"}


def check_representable(shape: Sequence[int], dtype: np.dtype, where: str) -> None:
  """Refuses a shape and dtype whose non-zero dimensions declare more bytes
  than any array can hold (`MAX_ARRAY_BYTES`), zero-size arrays included:
  every array a manifest declares can then be made (``np.zeros``), and the
  loader's own arithmetic on its bytes never overflows."""
  stored = SUPPORTED_DTYPES[storage_dtype_name(dtype.name)]
  nbytes = math.prod(d for d in shape if d) * max(dtype.itemsize, stored.itemsize)
  if nbytes > MAX_ARRAY_BYTES:
    raise errors.UnsafeCheckpointError(
        f"{where}: shape {list(shape)} of {dtype.name} declares {nbytes} bytes"
        f"{_NONZERO_TEXT[0 in shape]}, more than any array can hold (2**63 - 1);"
        " refusing it."
    )


def dtype_name(dtype: npt.DTypeLike, *, where: str) -> str:
  """The manifest name of ``dtype``; raises if pz_persist cannot store it."""
  dtype = np.dtype(dtype)
  name = dtype.name
  if SUPPORTED_DTYPES.get(name) != dtype:
    raise errors.EncodingError(f"{where}: arrays of dtype {dtype} are not supported.")
  return name


def dtype_from_name(name: object, *, where: str) -> np.dtype:
  """The dtype a manifest names; raises `ManifestError` for unknown names."""
  if not isinstance(name, str) or name not in SUPPORTED_DTYPES:
    raise errors.ManifestError(f"{where}: unknown dtype {name!r}.")
  return SUPPORTED_DTYPES[name]


def storage_dtype_name(name: str) -> str:
  """The dtype an array of dtype ``name`` is stored as by Orbax."""
  return _SUBSTITUTES.get(name, (name, ""))[0]


def storage_key(index: int, hint: str) -> str:
  """The key of array ``index`` in the Orbax tree of arrays.

  Keys are unique through the index; the hint (a label or tree path) only helps
  a person reading the checkpoint with plain Orbax. Only ``[A-Za-z0-9_-]``
  survive, so a label can neither collide with Orbax's ``.``-joined names nor
  become a path outside the checkpoint when Orbax uses per-array directories.
  """
  hint = _KEY_HINT.sub("_", hint).strip("_")[:80]
  return f"{index:05d}_{hint}" if hint else f"{index:05d}"


@dataclasses.dataclass(frozen=True, slots=True)
class ArraySpec:
  """What the manifest says about one stored array.

  Attributes:
    key: Key of the array in the Orbax tree of arrays.
    shape: Logical shape.
    dtype: Logical dtype name (see `SUPPORTED_DTYPES`).
    kind: Python type to restore: ``jax.Array``, ``numpy.ndarray`` or a NumPy
      scalar.
    weak_type: JAX's weak-type flag (``jax`` kind only).
    path: Where the array sits in the saved tree, for messages.
    label: Label of the Penzai variable holding the array, if any.
    checksums: Hashes of the stored bytes, one per distinct stored slice
      (None in checkpoints written before checksums existed).
  """

  key: str
  shape: tuple[int, ...]
  dtype: str
  kind: ArrayKind
  weak_type: bool = False
  path: str = ""
  label: str | None = None
  checksums: tuple[checksum_records.ShardChecksum, ...] | None = None

  def describe(self) -> str:
    """How messages name the array: its label and tree path (or its key)."""
    return f"label {self.label!r} at {self.path}" if self.label else self.name

  @property
  def name(self) -> str:
    """The array's short name, for lists of names: its label, else tree path."""
    return self.label or self.path or self.key

  @property
  def np_dtype(self) -> np.dtype:
    return SUPPORTED_DTYPES[self.dtype]

  @property
  def storage_dtype(self) -> np.dtype:
    return SUPPORTED_DTYPES[storage_dtype_name(self.dtype)]

  @property
  def size(self) -> int:
    return math.prod(self.shape)  # Python ints: a forged shape cannot overflow.

  @property
  def nbytes(self) -> int:
    """Bytes of the logical array (sub-byte dtypes count a byte per item)."""
    return self.size * self.np_dtype.itemsize

  @property
  def is_stored(self) -> bool:
    """Zero-size arrays have no data; Orbax refuses them, so they are skipped."""
    return self.size > 0

  def to_json(self) -> json_types.JSONObject:
    out: json_types.JSONObject = {
        "key": self.key,
        "shape": list(self.shape),
        "dtype": self.dtype,
        "kind": self.kind,
        "path": self.path,
    }
    if self.dtype != storage_dtype_name(self.dtype):
      out["stored_dtype"] = storage_dtype_name(self.dtype)
    if self.weak_type:
      out["weak_type"] = True
    if self.label is not None:
      out["label"] = self.label
    if self.checksums is not None:
      out["checksums"] = [
          {"index": [list(pair) for pair in c.index], checksum_records.ALGORITHM: c.digest}
          for c in self.checksums
      ]
    return out

  @classmethod
  def from_json(cls, data: object, *, where: str, leaf_keys: bool = False) -> ArraySpec:
    """Parses and validates one ``arrays`` entry of a manifest.

    ``leaf_keys``: the key may also be an Orbax leaf name, parts of
    ``[A-Za-z0-9_-]`` joined by ``.`` (format 3: items Orbax's
    ``PyTreeCheckpointHandler`` saved through pz_persist's type handler),
    never with an empty part, so never ``.``, ``..`` or a path.
    """
    if not isinstance(data, dict):
      raise errors.ManifestError(f"{where}: array entry must be an object.")
    for name in ("label", "path"):  # Say which array, as far as it says.
      if isinstance(data.get(name), str) and data[name]:
        where = f"{where} ({name} {data[name]!r:.100})"
        break
    allowed = {
        "key", "shape", "dtype", "kind", "path", "stored_dtype", "weak_type",
        "label", "checksums",
    }  # fmt: skip
    if not {"key", "shape", "dtype", "kind"} <= set(data) <= allowed:
      raise errors.ManifestError(
          f"{where}: array entry has fields {sorted(data)}; expected"
          f" key, shape, dtype, kind and optionally {sorted(allowed - {'key', 'shape', 'dtype', 'kind'})}."
      )
    key, shape, kind = data["key"], data["shape"], data["kind"]
    if not isinstance(key, str) or not all(
        part and not _KEY_HINT.search(part) for part in (key.split(".") if leaf_keys else [key])
    ):
      raise errors.ManifestError(f"{where}: invalid array key {key!r:.200}.")
    if not isinstance(shape, list) or not all(
        type(d) is int and d >= 0 for d in shape
    ):
      raise errors.ManifestError(f"{where}: invalid shape {shape!r:.100}.")
    check_shape_size(shape, where)
    dtype = dtype_from_name(data["dtype"], where=where).name
    check_representable(shape, SUPPORTED_DTYPES[dtype], where)
    if data.get("stored_dtype", storage_dtype_name(dtype)) != storage_dtype_name(dtype):
      raise errors.ManifestError(
          f"{where}: stored dtype {data['stored_dtype']!r} does not match"
          f" {dtype}."
      )
    if kind not in ARRAY_KINDS:
      raise errors.ManifestError(f"{where}: unknown array kind {kind!r}.")
    weak_type = data.get("weak_type", False)
    path = data.get("path", "")
    label = data.get("label")
    if not isinstance(weak_type, bool) or not isinstance(path, str):
      raise errors.ManifestError(f"{where}: invalid weak_type or path.")
    if CONTROL_CHARS.search(path):
      raise errors.ManifestError(f"{where}: invalid path {path!r:.100}.")
    if label is not None and (not isinstance(label, str) or label_problem(label)):
      raise errors.ManifestError(f"{where}: invalid label {label!r:.100}.")
    if kind == "numpy_scalar" and shape:
      raise errors.ManifestError(f"{where}: a NumPy scalar must have shape [].")
    return cls(
        key=key,
        shape=tuple(shape),
        dtype=dtype,
        kind=kind,
        weak_type=weak_type,
        path=path,
        label=label,
        checksums=_checksums_from_json(data.get("checksums"), tuple(shape), where),
    )

  @classmethod
  def trusted(
      cls, key: str, shape: tuple[int, ...], dtype: str, kind: ArrayKind, weak_type: bool,
      path: str, label: str | None,
      checksums: tuple[checksum_records.ShardChecksum, ...] | None,
  ) -> ArraySpec:
    """A spec of fields its caller validated (`pz_persist.format.compact`,
    column by column), built without the frozen ``__init__``, which costs
    several times more, once per array. (Slotted: one object per array for
    the garbage collector to walk, not two.)"""
    spec = object.__new__(cls)
    _set(spec, "key", key)
    _set(spec, "shape", shape)
    _set(spec, "dtype", dtype)
    _set(spec, "kind", kind)
    _set(spec, "weak_type", weak_type)
    _set(spec, "path", path)
    _set(spec, "label", label)
    _set(spec, "checksums", checksums)
    return spec

  def with_checksums(
      self, checksums: tuple[checksum_records.ShardChecksum, ...] | None
  ) -> ArraySpec:
    """This spec with ``checksums`` recorded (`trusted`: its other fields
    are checked already; a save records the checksums of every array)."""
    return ArraySpec.trusted(
        self.key, self.shape, self.dtype, self.kind, self.weak_type, self.path, self.label,
        checksums)

  def abstract(self) -> jax.ShapeDtypeStruct:
    """The array as a ``jax.ShapeDtypeStruct`` (what `inspect` returns)."""
    return jax.ShapeDtypeStruct(self.shape, self.np_dtype, weak_type=self.weak_type)


def abstract_values(specs: Sequence[ArraySpec]) -> list[jax.ShapeDtypeStruct]:
  """`ArraySpec.abstract` of each spec, one ``jax.ShapeDtypeStruct`` per
  distinct (shape, dtype, weak type) within the call.

  Why: building a ``ShapeDtypeStruct`` costs ~5 us (JAX checks its dtype),
  a third of decoding 4,000 arrays' abstract tree; arrays of one layer
  repeat the same few shapes. They are immutable stand-ins, so one object
  may stand for equal arrays of one tree (a new call makes new ones).
  """
  made: dict[tuple[tuple[int, ...], str, bool], jax.ShapeDtypeStruct] = {}
  out = []
  for spec in specs:
    key = (spec.shape, spec.dtype, spec.weak_type)
    value = made.get(key)
    if value is None:
      value = made[key] = spec.abstract()
    out.append(value)
  return out


_set = object.__setattr__


_HEX_DIGEST = re.compile(r"[0-9a-f]{32}")


def valid_checksum_entry(entry: object, shape: tuple[int, ...]) -> bool:
  """Whether ``entry`` is ``{"index": [[start, stop], ...], ALGORITHM: hex}``
  naming a slice within ``shape``."""
  if not isinstance(entry, dict) or set(entry) != {"index", checksum_records.ALGORITHM}:
    return False
  index, digest = entry["index"], entry[checksum_records.ALGORITHM]
  if not isinstance(digest, str) or not _HEX_DIGEST.fullmatch(digest):
    return False
  if not isinstance(index, list) or len(index) != len(shape):
    return False
  for pair, n in zip(index, shape):  # A loop, not all(): run for every array.
    if not isinstance(pair, list) or len(pair) != 2:
      return False
    start, stop = pair
    if type(start) is not int or type(stop) is not int or not 0 <= start <= stop <= n:
      return False
  return True


def _checksums_from_json(
    data: object, shape: tuple[int, ...], where: str
) -> tuple[checksum_records.ShardChecksum, ...] | None:
  """Parses and validates the ``checksums`` of one array entry."""
  if data is None:
    return None
  if not isinstance(data, list):
    raise errors.ManifestError(f"{where}: checksums must be a list.")
  parsed = []
  for i, entry in enumerate(data):
    if not valid_checksum_entry(entry, shape):
      raise errors.ManifestError(
          f"{where}: checksums[{i}] is not an {checksum_records.ALGORITHM} digest"
          f" of a slice of an array of shape {list(shape)}: {str(entry)[:200]}"
      )
    index, digest = entry["index"], entry[checksum_records.ALGORITHM]
    pairs = tuple((pair[0], pair[1]) for pair in index)
    parsed.append(checksum_records.ShardChecksum(pairs, digest))
  if math.prod(shape) and not checksum_records.tiles((c.index for c in parsed), shape):
    raise errors.ManifestError(
        f"{where}: the checksums' slices do not cut the array of shape"
        f" {list(shape)} into a grid covering each element once (slices"
        " missing, repeated or overlapping); the manifest is damaged or forged."
    )
  return tuple(parsed)


def kind_of(value: object) -> ArrayKind | None:
  """The `ArrayKind` of an array leaf, or None if ``value`` is not an array."""
  if isinstance(value, jax.Array):
    return "jax"
  if isinstance(value, np.ndarray):
    return "numpy"
  if isinstance(value, np.generic):
    return "numpy_scalar"
  return None


def to_storage(value: Array, spec: ArraySpec) -> Array:
  """Converts an array to the dtype Orbax stores it as (usually a no-op)."""
  stored_name, how = _SUBSTITUTES.get(spec.dtype, (spec.dtype, ""))
  if spec.kind == "numpy_scalar":
    value = np.asarray(value)
  if not how:
    return value
  stored = SUPPORTED_DTYPES[stored_name]
  if isinstance(value, jax.Array):
    if how == "cast":
      return value.astype(stored)
    return jax.lax.bitcast_convert_type(value, stored)
  return value.astype(stored) if how == "cast" else value.view(stored)


def from_storage(value: StoredArray, spec: ArraySpec) -> Any:
  """Undoes `to_storage` and restores the recorded kind and weak type."""
  stored_name, how = _SUBSTITUTES.get(spec.dtype, (spec.dtype, ""))
  logical = spec.np_dtype
  if how == "cast":  # A wider substitute: values past the logical dtype are damage.
    reason = casts.check(value, logical)
    if reason:
      where = spec.label or spec.path or spec.key
      raise errors.IntegrityError(
          f"{where}: the stored {stored_name} array of this {spec.dtype} array holds"
          f" {reason}; the checkpoint is damaged (load with verify=True to check its"
          " checksums).",
          damaged=(f"{where}: stored values outside {spec.dtype}",),
      )
  if how:
    if isinstance(value, jax.Array):
      value = (
          value.astype(logical)
          if how == "cast"
          else jax.lax.bitcast_convert_type(value, logical)
      )
    else:
      value = value.astype(logical) if how == "cast" else value.view(logical)
  if spec.kind == "numpy_scalar":
    return np.asarray(value)[()]
  if spec.kind == "jax" and spec.weak_type and isinstance(value, jax.Array):
    # Read to the host (``verify``'s check, ``to_host``): a NumPy copy, which
    # has no weak type to restore; only a JAX array is marked.
    return _as_weak(value)
  return value


def empty_array(spec: ArraySpec, sharding: jax.sharding.Sharding | None) -> StoredArray:
  """A zero-size array for ``spec`` (these are not stored: they hold no data)."""
  if spec.kind == "jax":
    out = jnp.zeros(spec.shape, spec.np_dtype, device=sharding)
    return _as_weak(out) if spec.weak_type else out
  if spec.kind == "numpy":
    return np.zeros(spec.shape, spec.np_dtype)
  raise errors.ManifestError(f"{spec.path}: a NumPy scalar cannot be empty.")


_WEAK_FILL = {"f": 0.0, "i": 0, "u": 0, "c": 0j}


def _as_weak(value: jax.Array) -> jax.Array:
  """Marks ``value`` weakly typed, as it was when saved.

  JAX has no public "set weak_type" call, but ``lax.full`` with a Python scalar
  makes a weakly typed array, and an indexed update keeps the flag. Weak arrays
  only come from Python scalars, so their dtype is the default one of their
  kind; any other dtype cannot be weak and is returned unchanged.
  """
  fill = _WEAK_FILL.get(value.dtype.kind)
  if fill is None:
    return value
  # (lax.full drops the weak flag when given a sharding; device_put keeps it.)
  base = jax.device_put(jax.lax.full(value.shape, fill), value.sharding)
  if base.dtype != value.dtype:
    return value
  return base.at[...].set(value)
