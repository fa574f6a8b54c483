"""Comparing two models or checkpoints: structure, labels, shapes, and array values.

Each side is a model in memory, a checkpoint path or an opened handle
(`pz_persist.tools.diff_sides`); the two trees are matched as a person means
it (`pz_persist.tools.diff_tree`: wrappers added, blocks cut, classes
replaced, labels, metadata and axis names), and the result renders as one
treescope tree, an HTML file or a terminal table
(`pz_persist.tools.diff_view`). The tree is the one model of a diff: the
flat fields of `CheckpointDiff` (``structure``, ``only_in_a``, ``arrays``...)
are views read from it. Two large checkpoints must never sit in
memory together, so arrays are read in batches of bounded size from each
side (Orbax reads only the requested arrays), compared in bounded pieces,
and dropped before the next batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import numpy.typing as npt
from etils import epath

from pz_persist import progress as progress_lib
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.storage import destinations
from pz_persist.storage import stores
from pz_persist.storage.reading import batching
from pz_persist.storage.reading import opening
from pz_persist.tools import diff_sides
from pz_persist.tools import diff_tree
from pz_persist.tools import diff_view

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


STRUCTURE_LINES = 50
"""Most lines `CheckpointDiff.structure` lists (the tree holds every change)."""


@dataclasses.dataclass(frozen=True)
class ArrayTable:
  """One side's arrays by manifest index: the name `pz_persist.diff` lists
  each under (its label, or its tree path) and its spec."""

  names: Mapping[int, str]
  specs: Sequence[arrays_lib.ArraySpec]

  @classmethod
  def of(cls, manifest: manifest_lib.Manifest) -> ArrayTable:
    return cls(diff_tree.array_names(manifest), manifest.arrays)

  def by_name(self) -> dict[str, arrays_lib.ArraySpec]:
    return {name: self.specs[index] for index, name in self.names.items()}


@dataclasses.dataclass
class CheckpointDiff:
  """Everything that differs between A and B (models or checkpoints).

  One model of the diff: `tree`, the tree of differences. The flat fields
  scripts read (``structure``, ``only_in_a``, ``only_in_b``, ``changed``,
  ``arrays``) are views derived from it and from the two sides' array
  tables, computed when read, never kept beside it.

  Renders in treescope by itself (in a notebook, or with
  ``treescope.display``) as one tree: unchanged parts folded, changed arrays
  highlighted with their statistics, added, removed and replaced structure
  marked in colour and words. `to_html` / `save_html` write the same tree as
  a self-contained HTML file, `table` as text for a terminal.

  Attributes:
    tree: The tree of differences (`pz_persist.tools.diff_tree.DiffNode`).
    a: How A is named (its path, or its class).
    b: How B is named.
    tables: A's and B's arrays (names and specs by manifest index).
    sources: The checkpoints compared (paths, or `pz_persist.open` handles;
      not models): `save_html` never writes over, inside or around them.
  """

  tree: diff_tree.DiffNode | None = None
  a: str = "A"
  b: str = "B"
  tables: tuple[ArrayTable, ArrayTable] | None = dataclasses.field(default=None, repr=False)
  sources: tuple[epath.Path, ...] = dataclasses.field(default=(), repr=False, compare=False)

  @property
  def structure(self) -> list[str]:
    """Where the saved structures differ, by tree path, as text (at most
    `STRUCTURE_LINES`; `changes` has every node)."""
    if self.tree is None:
      return []
    return diff_tree.structure_lines(self.tree)[:STRUCTURE_LINES]

  @property
  def only_in_a(self) -> list[str]:
    """Array names (labels, or tree paths) only A has."""
    return self._only_in(0)

  @property
  def only_in_b(self) -> list[str]:
    """Array names only B has."""
    return self._only_in(1)

  def _only_in(self, side: int) -> list[str]:
    if self.tables is None:
      return []
    other = set(self.tables[1 - side].names.values())
    return [name for name in self.tables[side].names.values() if name not in other]

  @property
  def changed(self) -> list[str]:
    """Arrays of both (by name) whose shape or dtype differs, as text."""
    if self.tables is None:
      return []
    specs_a, specs_b = (table.by_name() for table in self.tables)
    return [f"{name}: {_shape_text(spec)} != {_shape_text(specs_b[name])}"
            for name, spec in specs_a.items() if name in specs_b
            and (spec.shape, spec.dtype) != (specs_b[name].shape, specs_b[name].dtype)]

  @property
  def arrays(self) -> list[ArrayDiff]:
    """The arrays of both compared by value (one per pair of arrays, of one
    dtype), from the tree's leaves in their order."""
    if self.tree is None or self.tables is None:
      return []
    found: dict[tuple[int, int], ArrayDiff] = {}
    names_a, names_b = (table.names for table in self.tables)
    for node in self.tree.walk():
      ref_a, ref_b = node.refs
      if node.stats is None or ref_a is None or ref_b is None or (ref_a, ref_b) in found:
        continue
      if self.tables[0].specs[ref_a].dtype != self.tables[1].specs[ref_b].dtype:
        continue
      name = names_a[ref_a]
      if names_b[ref_b] != name:
        name = f"{name} -> {names_b[ref_b]}"
      s = node.stats
      found[ref_a, ref_b] = ArrayDiff(
          name, s.identical, s.max_abs, s.l2, s.relative_l2, s.fraction_changed)
    return list(found.values())

  @property
  def identical(self) -> bool:
    """No difference of any kind: the tree's verdict (a change of structure
    or of an array's values marks the root changed), and no array name only
    one side has."""
    tree_unchanged = self.tree is None or self.tree.status == "unchanged"
    return tree_unchanged and not (self.only_in_a or self.only_in_b or self.changed)

  def changes(self) -> list[diff_tree.DiffNode]:
    """Every node of `tree` that is not unchanged, parents first."""
    return [] if self.tree is None else [
        n for n in self.tree.walk() if n.status != "unchanged"]

  def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
    return diff_view.treescope_repr(self, path, subtree_renderer)

  def to_html(self) -> str:
    """The diff as one self-contained HTML page (nothing fetched)."""
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


