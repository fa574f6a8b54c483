"""Safetensors files: a reader for Hugging Face weights, and a Penzai export.

Safetensors is the exchange format of the wider ecosystem (Hugging Face, vLLM,
llama.cpp converters). Two needs meet here:

* `pz_persist.pretrained.load_hf` reads Hugging Face checkpoints tensor by
  tensor. `SafetensorsFile` parses the format itself (an 8-byte little-endian
  header length, a JSON header, then the raw buffer) and memory-maps the
  buffer, so a tensor is read only when asked for and bfloat16 works with any
  ``safetensors`` release (its NumPy front end learned bfloat16 late). Every
  offset, shape and dtype in the header is checked against the file's size
  first, so a truncated or corrupt file is a `SafetensorsFormatError` naming
  the file, never a crash or a silently short array. As in the reference
  implementation, the tensors' byte ranges must tile the data buffer (no
  overlap, no gap, ending with the file), so the tensors of a file are never
  larger than the file; only regular files are read (a FIFO or a device is
  refused without blocking), and the header is bounded in size and nesting.
* `export_safetensors` writes a Penzai model's variables as one safetensors
  file that plain ``safetensors`` code can read, and stores what a bare
  tensor loses (label, axis names, parameter or state variable, metadata) as
  JSON in the file's ``__metadata__``; `load_safetensors` reads them back into
  the same NamedArray values, bit for bit.
"""

from __future__ import annotations

import collections
import json
import math
import os
import threading
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
from penzai import pz

from pz_persist import errors
from pz_persist.errors import SafetensorsFormatError  # Documented here too.
from pz_persist.format import casts
from pz_persist.format import variable_kinds
from pz_persist.pretrained import _files
from pz_persist.safety import safe_io
from pz_persist.storage import destinations
from pz_persist.storage import stores
from pz_persist.storage.reading import host_memory
from pz_persist.storage.reading import opening

METADATA_KEY = "pz_persist"
"""The ``__metadata__`` key under which `export_safetensors` stores its JSON."""

FORMAT_VERSION = 1

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # The limit the safetensors library uses.

MAX_RANK = 64
"""Most dimensions a tensor may declare: NumPy's own limit on an array."""

_MAX_INDEX = 2**63 - 1  # NumPy refuses shapes whose non-zero dims times itemsize pass it.

# Safetensors dtype codes <-> NumPy dtypes (all little-endian on disk).
_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_CODES: dict[np.dtype, str] = {dtype.newbyteorder("="): code for code, dtype in _DTYPES.items()}


def _compact_entry(entry: dict[str, Any]) -> Any:
  """`json.loads`'s ``object_hook`` for a safetensors header: an object that
  is exactly ``{"dtype": str, "shape": [int...], "data_offsets": [int, int]}``
  becomes the tuple ``(dtype, shape tuple, begin, end)``, any other stays a
  dict (checked by `SafetensorsFile._check_entry` as before).

  Why: a header of 20,000 tensors parsed as JSON is 60,000 dicts and lists
  that live until the header is checked; enough, on a mixture of experts,
  to trigger several of the garbage collector's full passes over the whole
  process. The tuples hold only strings and ints, so the collector stops
  tracking them, and the dicts and lists are freed as soon as they are
  parsed. (An ``object_hook``, not ``object_pairs_hook``: the latter holds a
  tuple per tensor until the whole header is parsed.)
  """
  if len(entry) == 3:
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if (type(code) is str and type(shape) is list and type(offsets) is list
        and len(offsets) == 2 and type(offsets[0]) is int and type(offsets[1]) is int
        and all(type(n) is int and n >= 0 for n in shape)):
      return code, tuple(shape), offsets[0], offsets[1]
  return entry


