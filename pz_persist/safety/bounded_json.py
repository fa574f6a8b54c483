"""Parsing JSON a checkpoint holds, with memory and time bounded by its size.

Why: Python's ``json`` turns each value into an object of tens of bytes, so
a few bytes of JSON such as ``[{},{},...]`` cost 25 bytes of memory each
(17 MiB took 288 MiB) before any validation sees them, and deep nesting
recurses once per level. Every JSON file pz_persist reads from a checkpoint
(the manifest, the file digest list, Orbax's ``_CHECKPOINT_METADATA``, and
Orbax's ``_METADATA`` before Orbax parses it) therefore goes through `loads`
or `check`, which count the values and the nesting depth *before* parsing,
in NumPy over fixed-size chunks (~25 ns per byte, a few MiB of temporaries
whatever the size), and refuse a file over its limits naming it.

What a caller gets: parsing costs at most about 90 bytes of memory per value
(``max_nodes``; with `node_limit`, ~23 bytes per byte of input) on top of the
input (parsing itself takes 100-500 ns per byte); nesting deeper than
``max_depth`` never reaches the parser. A file whose legitimate content is as
dense as any JSON (a pz_persist manifest: `pz_persist.format.manifest.parse_json`)
limits its objects per byte instead (``max_objects``), the values that cost
the most: any JSON then costs at most ~30 bytes of memory per byte.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from typing import Any
from typing import BinaryIO
from typing import NoReturn

import numpy as np
from etils import epath

from pz_persist import errors

_CHUNK = 1 << 18
"""Bytes scanned at once (the scan's temporaries are ~30 bytes per byte)."""

_OTHER, _OPEN, _CLOSE, _SEPARATOR, _QUOTE, _BACKSLASH = range(6)


def _byte_classes() -> np.ndarray:
  table = np.full(256, _OTHER, np.uint8)
  for chars, kind in (("[{", _OPEN), ("]}", _CLOSE), (",:", _SEPARATOR),
                      ('"', _QUOTE), ("\\", _BACKSLASH)):
    table[[ord(c) for c in chars]] = kind
  return table


_CLASSES = _byte_classes()


def structure(data: bytes) -> tuple[int, int]:
  """``(values, depth)`` of a JSON text, counted without parsing it.

  Values are counted as the containers opened plus the ``,`` and ``:``
  outside strings, plus one: exactly the number of values and object keys
  of valid JSON (one more per empty container), so an upper bound of what
  parsing allocates. Depth is the deepest nesting of ``[``/``{``. For
  invalid JSON the counts mean nothing, but the parser refuses it anyway.
  """
  counted = scan(data)
  return counted.values, counted.depth


@dataclasses.dataclass(frozen=True)
class Counts:
  """What `scan` counts of a JSON text (see `structure`).

  Attributes:
    values: Its values and object keys (one more per empty container).
    depth: Its deepest nesting of ``[`` and ``{``.
    objects: Its objects (``{`` outside strings): the costliest values to
      parse (a dict is 64 bytes empty, 184 with a key, against 8 for a small
      number in a list).
  """

  values: int
  depth: int
  objects: int


def scan(data: bytes) -> Counts:
  """The `Counts` of a JSON text, without parsing it (~25 ns per byte)."""
  nodes, depth, deepest, objects = 1, 0, 0, 0
  in_string, backslashes = False, 0  # Carried from one chunk to the next.
  view = np.frombuffer(data, np.uint8)
  for start in range(0, len(view), _CHUNK):
    chunk = view[start:start + _CHUNK]
    kinds = _CLASSES.take(chunk)
    quotes = np.flatnonzero(kinds == _QUOTE)
    escaping = kinds == _BACKSLASH
    if backslashes or escaping.any():
      quotes = quotes[_escape_runs(escaping, quotes, backslashes) % 2 == 0]
      backslashes = _trailing_backslashes(escaping, backslashes)
    else:
      backslashes = 0
    if len(quotes):
      toggles = np.zeros(len(kinds), np.int8)
      toggles[quotes] = 1
      outside = (np.bitwise_xor.accumulate(toggles) ^ in_string) == 0
      in_string = bool((len(quotes) + in_string) % 2)
      kinds = np.where(outside, kinds, _OTHER)
    elif in_string:
      continue
    opens = kinds == _OPEN
    nodes += int(np.count_nonzero(opens)) + int(np.count_nonzero(kinds == _SEPARATOR))
    # The depth after each bracket (the deepest is after an opening one):
    # summed over the brackets alone, not over every byte.
    brackets = np.flatnonzero(opens | (kinds == _CLOSE))
    if len(brackets):
      objects += int(np.count_nonzero(chunk[brackets] == _BRACE))
      levels = np.cumsum(np.where(opens[brackets], 1, -1)) + depth
      deepest = max(deepest, int(levels.max()))
      depth = int(levels[-1])
  return Counts(nodes, deepest, objects)


_BRACE = ord("{")


def _escape_runs(escaping: np.ndarray, quotes: np.ndarray, carried: int) -> np.ndarray:
  """How many backslashes directly precede each quote (odd: it is escaped)."""
  positions = np.arange(len(escaping))
  # For each position, the last one at or before it that is no backslash.
  last_other = np.maximum.accumulate(np.where(escaping, -1, positions))
  before = np.where(quotes > 0, last_other[np.maximum(quotes - 1, 0)], -1)
  return np.where(before < 0, quotes + carried, quotes - 1 - before)


def _trailing_backslashes(escaping: np.ndarray, carried: int) -> int:
  others = np.flatnonzero(~escaping)
  if not len(others):
    return carried + len(escaping)
  return len(escaping) - 1 - int(others[-1])


def node_limit(size: int, *, most: int, bytes_per_node: int = 4) -> int:
  """The ``max_nodes`` for a file of ``size`` bytes: ``most``, and no more
  than one value per ``bytes_per_node`` bytes (plus a small allowance).

  Why: what a file's values cost grows with how densely they are packed;
  ``[{},{},...]`` costs 25 bytes of memory per byte, real pz_persist and
  Orbax JSON under 9. At 4 bytes per value parsing costs at most ~23 bytes
  of memory per byte (measured; the real files spend over 6 bytes per value).
  """
  return min(most, size // bytes_per_node + 4096)


def check(
    data: bytes, *, where: str, max_nodes: int, max_depth: int, max_objects: int | None = None,
) -> None:
  """Refuses JSON with more than ``max_nodes`` values, deeper than
  ``max_depth`` or with more than ``max_objects`` objects (None: any), without
  parsing it (for files another library parses).

  Raises:
    ManifestError: naming ``where`` and the limit exceeded.
  """
  counted = scan(data)
  nodes, depth = counted.values, counted.depth
  if nodes > max_nodes:
    raise errors.ManifestError(
        f"{where}: {nodes} JSON values in {len(data)} bytes, over the limit of"
        f" {max_nodes}; the file is damaged or forged (refused before parsing)."
    )
  if max_objects is not None and counted.objects > max_objects:
    raise errors.ManifestError(
        f"{where}: {nodes} JSON values in {len(data)} bytes, over the limit for"
        f" its size: {counted.objects} of them are objects, at most {max_objects}"
        " are allowed; the file is damaged or forged (refused before parsing)."
    )
  if depth > max_depth:
    raise errors.ManifestError(
        f"{where}: JSON nested {depth} levels deep, over the limit of"
        f" {max_depth}; the file is damaged or forged (refused before parsing)."
    )


def read_limited(f: BinaryIO, limit: int) -> bytes:
  """At most ``limit + 1`` bytes of an open file (one more says "too big").

  Why not ``f.read(limit + 1)``: that allocates ``limit + 1`` bytes up front
  (hundreds of MiB for a file of a few bytes); a local file's size is known.
  """
  try:
    size = os.fstat(f.fileno()).st_size
  except (AttributeError, OSError, io.UnsupportedOperation):
    size = limit  # Not a local file: its reader allocates what it reads.
  return f.read(min(size, limit) + 1)


ORBAX_METADATA = "_METADATA"
MAX_ORBAX_METADATA_BYTES = 256 * 2**20
MAX_ORBAX_METADATA_NODES = 2**23
"""Limits of Orbax's ``_METADATA`` (its tree of arrays: ~20 values and ~300
bytes per array), which Orbax parses itself with no limit."""


def check_orbax_metadata(directory: epath.PathLike) -> None:
  """Refuses an item whose Orbax ``_METADATA`` is oversized or a JSON bomb.

  Call before anything (Orbax's ``handler.metadata``, a direct read) parses
  it. A missing or unreadable file is left for that reader to report.

  Raises:
    ManifestError: naming the file and the limit exceeded.
  """
  path = epath.Path(directory) / ORBAX_METADATA
  if "://" not in os.fspath(path) and not os.path.isfile(os.fspath(path)):
    return  # Missing, or not a file: check_contained / the reader say so.
  try:
    data = read_file(path, max_bytes=MAX_ORBAX_METADATA_BYTES)
  except OSError:
    return
  most = node_limit(len(data), most=MAX_ORBAX_METADATA_NODES)
  check(data, where=str(path), max_nodes=most, max_depth=32)


def read_file(path: epath.PathLike, *, max_bytes: int) -> bytes:
  """The bytes of a (regular) file of at most ``max_bytes``.

  Raises:
    ManifestError: the file is larger, naming it.
    OSError: it cannot be read.
  """
  with epath.Path(path).open("rb") as f:
    data = read_limited(f, max_bytes)
  if len(data) > max_bytes:
    raise errors.ManifestError(
        f"{path}: over the {max_bytes}-byte limit; the file is damaged or"
        " forged (refused before reading it whole)."
    )
  return data


def loads(
    data: bytes, *, where: str, max_nodes: int, max_depth: int, max_objects: int | None = None,
) -> Any:
  """Parses JSON from a checkpoint within the given limits.

  Strict JSON only: ``NaN``/``Infinity`` and duplicate object keys (which
  parsers resolve differently) are refused.

  Args:
    data: The file's bytes (the caller has bounded their length).
    where: The file, for error messages.
    max_nodes: Most values (and object keys) the text may hold.
    max_depth: Deepest nesting of arrays and objects allowed.
    max_objects: Most objects the text may hold (None: any).

  Raises:
    ManifestError: over a limit, or not valid JSON; naming ``where``.
  """
  check(data, where=where, max_nodes=max_nodes, max_depth=max_depth, max_objects=max_objects)
  # Python's garbage collector is left running while parsing, though parsing
  # sets it off often (a collection every 700 containers; pausing it halved
  # the parse of a 1 MB manifest in a process holding a model, 29 ms to 13 ms):
  # `gc.disable` / `gc.enable` are process-wide, so another thread saw the
  # collector off meanwhile, and one that turned it off itself had it turned
  # back on. Nothing a user set is changed, even briefly.
  try:
    return json.loads(
        data, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys
    )
  except (ValueError, RecursionError) as e:
    raise errors.ManifestError(f"{where}: not valid JSON: {e}") from None


def _refuse_constant(name: str) -> NoReturn:
  raise ValueError(f"non-standard JSON constant {name}")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
  result = dict(pairs)
  if len(result) != len(pairs):
    seen: set[str] = set()
    for key, _ in pairs:
      if key in seen:
        raise ValueError(f"duplicate object key {key!r:.100}")
      seen.add(key)
  return result
