"""Reading part of one stored array, verified: what `pz_persist.open`'s
``read(label, index)`` stands on.

How a slice is verified: the checksums of an array are recorded per slice, as
a grid (`pz_persist.format.checksum_records`). A slice read reads the smallest
box of whole grid cells that holds the slice (for arrays saved whole since
0.7, the tiles of about 16 MiB of rows along the leading axis that the slice
overlaps, `pz_persist.storage.integrity.checksums.TILE_BYTES`; for older checkpoints,
with one checksum per array, the whole array), hashes every cell of that box
and compares each with its recorded digest, and only then cuts the slice out
of the box. So no byte is returned that was not checked, and a damaged cell
the slice does not overlap is neither read nor reported. With ``verify=False``
only the slice's own box is read, and nothing is hashed.

Like every read (`pz_persist.storage.reading.reader.read_arrays`) it runs inside
`containment.files_unchanged`, checks Orbax's metadata against the manifest
before allocating, and is bounded by the allocation limit
(`pz_persist.safety.limits`), counting the box it allocates.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath

from pz_persist import errors
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format.checksum_records import Index
from pz_persist.format.checksum_records import ShardChecksum
from pz_persist.safety import bounded_json
from pz_persist.safety import limits
from pz_persist.storage.integrity import checksums as checksums_lib
from pz_persist.storage.integrity import containment
from pz_persist.storage.integrity import orbax_metadata_checks
from pz_persist.storage.reading import direct_read
from pz_persist.storage.reading import reader


def box_to_read(spec: arrays_lib.ArraySpec, wanted: Index, *, verify: bool) -> Index:
  """The box read for the slice ``wanted`` (``(start, stop)`` per dimension):
  with ``verify``, the smallest box of whole checksum cells holding it."""
  if not verify or not spec.checksums:
    return wanted
  box = []
  for dim, (start, stop) in enumerate(wanted):
    cells = {record.index[dim] for record in spec.checksums}
    if start == stop:  # An empty slice: no cell, nothing to check.
      box.append((start, stop))
      continue
    hit = [cell for cell in cells if cell[0] < stop and start < cell[1]]
    box.append((min(c[0] for c in hit), max(c[1] for c in hit)))
  return tuple(box)


def read_box(
    directory: epath.Path,
    spec: arrays_lib.ArraySpec,
    wanted: Index,
    *,
    verify: bool = True,
    snapshot: containment.Snapshot | None = None,
) -> tuple[np.ndarray, Index]:
  """Reads the stored box holding ``wanted`` of one array; returns it (in its
  storage dtype) and its index, every checksum cell in it checked.

  Raises:
    IntegrityError: a cell read does not match its checksum (naming the
      label, tree path and the cells), or the files cannot be read.
    ManifestError: the stored shape or dtype is not the manifest's.
    UnsafeCheckpointError: the box exceeds the allocation limit, or a file
      of ``directory`` changed while it was read.
  """
  where = str(directory)
  box = box_to_read(spec, wanted, verify=verify)
  shape = tuple(stop - start for start, stop in box)
  size = int(np.prod(shape, dtype=np.int64)) * spec.storage_dtype.itemsize
  limits.check_allocation([spec], {spec.key: size}, where=where)
  with containment.files_unchanged(directory, before=snapshot):
    bounded_json.check_orbax_metadata(directory)
    try:
      store = direct_read.open_array(directory, spec.key)
      orbax_metadata_checks.check_stored_metadata([spec], {spec.key: types.SimpleNamespace(
          shape=store.shape, dtype=store.dtype.numpy_dtype,
          storage=types.SimpleNamespace(chunk_shape=store.chunk_layout.read_chunk.shape),
      )}, where=where)
      region = tuple(slice(start, stop) for start, stop in box)
      data = np.asarray(store[region].read().result())
    except errors.ArrayReadError as e:
      raise reader.read_failure(_one(spec), [spec.key], where, e.cause) from e.cause
    except errors.PzPersistError:
      raise
    except (KeyboardInterrupt, MemoryError):
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise reader.read_failure(_one(spec), [spec.key], where, e) from e
  if verify and spec.checksums is not None:
    damaged = _damaged_cells(data, box, spec.checksums)
    if damaged:
      cells = ", ".join(
          "[" + ", ".join(f"{a}:{b}" for a, b in index) + "]" for index in damaged[:4]
      )
      more = f" and {len(damaged) - 4} more" if len(damaged) > 4 else ""
      reader.raise_if_damaged(
          [f"{spec.describe()} (key {spec.key}): slice(s) {cells}{more} differ"], where=where
      )
  return data, box


def _damaged_cells(
    data: np.ndarray, box: Index, records: Sequence[ShardChecksum]
) -> list[Index]:
  """The recorded cells inside ``box`` whose bytes in ``data`` hash differently."""
  damaged = []
  for record in records:
    if not all(b0 <= r0 and r1 <= b1 for (r0, r1), (b0, b1) in zip(record.index, box)):
      continue
    local = tuple(slice(r0 - b0, r1 - b0) for (r0, r1), (b0, _) in zip(record.index, box))
    if checksums_lib.digest_of(data[local]) != record.digest:
      damaged.append(record.index)
  return damaged


class _One:
  """A stand-in manifest holding one array, for `reader.read_failure`."""

  def __init__(self, spec: arrays_lib.ArraySpec):
    self.arrays = (spec,)


def _one(spec: arrays_lib.ArraySpec) -> Any:
  return _One(spec)
