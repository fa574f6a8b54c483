"""Small arrays stored as one raw chunk, read as the key-value entries they are.

Why: a load of many small arrays (optimizer states, unstacked layers, LoRA
adapters) paid TensorStore's per-array costs on the direct path: a
``ts.open`` of each array (its spec, its ``.zarray`` read and parsed, a
driver opened), then a read through the array driver, about 0.12 ms an array
on a 2-core VM, where reading the two entries of each array from the item's
OCDBT store costs about 0.03 ms. `pz_persist.storage.writing.direct_write` writes such
arrays as those two entries (``<key>/.zarray`` and the chunk); this module is
its mirror on the read side, for any writer's checkpoint (Orbax's own too):

* the item's OCDBT key-value store is opened once (`open_store`, from the
  read spec Orbax builds for the first array), and every ``.zarray`` of the
  small arrays is read in one batch of concurrent reads (`RawStore.plan`);
* an array is read raw only if its ``.zarray`` is, byte for byte, the one
  TensorStore writes for a single chunk of the manifest's shape and stored
  dtype whose chunk is the array's C-order bytes: `pz_persist.storage.
  direct_write.raw_chunk_layout` asks TensorStore itself, on an in-memory
  store, once per distinct ``.zarray`` (so a compressor, a filter, another
  byte order, Fortran order, other chunks or another shape or dtype never
  pass). So the stored metadata is checked against the manifest before the
  array's memory is allocated, as on the ``ts.open`` path;
* the chunks are read in batches of concurrent reads (`RawStore.read`),
  each copied into 64-byte aligned heap memory of its own
  (`pz_persist.storage.reading.host_memory.aligned_heap`), which a CPU ``jax.Array``
  adopts without another copy and which is freed with its array alone (an
  array a user keeps holds its own bytes, not a buffer shared with the rest
  of its load); a chunk that is not exactly the array's length (or is
  missing, or cannot be read) is left to the ``ts.open`` path;
* everything else (large, chunked, compressed, zarr3, not OCDBT, a
  ``.zarray`` that differs in any byte) goes through ``ts.open`` as before,
  which raises the errors that name the array (a stored shape or dtype
  that is not the manifest's, a damaged chunk).

The caller (`pz_persist.storage.reading.direct_read`, inside `pz_persist.storage.
reader.read_arrays`) is unchanged otherwise: it checks every array's bytes
against its checksums as each is read, and the read runs inside
`pz_persist.storage.integrity.containment.files_unchanged` (TensorStore opens the store's
files by path here too).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from pz_persist.format import array_specs as arrays_lib
from pz_persist.storage.reading import host_memory
from pz_persist.storage.writing import direct_write

MAX_ZARRAY_BYTES = 4096
"""A ``.zarray`` longer than this is left to ``ts.open`` (TensorStore's own
are about 150 bytes)."""

IN_FLIGHT_BYTES = 64 * 2**20
"""Chunk bytes read at once before the oldest are copied out (bounds the
memory TensorStore holds for them beside the arrays)."""


def small(spec: arrays_lib.ArraySpec) -> bool:
  """Whether ``spec``'s stored array is small enough to be written raw."""
  return 0 < _stored_bytes(spec) <= direct_write.SMALL_ARRAY_BYTES


def _stored_bytes(spec: arrays_lib.ArraySpec) -> int:
  return spec.size * spec.storage_dtype.itemsize


def open_store(read_spec: Any, key: str, context: ts.Context) -> RawStore | None:
  """The item's OCDBT key-value store, from Orbax's read spec of array
  ``key``; None where that array is not a zarr2 array in an OCDBT store
  under its own key, or the store cannot be opened (the ``ts.open`` path
  then reads and reports)."""
  if not isinstance(read_spec, dict) or read_spec.get("driver") != "zarr":
    return None
  kvstore = read_spec.get("kvstore")
  if not isinstance(kvstore, dict) or kvstore.get("driver") != "ocdbt":
    return None
  if kvstore.get("path") != key:
    return None
  try:
    return RawStore(ts.KvStore.open({**kvstore, "path": ""}, context=context).result())
  except Exception:  # pylint: disable=broad-exception-caught  # ts.open reports it.
    return None