class SafetensorsFile:
  """One safetensors file; tensors are read one at a time.

  Only the header is read on construction (and fully validated against the
  file size); `get` reads one tensor's bytes straight into a new NumPy array.
  Why not a memory map: the pages of a mapped file count in the process's
  resident memory for as long as the map lives, so a model read through one
  map peaks at about twice its size; reading into fresh arrays keeps the peak
  at the arrays themselves (the file stays in the OS page cache either way).

  Attributes:
    path: The file.
    metadata: The header's ``__metadata__`` (str to str), or ``{}``.
    entries: ``{tensor name: (dtype, shape, begin, end)}``, offsets relative
      to the start of the data buffer.
  """

  def __init__(self, path: str | os.PathLike[str]):
    self.path = os.fspath(path)
    try:
      self._file = _files.open_regular(self.path)
    except OSError as e:
      raise SafetensorsFormatError(f"cannot read safetensors file {self.path}: {e}") from e
    self._lock = threading.Lock()
    try:
      self.identity = _files.identity(os.fstat(self._file.fileno()))
      self._read_header()
    except BaseException:
      self.close()
      raise

  def _read_header(self) -> None:
    size = self.identity[2]
    f = self._file
    try:
      prefix = f.read(8)
      if len(prefix) < 8:
        raise self._error(f"is {size} bytes long, too short for a header")
      header_len = int.from_bytes(prefix, "little")
      if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
        raise self._error(
            f"declares a {header_len}-byte header but the file is {size}"
            " bytes long (truncated or not a safetensors file)"
            if header_len <= _MAX_HEADER_BYTES else
            f"declares a {header_len}-byte header, over the safetensors"
            f" limit of {_MAX_HEADER_BYTES} bytes"
        )
      raw_header = f.read(header_len)
    except OSError as e:
      raise SafetensorsFormatError(f"cannot read safetensors file {self.path}: {e}") from e
    header = _files.parse_json(raw_header, lambda what: self._error(f"has a header that {what}"),
                               _compact_entry)
    if not isinstance(header, dict):
      raise self._error("has a header that is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
      raise self._error("has a __metadata__ that is not a str-to-str mapping")
    self.metadata: dict[str, str] = metadata
    self._data_start = 8 + header_len
    data_size = size - self._data_start
    self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
    for name, info in header.items():
      self.entries[name] = self._check_entry(name, info, data_size)
    self._check_layout(data_size)

  def check_unchanged(self) -> None:
    """Refuses what was read if the file changed since it was opened: its
    descriptor (rewritten in place) or its name (replaced by another file).

    Raises:
      FileChangedError: naming the file.
    """
    _files.check_unchanged(self.path, self.identity, self._file.fileno())

  def close(self) -> None:
    """Closes the file's one descriptor (reading a tensor after fails)."""
    self._file.close()

  def __enter__(self) -> SafetensorsFile:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def _error(self, what: str, name: str | None = None) -> SafetensorsFormatError:
    where = f"safetensors file {self.path}" + (f", tensor {name!r}," if name else "")
    return SafetensorsFormatError(f"{where} {what}.")

  def _check_entry(self, name: str, info: Any, data_size: int):
    """Validates one header entry, so that `get` can never read out of bounds."""
    if type(info) is tuple:  # Well-typed, from `_compact_entry`: check the values.
      code, shape, begin, end = info
      dtype = _DTYPES.get(code)
      if (dtype is not None and len(shape) <= MAX_RANK and 0 <= begin <= end <= data_size
          and (not shape or min(shape) > 0) and math.prod(shape) * dtype.itemsize == end - begin
          and end - begin <= _MAX_INDEX):
        return dtype, shape, begin, end
      # Anything else: the checks below name what is wrong.
      info = {"dtype": code, "shape": list(shape), "data_offsets": [begin, end]}
    if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"}:
      raise self._error("has a malformed header entry", name)
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(code, str) or code not in _DTYPES:
      raise self._error(
          f"has dtype {code!r}, which is not one of {sorted(_DTYPES)}", name
      )
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
      raise self._error(f"has an invalid shape {shape!r:.200}", name)
    if len(shape) > MAX_RANK:
      raise self._error(
          f"has {len(shape)} dimensions, more than the {MAX_RANK} an array can have", name)
    if math.prod(max(n, 1) for n in shape) * _DTYPES[code].itemsize > _MAX_INDEX:
      raise self._error(
          f"declares a shape {tuple(shape)!r:.200} whose dimensions multiply past what an"
          " array can index (even with a zero among them, NumPy and JAX refuse it)", name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
      raise self._error(f"has invalid data offsets {offsets!r}", name)
    dtype = _DTYPES[code]
    nbytes = math.prod(shape) * dtype.itemsize
    begin, end = offsets
    if end - begin != nbytes:
      raise self._error(
          f"has {end - begin} bytes of data for shape {tuple(shape)} {code}"
          f" ({nbytes} bytes expected)",
          name,
      )
    if end > data_size:
      raise self._error(
          f"ends at byte {self._data_start + end} but the file is only"
          f" {self._data_start + data_size} bytes long (truncated?)",
          name,
      )
    return dtype, tuple(shape), begin, end

  def _check_layout(self, data_size: int) -> None:
    """Refuses tensors that do not tile the data buffer exactly.

    Why: the reference safetensors implementation (the Rust crate) requires
    the tensors, sorted by offset, to follow each other without gap or
    overlap and to end where the file ends ("invalid offset" otherwise).
    Overlapping entries would let a small file alias one byte range from
    many tensors and so ask for any allocation; with this rule the tensors
    together are never larger than the file.
    """
    if self.entries:
      # Vectorised: sorted by (begin, end), each begins where the one before
      # ends, the first at 0 and the last at the end of the file.
      bounds = np.array([entry[2:] for entry in self.entries.values()], dtype=np.int64)
      order = np.lexsort((bounds[:, 1], bounds[:, 0]))
      begins, ends = bounds[order, 0], bounds[order, 1]
      if begins[0] == 0 and ends[-1] == data_size and np.array_equal(begins[1:], ends[:-1]):
        return
    start = 0  # Something is wrong: find the first tensor out of place, to name it.
    for name, (_, _, begin, end) in sorted(self.entries.items(), key=lambda item: item[1][2:]):
      if begin != start:
        raise self._error(
            f"has an invalid offset: its data starts at byte {begin} of the"
            f" data buffer, where the previous tensor ends at {start} (tensors"
            " must follow each other without gaps or overlaps, as the"
            " safetensors format requires)",
            name,
        )
      start = end
    if start != data_size:
      raise self._error(
          f"has {data_size - start} bytes after its last tensor (the"
          " safetensors format requires the tensors to end where the file"
          " ends; the file is damaged or not a safetensors file)"
      )

  def planned(self, names: Iterable[str] | None = None) -> list[_files.PlannedArray]:
    """What reading ``names`` (default: every tensor) allocates, as stored."""
    names = self.entries if names is None else names
    return [
        _files.PlannedArray(name, self.entries[name][0], self.entries[name][1])
        for name in names
    ]

  def keys(self) -> list[str]:
    return list(self.entries)

  def get(self, name: str, dtype: Any = None, *, allow_lossy: bool = False) -> np.ndarray:
    """The tensor ``name``, read into a new array (cast to ``dtype`` if given).

    A cast that would change values beyond rounding a float (see
    `pz_persist.format.casts`) raises `LossyCastError` naming the file and
    tensor, unless ``allow_lossy``.

    A cast streams the stored bytes through a buffer of `CAST_BUFFER_BYTES`
    into the new array, instead of reading the whole stored tensor first:
    a float32 checkpoint loaded as bfloat16 then never holds a float32 copy,
    and new memory is only ever mapped for the result (on a virtual
    machine, mapping new memory is most of a warm load's time).
    """
    if name not in self.entries:
      raise self._error(f"has no tensor {name!r}")
    stored, shape, _, _ = self.entries[name]
    out = host_memory.aligned_empty(shape, stored if dtype is None else np.dtype(dtype))
    self.read_into(name, out, allow_lossy=allow_lossy)
    return out

  def read_many_into(self, items: Iterable[tuple[str, np.ndarray]], *,
                     allow_lossy: bool = False) -> None:
    """`read_into` for each ``(name, out)``, the file checked unchanged once
    before and once after them all (not around each): a stack of 128
    experts' tensors read from one file pays two checks, not 256."""
    items = list(items)
    for name, out in items:
      self._check_out(name, out)
    with self._lock:
      self.check_unchanged()
      for name, out in items:
        self._read_unlocked(name, out, allow_lossy)
      self.check_unchanged()

  def read_stack_into(self, names: Sequence[str], indices: Sequence[int], out: np.ndarray, *,
                      allow_lossy: bool = False) -> None:
    """Reads the tensor ``names[j]`` into ``out[indices[j]]`` for each j (a
    stack of experts' tensors, `pz_persist.pretrained.hf.weights.stacked`),
    ``out`` a C-contiguous array whose rows have the tensors' shape; as
    `read_many_into`, the file checked unchanged once before and after.

    Why not `read_many_into`: with ``out`` checked once, a part costs one
    seek and one read into its row's bytes, and no array view, tuple or
    check of its own (a model of 128 experts x 48 layers has 18,432 parts).
    """
    row_shape = out.shape[1:]
    if not out.flags.c_contiguous or len(names) != len(indices):
      raise ValueError(f"read_stack_into needs a C-contiguous array and an index per name,"
                       f" not {out.shape} and {len(names)} names, {len(indices)} indices")
    entries = self.entries
    for name, i in zip(names, indices):
      entry = entries.get(name)
      if entry is None:
        raise self._error(f"has no tensor {name!r}")
      if entry[1] != row_shape or not 0 <= i < out.shape[0]:
        raise ValueError(f"read_stack_into({name!r}) needs rows of shape {entry[1]},"
                         f" not {row_shape} (row {i} of {out.shape[0]})")
    if not names or out.dtype != entries[names[0]][0]:  # A cast: each part streamed through it.
      self.read_many_into(zip(names, (out[i] for i in indices)), allow_lossy=allow_lossy)
      return
    raw = out.reshape(-1).view(np.uint8)
    row = math.prod(row_shape) * out.dtype.itemsize
    with self._lock:
      self.check_unchanged()
      f, start = self._file, self._data_start
      try:
        for name, i in zip(names, indices):
          stored, _, begin, end = entries[name]
          if stored != out.dtype:  # Parts of several dtypes: each cast as it is read.
            self._read_unlocked(name, out[i], allow_lossy)
            continue
          f.seek(start + begin)
          read = f.readinto(raw[i * row:(i + 1) * row].data) if end > begin else 0
          if read != end - begin:
            raise self._error(f"ended after {read} of {end - begin} bytes (truncated?)", name)
      except OSError as e:
        raise self._error(f"cannot be read ({e})") from e
      self.check_unchanged()

  def _check_out(self, name: str, out: np.ndarray) -> None:
    if name not in self.entries:
      raise self._error(f"has no tensor {name!r}")
    shape = self.entries[name][1]
    if out.shape != shape or not out.flags.c_contiguous:
      raise ValueError(f"read_into({name!r}) needs a C-contiguous array of shape {shape},"
                       f" not {out.shape}")

  def _read_unlocked(self, name: str, out: np.ndarray, allow_lossy: bool) -> None:
    """Reads ``name`` into ``out`` (checked by `_check_out`), holding the lock."""
    stored, _, begin, end = self.entries[name]
    if begin == end:
      return
    try:
      f = self._file
      f.seek(self._data_start + begin)
      if out.dtype == stored:
        read = f.readinto(out.reshape(-1).view(np.uint8).data)
      else:
        where = None if allow_lossy else f"safetensors file {self.path}, tensor {name!r}"
        read = _read_cast(f, out.reshape(-1), stored, where)
    except OSError as e:
      raise self._error(f"cannot be read ({e})", name) from e
    if read != end - begin:
      raise self._error(f"ended after {read} of {end - begin} bytes (truncated?)", name)

  def read_into(self, name: str, out: np.ndarray, *, allow_lossy: bool = False) -> None:
    """Reads the tensor ``name`` into ``out``, a C-contiguous array of its
    shape (cast to ``out.dtype`` as `get` does): several tensors can fill
    one preallocated buffer (a stack of per-expert tensors,
    `pz_persist.pretrained.hf.weights.stacked`) without a copy each."""
    self._check_out(name, out)
    # Through the one descriptor opened with the header, checked before and
    # after: every tensor comes from the file whose header was validated,
    # and none from a version that replaced or rewrote it meanwhile.
    with self._lock:
      self.check_unchanged()
      self._read_unlocked(name, out, allow_lossy)
      self.check_unchanged()


CAST_BUFFER_BYTES = 16 * 2**20
"""Stored bytes a cast read holds at once (`SafetensorsFile.get`)."""


def _read_cast(f: Any, out: np.ndarray, stored: np.dtype, where: str | None) -> int:
  """Reads ``out.size`` elements of dtype ``stored`` from ``f`` into the flat
  ``out``, casting piece by piece, each piece checked by `casts.refuse`
  (naming ``where``; None: lossy casts allowed); returns the bytes read
  (short if the file ends early)."""
  step = max(1, CAST_BUFFER_BYTES // stored.itemsize)
  buffer = np.empty(min(step, out.size), stored)
  raw = buffer.view(np.uint8).data
  total = 0
  for start in range(0, out.size, step):
    count = min(step, out.size - start)
    got = f.readinto(raw[: count * stored.itemsize])
    total += got
    if got != count * stored.itemsize:
      break
    if where is not None:
      casts.refuse(buffer[:count], out.dtype, where)
    with np.errstate(all="ignore"):  # What allow_lossy allowed.
      np.copyto(out[start : start + count], buffer[:count], casting="unsafe")
  return total


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Iterable[tuple[str, Any]] | Mapping[str, Any],
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
  """Writes a safetensors file, streaming one array at a time.

  Unlike ``safetensors.numpy.save_file`` this never holds every array on the
  host at once: shapes and dtypes are taken first (``jax.Array`` and NumPy
  arrays both have them), then each array is fetched and written in turn. The
  file is written beside ``path`` and renamed into place, so a failed export
  never leaves a partial file behind.

  Args:
    path: The file to write.
    tensors: ``(name, array)`` pairs, or a mapping.
    metadata: The ``__metadata__`` strings.
  """
  items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
  header: dict[str, Any] = {}
  if metadata:
    header["__metadata__"] = dict(metadata)
  offset = 0
  for name, array in items:
    if name in header:
      raise SafetensorsFormatError(f"two tensors are named {name!r}; names must be unique.")
    dtype = np.dtype(array.dtype)
    code = _CODES.get(dtype.newbyteorder("="))
    if code is None:
      raise errors.EncodingError(
          f"tensor {name!r} has dtype {dtype}, which safetensors cannot store"
          f" (supported: {sorted(_CODES.values())})."
      )
    nbytes = math.prod(array.shape) * dtype.itemsize
    header[name] = {
        "dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + nbytes]
    }
    offset += nbytes
  raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
  raw += b" " * (-len(raw) % 8)  # The format aligns the data buffer to 8 bytes.
  with safe_io.writing_whole(stores.normalise(path)) as f:  # Absolute; file:// local.
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for _, array in items:
      host = np.ascontiguousarray(np.asarray(jax.device_get(array)))
      f.write(host.astype(host.dtype.newbyteorder("<"), copy=False).tobytes())
      del host


def _jsonable(value: Any) -> bool:
  try:
    return json.loads(json.dumps(value)) == value
  except (TypeError, ValueError):
    return False


def export_safetensors(model_or_path: Any, out: str | os.PathLike[str]) -> None:
  """Exports a Penzai model's variables as one safetensors file.

  Tools outside Penzai (and other frameworks) read safetensors; this gives them
  every parameter and state variable under its label, while the file's
  ``__metadata__["pz_persist"]`` keeps, as JSON, what `load_safetensors` needs
  to rebuild the exact Penzai values: each tensor's label, axis names
  (``null`` for positional axes), kind (``"parameter"`` or
  ``"state_variable"``) and metadata (kept when it is JSON-able; otherwise
  dropped and marked ``"metadata_dropped": true``). Dtypes and bits are kept
  exactly, bfloat16 included.

  Example::

    pzp.export_safetensors(model, "/tmp/model.safetensors")
    values = pzp.pretrained.load_safetensors("/tmp/model.safetensors")
    unbound, _ = pz.unbind_variables(model)
    model = pz.bind_variables(unbound, values)

  Args:
    model_or_path: A Penzai model (any tree of variables), or the path of a
      pz_persist checkpoint written by `pz_persist.save_model` (or a
      `pz_persist.open` handle of one).
    out: The safetensors file to write (replaced if it exists): never over,
      inside or around the checkpoint read, nor inside any checkpoint (the
      destination rule, `pz_persist.storage.destinations.check_output`).

  Raises:
    EncodingError: a label that is not a string (safetensors names tensors by
      string), an axis name that is not a string, or an unsupported dtype;
      raised before anything is written.
    ArgumentError: ``out`` breaks the destination rule (nothing is read or
      written).
  """
  source = [model_or_path] if opening.checkpoint_path(model_or_path) is not None else []
  out = destinations.check_output(out, source, file=True)  # Before the (long) load.
  if source:
    from pz_persist import model as model_lib

    model_or_path = model_lib.load_model(model_or_path)
  _, variables = pz.unbind_variables(model_or_path, freeze=True)
  tensors: list[tuple[str, Any]] = []
  described: dict[str, Any] = {}
  for var in variables:
    label = var.label
    if not isinstance(label, str):
      raise errors.EncodingError(
          f"variable label {label!r} is not a string; safetensors names tensors"
          " by string, so only models whose variables have string labels can"
          " be exported."
      )
    value = var.value
    if isinstance(value, pz.nx.NamedArrayView):
      value = value.as_namedarray()
    if isinstance(value, pz.nx.NamedArray):
      data = value.data_array
      named = list(value.named_axes)
      for name in named:
        if not isinstance(name, str):
          raise errors.EncodingError(
              f"variable {label!r}: axis name {name!r} is not a string."
          )
      axes: list[str | None] | None = [None] * (data.ndim - len(named)) + named
    elif isinstance(value, (jax.Array, np.ndarray, np.generic)):
      data, axes = value, None
    else:
      raise errors.EncodingError(
          f"variable {label!r} holds a {type(value).__name__}; only arrays and"
          " NamedArrays can be exported to safetensors."
      )
    entry: dict[str, Any] = {
        "label": label,
        "axes": axes,
        "kind": variable_kinds.kind_of(var),
    }
    metadata = dict(var.metadata or {})
    if _jsonable(metadata):
      entry["metadata"] = metadata
    else:
      entry["metadata_dropped"] = True
    described[label] = entry
    tensors.append((label, data))
  meta = json.dumps({"format_version": FORMAT_VERSION, "tensors": described})
  write_safetensors(out, tensors, metadata={METADATA_KEY: meta})


def load_safetensors(
    path: str | os.PathLike[str],
    *,
    into: Any = None,
    sharding: jax.sharding.Sharding | None = None,
) -> Any:
  """Reads a file written by `export_safetensors` back into Penzai values.

  Returns a tuple of ``pz.ParameterValue`` / ``pz.StateVariableValue`` (each
  with its label, metadata and a NamedArray with the saved axis names, dtype
  and bits), which is exactly what ``pz.bind_variables`` takes::

    unbound, _ = pz.unbind_variables(model)
    model = pz.bind_variables(unbound, pzp.pretrained.load_safetensors(path))

  or, equivalently, ``pzp.pretrained.load_safetensors(path, into=model)``.

  Args:
    path: The safetensors file.
    into: A model (bound or with slots) whose variables have exactly the
      file's labels: the file's values replace them, as new mutable
      variables, and the new model is returned (the one passed in is not
      changed). For partial loads, renames
      or casts use `pz_persist.load_model` on a native checkpoint instead.
    sharding: Where to put the arrays (default: the first local device).

  Raises:
    SafetensorsFormatError: the file is malformed, or it has no pz_persist
      metadata (it was not written by `export_safetensors`; for Hugging Face
      checkpoints use `pz_persist.pretrained.load_hf`), or its metadata is
      malformed (a label that is not the tensor's name, an unknown kind,
      invalid axis names); all checked before any tensor is read.
    UnsafeCheckpointError: the file is a FIFO or device, or its tensors would
      allocate more than `pz_persist.safety.limits.allocation_limit`.
    FileChangedError: the file was replaced or rewritten during the load.
  """
  with SafetensorsFile(path) as file:  # Every tensor through its one descriptor.
    return _load_file(file, into, sharding)


def _load_file(file: SafetensorsFile, into: Any, sharding: jax.sharding.Sharding | None) -> Any:
  raw = file.metadata.get(METADATA_KEY)
  if raw is None:
    raise SafetensorsFormatError(
        f"safetensors file {file.path} has no {METADATA_KEY!r} metadata: it was"
        " not written by pz_persist.export_safetensors, so its tensors have no"
        " labels or axis names to restore (for a Hugging Face checkpoint use"
        " pz_persist.pretrained.load_hf)."
    )
  described = _described_tensors(file, raw)
  missing = sorted(set(file.entries) ^ set(described))
  if missing:
    raise SafetensorsFormatError(
        f"safetensors file {file.path}: tensors and metadata disagree on {missing}."
    )
  for name, entry in described.items():
    _check_axes(file, name, entry.get("axes"), len(file.entries[name][1]))
  if into is not None:
    unbound, current = pz.unbind_variables(into)
    _check_fits(file, unbound, current, set(described))
  _files.check_planned_allocation(file.planned(), where=f"safetensors file {file.path}")
  sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  values: list[pz.AbstractVariableValue] = []
  for name, entry in described.items():
    host = file.get(name)
    data = jax.device_put(host, sharding)
    del host
    axes = entry.get("axes")
    if axes is None:
      value: Any = data
    else:
      positional = sum(a is None for a in axes)
      value = pz.nx.NamedArray(
          named_axes=collections.OrderedDict(
              zip(axes[positional:], data.shape[positional:])
          ),
          data_array=data,
      )
    cls = variable_kinds.value_class(entry["kind"])
    values.append(cls(value=value, label=entry["label"], metadata=entry.get("metadata", {})))
  if into is None:
    return tuple(values)
  return pz.bind_variables(unbound, values, unfreeze_as_copy=True)


_KINDS = tuple(variable_kinds.KINDS)


def _described_tensors(file: SafetensorsFile, raw: str) -> dict[str, dict[str, Any]]:
  """The ``pz_persist`` metadata's tensor entries, each checked: a JSON object
  whose label is the tensor's name, with a known ``kind``, ``axes`` null or a
  list of strings and nulls, ``metadata`` an object."""
  def error(what: str) -> SafetensorsFormatError:
    return SafetensorsFormatError(
        f"safetensors file {file.path}: its {METADATA_KEY!r} metadata {what}."
    )

  info = _files.parse_json(raw.encode("utf-8"), error)
  if not isinstance(info, dict) or not isinstance(info.get("tensors"), dict):
    raise error("is malformed: it must be a JSON object with a 'tensors' object")
  version = info.get("format_version")
  if version != FORMAT_VERSION:
    raise errors.FormatVersionError(
        f"safetensors file {file.path} has pz_persist format version"
        f" {version!r}; this pz_persist reads version {FORMAT_VERSION}."
    )
  described = info["tensors"]
  for name, entry in described.items():
    if not isinstance(entry, dict) or entry.get("label") != name:
      raise error(f"describes tensor {name!r} without a JSON object whose 'label' is its name")
    if entry.get("kind") not in _KINDS:
      raise error(f"gives tensor {name!r} the kind {entry.get('kind')!r}; expected one of {_KINDS}")
    if not isinstance(entry.get("metadata", {}), dict):
      raise error(f"gives tensor {name!r} metadata that is not a JSON object")
  return described


def _check_axes(file: SafetensorsFile, name: str, axes: Any, ndim: int) -> None:
  """Refuses axis names that cannot describe the stored tensor, before any read."""
  if axes is None:
    return
  if not isinstance(axes, list) or not all(a is None or isinstance(a, str) for a in axes):
    raise SafetensorsFormatError(
        f"safetensors file {file.path}, tensor {name!r}: axis names {axes!r:.80}"
        " are not a list of strings and nulls."
    )
  if len(axes) != ndim:
    raise SafetensorsFormatError(
        f"safetensors file {file.path}, tensor {name!r}: {len(axes)} axis"
        f" names for {ndim} dimensions."
    )
  positional = sum(a is None for a in axes)
  if any(a is None for a in axes[positional:]):
    raise SafetensorsFormatError(
        f"safetensors file {file.path}, tensor {name!r}: positional axes"
        " must come before named ones."
    )
  if len(set(axes[positional:])) != ndim - positional:
    raise SafetensorsFormatError(
        f"safetensors file {file.path}, tensor {name!r}: axis names {axes} repeat."
    )


def _check_fits(file: SafetensorsFile, unbound: Any, current: Any, have: set[str]) -> None:
  """Refuses a model whose variable labels are not exactly the file's."""
  wanted = {v.label for v in current} | {
      slot.label
      for slot in pz.select(unbound)
      .at_instances_of(pz.ParameterSlot | pz.StateVariableSlot)
      .get_sequence()
  }
  if wanted != have:
    raise SafetensorsFormatError(
        f"safetensors file {file.path} does not fit the model: missing"
        f" {sorted(map(str, wanted - have))}, unexpected"
        f" {sorted(map(str, have - wanted))}."
    )
