"""The fast path of a load: TensorStore reads straight into the final arrays.

Orbax's restore path serves every case (shardings, many processes, remote
storage) and pays for it on the commonest one, a model loaded whole into one
process: its per-call metadata reads, 64 MiB batches, and a ``device_put``
that copies each array out of TensorStore's 16-byte aligned buffer (JAX's CPU
backend only adopts 64-byte aligned memory) made a 1 GiB load take 1.9-2.4 s
in a warm process, against 0.4-0.5 s for the same files read here.

This module reads the same files, through the same TensorStore specs Orbax
builds (``ocp.type_handlers.get_json_tspec_read``), so the format, its
checks and its errors are unchanged; only the destination differs. Small
arrays stored as one raw chunk skip ``ts.open`` altogether: they are read as
the item's OCDBT key-value entries (`pz_persist.storage.reading.raw_chunks`), and
anything that is not exactly that layout falls back to ``ts.open`` here. Each
array's chunks are copied by TensorStore directly into a 64-byte aligned
buffer from `pz_persist.storage.reading.host_memory.aligned_empty`, which then becomes the
``jax.Array`` (or stays the NumPy array) without another copy. Peak memory
is the arrays themselves plus the chunks in flight (bounded by
`IN_FLIGHT_BYTES`), whose buffers glibc reuses rather than maps afresh once
the process opted in (`pz_persist.tune_host_allocator`).

TensorStore opens the files by path, so `read` is only ever called inside
`pz_persist.storage.integrity.containment.files_unchanged` (by
`pz_persist.storage.reading.reader.read_arrays`, which also checks the
checksums, as each array is read, and places the arrays): every file is
checked before the read and again after it, and nothing read is returned if
one was swapped (for a link out of the checkpoint, say) in between.

Which loads take it (`applies`): one process, every array going to host
memory or to devices of this process (one device, or a mesh of them: the
array is read whole once and each device gets its shard). Loads across
processes keep Orbax's path, which reads each process's shards only.
"""

from __future__ import annotations

import collections
import json
import types
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from pz_persist import errors
from pz_persist.format import array_specs as arrays_lib
from pz_persist.safety import bounded_json
from pz_persist.safety import safe_io
from pz_persist.storage.integrity import orbax_metadata_checks
from pz_persist.storage.reading import host_memory
from pz_persist.storage.reading import raw_chunks

IN_FLIGHT_BYTES = 64 * 2**20
"""Arrays whose reads run at once, by bytes: enough to keep TensorStore's
threads busy (16 chunks of 4 MiB), small enough that the chunk buffers alive
at any moment stay a small part of a load's memory. Measured onto the CPU
of a 2-core VM: peak 1.19x the arrays' bytes with 64 MiB, 1.37x with
256 MiB. Onto an H200 (1 GiB, fresh / warm / peak host memory): 0.56-0.58 s /
0.36-0.41 s / 0.77-0.79x with 64 MiB, 0.63 s / 0.37 s / 0.89x with 128 MiB,
0.60 s / 0.30 s / 1.07x with 256 MiB (``benchmarks/accelerator.py``
``pz_persist:rN``): more reads in flight help a warm process a little and
cost memory."""


def applies(targets: Mapping[str, jax.sharding.Sharding | None]) -> bool:
  """Whether a read of ``targets`` (storage key -> placement) can go direct.

  None means a NumPy array; a sharding must place the array on devices of
  this process only (one device, or a mesh of one host's devices: each
  array is read whole once and ``jax.device_put`` sends each device its
  shard). Loads across processes keep Orbax's path, where each process
  reads only the shards its devices hold.
  """
  if jax.process_count() != 1:
    return False
  return all(target is None or target.is_fully_addressable for target in targets.values())


