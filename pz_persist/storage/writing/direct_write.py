"""The fast path of a save: one process's arrays written in Orbax's layout.

Orbax's ``PyTreeCheckpointHandler`` serves every case (shardings, many
processes, async device transfers) and pays for it per array: a ParamInfo,
a write spec, an asyncio task, a ``ts.open`` of the array and another of its
entry in ``_sharding``, about 1.5 ms of Python per array on a 2-core VM. A
tree of 4,000 small arrays (an unstacked model's optimizer state) spent 6 s
there before its 62 MiB were written.

This module writes the same files for the commonest case, one process whose
arrays each sit whole in host memory or on one device (`applies`):

* every array goes into the same OCDBT store Orbax writes
  (``ocdbt.process_0``, merged into the item's root by Orbax's own
  ``finalize``), through the write spec Orbax itself builds
  (``build_array_write_spec``: its chunk shapes, its OCDBT configuration),
  built once per distinct shape and dtype. All writes are issued at once,
  without a transaction, into data files of `DATA_FILE_BYTES`: TensorStore
  then writes several files in parallel as the chunks are encoded, where one
  transaction (Orbax's way) encodes everything first and then writes one
  2 GiB file (see `DATA_FILE_BYTES`). Atomicity is the checkpoint's, not
  the store's: the item is written under a temporary name and moved into
  place whole (`pz_persist.storage.stores`: `Store.publish`);
* a small array stored in one chunk is written as its two key-value
  entries (``<key>/.zarray`` and the chunk) with no ``ts.open`` at all. The
  bytes are what the zarr driver writes: `raw_chunk_layout` has
  TensorStore encode a sample of each dtype and rank once per process and
  takes this path only if the sample's chunk is the array's own C-order
  bytes and its ``.zarray`` is reproduced exactly; otherwise the array goes
  through ``ts.open`` like the large ones;
* ``_METADATA``, ``_sharding`` and ``array_metadatas/process_0`` are written
  with the content Orbax writes for the same tree (`orbax_files`), which
  ``tests/test_direct_write.py`` compares with Orbax's own output.

So plain Orbax restores these checkpoints by itself, and pz_persist reads them
through the same readers as any other. Saves with several processes, arrays
sharded over several devices, zarr3, compression or an object store keep
Orbax's path.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import json
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from pz_persist.safety import safe_io
from pz_persist.storage import orbax_seam
from pz_persist.storage.integrity import checksums

SMALL_ARRAY_BYTES = 2**20
"""Arrays up to this size, stored in one chunk, are written as raw key-value
entries; larger ones through ``ts.open``, which writes straight from the
array's memory (``can_reference_source_data_indefinitely``) rather than from a
``bytes`` copy, and whose per-array cost is small beside their bytes."""

DATA_FILE_BYTES = 16 * 2**20
"""OCDBT's target data file size for direct writes (Orbax's default: 2 GiB).
Measured on 531 MiB in 48 arrays, pz_persist.save then os.sync (2-core VM
under load, four configurations taking turns, best of two): one transaction
into 2 GiB files (Orbax's way) 1.38 s; one transaction into 16 MiB files
1.73 s; no transaction, 64 MiB files 0.82 s; 16 MiB files 0.76 s. Readers do
not care how many files the store has; it only changes how many TensorStore
writes at once."""


def applies(
    stored: Mapping[str, Any], *, use_ocdbt: bool, use_zarr3: bool,
    use_compression: bool, directory: epath.PathLike,
) -> bool:
  """Whether ``stored`` (key -> array) can be saved by `start`.

  One process, Orbax's default layout (OCDBT, zarr2) without compression, a
  local directory, and every array whole in host memory (NumPy) or on one
  device, of an ordinary NumPy dtype.
  """
  if jax.process_count() != 1 or not use_ocdbt or use_zarr3 or use_compression:
    return False
  if not safe_io.is_local(directory):
    return False
  return all(_whole_on_one_device(value) for value in stored.values())


def _whole_on_one_device(value: Any) -> bool:
  if not np.size(value):  # Orbax refuses these; its path says so.
    return False
  if isinstance(value, np.ndarray):
    return value.dtype.kind in "biufcV" and not value.dtype.hasobject
  if isinstance(value, jax.Array):
    return (
        len(value.sharding.device_set) == 1
        and value.is_fully_addressable
        and not jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended)
    )
  return False


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How one distinct (shape, dtype) is stored: Orbax's write spec for it."""

  spec: dict[str, Any]  # With the array's key left out of the kvstore path.
  chunk_shape: tuple[int, ...]
  zarray: bytes | None  # The ``.zarray`` entry when written raw, else None.
  chunk_key: str | None


class _Specs:
  """Orbax's write spec per distinct (shape, dtype), built once per save."""

  def __init__(self, directory: epath.Path, chunk_byte_size: int | None):
    self._directory = directory
    self._chunk_byte_size = chunk_byte_size
    self.context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
    self._layouts: dict[tuple[tuple[int, ...], str], _Layout] = {}

  def layout(self, shape: tuple[int, ...], dtype: np.dtype) -> _Layout:
    found = self._layouts.get((shape, dtype.str + dtype.name))
    if found is None:
      found = self._build(shape, dtype)
      self._layouts[(shape, dtype.str + dtype.name)] = found
    return found

  def _build(self, shape: tuple[int, ...], dtype: np.dtype) -> _Layout:
    info = ocp.type_handlers.ParamInfo(
        name="_", parent_dir=self._directory, is_ocdbt_checkpoint=True,
        use_zarr3=False, use_compression=False, ts_context=self.context,
        ocdbt_target_data_file_size=DATA_FILE_BYTES,
    )
    # An array hashed in tiles of rows (`checksums.tile_rows`) is chunked as
    # Orbax chunks one tile, so no chunk crosses a tile: a slice read reads
    # the chunks of the tiles it overlaps and no others.
    rows = checksums.tile_rows(shape, dtype.itemsize)
    built = orbax_seam.build_array_write_spec(
        info=info, arg=ocp.SaveArgs(chunk_byte_size=self._chunk_byte_size),
        global_shape=shape, local_shape=shape if rows is None else (rows, *shape[1:]),
        dtype=dtype, use_ocdbt=True, process_index=0,
    )
    spec = built.json
    chunk_shape = tuple(built.metadata.chunk_shape)
    zarray = chunk_key = None
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if (
        spec.get("driver") == "zarr"
        and chunk_shape == shape
        and 0 < nbytes <= SMALL_ARRAY_BYTES
    ):
      other_metadata = {
          name: value for name, value in spec["metadata"].items()
          if name not in ("shape", "chunks")
      }
      raw = raw_chunk_layout(dtype, len(shape), json.dumps(other_metadata, sort_keys=True))
      if raw is not None:
        fields, chunk_key = raw
        zarray = zarray_bytes({**fields, "shape": list(shape), "chunks": list(shape)})
    return _Layout(spec, chunk_shape, zarray, chunk_key)


def zarray_bytes(fields: Mapping[str, Any]) -> bytes:
  """A ``.zarray`` as TensorStore writes it: compact, keys sorted."""
  return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


@functools.lru_cache(maxsize=256)
def raw_chunk_layout(
    dtype: np.dtype, rank: int, metadata_json: str
) -> tuple[dict[str, Any], str] | None:
  """The ``.zarray`` fields and chunk key TensorStore writes for a one-chunk
  array of ``dtype`` and ``rank`` with Orbax's ``metadata`` (all but its
  shape and chunks), if its chunk is the array's raw C-order bytes; else
  None.

  Asked of TensorStore itself, once per process for each dtype and rank, on
  an in-memory store: so the raw path writes exactly what the zarr driver
  would, and a TensorStore that encoded chunks differently (another byte
  order, a filter) would send these arrays through ``ts.open`` instead.
  """
  shape = (2,) * rank
  metadata = {**json.loads(metadata_json), "shape": list(shape), "chunks": list(shape)}
  sample = (np.arange(int(np.prod(shape)) or 1) % 3 + 1).astype(dtype).reshape(shape)
  array = ts.open(
      {"driver": "zarr", "kvstore": {"driver": "memory", "path": "a/"},
       "metadata": metadata, "dtype": jax.numpy.dtype(dtype).name},
      create=True, context=ts.Context(),
  ).result()
  array.write(sample).result()
  store = array.kvstore
  assert store is not None  # A zarr array opened on a kvstore has one.
  written = store.list().result()
  chunk_keys = [key for key in written if not key.endswith(b".zarray")]
  if len(chunk_keys) != 1 or len(written) != 2:
    return None
  zarray = store.read(b".zarray").result().value
  chunk = store.read(chunk_keys[0]).result().value
  fields = json.loads(zarray)
  if zarray_bytes(fields) != zarray or chunk != _c_bytes(sample):
    return None
  return fields, chunk_keys[0].decode()


def _c_bytes(array: np.ndarray) -> bytes:
  """The array's bytes in C order, as the zarr driver stores a raw chunk."""
  return checksums.c_order_bytes(array).tobytes()


@dataclasses.dataclass(frozen=True)
class Started:
  """Writes under way: `finish` waits for them and writes Orbax's files."""

  directory: epath.Path
  writes: tuple[ts.Future, ...]
  files: dict[str, bytes]

  def finish(self) -> None:
    """Waits for every array's write, then writes Orbax's metadata files.

    Raises:
      Whatever TensorStore raised for a write (the save then fails, and its
      temporary directory is deleted by `pz_persist.storage.lifecycle.leftovers`), once
      every other write has ended too (`settle`).
    """
    settle(self.writes)
    for write in self.writes:
      write.result()
    for name, data in self.files.items():
      path = self.directory / name
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_bytes(data)


def settle(writes: Sequence[ts.Future]) -> None:
  """Waits until every TensorStore future in ``writes`` has ended, whether it
  succeeded or failed; raises nothing of theirs.

  Why every one, even after one failed: a write still under way when the save
  gives up goes on in TensorStore's threads. It recreates directories the
  cleanup deleted (or a next save's cleanup did), and when it ends it lets go
  of the array it wrote from, which takes Python's lock from a TensorStore
  thread: after the interpreter began to exit, that kills the process
  ("terminate called without an active exception", SIGABRT) instead of the
  exit status the program asked for. So no write outlives the save that
  started it. (A TensorStore ``cancel`` only detaches the future; the write
  itself goes on, so it is no substitute for waiting.)
  """
  for write in writes:
    with contextlib.suppress(Exception, asyncio.CancelledError):
      write.exception()  # Blocks until it ended; returns its error, if any.


def start(
    directory: epath.Path,
    stored: Mapping[str, Any],
    host: Mapping[str, np.ndarray],
    *,
    chunk_byte_size: int | None,
) -> Started:
  """Starts writing ``stored`` (its host copies ``host``) into ``directory``.

  Returns once every write is issued; TensorStore's threads write the bytes,
  and `Started.finish` waits for them and writes Orbax's metadata files.
  """
  specs = _Specs(directory, chunk_byte_size)
  layouts = {key: specs.layout(tuple(value.shape), np.dtype(value.dtype))
             for key, value in stored.items()}
  kvstore = None
  writes: list[ts.Future] = []
  opening: list[tuple[Any, np.ndarray]] = []
  try:
    for key, layout in layouts.items():
      data = host[key]
      if layout.zarray is not None:
        if kvstore is None:
          kvstore = ts.KvStore.open(
              {**layout.spec["kvstore"], "path": ""}, context=specs.context
          ).result()
        writes.append(kvstore.write(f"{key}/.zarray", layout.zarray))
        writes.append(kvstore.write(f"{key}/{layout.chunk_key}", _c_bytes(data)))
      else:
        spec = {**layout.spec, "kvstore": {**layout.spec["kvstore"], "path": key}}
        opening.append((ts.open(spec, create=True, open=True, context=specs.context), data))
    for opened, data in opening:  # All opened at once; each written once open.
      writes.append(opened.result().write(data, can_reference_source_data_indefinitely=True))
    files = orbax_files(stored, layouts)
  except BaseException:
    # Nothing issued so far may outlive the failed save (see `settle`).
    settle(writes + [opened for opened, _ in opening])
    raise
  return Started(directory=directory, writes=tuple(writes), files=files)


def _sharding_metadata(sharding: Any) -> Any:
  """How Orbax's array handler describes ``sharding`` in ``_sharding`` (None
  for a kind it does not describe), through Orbax's public metadata classes."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return ocp.metadata.NamedShardingMetadata.from_jax_sharding(sharding)
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return ocp.metadata.SingleDeviceShardingMetadata.from_jax_sharding(sharding)
  return None


def orbax_files(stored: Mapping[str, Any], layouts: Mapping[str, _Layout]) -> dict[str, bytes]:
  """``_METADATA``, ``_sharding`` and ``array_metadatas/process_0`` as Orbax
  writes them for the flat tree ``stored`` (what its restore reads to
  rebuild the tree, place the arrays and check their chunking)."""
  tree = {}
  shardings: dict[str, str] = {}
  array_metadatas = []
  serialized: dict[Any, str | None] = {}
  for key, value in stored.items():
    is_jax = isinstance(value, jax.Array)
    value_metadata: dict[str, Any] = {
        "value_type": "jax.Array" if is_jax else "np.ndarray",
        "skip_deserialize": False,
    }
    if is_jax:
      shape = list(value.shape)
      value_metadata["write_shape"] = shape
      sharding = value.sharding
      if sharding not in serialized:
        described = _sharding_metadata(sharding)
        serialized[sharding] = described and described.to_serialized_string()
      described_as = serialized[sharding]
      if described_as is not None:
        shardings[base64.urlsafe_b64encode(key.encode()).decode()] = described_as
      array_metadatas.append({"array_metadata": {
          "param_name": key, "write_shape": shape,
          "chunk_shape": list(layouts[key].chunk_shape), "ext_metadata": None,
      }})
    tree[str((key,))] = {
        "key_metadata": [{"key": key, "key_type": 2}],
        "value_metadata": value_metadata,
    }
  files = {
      "_METADATA": json.dumps({
          "tree_metadata": tree, "use_ocdbt": True, "use_zarr3": False,
          "store_array_data_equal_to_fill_value": True, "custom_metadata": None,
      }).encode(),
  }
  if shardings:
    files["_sharding"] = json.dumps(shardings, sort_keys=True, separators=(",", ":")).encode()
  if array_metadatas:
    files["array_metadatas/process_0"] = json.dumps(
        {"array_metadatas": array_metadatas}
    ).encode()
  return files
