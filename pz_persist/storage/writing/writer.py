"""The one writer of pz_persist items: the twin of `pz_persist.storage.reading.reader`.

Every save, whichever entry point started it (`pz_persist.save`,
`CheckpointManager`, `PenzaiSave` in Orbax's own checkpointers, Orbax's v1
API, the type handler), goes through here, so every save writes the same
files::

  item/
    pz_persist.json         the manifest, with a checksum per stored shard
    pz_persist.files.json   the size and digest of every other file (local)
    _METADATA, d/...        the arrays, as Orbax writes them

What this module owns, in order:

1. `encode`: the whole tree validated and encoded before anything is written
   (`pz_persist.format.encode`, which copies NumPy values: a save writes the
   tree as it was called with), and the manifest it will publish checked by
   the reader's own parse and limits (`check_publishable`): a save that
   succeeds always loads;
2. the host copies hashed later (`pz_persist.storage.integrity.checksums.host_copies`:
   views of the arrays' own buffers on the CPU backend, copies into pinned
   host memory on GPUs), taken before the blocking part of an async save
   returns;
3. the choice between `pz_persist.storage.writing.direct_write` (one process, whole
   arrays, local) and Orbax's own array writer, which each Orbax adapter
   hands in (`ArrayWriter`: the v0 ``PyTreeCheckpointHandler`` or the v1
   ``PyTreeHandler``);
4. hashing (every process; the digests of shards are exchanged) and the
   manifest (the primary process);
5. the file digests (`pz_persist.storage.integrity.file_digests`), once every file of
   the item is final: in `Writer.finalize` for Orbax's v0 API, at the end of
   the v1 save (whose array writer finalizes inside its own awaitable).

The mutable-variable ``TypeHandler`` saves through `encode_leaves` (Orbax's
``PyTreeCheckpointHandler`` writes and finalizes that item itself): its
records, and a manifest of its variables, so every reader reads it too; it
has no digest list, as Orbax finalizes the item after the type handler's last
word. The Orbax handlers in `pz_persist.orbax` only adapt Orbax's calling
conventions to this module's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import threading
import uuid
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Protocol

import jax
import orbax.checkpoint as ocp
from etils import epath

from pz_persist import errors
from pz_persist.format import checksum_records
from pz_persist.format import encode as encode_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import nodes
from pz_persist.format import variable_kinds
from pz_persist.safety import safe_io
from pz_persist.storage.integrity import checksums
from pz_persist.storage.integrity import file_digests
from pz_persist.storage.writing import direct_write

DEFAULT_CHUNK_BYTES = 4 * 2**20
"""Arrays are stored in chunks of about this size, so that a process reading
a shard decodes little beyond it (one whole-array chunk would be decoded in
full by every process that reads any part of it)."""

SETTLE_SECONDS = 120.0
"""How long `Writer.cancel` waits for a direct write's issued writes to end:
far above what the rest of a local write takes; only there so that a hung
disk cannot hang the interrupted save for ever."""


# ---- Encoding. ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Encoded:
  """A tree ready to be written.

  Attributes:
    manifest: Its manifest, without checksums yet (`with_checksums`).
    stored: The ``{key: array}`` tree of its stored arrays, as Orbax writes it.
  """

  manifest: manifest_lib.Manifest
  stored: dict[str, Any]


def encode(tree: Any) -> Encoded:
  """Validates and encodes ``tree``; reads no array's bytes.

  Raises:
    EncodingError: a value cannot be saved (the message names its place).
  """
  encoded = encode_lib.encode(tree)
  manifest = manifest_lib.Manifest(
      tree=encoded.tree, variables=tuple(encoded.variables), arrays=tuple(encoded.arrays),
      format_version=nodes.format_needed(
          encoded.tree, encoded.variables, at_least=manifest_lib.WRITTEN_FORMAT
      ),
  )
  stored = encoded.stored_arrays()
  check_publishable(manifest, stored, what="tree")
  return Encoded(manifest, stored)


PLACEHOLDER_DIGEST = "0" * 32
"""The digest `check_publishable` records before the arrays are hashed: any
digest is 32 hex digits, so the manifest checked is the one written, byte
for byte but for its digests."""


def check_publishable(
    manifest: manifest_lib.Manifest, stored: Mapping[str, Any], *, what: str
) -> None:
  """Refuses, before anything is written, a save whose manifest a reader
  would refuse (`pz_persist.format.manifest.check_publishable`): the one
  check every save path makes (`encode`, `encode_leaves`).

  The checksums are not computed yet (an async save hashes in the
  background): the slices they will record are (`checksums.indices`), so
  the manifest checked differs from the one written only in its digests.

  Raises:
    EncodingError: naming what a reader would refuse.
  """
  slices = checksums.indices(stored)
  manifest_lib.check_publishable(with_checksums(manifest, {
      key: tuple(checksum_records.ShardChecksum(index, PLACEHOLDER_DIGEST) for index in found)
      for key, found in slices.items()
  }), what=what)


def encode_hashed(tree: Any) -> tuple[manifest_lib.Manifest, dict[str, Any]]:
  """`encode`, with the checksums of every stored array (per distinct shard)
  computed now; in a multi-process save every process must call this, in the
  same order."""
  encoded = encode(tree)
  return with_checksums(encoded.manifest, checksums.compute(encoded.stored)), encoded.stored


def with_checksums(
    manifest: manifest_lib.Manifest,
    sums: dict[str, tuple[checksum_records.ShardChecksum, ...]],
) -> manifest_lib.Manifest:
  """``manifest`` with the checksums of its stored arrays recorded."""
  return manifest.with_arrays(tuple(
      spec.with_checksums(sums[spec.key]) if spec.key in sums else spec
      for spec in manifest.arrays
  ))


# ---- Variables saved leaf by leaf (the type handler). ----------------------

RECORDS_PREFIX = "pz_persist_variables-"
"""The type handler's records files: ``pz_persist_variables-<uuid>.json``."""


