"""Looking at checkpoints and models: treescope HTML files and plain tables.

Treescope is how Penzai users look at models; `render_html` writes its
interactive rendering to a standalone HTML file, for checking a model or a
checkpoint outside a notebook (in a browser, or attached to a report).
`format_table` is the plain-text view the command line prints.
"""

from __future__ import annotations

import functools
import html
import os
import re
import shutil
from typing import Any

import treescope
from etils import epath

from pz_persist import checkpoint
from pz_persist.format import manifest_queries
from pz_persist.safety import terminal
from pz_persist.storage import opening


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
    obj_or_path: A Python object (model, tree) or a checkpoint path (a
      ``pathlib.Path`` / ``epath.Path``, or a string naming a directory).
    out: The HTML file to write.
    arrays: For a checkpoint path: load the arrays, so the view shows their
      summaries (mean, spread, range). With False only the manifest is read
      and arrays show as shapes and dtypes.
    compress: Compress the embedded rendering (smaller file for big models;
      by default the file stays searchable text).

  Returns:
    The path written.
  """
  value, title = obj_or_path, type(obj_or_path).__name__
  if _is_path(obj_or_path):
    value = (checkpoint.load if arrays else checkpoint.inspect)(obj_or_path)
    title = os.fspath(obj_or_path)
  body = treescope.render_to_html(value, roundtrip_mode=False, compressed=compress)
  written = epath.Path(out)
  written.parent.mkdir(parents=True, exist_ok=True)
  written.write_text(
      "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
      f"<title>{html.escape(title)} - pz_persist</title></head>\n"
      f"<body>\n{body}\n</body></html>\n",
      encoding="utf-8",
  )
  return written


def _is_path(obj: Any) -> bool:
  if isinstance(obj, os.PathLike):
    return True
  return isinstance(obj, str) and epath.Path(obj).is_dir()


def format_table(
    header: list[str],
    rows: list[list[str]],
    *,
    right: tuple[str, ...] = (),
    width: int | None = None,
    shrink: tuple[str, ...] = (),
) -> str:
  """Columns separated by two spaces; those named in ``right`` right-aligned.

  With ``width``, the columns named in ``shrink`` are cut in the middle with
  "…", in that order (the first as far as needed, down to 12 characters,
  then the next), until the table fits: a label's start and end say more
  than its middle.
  """
  cells = [[str(cell) for cell in row] for row in [header, *rows]]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  for name in shrink if width is not None else ():
    excess = sum(widths) + 2 * (len(widths) - 1) - (width or 0)  # Not None here.
    column = header.index(name)
    target = max(12, widths[column] - excess)
    if excess <= 0 or target >= widths[column]:
      continue
    widths[column] = target
    for row in cells[1:]:
      row[column] = _middle_cut(row[column], target)
  lines = []
  for row in cells:
    padded = [
        cell.rjust(w) if name in right else cell.ljust(w)
        for name, cell, w in zip(header, row, widths)
    ]
    lines.append("  ".join(padded).rstrip())
  return "\n".join(lines)


def _middle_cut(text: str, width: int) -> str:
  if len(text) <= width:
    return text
  head = (width - 1) // 2
  return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def _count(n: int, noun: str) -> str:
  return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def describe_checkpoint(path: epath.PathLike, *, width: int | None = None) -> str:
  """What a checkpoint holds, as text: a header, its variables, its constants.

  The header says what was saved (a model's class, or a tree) and how many
  parameters and state variables; the table lists every variable's array
  (label, axes, shape, dtype, bytes); the small arrays layers hold themselves
  (``RMSStandardize.epsilon``...) follow, grouped by field name, since a deep
  model holds hundreds of them under long tree paths. Everything shown is cut
  to ``width`` columns (the terminal's, by default) and is printable: values
  from the checkpoint are escaped (`pz_persist.safety.terminal`).
  """
  if width is None:
    width = shutil.get_terminal_size(fallback=(120, 24)).columns
  opened = opening.read(path, lambda opened: opened)  # The manifest only.
  item, manifest = opened.item, opened.manifest
  one_line = functools.partial(terminal.printable, newlines=False)
  rows = manifest_queries.array_rows(manifest)
  held = manifest_queries.variables(manifest, where=str(item))
  parameters = sum(v.kind == "parameter" for v in held)
  total = sum(row.spec.nbytes for row in rows)
  root = manifest.tree
  kind = "tree"
  if root.get("t") == "struct" and isinstance(root.get("class"), dict):
    kind = f"model {root['class'].get('module')}.{root['class'].get('qualname')}"
  mutable = " (mutable)" if manifest.variables else ""
  lines = [
      one_line(item),
      f"  {one_line(kind)}",
      f"  {_count(parameters, 'parameter')},"
      f" {_count(len(held) - parameters, 'state variable')}{mutable}:"
      f" {terminal.size_text(total)} in {_count(len(rows), 'array')}",
      f"  written by {one_line(manifest.writer)} (format {manifest.format_version})",
  ]
  variable_rows = [row for row in rows if row.spec.label is not None]
  if variable_rows:
    lines += ["", format_table(
        ["label", "axes", "shape", "dtype", "bytes"],
        [
            [one_line(row.label), one_line(row.axes_text), _shape_text(row.spec.shape),
             row.spec.dtype, terminal.size_text(row.spec.nbytes)]
            for row in variable_rows
        ],
        right=("bytes",), width=width, shrink=("axes", "label"),
    )]
  constants = _constant_groups([row for row in rows if row.spec.label is None])
  if constants:
    count = sum(group[3] for group in constants)
    nbytes = sum(group[4] for group in constants)
    lines += [
        "",
        f"{_count(count, 'constant')} held by layers ({terminal.size_text(nbytes)}):",
        format_table(
            ["field", "shape", "dtype", "count", "bytes"],
            [[one_line(name), shape, dtype, str(n), terminal.size_text(b)]
             for name, shape, dtype, n, b in constants],
            right=("count", "bytes"), width=width, shrink=("field",),
        ),
    ]
  return "\n".join(lines)


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
    last = _LAST_NAME.search(str(row.spec.path))
    name = (last[1] or last[2].strip("'\"")) if last else str(row.spec.path)
    key = (name, _shape_text(row.spec.shape), row.spec.dtype)
    groups.setdefault(key, [0, 0])
    groups[key][0] += 1
    groups[key][1] += row.spec.nbytes
  return [(*key, n, b) for key, (n, b) in groups.items()]
