"""The manifest: one versioned JSON file that makes a directory of arrays a tree.

Orbax stores the arrays of a checkpoint item as a flat ``{key: array}`` dict;
the manifest, ``pz_persist.json`` in the same directory, says how to rebuild
the saved tree from them (see `pz_persist.format.encode` and `pz_persist.format.decode`) and describes each array
(shape, dtype, label) so `pz_persist.inspect` can show a checkpoint without
reading any array data. Layout::

  {
    "format": "pz_persist",
    "format_version": 2,  # or 3; format 4: pz_persist.format.compact
    "writer": "pz_persist 0.7.0",
    "tree": {...},        # typed JSON node of the saved tree
    "variables": [...],   # mutable variables, referenced from the tree
    "arrays": [...]       # one entry per array, see ArraySpec.to_json
  }

A manifest is validated as a whole before any of it is used: a newer
``format_version`` than this library reads is refused with an upgrade hint,
oversized files are refused before parsing, and every array entry is checked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from collections.abc import Sequence
from typing import Any

from etils import epath

from pz_persist import errors
from pz_persist import version
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import compact as compact_lib
from pz_persist.format import json_types
from pz_persist.format import nodes
from pz_persist.safety import bounded_json
from pz_persist.safety import safe_io

MANIFEST_FILENAME = "pz_persist.json"

FILE_DIGESTS_FILENAME = "pz_persist.files.json"
"""The list of the item's files with their sizes and digests, written beside
the manifest once every other file is final (`pz_persist.storage.integrity.file_digests`)."""

MAX_FILE_DIGESTS_BYTES = 64 * 2**20
"""Larger digest files are refused before parsing."""
FORMAT_NAME = "pz_persist"
FORMAT_VERSION = 4
"""The newest manifest format this library reads (and the one it writes).

Version 2 added per-array ``checksums``, which every stored array of a
version 2 manifest must have; version 1 manifests (no checksums) still load,
and `pz_persist.verify` says their arrays are unverifiable. Version 3 allows
array keys that are Orbax leaf names (`FIRST_FORMAT_WITH_LEAF_KEYS`); only
items whose variables Orbax's ``PyTreeCheckpointHandler`` saved through
pz_persist's type handler declared it. Version 4 writes the same content
compactly (`pz_persist.format.compact`: tables of node types, classes and
shared static values, positional nodes, a columnar arrays table; its
``leaf_keys`` says whether array keys are leaf names). Every save writes 4
(or the format its nodes need, `pz_persist.format.nodes.format_needed`).
"""

FIRST_FORMAT_WITH_CHECKSUMS = 2

WRITTEN_FORMAT = 4
"""The format a manifest declares unless what it holds needs a newer one
(a newer node type, `pz_persist.format.nodes.format_needed`)."""

FIRST_COMPACT_FORMAT = 4
"""Manifests of this format on are written compactly (`pz_persist.format.compact`)."""

FIRST_FORMAT_WITH_LEAF_KEYS = 3
"""Array keys may be Orbax's ``.``-joined leaf names from this format on."""

MAX_MANIFEST_BYTES = 256 * 1024 * 1024
"""Larger manifests are refused before parsing (a model has ~1 KiB per array)."""

MAX_MANIFEST_NODES = 2**24
"""Most JSON values (and object keys) a manifest may hold, whatever its size.

Measured: a Gemma-like transformer saved unstacked has ~128 values (~1 KiB)
per array, and a checksum of a shard ~14 more (~90 bytes), so 2**24 values
hold ~130,000 unsharded arrays, or a 126-layer model (~1,100 arrays) sharded
512 ways ~1.8 times over. Parsing costs at most ~90 bytes per value (1.5 GiB
here), whatever the file holds."""