def leaf_array_name(leaf_name: str, index: int, count: int) -> str:
  """The name Orbax stores a variable's ``index``-th stored array under, of
  ``count``: a one-array variable (the usual case) stores it under the leaf's
  own name, so plain Orbax reads it as an array."""
  return leaf_name if count == 1 else f"{leaf_name}.pz{index}"


@dataclasses.dataclass(frozen=True)
class LeafSave:
  """What the type handler saves of the mutable variables of one Orbax item.

  Attributes:
    stored: Storage name -> array, for Orbax's own ``jax.Array`` handler.
    leaf_of_array: Storage name -> the leaf holding it (for its ``ParamInfo``).
    records: The records file's content, ``{leaf name: record}``, read by the
      type handler's restore (inside Orbax's).
    manifest: The item's manifest, read by every other reader
      (`leaves_manifest`).
  """

  stored: dict[str, Any]
  leaf_of_array: dict[str, str]
  records: dict[str, Any]
  manifest: manifest_lib.Manifest

  def write(self, directory: epath.Path) -> None:
    """Writes the records and the manifest (the primary process), once the
    item's directory exists."""
    path = directory / f"{RECORDS_PREFIX}{uuid.uuid4().hex}.json"
    safe_io.write_small_file(path, _records_bytes(self.records))
    manifest_lib.write(directory, self.manifest)