def _shape_text(spec: arrays_lib.ArraySpec) -> str:
  return f"{spec.dtype}[{','.join(map(str, spec.shape))}]"


def structure_differences(a: manifest_lib.Manifest, b: manifest_lib.Manifest,
                          limit: int = STRUCTURE_LINES) -> list[str]:
  """Where two saved trees differ (classes, fields, labels, shapes), by path:
  `diff_tree.structure_lines` of their diff tree (no array is read)."""
  tables = ArrayTable.of(a), ArrayTable.of(b)
  tree = diff_tree.Matcher(a, b, (tables[0].names, tables[1].names)).build()
  tree.settle()
  return diff_tree.structure_lines(tree)[:limit]


COMPARE_ELEMENTS = 1 << 20
"""Elements compared at once within one array: the float64 differences of a
piece, not of the whole array, are all a comparison holds."""


def compare_values(a: npt.ArrayLike, b: npt.ArrayLike) -> diff_tree.ArrayStats:
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


def _host(value: np.ndarray | jax.Array) -> np.ndarray:
  if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key):
    value = jax.random.key_data(value)
  return np.asarray(value)


def diff(
    a: object,
    b: object,
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
  tables = ArrayTable.of(a.manifest), ArrayTable.of(b.manifest)
  tree = diff_tree.Matcher(a.manifest, b.manifest, (tables[0].names, tables[1].names)).build()
  result = CheckpointDiff(tree=tree, a=a.description, b=b.description, tables=tables)
  leaves: dict[tuple[int, int], list[diff_tree.DiffNode]] = {}
  for node in tree.walk():
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
      del values_a, values_b
      tracker.advance(sum(sizes[pair] for pair in batch))
  tree.settle()
  return result
