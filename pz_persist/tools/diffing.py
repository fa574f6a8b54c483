"""Comparing two models or checkpoints: structure, labels, shapes, and array values.

Each side is a model in memory, a checkpoint path or an opened handle
(`pz_persist.tools.diff_sides`); the two trees are matched as a person means
it (`pz_persist.tools.diff_tree`: wrappers added, blocks cut, classes
replaced, labels, metadata and axis names), and the result renders as one
treescope tree, an HTML file or a terminal table
(`pz_persist.tools.diff_view`). Two large checkpoints must never sit in
memory together, so arrays are read in batches of bounded size from each
side (Orbax reads only the requested arrays), compared in bounded pieces,
and dropped before the next batch.
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
from pz_persist.storage import destinations
from pz_persist.storage import stores
from pz_persist.storage.reading import batching
from pz_persist.storage.reading import opening
from pz_persist.tools import diff_sides
from pz_persist.tools import diff_tree

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
    fraction_changed: Fraction of the elements whose values differ.
  """

  name: str
  identical: bool
  max_abs: float
  l2: float
  relative_l2: float
  fraction_changed: float = 0.0


@dataclasses.dataclass
class CheckpointDiff:
  """Everything that differs between A and B (models or checkpoints).

  Renders in treescope by itself (in a notebook, or with
  ``treescope.display``) as one tree: unchanged parts folded, changed arrays
  highlighted with their statistics, added, removed and replaced structure
  marked in colour and words. `to_html` / `save_html` write the same tree as
  a self-contained HTML file, `table` as text for a terminal.

  Attributes:
    only_in_a: Array names (labels, or tree paths) only A has.
    only_in_b: Array names only B has.
    changed: Arrays of both whose shape or dtype differs, as text.
    structure: Where the saved structures differ, by tree path, as text.
    arrays: The arrays of both compared by value.
    tree: The tree of differences (`pz_persist.tools.diff_tree.DiffNode`).
    a: How A is named (its path, or its class).
    b: How B is named.
    sources: The checkpoints compared (paths, or `pz_persist.open` handles;
      not models): `save_html` never writes over, inside or around them.
  """

  only_in_a: list[str] = dataclasses.field(default_factory=list)
  only_in_b: list[str] = dataclasses.field(default_factory=list)
  changed: list[str] = dataclasses.field(default_factory=list)
  structure: list[str] = dataclasses.field(default_factory=list)
  arrays: list[ArrayDiff] = dataclasses.field(default_factory=list)
  tree: diff_tree.DiffNode | None = dataclasses.field(default=None, repr=False)
  a: str = "A"
  b: str = "B"
  sources: tuple[Any, ...] = dataclasses.field(default=(), repr=False, compare=False)

  @property
  def identical(self) -> bool:
    return not (
        self.only_in_a or self.only_in_b or self.changed or self.structure
        or any(not a.identical for a in self.arrays)
        or (self.tree is not None and self.tree.status != "unchanged")
    )

  def changes(self) -> list[diff_tree.DiffNode]:
    """Every node of `tree` that is not unchanged, parents first."""
    return [] if self.tree is None else [
        n for n in self.tree.walk() if n.status != "unchanged"]

  def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
    from pz_persist.tools import diff_view  # pylint: disable=import-outside-toplevel
    return diff_view.treescope_repr(self, path, subtree_renderer)

  def to_html(self) -> str:
    """The diff as one self-contained HTML page (nothing fetched)."""
    from pz_persist.tools import diff_view  # pylint: disable=import-outside-toplevel
    return diff_view.to_html(self)

  def save_html(self, path: epath.PathLike) -> epath.Path:
    """Writes `to_html` to ``path``; returns the path written.

    Raises:
      ArgumentError: ``path`` is over, inside or around a checkpoint compared
        (or inside any checkpoint): the destination rule,
        `pz_persist.storage.destinations.write_output`. Nothing is written.
    """
    destinations.check_output(path, self.sources, file=True)  # Before rendering a large page.
    return destinations.write_output(path, self.to_html(), self.sources)

  def table(self, width: int | None = None, *, color: bool = False,
            every_array: bool = False) -> str:
    """The diff as text: one row per change, fitting ``width`` columns (the
    terminal's by default); ``every_array`` lists unchanged arrays too."""
    from pz_persist.tools import diff_view  # pylint: disable=import-outside-toplevel
    return diff_view.table(self, width=width, color=color, every_array=every_array)

  def __str__(self) -> str:
    return self.table(width=100)