def encode_leaves(leaves: Sequence[tuple[str, Any]]) -> LeafSave:
  """Encodes and hashes the mutable variables Orbax's ``PyTreeCheckpointHandler``
  hands the type handler, as ``(leaf name, variable)`` pairs, in order.

  Each variable is saved frozen; a variable held by several leaves is saved
  once, the others record ``{"same_as": leaf}``. Every process computes the
  checksums (they exchange the digests of shards).

  Raises:
    EncodingError: a variable cannot be saved (the message names its leaf).
  """
  records: dict[str, Any] = {}
  first_name_of: dict[int, str] = {}
  stored: dict[str, Any] = {}
  leaf_of_array: dict[str, str] = {}
  encoded_of: dict[str, tuple[Any, encode_lib.EncodedTree, dict[str, str]]] = {}
  for leaf, variable in leaves:
    if id(variable) in first_name_of:
      records[leaf] = {"same_as": first_name_of[id(variable)]}
      continue
    first_name_of[id(variable)] = leaf
    encoded = encode_lib.encode(variable.freeze(), root=f"leaf {leaf!r}")
    pairs = [
        (spec, value) for spec, value in zip(encoded.arrays, encoded.values) if spec.is_stored
    ]
    names = {}
    for index, (spec, value) in enumerate(pairs):
      name = leaf_array_name(leaf, index, len(pairs))
      # Penzai variables hold jax.Arrays; anything else is made one.
      stored[name] = value if spec.kind == "jax" else jax.numpy.asarray(value)
      leaf_of_array[name] = leaf
      names[spec.key] = name
    encoded_of[leaf] = (variable, encoded, names)
    records[leaf] = None  # Filled below, in this order.
  sums = checksums.compute(stored)
  for leaf, (variable, encoded, names) in encoded_of.items():
    records[leaf] = _record(variable, encoded, names, sums)
  manifest = leaves_manifest(
      [(leaf, records[leaf].get("same_as", leaf)) for leaf, _ in leaves],
      {leaf: (variable_kinds.kind_of(variable), encoded, names)
       for leaf, (variable, encoded, names) in encoded_of.items()},
      sums,
  )
  what = f"the variables of leaves {', '.join(map(repr, encoded_of))}"
  manifest_lib.check_publishable(manifest, what=what)  # Hashed already: as written.
  try:  # The records file holds the same nodes, read within the manifest's limits.
    manifest_lib.parse_json(_records_bytes(records), where="records")
  except errors.ManifestError as e:
    raise errors.EncodingError(
        f"{what} cannot be saved: a reader would refuse the records file they need ({e})"
        " Nothing was written."
    ) from None
  return LeafSave(stored, leaf_of_array, records, manifest)


def _records_bytes(records: dict[str, Any]) -> bytes:
  """The type handler's records file, as `LeafSave.write` writes it."""
  return json.dumps(records, allow_nan=False).encode()


def _record(
    variable: Any,
    encoded: encode_lib.EncodedTree,
    names: Mapping[str, str],
    sums: Mapping[str, tuple[checksum_records.ShardChecksum, ...]],
) -> dict[str, Any]:
  """The JSON record of one variable, with its arrays' checksums."""
  return {
      "kind": variable_kinds.kind_of(variable),
      "tree": encoded.tree,
      "arrays": [
          dataclasses.replace(spec, checksums=sums[names[spec.key]]).to_json()
          if spec.key in names else spec.to_json()
          for spec in encoded.arrays
      ],
  }


def leaves_manifest(
    leaves: Sequence[tuple[str, str]],
    variables: Mapping[str, tuple[str, encode_lib.EncodedTree, Mapping[str, str]]],
    sums: Mapping[str, tuple[checksum_records.ShardChecksum, ...]],
) -> manifest_lib.Manifest:
  """The manifest of an item whose mutable variables Orbax's own
  ``PyTreeCheckpointHandler`` saved leaf by leaf, through pz_persist's type
  handler (`pz_persist.orbax.variable_type_handler`).

  Why: so that `pz_persist.load`, ``inspect``, ``load_model(path, into=)``,
  ``migrate`` and the command read such an item like any other. Its tree is
  ``{leaf name: variable}`` (a variable held by two leaves is one variable);
  its arrays keep the names Orbax stored them under (``.``-joined leaf names,
  which the manifest says with ``leaf_keys``), so the
  arrays are written once, by Orbax.

  Args:
    leaves: ``(leaf name, name of the variable it holds)``, every leaf in order.
    variables: Variable name -> (its kind, its frozen value as encoded, the
      storage name of each of its stored arrays by encoded key).
    sums: The checksums of the stored arrays, by storage name.
  """
  entries: list[dict[str, Any]] = []
  arrays: list[Any] = []
  ref_of: dict[str, int] = {}
  for name, (kind, encoded, names) in variables.items():
    if encoded.variables or encoded.tree.get("t") not in variable_kinds.BY_VALUE_TAG:
      raise AssertionError(f"leaf {name!r}: not one frozen variable value")
    base = len(arrays)
    for index, spec in enumerate(encoded.arrays):
      if spec.key in names:
        arrays.append(dataclasses.replace(
            spec, key=names[spec.key], checksums=sums[names[spec.key]]))
      else:  # Not stored (no data): a key of its own all the same.
        arrays.append(dataclasses.replace(spec, key=f"{name}.pz_unstored{index}"))
    value = encoded.tree
    ref_of[name] = len(entries)
    entries.append({
        "kind": kind, "label": value["label"], "metadata": value["metadata"],
        "value": _arrays_from(value["value"], base),
    })
  tree = nodes.node("dict", items=[
      [nodes.node("str", v=leaf), nodes.node("variable", ref=ref_of[variable])]
      for leaf, variable in leaves
  ])
  return manifest_lib.Manifest(
      tree=tree, variables=tuple(entries), arrays=tuple(arrays),
      format_version=manifest_lib.WRITTEN_FORMAT, leaf_keys=True,
  )