def read(
    directory: epath.Path,
    specs: Sequence[arrays_lib.ArraySpec],
    *,
    where: str,
    on_read: Callable[[arrays_lib.ArraySpec, np.ndarray], None],
    buffer_for: Callable[[arrays_lib.ArraySpec], np.ndarray | None] | None = None,
) -> None:
  """Reads the stored arrays of ``specs`` into host memory, handing each to
  ``on_read`` once it is read, while TensorStore goes on reading the next
  ones (the reader checks and places it there:
  `pz_persist.storage.reading.streaming.Placer.take`). Nothing is kept here,
  so an array placed on a device frees its host buffer for the next reads.

  Each array is read into ``buffer_for(spec)`` (the placer's page-locked
  staging buffers, for arrays on their way to an accelerator:
  `pz_persist.storage.reading.staging`); where that is None, into a NumPy
  array in a new 64-byte aligned buffer, which a CPU ``jax.Array`` adopts
  without a copy.

  Raises:
    IntegrityError: Orbax's ``_METADATA`` cannot be read.
    ManifestError: a stored array's shape or dtype differs from the manifest
      (checked before anything is allocated).
    ArrayReadError: TensorStore failed on one array's files.
  """
  use_ocdbt, use_zarr3 = _layout(directory)
  context = ocp.type_handlers.get_ts_context(use_ocdbt=use_ocdbt)
  done = on_read
  # Small arrays stored as one raw chunk: read as key-value entries, with
  # no ts.open (see `raw_chunks`); their .zarray checked before the rest open.
  small = [spec for spec in specs if raw_chunks.small(spec)]
  raw_store, chunks = None, {}
  if small and use_ocdbt and not use_zarr3:
    first = small[0].key
    raw_store = raw_chunks.open_store(
        _read_spec(directory, first, use_zarr3, use_ocdbt, context), first, context
    )
    if raw_store is not None:
      chunks = raw_store.plan(small)
  rest = [spec for spec in specs if spec.key not in chunks]
  opening = _open(directory, rest, use_zarr3, use_ocdbt, context)
  if raw_store is not None and chunks:
    unread = raw_store.read(
        [spec for spec in small if spec.key in chunks], chunks, done, buffer_for
    )
    if unread:  # Left to ts.open, which says what is wrong with them.
      opening.update(_open(directory, unread, use_zarr3, use_ocdbt, context))
      rest = [spec for spec in specs if spec.key in opening]
  stores = {key: _result(key, future) for key, future in opening.items()}
  # What TensorStore will trust when it allocates and copies, checked
  # against the manifest before a byte of these arrays' data is allocated.
  orbax_metadata_checks.check_stored_metadata(
      rest,
      {
          key: types.SimpleNamespace(
              shape=store.shape,
              dtype=store.dtype.numpy_dtype,
              storage=types.SimpleNamespace(
                  chunk_shape=store.chunk_layout.read_chunk.shape
              ),
          )
          for key, store in stores.items()
      },
      where=where,
  )

  def finish(flight: tuple[arrays_lib.ArraySpec, np.ndarray, Any]) -> int:
    spec, out, copy = flight
    _result(spec.key, copy)
    done(spec, out)
    return out.nbytes

  in_flight: collections.deque[tuple[arrays_lib.ArraySpec, np.ndarray, Any]] = collections.deque()
  flying_bytes = 0
  try:
    for spec in rest:
      out = None if buffer_for is None else buffer_for(spec)
      if out is None:
        out = host_memory.aligned_empty(spec.shape, spec.storage_dtype)
      copy = ts.array(out, copy=False, write=True).write(stores.pop(spec.key))
      in_flight.append((spec, out, copy))
      flying_bytes += out.nbytes
      while in_flight and flying_bytes > IN_FLIGHT_BYTES:
        flying_bytes -= finish(in_flight.popleft())
    while in_flight:
      finish(in_flight.popleft())
  finally:
    # Failed: no read may go on writing into a buffer once this returns (the
    # caller's staging buffers are unlocked and let go of then).
    _wait_for_reads(in_flight)
  host_memory.release_freed()


def _wait_for_reads(in_flight: collections.deque[tuple[arrays_lib.ArraySpec, np.ndarray, Any]]) -> None:
  """Cancels the reads still writing into their buffers and waits for them,
  whatever their outcome (the failure already raised is the one reported),
  and forgets them. A second Ctrl-C stops the wait."""
  for _, _, copy in in_flight:
    copy.cancel()
  while in_flight:
    _, _, copy = in_flight.popleft()
    try:
      copy.result()
    except Exception:  # pylint: disable=broad-exception-caught  # Already failing.
      pass


def _open(
    directory: epath.Path,
    specs: Sequence[arrays_lib.ArraySpec],
    use_zarr3: bool,
    use_ocdbt: bool,
    context: ts.Context,
) -> dict[str, Any]:
  """``ts.open`` of each of ``specs``' arrays, started: ``{key: future}``."""
  keys = [spec.key for spec in specs]
  return {
      key: ts.open(tspec, context=context, open=True, read=True)
      for key, tspec in zip(keys, _read_specs(directory, keys, use_zarr3, use_ocdbt, context))
  }