class RawStore:
  """Reads of raw chunks from one item's OCDBT store."""

  def __init__(self, kvstore: ts.KvStore):
    self._kvstore = kvstore
    self._verdicts: dict[bytes, tuple[tuple[int, ...], np.dtype, str | None]] = {}

  def plan(self, specs: Sequence[arrays_lib.ArraySpec]) -> dict[str, str]:
    """``{storage key: chunk key}`` of the arrays of ``specs`` stored as one
    raw chunk of the manifest's shape and stored dtype, by their ``.zarray``
    (all read at once). The others are left out."""
    # Futures in a list beside ``specs``, not in pairs: a load of many small
    # arrays makes the cyclic collector run often enough as it is.
    reads = [self._kvstore.read(f"{spec.key}/.zarray") for spec in specs]
    chunks = {}
    for spec, future in zip(specs, reads):
      try:
        result = future.result()
      except Exception:  # pylint: disable=broad-exception-caught  # ts.open reports it.
        continue
      if result.state != "value" or len(result.value) > MAX_ZARRAY_BYTES:
        continue
      chunk = self._chunk_key(result.value, spec)
      if chunk is not None:
        chunks[spec.key] = f"{spec.key}/{chunk}"
    return chunks

  def _chunk_key(self, zarray: bytes, spec: arrays_lib.ArraySpec) -> str | None:
    """The chunk key if ``zarray`` is exactly the ``.zarray`` of a raw
    single-chunk array of ``spec``'s shape and stored dtype, else None."""
    dtype = spec.storage_dtype
    # By the bytes alone (no key tuple per array): the arrays of one item
    # mostly share a few .zarray entries and specs.
    known = self._verdicts.get(zarray)
    if known is not None and known[0] == spec.shape and known[1] is dtype:
      return known[2]
    verdict = _raw_chunk_key(zarray, spec.shape, dtype)
    self._verdicts[zarray] = (spec.shape, dtype, verdict)
    return verdict

  def read(
      self,
      specs: Sequence[arrays_lib.ArraySpec],
      chunks: dict[str, str],
      on_read: Callable[[arrays_lib.ArraySpec, np.ndarray], None],
      buffer_for: Callable[[arrays_lib.ArraySpec], np.ndarray | None] | None = None,
  ) -> list[arrays_lib.ArraySpec]:
    """Reads the chunk of each of ``specs`` (keys in ``chunks``, from `plan`)
    into ``buffer_for(spec)`` (where that is None, aligned heap memory of
    its own: see `pz_persist.storage.reading.direct_read.read`);
    ``on_read(spec, array)`` once each is read.

    Returns:
      The specs whose chunk was not read: missing, unreadable, or not the
      array's length (the ``ts.open`` path reads them and says what is wrong).
    """
    failed: list[arrays_lib.ArraySpec] = []
    waiting: collections.deque[arrays_lib.ArraySpec] = collections.deque()
    futures: collections.deque[Any] = collections.deque()  # Beside ``waiting``.
    flying = 0

    def finish() -> int:
      spec, future = waiting.popleft(), futures.popleft()
      nbytes = _stored_bytes(spec)
      try:
        result = future.result()
      except Exception:  # pylint: disable=broad-exception-caught  # ts.open reports it.
        result = None
      if result is None or result.state != "value" or len(result.value) != nbytes:
        failed.append(spec)
        return nbytes
      out = None if buffer_for is None else buffer_for(spec)
      if out is None:
        out = host_memory.aligned_heap(nbytes).view(spec.storage_dtype).reshape(spec.shape)
      out.reshape(-1).view(np.uint8)[:] = np.frombuffer(result.value, np.uint8)
      on_read(spec, out)
      return nbytes

    for spec in specs:
      waiting.append(spec)
      futures.append(self._kvstore.read(chunks[spec.key]))
      flying += _stored_bytes(spec)
      while flying > IN_FLIGHT_BYTES:
        flying -= finish()
    while waiting:
      finish()
    return failed


def _raw_chunk_key(zarray: bytes, shape: tuple[int, ...], dtype: np.dtype) -> str | None:
  """See `RawStore._chunk_key` (uncached)."""
  try:
    fields = json.loads(zarray)
  except (ValueError, RecursionError):
    return None
  if not isinstance(fields, dict):
    return None
  if fields.get("shape") != list(shape) or fields.get("chunks") != list(shape):
    return None
  other = {name: value for name, value in fields.items() if name not in ("shape", "chunks")}
  try:
    layout = direct_write.raw_chunk_layout(
        dtype, len(shape), json.dumps(other, sort_keys=True)
    )
  except Exception:  # pylint: disable=broad-exception-caught  # Not a layout TensorStore writes.
    return None
  if layout is None:
    return None
  expected, chunk_key = layout
  written = direct_write.zarray_bytes({**expected, "shape": list(shape), "chunks": list(shape)})
  return chunk_key if written == zarray else None