MIN_BYTES_PER_OBJECT = 8
"""A manifest may hold at most one JSON object per this many bytes (and a
few thousand more: `bounded_json.node_limit`).

Why objects, and not values: dense JSON costs about as much memory per byte
whatever it holds, except objects (``[{},{},...]``: 24 bytes of memory per
byte, 184 bytes per object with a key). The values of a legitimate format 4
manifest are as dense as any JSON's: a list of 20,000 ``None`` is
``[3],[3],...`` (2 bytes per value, 24 bytes of memory per byte), nested
empty tuples 1.75 bytes per value, a ``[],[],...`` bomb 1.5; a limit on
values per byte that refused the bomb refused those saves too (issue 36).
Objects are what no pz_persist writer packs densely: format 4 writes two,
plus one ``{"module", "qualname"}`` of 27 bytes or more per function
reference; formats 1 to 3 one per node, of 12 bytes or more
(``{"t":"none"}``). So with values bounded only by `MAX_MANIFEST_NODES`,
parsing a manifest costs at most ~30 bytes of memory per byte (measured: the
densest content pz_persist writes, nested empty tuples, 27; a list bomb
``[[]],[[]],...`` 30), and at most ~1.5 GiB whatever its size."""

MAX_JSON_DEPTH = 512
"""Deepest JSON nesting of a manifest (real models: ~45; the tree itself is
limited to `pz_persist.format.nodes.MAX_DEPTH` levels of ~3 JSON levels each)."""

_FIELDS = {"format", "format_version", "writer", "tree", "variables", "arrays"}


