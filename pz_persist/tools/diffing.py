"""Comparing two checkpoints: structure, labels, shapes, and array values.

Two large checkpoints must never sit in memory together, so arrays are read in
batches of bounded size from each side (Orbax reads only the requested arrays),
compared, and dropped before the next batch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from pz_persist import progress as progress_lib
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import nodes
from pz_persist.storage import batching
from pz_persist.storage import opening
from pz_persist.storage import reader

DEFAULT_BATCH_BYTES = 256 * 2**20
"""Most array bytes read from each checkpoint at once."""


@dataclasses.dataclass(frozen=True)
class ArrayDiff:
  """How one array differs between checkpoints A and B.

  Attributes:
    name: The variable label (with an index if it has several arrays) or the
      tree path of the array.
    identical: Bit-identical values.
    max_abs: Largest absolute difference.
    l2: Euclidean norm of the difference.
    relative_l2: ``l2`` divided by the norm of B's array (0 if both are zero).
  """

  name: str
  identical: bool
  max_abs: float
  l2: float
  relative_l2: float


@dataclasses.dataclass
class CheckpointDiff:
  """Everything that differs between checkpoints A and B."""

  only_in_a: list[str] = dataclasses.field(default_factory=list)
  only_in_b: list[str] = dataclasses.field(default_factory=list)
  changed: list[str] = dataclasses.field(default_factory=list)
  structure: list[str] = dataclasses.field(default_factory=list)
  arrays: list[ArrayDiff] = dataclasses.field(default_factory=list)

  @property
  def identical(self) -> bool:
    return not (
        self.only_in_a or self.only_in_b or self.changed or self.structure
        or any(not a.identical for a in self.arrays)
    )


JSON_SCHEMA = "pz-persist.diff/1"
"""The ``schema`` of `record`'s output (docs/reference/cli-json.md)."""


def record(result: CheckpointDiff) -> dict[str, Any]:
  """``result`` as JSON-ready data (``pz-persist diff --json``); an infinite
  ``relative_l2`` (B's array is all zeros, A's is not) is ``null``."""
  def finite(x: float) -> float | None:
    return x if math.isfinite(x) else None

  return {
      "identical": result.identical,
      "structure": list(result.structure),
      "only_in_a": list(result.only_in_a),
      "only_in_b": list(result.only_in_b),
      "changed": list(result.changed),
      "arrays": [
          {"name": a.name, "identical": a.identical, "max_abs": finite(a.max_abs),
           "l2": finite(a.l2), "relative_l2": finite(a.relative_l2)}
          for a in result.arrays
      ],
  }


def _array_names(manifest: manifest_lib.Manifest) -> dict[str, int]:
  """Stable names of a checkpoint's arrays: label (+ index) or tree path."""
  counts: dict[str, int] = {}
  names = {}
  for index, spec in enumerate(manifest.arrays):
    if spec.label is None:
      name = spec.path
    else:
      position = counts.get(spec.label, 0)
      counts[spec.label] = position + 1
      name = spec.label if position == 0 else f"{spec.label}[{position}]"
    names[name] = index
  return names


def _shape_text(spec: arrays_lib.ArraySpec) -> str:
  return f"{spec.dtype}[{','.join(map(str, spec.shape))}]"