def _result(key: str, future: Any) -> Any:
  try:
    return future.result()
  except (KeyboardInterrupt, MemoryError):
    raise
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise errors.ArrayReadError(key, e) from e


def _layout(directory: epath.Path) -> tuple[bool, bool]:
  """``(use_ocdbt, use_zarr3)``: how Orbax laid out the stored arrays."""
  path = directory / "_METADATA"
  try:
    data = safe_io.read_small_file(
        path, bounded_json.MAX_ORBAX_METADATA_BYTES, what="Orbax's metadata"
    )
    stored = json.loads(data)
    use_zarr3 = stored.get("use_zarr3", False)
  except errors.UnsafeCheckpointError:
    raise
  except (OSError, ValueError, AttributeError, RecursionError) as e:
    raise orbax_metadata_checks.unreadable_stored_metadata(directory, e) from None
  if not isinstance(use_zarr3, bool):
    raise errors.ManifestError(f"{path}: use_zarr3 is {use_zarr3!r}, not a bool.")
  return ocp.type_handlers.is_ocdbt_checkpoint(directory), use_zarr3


def _read_specs(
    directory: epath.Path,
    keys: Sequence[str],
    use_zarr3: bool,
    use_ocdbt: bool,
    context: ts.Context,
) -> list[dict[str, Any]]:
  """Orbax's TensorStore read spec of each of ``keys``, in order.

  Why not Orbax's builder for each: it takes ~0.15 ms an array (a few
  seconds for a tree of 16,000 small arrays), and the specs of one item
  differ only by the key. Orbax builds the first two; the others are the
  first with its key replaced, which is used only if it reproduces the
  second exactly (otherwise Orbax builds every one).
  """
  def build(key: str) -> dict[str, Any]:
    return _read_spec(directory, key, use_zarr3, use_ocdbt, context)

  if len(keys) < 3:
    return [build(key) for key in keys]
  first, second = build(keys[0]), build(keys[1])
  paths = _paths_ending_with(first, keys[0])
  if _rekeyed(first, paths, keys[0], keys[1]) != second:
    return [first, second] + [build(key) for key in keys[2:]]
  return [first, second] + [_rekeyed(first, paths, keys[0], key) for key in keys[2:]]


def _paths_ending_with(spec: Any, key: str) -> list[tuple[str, ...]]:
  """The paths (of dict keys) to the strings of ``spec`` that end with
  ``key``: the key itself, or a path to it."""
  if isinstance(spec, dict):
    return [
        (name, *path)
        for name, value in spec.items()
        for path in _paths_ending_with(value, key)
    ]
  return [()] if isinstance(spec, str) and spec.endswith(key) else []


def _rekeyed(
    spec: dict[str, Any], paths: Sequence[tuple[str, ...]], old: str, new: str
) -> dict[str, Any]:
  """``spec`` with the strings at ``paths`` ending with ``new`` instead of
  ``old``: the dicts on those paths copied, the rest shared (TensorStore
  only reads a spec)."""
  out = dict(spec)
  for path in paths:
    node = out
    for name in path[:-1]:
      node[name] = dict(node[name])
      node = node[name]
    node[path[-1]] = node[path[-1]][: len(node[path[-1]]) - len(old)] + new
  return out


def _read_spec(
    directory: epath.Path, key: str, use_zarr3: bool, use_ocdbt: bool, context: ts.Context
) -> dict[str, Any]:
  info = ocp.type_handlers.ParamInfo(
      name=key, parent_dir=directory, use_zarr3=use_zarr3, ts_context=context
  )
  return ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=use_ocdbt)


def open_array(directory: epath.Path, key: str) -> Any:
  """The opened TensorStore of one stored array (Orbax's read spec), for a
  reader of part of it (`pz_persist.storage.reading.slices`); inside
  `pz_persist.storage.integrity.containment.files_unchanged`, like `read`.

  Raises:
    ArrayReadError: TensorStore cannot open the array's files.
  """
  use_ocdbt, use_zarr3 = _layout(directory)
  context = ocp.type_handlers.get_ts_context(use_ocdbt=use_ocdbt)
  spec = _read_spec(directory, key, use_zarr3, use_ocdbt, context)
  return _result(key, ts.open(spec, context=context, open=True, read=True))