@dataclasses.dataclass(frozen=True)
class Manifest:
  """The parsed, validated manifest of one checkpoint item.

  Attributes:
    tree: Typed JSON node of the saved tree.
    variables: Entries of the mutable variables the tree references.
    arrays: Description of every array, indexed by array node ``ref``.
    writer: Library and version that wrote the checkpoint.
    format_version: Manifest format version.
  """

  tree: nodes.Node
  variables: tuple[nodes.Node, ...]
  arrays: tuple[arrays_lib.ArraySpec, ...]
  writer: str = f"pz_persist {version.__version__}"
  format_version: int = WRITTEN_FORMAT
  leaf_keys: bool = False
  """Whether the array keys are Orbax leaf names (items Orbax's
  ``PyTreeCheckpointHandler`` saved through pz_persist's type handler)."""
  compact: compact_lib.Parsed | None = dataclasses.field(
      default=None, init=False, compare=False, repr=False
  )
  """A format 4 manifest as read: its compact nodes and tables, which the
  decoder reads directly (`decodable`). ``tree`` and ``variables`` are then
  expanded into the typed JSON of formats 1 to 3 only when asked for. Not
  an argument: a manifest built or replaced (``dataclasses.replace``) holds
  its own ``tree`` and ``variables``, never another's compact form."""

  def __getattr__(self, name: str) -> Any:
    # Only reached for an attribute the instance lacks: the tree and
    # variables of a format 4 manifest, until first asked for.
    parsed = self.__dict__.get("compact")
    if name not in ("tree", "variables") or parsed is None:
      raise AttributeError(name)
    self.__dict__["tree"], self.__dict__["variables"] = parsed.expanded()
    return self.__dict__[name]

  @classmethod
  def from_compact(cls, parsed: compact_lib.Parsed, format_version: int) -> Manifest:
    """The manifest of a checked format 4 manifest; its ``tree`` and
    ``variables`` are expanded when first read (the decoder needs neither)."""
    manifest = object.__new__(cls)
    manifest.__dict__.update(
        arrays=parsed.arrays, writer=parsed.writer, format_version=format_version,
        leaf_keys=parsed.leaf_keys, compact=parsed,
    )
    return manifest

  def decodable(self) -> tuple[Any, Any, compact_lib.Tables | None]:
    """``(tree, variables, tables)`` as `pz_persist.format.decode.decode`
    reads them: a format 4 manifest's compact nodes and tables, else the
    typed JSON."""
    if self.compact is not None:
      return self.compact.tree, self.compact.variable_entries(), self.compact.tables
    return self.tree, self.variables, None

  def to_json(self) -> json_types.JSONObject:
    if self.format_version >= FIRST_COMPACT_FORMAT:
      return compact_lib.to_json(
          self.tree, self.variables, self.arrays, writer=self.writer,
          leaf_keys=self.leaf_keys, format_version=self.format_version,
          compacted=self._compacted(),
      )
    return {
        "format": FORMAT_NAME,
        "format_version": self.format_version,
        "writer": self.writer,
        "tree": self.tree,
        "variables": list(self.variables),
        "arrays": [spec.to_json() for spec in self.arrays],
    }

  def with_arrays(self, arrays: tuple[arrays_lib.ArraySpec, ...]) -> Manifest:
    """This manifest with other array entries (their checksums, as a save
    records them), keeping its compacted tree: a save checks the manifest it
    will write before hashing (`check_publishable`) and writes it after, and
    compacts the tree once for both."""
    changed = dataclasses.replace(self, arrays=arrays)
    if self.format_version >= FIRST_COMPACT_FORMAT:
      changed.__dict__["_compacted_nodes"] = self._compacted()
    return changed

  def _compacted(self) -> json_types.JSONObject:
    """`compact_lib.compact_nodes` of its tree and variables, computed once
    (a manifest is frozen; `with_arrays` hands it on)."""
    found = self.__dict__.get("_compacted_nodes")
    if found is None:
      found = self.__dict__["_compacted_nodes"] = compact_lib.compact_nodes(self.tree, self.variables)
    return found

  def dumps(self) -> bytes:
    return json.dumps(self.to_json(), allow_nan=False, separators=(",", ":")).encode()

  @classmethod
  def loads(cls, data: bytes, *, where: str) -> Manifest:
    """Parses and validates a manifest.

    Args:
      data: The file's bytes.
      where: The file's path, for error messages.

    Raises:
      ManifestError: not valid JSON, or not a pz_persist manifest.
      FormatVersionError: written by a newer format than this library reads.
    """
    if len(data) > MAX_MANIFEST_BYTES:
      raise errors.ManifestError(
          f"{where}: manifest is {len(data)} bytes, over the"
          f" {MAX_MANIFEST_BYTES}-byte limit."
      )
    return cls._parse(data, where=where)

  @classmethod
  def _parse(cls, data: bytes, *, where: str) -> Manifest:
    raw = parse_json(data, where=where)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
      raise errors.ManifestError(f"{where}: not a pz_persist manifest.")
    found = raw.get("format_version")
    if type(found) is not int or found < 1:
      raise errors.ManifestError(f"{where}: invalid format_version {found!r}.")
    if found > FORMAT_VERSION:
      raise errors.FormatVersionError(
          f"{where} was written by {raw.get('writer', 'a newer pz_persist')!s:.60}"
          f" in manifest format {found}: it needs a pz_persist that reads format {found};"
          f" this pz_persist ({version.__version__}) reads formats 1 to {FORMAT_VERSION}."
          f" Upgrade with: {version.install_command(upgrade=True)}"
      )
    if found >= FIRST_COMPACT_FORMAT:
      return cls.from_compact(
          compact_lib.parse(raw, where=where, reader_format=FORMAT_VERSION), found)
    if set(raw) != _FIELDS:
      raise errors.ManifestError(
          f"{where}: manifest fields {sorted(raw)}, expected {sorted(_FIELDS)}."
      )
    if not isinstance(raw["tree"], dict) or not isinstance(raw["variables"], list):
      raise errors.ManifestError(f"{where}: tree must be an object, variables a list.")
    if not isinstance(raw["arrays"], list) or not isinstance(raw["writer"], str):
      raise errors.ManifestError(f"{where}: arrays must be a list, writer a string.")
    if arrays_lib.CONTROL_CHARS.search(raw["writer"]):
      raise errors.ManifestError(f"{where}: invalid writer {raw['writer']!r:.100}.")
    specs = tuple(
        arrays_lib.ArraySpec.from_json(
            entry, where=f"{where}: arrays[{i}]",
            leaf_keys=found >= FIRST_FORMAT_WITH_LEAF_KEYS,
        )
        for i, entry in enumerate(raw["arrays"])
    )
    if found >= FIRST_FORMAT_WITH_CHECKSUMS:
      _check_checksummed(specs, found, where)
    check_typed_nodes(raw["tree"], raw["variables"], specs, where=where)
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
      if spec.key in seen:
        raise errors.ManifestError(
            f"{where}: arrays[{seen[spec.key]}] and arrays[{i}] share the"
            f" storage key {spec.key!r}."
        )
      seen[spec.key] = i
    return cls(
        tree=raw["tree"],
        variables=tuple(raw["variables"]),
        arrays=specs,
        writer=raw["writer"],
        format_version=found,
        leaf_keys=found >= FIRST_FORMAT_WITH_LEAF_KEYS,
    )


