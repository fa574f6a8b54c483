"""Looking at checkpoints and models: treescope HTML files and plain tables.

Treescope is how Penzai users look at models; `render_html` writes its
interactive rendering to a standalone HTML file, for checking a model or a
checkpoint outside a notebook (in a browser, or attached to a report).
`format_table` is the plain-text view the command line prints.
"""

from __future__ import annotations

import html
import os
from typing import Any

import treescope
from etils import epath

from pz_persist import catalog
from pz_persist import checkpoint
from pz_persist import manifest as manifest_lib


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
  out = epath.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(
      "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
      f"<title>{html.escape(title)} - pz_persist</title></head>\n"
      f"<body>\n{body}\n</body></html>\n",
      encoding="utf-8",
  )
  return out


def _is_path(obj: Any) -> bool:
  if isinstance(obj, os.PathLike):
    return True
  return isinstance(obj, str) and epath.Path(obj).is_dir()


def size_text(nbytes: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if nbytes < 1024 or unit == "TiB":
      return f"{nbytes} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
    nbytes /= 1024
  raise AssertionError


def format_table(
    header: list[str], rows: list[list[str]], *, right: tuple[str, ...] = ()
) -> str:
  """Columns separated by two spaces; those named in ``right`` right-aligned."""
  widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
  lines = []
  for row in [header, *rows]:
    cells = [
        str(cell).rjust(width) if name in right else str(cell).ljust(width)
        for name, cell, width in zip(header, row, widths)
    ]
    lines.append("  ".join(cells).rstrip())
  return "\n".join(lines)


def describe_checkpoint(path: epath.PathLike) -> str:
  """A text table of a checkpoint's arrays: label, axes, shape, dtype, bytes."""
  item = checkpoint.find_item(path)
  manifest = manifest_lib.read(item)
  # Variables' arrays first, then those layers hold themselves (by tree path).
  rows = sorted(catalog.array_rows(manifest), key=lambda row: row.spec.label is None)
  total = sum(row.spec.nbytes for row in rows)
  root = manifest.tree
  kind = "tree"
  if root.get("t") == "struct" and isinstance(root.get("class"), dict):
    kind = f"model {root['class'].get('module')}.{root['class'].get('qualname')}"
  lines = [
      f"{item}",
      f"  {kind}; {len(manifest.variables)} mutable variable(s); written by"
      f" {manifest.writer} (format {manifest.format_version})",
      "",
      format_table(
          ["label", "axes", "shape", "dtype", "bytes"],
          [
              [row.label, row.axes_text, "x".join(map(str, row.spec.shape)) or "()",
               row.spec.dtype, size_text(row.spec.nbytes)]
              for row in rows
          ],
          right=("bytes",),
      ),
      "",
      f"{len(rows)} array(s), {size_text(total)}",
  ]
  return "\n".join(lines)