JSON_SCHEMA = "pz-persist.diff/1"
"""The ``schema`` of `record`'s output (docs/reference/cli-json.md). Fields
are only added within a version (``changes`` and ``fraction_changed`` were);
none is removed or changes meaning."""


def record(result: CheckpointDiff) -> dict[str, Any]:
  """``result`` as JSON-ready data (``pz-persist diff --json``); an infinite
  ``relative_l2`` (B's array is all zeros, A's is not) is ``null``."""
  finite = diff_tree.finite

  def stats(node: diff_tree.DiffNode) -> dict[str, Any] | None:
    if node.stats is None:
      return None
    s = node.stats
    return {"identical": s.identical, "max_abs": finite(s.max_abs), "l2": finite(s.l2),
            "relative_l2": finite(s.relative_l2), "fraction_changed": s.fraction_changed}

  return {
      "changes": [
          {"path": n.path, "status": n.status, "kind": n.kind, "summary": n.summary,
           "notes": list(n.notes), "stats": stats(n)}
          for n in result.changes()
      ],
      "identical": result.identical,
      "structure": list(result.structure),
      "only_in_a": list(result.only_in_a),
      "only_in_b": list(result.only_in_b),
      "changed": list(result.changed),
      "arrays": [
          {"name": a.name, "identical": a.identical, "max_abs": finite(a.max_abs),
           "l2": finite(a.l2), "relative_l2": finite(a.relative_l2),
           "fraction_changed": a.fraction_changed}
          for a in result.arrays
      ],
  }


def _array_names(manifest: manifest_lib.Manifest) -> dict[str, int]:
  """Stable names of a checkpoint's arrays: label (+ index) or tree path."""
  return {name: index for index, name in diff_tree.array_names(manifest).items()}


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
    sharding = diff_tree.sharding_text(node, 60)
    if sharding is not None:
      return sharding
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




COMPARE_ELEMENTS = 1 << 20
"""Elements compared at once within one array: the float64 differences of a
piece, not of the whole array, are all a comparison holds."""


def compare_values(a: Any, b: Any) -> diff_tree.ArrayStats:
  """How two host arrays of one shape differ, in bounded pieces."""
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype == b.dtype and a.tobytes() == b.tobytes():
    return diff_tree.ArrayStats(True)
  if a.size == 0:
    return diff_tree.ArrayStats(a.dtype == b.dtype)
  wide = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
  flat_a, flat_b = a.reshape(-1), b.reshape(-1)
  max_abs, squares, norm_b, changed = 0.0, 0.0, 0.0, 0
  for start in range(0, a.size, COMPARE_ELEMENTS):
    x = flat_a[start:start + COMPARE_ELEMENTS]
    y = flat_b[start:start + COMPARE_ELEMENTS]
    if x.dtype == y.dtype:
      differs = x != y
    else:
      differs = x.astype(wide) != y.astype(wide)
    if np.issubdtype(x.dtype, np.inexact) and np.issubdtype(y.dtype, np.inexact):
      differs &= ~(np.isnan(x) & np.isnan(y))
    changed += int(np.count_nonzero(differs))
    wide_x, wide_y = x.astype(wide), y.astype(wide)
    difference = np.abs(wide_x - wide_y)
    if np.issubdtype(x.dtype, np.inexact) or np.issubdtype(y.dtype, np.inexact):
      difference[np.isnan(wide_x) & np.isnan(wide_y)] = 0  # NaN on both sides: no change.
      wide_y = np.where(np.isnan(wide_y), 0, wide_y)
    max_abs = float(np.max([max_abs, np.max(difference)]))
    squares += float(np.sum(difference.real ** 2))
    norm_b += float(np.sum(np.abs(wide_y) ** 2))
  l2, norm = math.sqrt(squares), math.sqrt(norm_b)
  return diff_tree.ArrayStats(
      False, max_abs, l2, l2 / norm if norm else (0.0 if l2 == 0 else math.inf),
      changed / a.size,
  )


def _host(value: Any) -> Any:
  if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key):
    value = jax.random.key_data(value)
  return np.asarray(value)