def check_typed_nodes(
    tree: object, variables: Sequence[object], specs: tuple[arrays_lib.ArraySpec, ...], *,
    where: str
) -> None:
  """The checks of typed JSON (formats 1 to 3, and the Orbax type handler's
  records, `pz_persist.orbax.variable_type_handler`) made before decoding:
  depth counted through variable entries, and each array entry referred to
  once (`nodes.arrays_referenced_once`; format 4's are made as it is parsed,
  `compact_lib.parse`).

  Raises:
    ManifestError: naming the node or both places at fault.
  """
  refs = nodes.check_depth_through_variables(tree, variables, where)
  nodes.arrays_referenced_once(
      refs, len(specs), lambda: nodes.array_places(tree, variables),
      lambda ref: specs[ref].describe(), where)


def parse_json(data: bytes, *, where: str) -> Any:
  """Parses the JSON of a manifest (or of the type handler's records, which
  hold the same nodes) within the manifest's limits: `MAX_MANIFEST_NODES`
  values, `MIN_BYTES_PER_OBJECT`, `MAX_JSON_DEPTH` (`bounded_json`).

  The one place these limits are applied: readers parse through it, and a
  writer's manifest passes through it before it is published
  (`check_publishable`), so a save cannot write what a reader refuses.

  Raises:
    ManifestError: over a limit, or not valid JSON; naming ``where``.
  """
  return bounded_json.loads(
      data, where=where, max_nodes=MAX_MANIFEST_NODES, max_depth=MAX_JSON_DEPTH,
      max_objects=bounded_json.node_limit(
          len(data), most=MAX_MANIFEST_NODES, bytes_per_node=MIN_BYTES_PER_OBJECT),
  )


def _check_checksummed(
    specs: tuple[arrays_lib.ArraySpec, ...], found: int, where: str
) -> None:
  """Refuses a stored array without checksums in a format that records them.

  Why: the checksums are what ``verify`` trusts; if deleting them made an
  array merely "unverified", whoever modified the arrays could delete them
  too and have the modified data load, verified, and ``verify`` say OK.
  """
  for i, spec in enumerate(specs):
    if spec.is_stored and spec.checksums is None:
      raise errors.ManifestError(
          f"{where}: arrays[{i}] ({spec.describe()}) has no checksums, which"
          f" every stored array of manifest format {found} records; the"
          " manifest is damaged or was edited."
      )