class _StructureDiff:
  """Walks two manifests' trees side by side, naming each difference by its
  Python-like path (``tree.body.sublayers[2]``) and not descending further
  into a branch once it differs."""

  def __init__(self, a: manifest_lib.Manifest, b: manifest_lib.Manifest, limit: int):
    self._manifests = (a, b)
    self._limit = limit
    self.found: list[str] = []

  def _describe(self, node: Any, side: int) -> str:
    if not isinstance(node, dict):
      return json.dumps(node)[:60]
    tag = node.get("t")
    if nodes.names_class(tag):
      name = str(_dict(node.get("class")).get("qualname", "?"))
      return f"{name}.{node.get('name')}" if tag == "enum" else name
    if tag == "function":
      ref = _dict(node.get("ref"))
      return f"{ref.get('module')}.{ref.get('qualname')}"
    if tag == "mesh" and nodes.is_pairs(node.get("axes")):
      return "mesh(" + ", ".join(f"{name}={size}" for name, size in node["axes"]) + ")"
    if tag == "partition_spec":
      return f"PartitionSpec{json.dumps(node.get('spec'))[:60]}"
    if tag == "array":
      spec = _entry(self._manifests[side].arrays, node.get("ref"))
      return _shape_text(spec) if spec is not None else "invalid array reference"
    if "v" in node:
      return json.dumps(node["v"])[:60]
    if isinstance(node.get("items"), list):
      values = [item.get("v") for item in node["items"] if isinstance(item, dict) and "v" in item]
      shown = json.dumps(values)
      if len(values) == len(node["items"]) and len(shown) <= 60:
        return f"{tag} {shown}"  # A short list of plain values: show them.
      return f"{tag} of {len(node['items'])}"
    return str(tag)

  def _differ(self, a: Any, b: Any, path: str) -> None:
    if len(self.found) < self._limit:
      self.found.append(f"{path}: {self._describe(a, 0)} != {self._describe(b, 1)}")

  def compare(self, a: Any, b: Any, path: str) -> None:
    """Records where ``a`` and ``b`` differ. The manifests' JSON is
    unchecked (only decoding checks it), so anything malformed is compared
    as a plain value."""
    if len(self.found) >= self._limit:
      return
    if _tag(a) == _tag(b) == "variable":  # Compare the referenced entries.
      entries = [_entry(m.variables, n.get("ref")) for m, n in zip(self._manifests, (a, b))]
      if None not in entries:
        a, b = entries
    if not isinstance(a, dict) or not isinstance(b, dict):
      if a != b:
        self._differ(a, b, path)
      return
    if (_tag(a) == _tag(b) and nodes.keyed_items(_tag(a))
        and isinstance(a.get("items"), list) and isinstance(b.get("items"), list)
        and all(map(_is_pair, [*a["items"], *b["items"]]))):
      self._compare_keys(a, b, path)  # Entries by key, whatever their number.
      return
    if _tag(a) != _tag(b) or self._describe(a, 0) != self._describe(b, 1):
      self._differ(a, b, path)  # Different class, value, shape or length.
      return
    if "fields" in a and _pairs(a["fields"]) is not None and _pairs(b.get("fields")) is not None:
      self._compare_fields(a, b, path)
    elif isinstance(a.get("items"), list) and isinstance(b.get("items"), list):
      self._compare_items(a, b, path)
    else:  # Axes, labels, metadata, values: compare what remains, key by key.
      for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
          self.compare(x, y, f"{path}.{key}")
        elif key not in ("t", "ref") and x != y:
          self._differ(a, b, path)
          return

  def _compare_fields(self, a: dict[str, Any], b: dict[str, Any], path: str) -> None:
    fields_a, fields_b = (_pairs(node["fields"]) or {} for node in (a, b))  # Checked by compare.
    for name in dict.fromkeys([*fields_a, *fields_b]):
      if name not in fields_a or name not in fields_b:
        self.found.append(f"{path}.{name}: only in {'A' if name in fields_a else 'B'}")
      else:
        self.compare(fields_a[name], fields_b[name], f"{path}.{name}")

  def _compare_keys(self, a: dict[str, Any], b: dict[str, Any], path: str) -> None:
    """A dict's entries matched by key: each key only one side has is named,
    the values of the others compared (a configuration saved as a dict
    shows which settings differ, not only that the dicts' sizes do)."""
    def keyed(node: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
      return {json.dumps(key, sort_keys=True): (key, value) for key, value in node["items"]}

    entries_a, entries_b = keyed(a), keyed(b)
    for key in dict.fromkeys([*entries_a, *entries_b]):
      if len(self.found) >= self._limit:
        return
      side = entries_a if key in entries_a else entries_b
      where = f"{path}[{self._describe(side[key][0], 0)}]"
      if key not in entries_a or key not in entries_b:
        self.found.append(f"{where}: only in {'A' if key in entries_a else 'B'}")
      else:
        self.compare(entries_a[key][1], entries_b[key][1], where)
    common = [key for key in entries_a if key in entries_b]
    if common != [key for key in entries_b if key in entries_a] and len(self.found) < self._limit:
      self.found.append(f"{path}: the same keys in another order")

  def _compare_items(self, a: dict[str, Any], b: dict[str, Any], path: str) -> None:
    keyed = nodes.keyed_items(_tag(a))
    for index, (x, y) in enumerate(zip(a["items"], b["items"])):
      if not keyed:
        self.compare(x, y, f"{path}[{index}]")
      elif not _is_pair(x) or not _is_pair(y):
        self.compare(x, y, f"{path} item {index}")
      elif x[0] != y[0]:
        self._differ(x[0], y[0], f"{path} key {index}")
      else:
        self.compare(x[1], y[1], f"{path}[{self._describe(x[0], 0)}]")


def _dict(value: Any) -> dict[str, Any]:
  return value if isinstance(value, dict) else {}


def _entry(entries: Sequence[Any], ref: Any) -> Any:
  """``entries[ref]`` if ``ref`` is a valid index, else None."""
  return entries[ref] if type(ref) is int and 0 <= ref < len(entries) else None


def _is_pair(value: Any) -> bool:
  return isinstance(value, list) and len(value) == 2


def _pairs(value: Any) -> dict[str, Any] | None:
  """A struct's ``fields`` as ``{name: node}``, or None if malformed."""
  if not isinstance(value, list) or not all(
      _is_pair(pair) and isinstance(pair[0], str) for pair in value
  ):
    return None
  return dict(map(tuple, value))


def _tag(node: Any) -> str | None:
  return node.get("t") if isinstance(node, dict) else None


def structure_differences(
    a: manifest_lib.Manifest, b: manifest_lib.Manifest, limit: int = 50
) -> list[str]:
  """Where two saved trees differ (classes, fields, labels, shapes), by path."""
  walker = _StructureDiff(a, b, limit)
  walker.compare(a.tree, b.tree, "tree")
  return walker.found


def _compare(name: str, a: Any, b: Any) -> ArrayDiff:
  if jax.dtypes.issubdtype(getattr(a, "dtype", None), jax.dtypes.prng_key):
    a, b = jax.random.key_data(a), jax.random.key_data(b)
  a, b = np.asarray(a), np.asarray(b)
  identical = a.tobytes() == b.tobytes()
  if identical or a.size == 0:
    return ArrayDiff(name, identical, 0.0, 0.0, 0.0)
  wide = np.complex128 if np.iscomplexobj(a) else np.float64
  difference = a.astype(wide) - b.astype(wide)
  l2 = float(np.linalg.norm(difference.ravel()))
  norm_b = float(np.linalg.norm(b.astype(wide).ravel()))
  return ArrayDiff(
      name,
      False,
      float(np.max(np.abs(difference))),
      l2,
      l2 / norm_b if norm_b else math.inf,
  )


def diff(
    path_a: epath.PathLike,
    path_b: epath.PathLike,
    *,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    progress: progress_lib.Progress = None,
) -> CheckpointDiff:
  """Compares checkpoints A and B, reading at most ``batch_bytes`` at a time.

  Example::

    result = pzp.diff("/tmp/run/100/params", "/tmp/run/200/params")
    for array in result.arrays:
      print(array.name, array.max_abs, array.relative_l2)

  Args:
    path_a: Checkpoint A (a checkpoint directory or its item directory).
    path_b: Checkpoint B.
    batch_bytes: Most array bytes read from each checkpoint at once.
    progress: None (default): a bar on stderr if it is a terminal or in a
      notebook; True: always; False: never; or a function called as
      ``progress(done, total)`` with bytes of A's arrays compared
      (`pz_persist.progress`).
  """
  # Each opened as every read is (`opening`): never a mix of two saves.
  return opening.read(path_a, lambda a: opening.read(
      path_b, lambda b: _diff(a, b, batch_bytes, progress)
  ))


def _diff(
    a: opening.OpenItem,
    b: opening.OpenItem,
    batch_bytes: int,
    progress: progress_lib.Progress,
) -> CheckpointDiff:
  """`diff` of two opened items."""
  items = [a.item, b.item]
  manifests = [a.manifest, b.manifest]
  snapshots = [a.snapshot, b.snapshot]
  result = CheckpointDiff()
  result.structure = structure_differences(a.manifest, b.manifest)
  names_a, names_b = (_array_names(m) for m in manifests)
  result.only_in_a = [n for n in names_a if n not in names_b]
  result.only_in_b = [n for n in names_b if n not in names_a]
  common = []
  for name in (n for n in names_a if n in names_b):
    spec_a = manifests[0].arrays[names_a[name]]
    spec_b = manifests[1].arrays[names_b[name]]
    if (spec_a.shape, spec_a.dtype) != (spec_b.shape, spec_b.dtype):
      result.changed.append(f"{name}: {_shape_text(spec_a)} != {_shape_text(spec_b)}")
    else:
      common.append(name)

  sizes = {n: manifests[0].arrays[names_a[n]].nbytes for n in common}
  description = f"comparing {items[0]} with {items[1]}"
  with progress_lib.tracking(progress, description, sum(sizes.values())) as tracker:
    for batch in batching.batches(common, sizes.__getitem__, batch_bytes):
      values = [
          reader.read_arrays(item, manifest, refs={names[n] for n in batch},
                             snapshot=snapshot)
          for item, manifest, names, snapshot in zip(
              items, manifests, (names_a, names_b), snapshots)
      ]
      result.arrays.extend(
          _compare(n, values[0][names_a[n]], values[1][names_b[n]]) for n in batch
      )
      del values
      tracker.advance(sum(sizes[n] for n in batch))
  return result
