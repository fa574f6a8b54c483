"""Looking at checkpoints and models: treescope HTML files and plain tables.

Treescope is how Penzai users look at models; `render_html` writes its
interactive rendering to a standalone HTML file, for checking a model or a
checkpoint outside a notebook (in a browser, or attached to a report).
`format_table` is the plain-text view the command line prints.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import os
import re
import shutil
from typing import Any

import treescope
from etils import epath

from pz_persist import checkpoint
from pz_persist import errors
from pz_persist.format import folding
from pz_persist.format import manifest_queries
from pz_persist.format import nodes
from pz_persist.safety import terminal
from pz_persist.storage import destinations
from pz_persist.storage import stores
from pz_persist.storage.reading import opening


def render_html(
    obj_or_path: Any,
    out: str | os.PathLike[str],
    *,
    arrays: bool = True,
    compress: bool = False,
) -> epath.Path:
  """Writes a standalone treescope HTML view of a model, tree or checkpoint.

  Example::

    pzp.render_html(model, "/tmp/model.html")
    pzp.render_html("/tmp/mlp_lora", "/tmp/checkpoint.html", arrays=False)

  Args:
    obj_or_path: A Python object (model, tree), a checkpoint path (a
      ``pathlib.Path`` / ``epath.Path``, or a string naming a directory), or
      a `pz_persist.open` handle (read as its path would be).
    out: The HTML file to write: never over, inside or around the checkpoint
      read, nor inside any checkpoint (the destination rule,
      `pz_persist.storage.destinations.write_output`; refused with
      `pz_persist.errors.ArgumentError` before anything is read).
    arrays: For a checkpoint path: load the arrays, so the view shows their
      summaries (mean, spread, range). With False only the manifest is read
      and arrays show as shapes and dtypes.
    compress: Compress the embedded rendering (smaller file for big models;
      by default the file stays searchable text).

  Parts nested deeper than `pz_persist.format.folding.NESTED_LEVELS` levels
  are shown as one folded list of lines keyed by path, so a tree of any
  depth renders without raising the recursion limit.

  Returns:
    The path written.
  """
  value, title = obj_or_path, type(obj_or_path).__name__
  sources = [obj_or_path] if _is_path(obj_or_path) else []
  destinations.check_output(out, sources, file=True)  # Before the (long) load.
  if sources:
    value = (checkpoint.load if arrays else checkpoint.inspect)(obj_or_path)
    title = os.fspath(opening.checkpoint_path(obj_or_path) or title)
  body = _render_deep(value, compress)
  return destinations.write_output(
      out,
      "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
      f"<title>{html.escape(title)} - pz_persist</title></head>\n"
      f"<body>\n{body}\n</body></html>\n",
      sources,
  )


def _render_deep(value: Any, compress: bool) -> str:
  """Treescope's HTML of ``value``, its parts nested deeper than
  `pz_persist.format.folding.NESTED_LEVELS` listed by path
  (`pz_persist.format.folding.fold`): any tree renders within Python's
  recursion limit as it is, which is left alone."""
  try:
    return treescope.render_to_html(folding.fold(value), roundtrip_mode=False,
                                    compressed=compress)
  except RecursionError:  # A value folding does not reach into (its own __treescope_repr__).
    raise errors.ArgumentError(
        f"cannot render this {type(value).__name__}: a part of it that is not a"
        " container, dataclass or variable nests deeper than treescope can render"
        " within Python's recursion limit; render a part of it."
    ) from None


def _is_path(obj: Any) -> bool:
  """Whether `render_html` reads ``obj`` as a checkpoint: a path object, a
  string naming a folder, or an opened handle."""
  if isinstance(obj, os.PathLike) or opening.opened_handle(obj) is not None:
    return True
  if not isinstance(obj, str) or "\0" in obj:  # Text to show, not a path.
    return False
  return epath.Path(stores.local_path(obj)).is_dir()


def format_table(
    header: list[str],
    rows: list[list[str]],
    *,
    right: tuple[str, ...] = (),
    width: int | None = None,
    wrap: tuple[str, ...] = (),
) -> str:
  """Columns separated by two spaces; those named in ``right`` right-aligned.

  With ``width``, the columns named in ``wrap`` are narrowed until the table
  fits, and their cells continue on the next lines (indented), broken after a ``/``,
  a space, ``.`` or ``]`` (before a ``[``): nothing is cut, so no two rows of
  different labels can look alike, and an axis name is never split unless it
  alone is wider than the space left.
  """
  cells = [[str(cell) for cell in row] for row in [header, *rows]]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  if width is not None:
    _narrow(widths, [header.index(name) for name in wrap if name in header], cells, width)
  lines = []
  for row in cells:
    wrapped = [_wrap(cell, w) for cell, w in zip(row, widths)]
    for line in range(max(map(len, wrapped))):
      padded = [
          (parts[line] if line < len(parts) else "").rjust(w) if name in right
          else (parts[line] if line < len(parts) else "").ljust(w)
          for name, parts, w in zip(header, wrapped, widths)
      ]
      lines.append("  ".join(padded).rstrip())
  return "\n".join(lines)


_BREAKS = (re.compile(r"(?<=[/ ])|(?=\[)"), re.compile(r"(?<=[.\]])"))
"""Where a wrapped cell may continue on the next line: best after a ``/`` or
a space or before a ``[``; in a piece still too wide, after a ``.`` or ``]``."""


def _pieces(text: str, width: int | None = None) -> list[str]:
  """``text`` split at the first kind of `_BREAKS`; pieces wider than
  ``width`` split again at the second."""
  pieces = [piece for piece in _BREAKS[0].split(text) if piece]
  return [
      part for piece in pieces
      for part in ([piece] if width is None or len(piece.rstrip()) <= width
                   else [p for p in _BREAKS[1].split(piece) if p])
  ]


def _narrow(widths: list[int], columns: list[int], cells: list[list[str]], width: int) -> None:
  """Narrows ``columns`` (in place) until the table fits ``width``.

  The first two share the room left so that the table has the fewest lines
  (the others keep their widths while that is enough); no column narrower
  than its longest unbreakable piece (and the indent of continuation lines)
  while another way fits, nor than 8.
  """
  def excess() -> int:
    return sum(widths) + 2 * (len(widths) - 1) - width

  if excess() <= 0 or not columns:
    return
  floors = {
      column: len(_INDENT) + max(
          len(piece.rstrip()) for row in cells for piece in _pieces(row[column], 1)
      )
      for column in columns
  }
  pair = columns[:2]
  room = widths[pair[0]] + (widths[pair[1]] if len(pair) > 1 else 0) - excess()
  if len(pair) == 2 and room >= floors[pair[0]] + floors[pair[1]]:
    body = cells[1::max(1, len(cells) // 1000)]  # A sample of a long table.
    def lines(column: int, w: int) -> list[int]:
      return [len(_wrap(row[column], w)) for row in body]
    first_range = range(floors[pair[0]], min(widths[pair[0]], room - floors[pair[1]]) + 1)
    second_lines = {w: lines(pair[1], w) for w in
                    range(max(floors[pair[1]], room - first_range[-1]), room - first_range[0] + 1)}
    best = min(
        first_range,
        key=lambda w: (sum(map(max, lines(pair[0], w), second_lines[room - w])), -w),
    )
    widths[pair[0]], widths[pair[1]] = best, room - best
    return
  if len(pair) == 1 and room >= floors[pair[0]]:
    widths[pair[0]] = room
    return
  for floor in (lambda c: floors[c], lambda c: 8):
    while excess() > 0:
      shrinkable = [c for c in columns if widths[c] > max(floor(c), 1)]
      if not shrinkable:
        break
      widest = max(shrinkable, key=lambda c: widths[c] - floor(c))
      widths[widest] -= 1


_INDENT = "  "
"""Before each continuation line of a wrapped cell: it belongs to the row above."""


@functools.lru_cache(maxsize=2**16)  # Tables repeat cells (axes), and
def _wrap(text: str, width: int) -> tuple[str, ...]:  # `_narrow` tries widths.
  """``text`` in lines of at most ``width`` characters, broken between
  `_pieces` (a piece wider than ``width`` is split where it must be); lines
  after the first are indented by `_INDENT`."""
  if len(text) <= width:
    return (text,)
  lines = [""]
  for piece in _pieces(text, width - len(_INDENT)):
    if len(lines[-1]) + len(piece.rstrip()) > width and lines[-1].strip():
      lines[-1] = lines[-1].rstrip()
      lines.append(_INDENT)
    while len(lines[-1]) + len(piece.rstrip()) > width:
      room = max(1, width - len(lines[-1]))
      lines[-1] += piece[:room]
      piece = piece[room:]
      lines.append(_INDENT)
    lines[-1] += piece
  return tuple(line.rstrip() for line in lines)


def _count(n: int, noun: str) -> str:
  return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


@dataclasses.dataclass(frozen=True)
class _Row:
  """One array of the table: its name (label, or tree path), the part of
  its tree path that tells it from other arrays of the same label ("" if the
  label is its own), and what the manifest says of it."""

  name: str
  where: str
  row: manifest_queries.ArrayRow


def _checkpoint_rows(opened: opening.OpenItem) -> tuple[str, list[_Row], list[_Row]]:
  """What kind of tree a checkpoint holds, the rows of its table of arrays
  and the rows of its constants (arrays layers of a model hold outside
  variables; a plain tree has none: all its arrays are in the table)."""
  manifest = opened.manifest
  root = manifest.tree
  kind = "tree"
  if root.get("t") == "struct" and isinstance(root.get("class"), dict):
    kind = f"model {root['class'].get('module')}.{root['class'].get('qualname')}"
  rows = manifest_queries.array_rows(manifest)
  is_model = kind != "tree"
  table = [row for row in rows if row.spec.label is not None or not is_model]
  constants = [row for row in rows if row.spec.label is None and is_model]
  names = [
      nodes.describe_label(row.spec.label) if row.spec.label is not None
      else _short_path(str(row.spec.path))
      for row in table
  ]
  wheres = [""] * len(table)
  by_name: dict[str, list[int]] = {}
  for index, name in enumerate(names):
    by_name.setdefault(name, []).append(index)
  for indices in by_name.values():
    if len(indices) > 1:
      parts = _distinguishing([str(table[i].spec.path) for i in indices])
      for index, part in zip(indices, parts):
        wheres[index] = part
  return (
      kind,
      [_Row(name, where, row) for name, where, row in zip(names, wheres, table)],
      [_Row(_short_path(str(row.spec.path)), "", row) for row in constants],
  )


_PATH_PARTS = re.compile(r"\.[^.\[\]]+|\[[^\[\]]*\]|^[^.\[\]]+")
"""The parts of a tree path: ``tree``, ``.mu``, ``[0]``, ``['w']``."""

_WRAPPERS = (".data_array", ".value")
"""Trailing parts that only say "the data of" a NamedArray or variable."""


def _short_path(path: str) -> str:
  """A tree path without the parts that only unwrap a NamedArray or a
  variable's value: ``tree['a'].data_array`` is ``tree['a']``."""
  changed = True
  while changed:
    changed = False
    for suffix in _WRAPPERS:
      if path.endswith(suffix) and len(path) > len(suffix):
        path, changed = path[: -len(suffix)], True
  return path


def _distinguishing(paths: list[str]) -> list[str]:
  """For arrays sharing a label: the part of each tree path that differs
  from the others (``mu`` and ``nu`` of an Adam state), without the parts
  all of them share at the start and at the end."""
  split = [_PATH_PARTS.findall(path) for path in paths]
  shortest = min(map(len, split))
  start = 0
  while start < shortest and len({tuple(s[start:start + 1]) for s in split}) == 1:
    start += 1
  end = 0
  while end < shortest - start and len({s[len(s) - end - 1] for s in split}) == 1:
    end += 1
  return ["".join(s[start:len(s) - end]).lstrip(".") or path for s, path in zip(split, paths)]


def describe_checkpoint(path: epath.PathLike, *, width: int | None = None) -> str:
  """What a checkpoint holds, as text: a header, its variables, its constants.

  The header says what was saved (a model's class, or a tree) and how many
  parameters and state variables; the table lists every variable's array
  (label, axes, shape, dtype, bytes), and in a plain tree every other array
  by tree path; where a label names several arrays (an optimizer's ``mu``
  and ``nu``), the column ``in`` shows the part of the tree path that tells
  them apart. The small arrays a model's layers hold themselves
  (``RMSStandardize.epsilon``...) follow, grouped by field name, since a
  deep model holds hundreds of them under long tree paths. Everything fits
  ``width`` columns (the terminal's, by default): long labels and axes
  continue on the next line, never cut. Values from the checkpoint are
  escaped (`pz_persist.safety.terminal`).
  """
  if width is None:
    width = shutil.get_terminal_size(fallback=(120, 24)).columns
  opened = opening.read(path, lambda opened: opened)  # The manifest only.
  item, manifest = opened.item, opened.manifest
  one_line = functools.partial(terminal.printable, newlines=False)
  kind, table, constants = _checkpoint_rows(opened)
  held = manifest_queries.variables(manifest, where=str(item))
  parameters = sum(v.kind == "parameter" for v in held)
  every = [*table, *constants]
  total = sum(r.row.spec.nbytes for r in every)
  mutable = " (mutable)" if manifest.variables else ""
  lines = [
      one_line(item),
      f"  {one_line(kind)}",
      f"  {_count(parameters, 'parameter')},"
      f" {_count(len(held) - parameters, 'state variable')}{mutable}:"
      f" {terminal.size_text(total)} in {_count(len(every), 'array')}",
      f"  written by {one_line(manifest.writer)} (format {manifest.format_version})",
  ]
  if table:
    repeated = any(r.where for r in table)
    paths = any(r.row.spec.label is None for r in table)
    header = [*(["in"] if repeated else []), "label or path" if paths else "label",
              "axes", "shape", "dtype", "bytes"]
    lines += ["", format_table(
        header,
        [
            [*([one_line(r.where)] if repeated else []), one_line(r.name),
             one_line(r.row.axes_text), _shape_text(r.row.spec.shape),
             r.row.spec.dtype, terminal.size_text(r.row.spec.nbytes)]
            for r in table
        ],
        right=("bytes",), width=width, wrap=(header[-5], "axes", *header[:-5]),
    )]
  groups = _constant_groups([r.row for r in constants])
  if groups:
    count = sum(group[3] for group in groups)
    nbytes = sum(group[4] for group in groups)
    lines += [
        "",
        f"{_count(count, 'constant')} held by layers ({terminal.size_text(nbytes)}):",
        format_table(
            ["field", "shape", "dtype", "count", "bytes"],
            [[one_line(name), shape, dtype, str(n), terminal.size_text(b)]
             for name, shape, dtype, n, b in groups],
            right=("count", "bytes"), width=width, wrap=("field",),
        ),
    ]
  return "\n".join(lines)


JSON_SCHEMA_INSPECT = "pz-persist.inspect/1"
"""The ``schema`` of `checkpoint_record`'s output (docs/reference/cli-json.md)."""


def checkpoint_record(path: epath.PathLike) -> dict[str, Any]:
  """What `describe_checkpoint` shows, as JSON-ready data: one item of
  ``pz-persist inspect --json`` (see ``docs/reference/cli-json.md``)."""
  opened = opening.read(path, lambda opened: opened)  # The manifest only.
  item, manifest = opened.item, opened.manifest
  kind, table, constants = _checkpoint_rows(opened)
  held = manifest_queries.variables(manifest, where=str(item))
  root_class = manifest.tree.get("class") if kind != "tree" else None
  return {
      "path": str(item),
      "kind": "model" if kind != "tree" else "tree",
      "class": (f"{root_class.get('module')}.{root_class.get('qualname')}"
                if isinstance(root_class, dict) else None),
      "writer": manifest.writer,
      "format_version": manifest.format_version,
      "parameters": sum(v.kind == "parameter" for v in held),
      "state_variables": sum(v.kind != "parameter" for v in held),
      "mutable": bool(manifest.variables),
      "bytes": sum(r.row.spec.nbytes for r in [*table, *constants]),
      "arrays": [
          {
              "label": (nodes.describe_label(r.row.spec.label)
                        if r.row.spec.label is not None else None),
              "path": str(r.row.spec.path),
              "axes": [None if a is None else str(a) for a in r.row.axes],
              "shape": list(r.row.spec.shape),
              "dtype": r.row.spec.dtype,
              "bytes": r.row.spec.nbytes,
              "constant": constant,
          }
          for constant, rows in ((False, table), (True, constants)) for r in rows
      ],
  }


def _shape_text(shape: tuple[int, ...]) -> str:
  return "x".join(map(str, shape)) or "()"


_LAST_NAME = re.compile(r"(?:\.([^.\[\]]+)|\[([^\[\]]+)\])$")
"""The last attribute (``.epsilon``) or index (``['w']``) of a tree path."""


def _constant_groups(rows: list[manifest_queries.ArrayRow]) -> list[tuple[str, str, str, int, int]]:
  """``(field name, shape, dtype, count, bytes)`` of arrays outside variables,
  grouped by the last name of their tree path (``...sublayers[0].epsilon`` is
  ``epsilon``), in order of first appearance."""
  groups: dict[tuple[str, str, str], list[int]] = {}
  for row in rows:
    last = _LAST_NAME.search(_short_path(str(row.spec.path)))
    name = (last[1] or last[2].strip("'\"")) if last else str(row.spec.path)
    key = (name, _shape_text(row.spec.shape), row.spec.dtype)
    groups.setdefault(key, [0, 0])
    groups[key][0] += 1
    groups[key][1] += row.spec.nbytes
  return [(*key, n, b) for key, (n, b) in groups.items()]