def check_publishable(manifest: Manifest, *, what: str) -> None:
  """Refuses to publish a manifest that a reader would refuse.

  Why: a save that succeeds must load. The manifest's bytes are parsed and
  checked by `Manifest.loads`, the very code every reader runs first (its
  JSON limits, `parse_json`; format 4's tables and nodes, with their depth
  counted through shared and variable entries), so what a writer publishes
  is inside every limit by construction, however the limits change. Every
  save path calls it before it writes anything
  (`pz_persist.storage.writing.writer.check_publishable`).

  Args:
    manifest: The manifest as it will be written (checksums included: only
      their digests may differ, and they do not change what is checked).
    what: What is being saved, for the message.

  Raises:
    EncodingError: naming what a reader would refuse, and how to save it.
  """
  try:
    Manifest.loads(manifest.dumps(), where="manifest")
  except errors.ManifestError as e:
    raise errors.EncodingError(
        f"{what} cannot be saved: a reader would refuse the manifest it needs,"
        f" saying: \"{e}\" Nothing was written. Save long lists of numbers as"
        " arrays (np.asarray) rather than as Python values, and nest values at"
        " most pz_persist.format.nodes.MAX_DEPTH levels deep."
    ) from None


def manifest_path(directory: epath.PathLike) -> epath.Path:
  return epath.Path(directory) / MANIFEST_FILENAME


def has_manifest(directory: epath.PathLike) -> bool:
  return manifest_path(directory).is_file()


def read(directory: epath.PathLike) -> Manifest:
  """Reads and validates the manifest of the checkpoint item in ``directory``."""
  return read_with_bytes(directory)[0]


def read_with_bytes(directory: epath.PathLike) -> tuple[Manifest, bytes]:
  """`read`, also returning the very bytes parsed (to hash them for identity)."""
  path = manifest_path(directory)
  try:  # No link followed, no FIFO opened, at most MAX_MANIFEST_BYTES.
    data = safe_io.read_small_file(path, MAX_MANIFEST_BYTES, what="manifest")
  except FileNotFoundError:
    raise errors.NotACheckpointError(
        f"{directory} is not a pz_persist checkpoint item: it has no"
        f" {MANIFEST_FILENAME}."
    ) from None
  except OSError as e:
    raise errors.ManifestError(f"{path}: cannot be read: {e}") from None
  manifest = Manifest.loads(data, where=str(path))
  _refuse_downgrade(directory, manifest, where=str(path))
  return manifest, data


def _refuse_downgrade(directory: epath.PathLike, manifest: Manifest, *, where: str) -> None:
  """Refuses a format-1 manifest in an item that a format-2 writer wrote.

  Why: format 1 predates checksums, so its arrays load unverified; rewriting a
  manifest as format 1 would hide edited arrays. The file digest list
  (`pz_persist.storage.integrity.file_digests`) came with checksums: an item holding one was
  written with checksums, and its manifest cannot be format 1.
  """
  if manifest.format_version >= 2:
    return
  digests = epath.Path(directory) / FILE_DIGESTS_FILENAME
  if safe_io.lexists(digests):
    raise errors.ManifestError(
        f"{where}: format {manifest.format_version} (no checksums) beside"
        f" {FILE_DIGESTS_FILENAME}, which only writers of checksummed formats"
        " write: the manifest was downgraded to hide edited arrays, or is"
        " damaged."
    )


def check_file(directory: epath.PathLike) -> None:
  """Refuses a manifest that is not a regular file, without opening it.

  Why: callers that look at the manifest before `read` (to notice a
  checkpoint being replaced, say) would otherwise hang on a FIFO or take a
  directory for a missing file; this names the problem first.
  """
  path = os.fspath(manifest_path(directory))
  mode = safe_io.local_mode(path)
  if mode is None:
    return  # Missing, unreadable (`read` says so) or remote.
  if stat.S_ISDIR(mode):
    raise errors.ManifestError(f"{path} is a directory, not a manifest file.")
  if not stat.S_ISREG(mode):
    raise errors.UnsafeCheckpointError(
        f"{path} is {safe_io.special_kind(mode)}, not a regular file; refusing"
        " to read it."
    )


def write(directory: epath.PathLike, manifest: Manifest) -> None:
  """Writes the manifest (whole or not at all: written aside, then renamed)."""
  safe_io.write_small_file(manifest_path(directory), manifest.dumps())