def _arrays_from(node: Any, base: int) -> Any:
  """``node`` with every array reference moved up by ``base``."""
  if isinstance(node, list):
    return [_arrays_from(value, base) for value in node]
  if not isinstance(node, dict):
    return node
  if nodes.tag_of(node) == "array":
    return {**node, "ref": node["ref"] + base}
  return {key: _arrays_from(value, base) for key, value in node.items()}


# ---- Writing. ----------------------------------------------------------------


class ArrayWriter(Protocol):
  """Orbax's own writer of a ``{key: array}`` tree, as an adapter hands it in.

  Used where a direct write does not apply (several processes, sharded
  arrays, compression, zarr3, object stores) or is turned off.
  """

  async def async_save(self, directory: epath.Path, stored: dict[str, Any]) -> list[Any]:
    """Starts writing; returns Orbax's commit futures."""

  def save(self, directory: epath.Path, stored: dict[str, Any]) -> None:
    """Writes synchronously."""

  def finalize(self, directory: epath.Path) -> None:
    """Orbax's finalize (the OCDBT merge)."""


@dataclasses.dataclass(frozen=True)
class WriteOptions:
  """How `Writer` writes; see `pz_persist.orbax.v0_handler.PenzaiCheckpointHandler`.

  Attributes:
    chunk_byte_size: About how large each stored chunk is.
    direct_writes: Let one process write whole arrays itself when it can.
    use_ocdbt, use_zarr3, use_compression: Orbax's layout, which a direct
      write reproduces file for file (or, if it cannot, leaves to Orbax).
    primary_host: The process that writes the manifest and file digests.
  """

  chunk_byte_size: int | None = DEFAULT_CHUNK_BYTES
  direct_writes: bool = True
  use_ocdbt: bool = True
  use_zarr3: bool = False
  use_compression: bool = False
  primary_host: int | None = 0