def diff(
    a: Any,
    b: Any,
    *,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    progress: progress_lib.Progress = None,
) -> CheckpointDiff:
  """Compares A and B, each a model, a checkpoint path or an opened handle.

  The result renders in treescope as one tree of differences (in a
  notebook, by itself); ``result.save_html(path)`` writes it as a
  self-contained HTML file, ``result.table()`` as text.

  Example::

    result = pzp.diff("/tmp/run/100/params", "/tmp/run/200/params")
    for array in result.arrays:
      print(array.name, array.max_abs, array.relative_l2)
    pzp.diff(model, edited_model)         # in a notebook: the tree of changes

  Args:
    a: A: a Penzai model or any tree pz_persist can save, a checkpoint path
      (a checkpoint directory or its item directory), or an opened handle.
    b: B, the same.
    batch_bytes: Most array bytes read from each side at once.
    progress: None (default): a bar on stderr if it is a terminal or in a
      notebook; True: always; False: never; or a function called as
      ``progress(done, total)`` with bytes of A's arrays compared
      (`pz_persist.progress`).
  """
  # A path stays opened as every read opens one (`opening`): never a mix of
  # two saves.
  result = diff_sides.with_side(a, lambda side_a: diff_sides.with_side(
      b, lambda side_b: _diff(side_a, side_b, batch_bytes, progress), "B"
  ), "A")
  # Made absolute now: a later save_html (perhaps from another working
  # directory) compares its destination with the very checkpoints compared.
  result.sources = tuple(
      stores.normalise(path) for path in map(opening.checkpoint_path, (a, b)) if path is not None
  )
  return result


def _diff(
    a: diff_sides.Side,
    b: diff_sides.Side,
    batch_bytes: int,
    progress: progress_lib.Progress,
) -> CheckpointDiff:
  """`diff` of two opened sides."""
  manifests = [a.manifest, b.manifest]
  result = CheckpointDiff(a=a.description, b=b.description)
  result.structure = structure_differences(a.manifest, b.manifest)
  names_a, names_b = (_array_names(m) for m in manifests)
  result.only_in_a = [n for n in names_a if n not in names_b]
  result.only_in_b = [n for n in names_b if n not in names_a]
  for name in (n for n in names_a if n in names_b):
    spec_a = manifests[0].arrays[names_a[name]]
    spec_b = manifests[1].arrays[names_b[name]]
    if (spec_a.shape, spec_a.dtype) != (spec_b.shape, spec_b.dtype):
      result.changed.append(f"{name}: {_shape_text(spec_a)} != {_shape_text(spec_b)}")

  by_index = diff_tree.array_names(manifests[0]), diff_tree.array_names(manifests[1])
  result.tree = diff_tree.Matcher(a.manifest, b.manifest, by_index).build()
  leaves: dict[tuple[int, int], list[diff_tree.DiffNode]] = {}
  for node in result.tree.walk():
    ref_a, ref_b = node.refs
    if ref_a is not None and ref_b is not None and (
        manifests[0].arrays[ref_a].shape == manifests[1].arrays[ref_b].shape):
      leaves.setdefault((ref_a, ref_b), []).append(node)
  pairs = list(leaves)
  sizes = {pair: manifests[0].arrays[pair[0]].nbytes for pair in pairs}
  description = f"comparing {a.description} with {b.description}"
  with progress_lib.tracking(progress, description, sum(sizes.values())) as tracker:
    for batch in batching.batches(pairs, sizes.__getitem__, batch_bytes):
      values_a = a.read([pair[0] for pair in batch])
      values_b = b.read([pair[1] for pair in batch])
      for pair in batch:
        stats = compare_values(_host(values_a[pair[0]]), _host(values_b[pair[1]]))
        for node in leaves[pair]:
          node.stats = stats
        spec_a, spec_b = manifests[0].arrays[pair[0]], manifests[1].arrays[pair[1]]
        if spec_a.dtype == spec_b.dtype:
          name = by_index[0][pair[0]]
          if by_index[1][pair[1]] != name:
            name = f"{name} -> {by_index[1][pair[1]]}"
          result.arrays.append(ArrayDiff(
              name, stats.identical, stats.max_abs, stats.l2, stats.relative_l2,
              stats.fraction_changed))
      del values_a, values_b
      tracker.advance(sum(sizes[pair] for pair in batch))
  result.tree.settle()
  return result