class Writer:
  """Writes pz_persist items: one per handler, one save at a time.

  `start` (async) or `write` (sync) writes the arrays and the manifest;
  `finalize` records the file digests once Orbax has finalized the arrays;
  `cancel` stops a started save's background work.
  """

  def __init__(self, arrays: ArrayWriter | None, options: WriteOptions | None = None):
    """``arrays`` is Orbax's writer for `start`, `write` and `finalize`;
    None where Orbax's writer starts and finalizes them itself (`finish_after`)."""
    self._arrays = arrays
    self._options = options or WriteOptions()
    # Directory -> its `start` not yet finalized, for `cancel`. Why every
    # one, not only the last: a CheckpointManager's items (params,
    # opt_state) are saved by one handler, so by one writer.
    self._unfinished: dict[str, _Started] = {}
    # Directory -> whether its save wrote arrays, for `finalize` (which would
    # otherwise ask the store: a request or more on gs:// and s3://).
    self._wrote_arrays: dict[str, bool] = {}

  def is_primary(self) -> bool:
    return ocp.multihost.is_primary_host(self._options.primary_host)

  def _orbax(self) -> ArrayWriter:
    if self._arrays is None:
      raise AssertionError("this writer's arrays are written by Orbax's own save")
    return self._arrays

  def _begin(self, directory: epath.Path, stored: dict[str, Any]) -> _Started:
    started = self._unfinished[os.fspath(directory)] = _Started()
    self._wrote_arrays[os.fspath(directory)] = bool(stored)
    return started

  def writes_directly(self, directory: epath.Path, stored: dict[str, Any]) -> bool:
    """Whether the arrays of ``stored`` are written by `direct_write`."""
    options = self._options
    return bool(stored) and options.direct_writes and isinstance(
        directory, epath.Path
    ) and direct_write.applies(
        stored, directory=directory, use_ocdbt=options.use_ocdbt,
        use_zarr3=options.use_zarr3, use_compression=options.use_compression,
    )

  async def start(self, directory: epath.Path, encoded: Encoded) -> list[ocp.future.Future]:
    """Starts saving; arrays are copied off the devices before this returns.

    Why the checksums are computed in the background: hashing every array
    (and, with several processes, exchanging the digests) would hold the
    training loop for as long again as Orbax's own blocking part. Only host
    copies of what this process hashes are taken here (on the CPU backend,
    views of the arrays' own buffers: nothing is copied); hashing them and
    writing the manifest is a commit future of its own, which Orbax awaits
    (with the arrays' futures) before `finalize`.
    """
    manifest, stored = encoded.manifest, encoded.stored
    begun = self._begin(directory, stored)
    futures = begun.futures
    if self.writes_directly(directory, stored):
      copies = checksums.host_copies(stored)
      work = _DirectWork()
      begun.direct.append(work)

      async def write_directly() -> None:
        if not work.begin():  # Abandoned before it began.
          raise concurrent.futures.CancelledError()
        try:
          self._write_directly(directory, manifest, stored, copies, stop=work.stop)
        finally:
          work.ended.set()

      futures.append(ocp.future.CommitFutureAwaitingContractedSignals(
          write_directly(), name="pz_persist_arrays_and_manifest"
      ))
      return futures
    if stored:  # Orbax refuses an empty tree; a tree of scalars has no arrays.
      begun.orbax_writes = True
      futures.extend(await self._orbax().async_save(directory, stored) or [])
    copies = checksums.host_copies(stored)

    async def hash_and_write_manifest() -> None:
      self._write_manifest(directory, manifest, copies)

    futures.append(ocp.future.CommitFutureAwaitingContractedSignals(
        hash_and_write_manifest(), name="pz_persist_manifest",
    ))
    return futures

  def write(self, directory: epath.Path, encoded: Encoded) -> None:
    """Saves synchronously (`finalize` still follows)."""
    manifest, stored = encoded.manifest, encoded.stored
    copies = checksums.host_copies(stored)
    begun = self._begin(directory, stored)
    if self.writes_directly(directory, stored):
      self._write_directly(directory, manifest, stored, copies)
      return
    if stored:
      begun.orbax_writes = True
      self._orbax().save(directory, stored)
    self._write_manifest(directory, manifest, copies)

  def finish_after(
      self,
      encoded: Encoded,
      arrays_saved: Awaitable[None] | None,
      created: Callable[[], Awaitable[epath.Path]],
  ) -> Awaitable[None]:
    """The rest of a save whose arrays Orbax's writer started and finalizes
    itself (Orbax's v1 ``PyTreeHandler``): once they are saved and the
    directory exists, the manifest and then the file digests.

    Args:
      encoded: What is saved.
      arrays_saved: Orbax's awaitable of the arrays (None: no stored array).
      created: Awaits the item directory's creation; returns its path.
    """
    copies = checksums.host_copies(encoded.stored)  # Hashed in the background.

    async def finish() -> None:
      if arrays_saved is not None:
        await arrays_saved
      path = await created()
      self._write_manifest(path, encoded.manifest, copies)
      if self.is_primary():  # Every file is final now: record their digests.
        file_digests.write(path)

    return finish()

  def _write_manifest(
      self,
      directory: epath.Path,
      manifest: manifest_lib.Manifest,
      copies: checksums.HostCopies,
  ) -> None:
    """Hashes the host copies (every process: the digests are exchanged)
    and writes the manifest with them (the primary process)."""
    manifest = with_checksums(manifest, copies.digests(exchange=str(directory)))
    if self.is_primary():
      manifest_lib.write(directory, manifest)

  def _write_directly(
      self,
      directory: epath.Path,
      manifest: manifest_lib.Manifest,
      stored: dict[str, Any],
      copies: checksums.HostCopies,
      stop: threading.Event | None = None,
  ) -> None:
    """Writes the arrays (TensorStore's threads) while this thread hashes
    them, then commits them, Orbax's metadata files and the manifest.

    Every write it started has ended when it returns or raises, even when
    hashing was stopped (``stop``, set by `cancel`) or a write failed: see
    `pz_persist.storage.writing.direct_write.settle`.
    """
    started = direct_write.start(
        directory, stored, copies.whole_arrays(),
        chunk_byte_size=self._options.chunk_byte_size,
    )
    try:
      hashed = with_checksums(manifest, copies.digests(stop=stop))
      started.finish()
    finally:
      direct_write.settle(started.writes)
    manifest_lib.write(directory, hashed)

  def cancel(self) -> bool:
    """Stops the background work of every `start` not yet finalized;
    returns whether every array write they started has ended.

    For a save interrupted or failed midway (see `pz_persist.save`, whose
    cleanup needs to know whether a write may still land): its futures are
    not returned to pz_persist by Orbax's checkpointer. A direct write stops
    hashing and waits for the writes it already issued (at most
    `SETTLE_SECONDS`); writes Orbax's own writer issued cannot be followed
    from here, so a save that had Orbax write arrays returns False.
    """
    unfinished = list(self._unfinished.values())
    self._unfinished.clear()
    for begun in unfinished:
      for future in begun.futures:
        future.cancel()
    ended = [work.abandon(SETTLE_SECONDS) for begun in unfinished for work in begun.direct]
    return all(ended) and not any(begun.orbax_writes for begun in unfinished)

  def finalize(self, directory: epath.Path) -> None:
    """Orbax's finalize of the arrays, if any were written, then the file
    digests (the primary process), once every file of the item is final."""
    self._unfinished.pop(os.fspath(directory), None)
    wrote_arrays = self._wrote_arrays.pop(os.fspath(directory), None)
    if wrote_arrays is None:  # Not saved by this writer: look.
      wrote_arrays = (directory / "_METADATA").exists() or any(
          directory.glob("ocdbt.process_*"))
    if wrote_arrays:
      self._orbax().finalize(directory)
    if self.is_primary():
      file_digests.write(directory)


@dataclasses.dataclass
class _Started:
  """One `start` (or `write`) of the writer, until it is finalized."""

  futures: list[ocp.future.Future] = dataclasses.field(default_factory=list)
  direct: list[_DirectWork] = dataclasses.field(default_factory=list)  # Its direct write.
  orbax_writes: bool = False  # Whether it had Orbax's writer write arrays.


class _DirectWork:
  """One direct write running in Orbax's background thread: how `cancel`
  stops it and learns that it ended.

  The thread may not have begun when the save is abandoned (Orbax's thread
  then never runs it): `begin` and `abandon` agree under a lock on which of
  the two came first, so `ended` is set in both cases.
  """

  def __init__(self) -> None:
    self.stop = threading.Event()
    self.ended = threading.Event()
    self._lock = threading.Lock()
    self._began = False

  def begin(self) -> bool:
    """Called by the work as it starts; False if it was abandoned already."""
    with self._lock:
      if self.stop.is_set():
        self.ended.set()
        return False
      self._began = True
      return True

  def abandon(self, timeout: float) -> bool:
    """Stops the work; True once it ended (within ``timeout`` seconds)."""
    with self._lock:
      self.stop.set()
      if not self._began:
        self.ended.set()  # It will not begin now.
    return self.ended.wait(timeout)
