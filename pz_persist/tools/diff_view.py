"""Showing a diff: one treescope tree, a self-contained HTML page, a terminal table.

The tree is built from treescope's public rendering parts
(`treescope.rendering_parts`): unchanged subtrees are foldables that start
collapsed (one click opens them), changed ones start expanded; a changed
array's line is highlighted with its statistics; added, removed and replaced
structure is coloured *and* says so in a word (colour alone is not
enough). Every text taken from a checkpoint (labels, metadata, class names,
tree paths) goes through treescope's text parts, which escape it for HTML,
or through `pz_persist.safety.terminal` for the terminal: nothing a
checkpoint holds is ever run or trusted as markup.
"""

from __future__ import annotations

import html
import os
import shutil
import sys
from collections.abc import Sequence
from typing import Any
from typing import Protocol
from typing import TextIO

import treescope
from treescope import rendering_parts as parts

from pz_persist.format import folding
from pz_persist.safety import terminal
from pz_persist.tools import diff_table
from pz_persist.tools import diff_tree


class Compared(Protocol):
  """An array compared by value (`pz_persist.tools.diffing.ArrayDiff`)."""

  @property
  def identical(self) -> bool: ...


class Shown(Protocol):
  """What a view needs of a diff (`pz_persist.tools.diff_view.Shown`).

  Why a protocol: the result imports its views; were the views to import the
  result back, the two would be one import cycle.
  """

  @property
  def tree(self) -> diff_tree.DiffNode | None: ...

  @property
  def a(self) -> str: ...

  @property
  def b(self) -> str: ...

  @property
  def identical(self) -> bool: ...

  @property
  def arrays(self) -> Sequence[Compared]: ...

STYLES = {
    "changed": "background-color: #ffe08a; color: #5c3b00; border-radius: 3px; padding: 0 3px",
    "added": "background-color: #c9f2c7; color: #0b4d12; border-radius: 3px; padding: 0 3px",
    "removed": "background-color: #ffd0d0; color: #7a0b0b; border-radius: 3px; padding: 0 3px;"
               " text-decoration: line-through",
    "replaced": "background-color: #e4d4ff; color: #3d1a78; border-radius: 3px; padding: 0 3px",
    "note": "color: #8a4b00; font-style: italic",
    "unchanged": "color: #7a7a7a",
}
"""CSS of each mark (the HTML test reads the computed colours back)."""

ARRAY_HIGHLIGHT = STYLES["changed"]
"""The style of a changed array's line and statistics."""

_WORDS = {"added": "added", "removed": "removed", "replaced": "replaced",
          "changed": "changed", "unchanged": "unchanged"}

_ANSI = {"changed": "33", "added": "32", "removed": "31", "replaced": "35"}


def stats_text(stats: diff_tree.ArrayStats) -> str:
  """An array's statistics as one short text."""
  if stats.identical:
    return "identical values"
  return (f"max |A-B| {_number(stats.max_abs)}, |A-B|/|B| {_number(stats.relative_l2)},"
          f" {_percent(stats.fraction_changed)} of elements changed")


def _number(x: float) -> str:
  return f"{x:.3g}"


def _percent(x: float) -> str:
  if x in (0.0, 1.0):
    return f"{x:.0%}"
  return f"{x * 100:.3g}%"


def _styled(text: str, status: str) -> parts.RenderableTreePart:
  return parts.custom_style(parts.text(text), STYLES[status])


def _line(node: diff_tree.DiffNode, inherited: bool,
          key: str | None = None) -> parts.RenderableTreePart:
  """The first line of a node: key (``key`` if given), kind, status word,
  summary, notes, stats. Inside an added or removed subtree (``inherited``)
  only its root says so."""
  pieces: list[parts.RenderableTreePart | str] = []
  key = node.key if key is None else key
  if key:
    pieces.append(parts.text(f"{key}: "))
  if node.status in ("added", "removed", "replaced") and not inherited:
    pieces.append(_styled(f"{_WORDS[node.status]} ", node.status))
  colour = {"added": "; color: #0b6b17", "removed": "; color: #9a1111"}.get(node.status, "")
  pieces.append(parts.custom_style(parts.text(node.kind), "font-weight: bold" + colour))
  if node.summary:
    pieces.append(parts.text(f" {node.summary}"))
  if node.shared:
    pieces.append(parts.custom_style(
        parts.text(f"  (shared: the same variable as {node.shared})"), STYLES["unchanged"]))
  for note in node.notes:
    pieces.append(parts.text("  "))
    pieces.append(_styled(note, "note"))
  if node.stats is not None and not node.stats.identical:
    pieces.append(parts.text("  "))
    pieces.append(_styled(f"changed: {stats_text(node.stats)}", "changed"))
  elif node.status == "changed" and not node.children:
    pieces.append(parts.text("  "))
    pieces.append(_styled("changed", "changed"))
  elif node.status == "changed":
    pieces.append(parts.custom_style(parts.text("  changed inside"), STYLES["note"]))
  elif node.status == "unchanged" and node.children:
    pieces.append(parts.custom_style(parts.text("  unchanged"), STYLES["unchanged"]))
  return parts.siblings(*pieces)


NESTED_LEVELS = 24
"""Levels of the diff tree rendered nested; below, each subtree is one list
of lines keyed by their path from it. Treescope renders each nested level
with about ten Python frames, so a tree as deep as the format allows
(`pz_persist.format.nodes.MAX_DEPTH`) would pass the interpreter's recursion
limit; flattened (`pz_persist.format.folding.flattened`, as `render_html`
folds a model's deep parts), the rendering's depth is bounded whatever the tree."""


def _render(node: diff_tree.DiffNode, parent_status: str = "",
            level: int = 0) -> parts.RenderableAndLineAnnotations:
  """A node: one line, or a foldable whose children show only when it is
  expanded (folded, it reads ``{...}``: an unchanged block stays one short
  line until clicked)."""
  inherited = node.status in ("added", "removed") and parent_status in (node.status, "replaced")
  line = _line(node, inherited)
  if not node.children:
    return parts.build_one_line_tree_node(line)
  whole = node.status in ("added", "removed") and all(
      n.status == node.status for n in node.walk())  # Nothing inside to compare.
  expand = (parts.ExpandState.COLLAPSED if node.status == "unchanged" or whole
            else parts.ExpandState.EXPANDED)
  if level >= NESTED_LEVELS:
    children = _flattened(node)
  else:
    children = [_render(child, node.status, level + 1) for child in node.children]
  return parts.build_custom_foldable_tree_node(
      label=parts.siblings(line, " {"),
      contents=parts.siblings(
          parts.fold_condition(
              collapsed=parts.text("...}"),
              expanded=parts.siblings(parts.indented_children(children), "}"),
          ),
      ),
      expand_state=expand,
  )


def _flattened(root: diff_tree.DiffNode) -> list[parts.RenderableAndLineAnnotations]:
  """Every node below ``root`` as one line, keyed by its path from ``root``
  (``.sublayers[0].sublayers[0]: Linear ...``), parents first."""

  def line(key: str, node: diff_tree.DiffNode,
           parent: diff_tree.DiffNode) -> parts.RenderableAndLineAnnotations:
    inherited = node.status in ("added", "removed") and parent.status in (
        node.status, "replaced")
    return parts.build_one_line_tree_node(_line(node, inherited, key))

  return folding.flattened(root, lambda node: [(c.key, c) for c in node.children], line)


def top_changes(result: Shown) -> list[diff_tree.DiffNode]:
  """The changes of ``result`` worth a line each (`diff_tree.top_changes`)."""
  return [] if result.tree is None else diff_tree.top_changes(result.tree)


def _header(result: Shown) -> str:
  if result.identical:
    return f"no differences: {result.a} and {result.b} ({len(result.arrays)} arrays compared)"
  counts: dict[str, int] = {}
  for node in top_changes(result):
    counts[node.status] = counts.get(node.status, 0) + 1
  differing = sum(not a.identical for a in result.arrays)
  summary = [f"{differing} of {len(result.arrays)} compared arrays differ"]
  summary += [f"{counts[s]} {s}" for s in ("added", "removed", "replaced") if counts.get(s)]
  if counts.get("changed"):
    summary.append(f"{counts['changed']} changed")
  return f"A: {result.a}\nB: {result.b}\n" + ", ".join(summary)


def treescope_repr(result: Shown, path: str | None,
                   subtree_renderer: Any) -> Any:
  """The whole diff as one treescope tree (``CheckpointDiff.__treescope_repr__``)."""
  del subtree_renderer
  header = [parts.build_one_line_tree_node(parts.text(line))
            for line in _header(result).rstrip("; ").split("\n")]
  if result.tree is None:
    return parts.build_one_line_tree_node(parts.text(_header(result).replace("\n", "; ")),
                                          path=path)
  return parts.build_foldable_tree_node_from_children(
      prefix=parts.siblings(parts.custom_style(parts.text("pz_persist diff"),
                                               "font-weight: bold"), " "),
      children=[*header, _render(result.tree)],
      suffix="",
      path=path,
      expand_state=parts.ExpandState.EXPANDED,
  )


def to_html(result: Shown) -> str:
  """A self-contained page: treescope's inline scripts and styles, no network."""
  body = treescope.render_to_html(result, roundtrip_mode=False, compressed=False)
  title = html.escape(f"pz_persist diff: {result.a} vs {result.b}")
  return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
          f"<title>{title}</title></head>\n<body>\n{body}\n</body></html>\n")


def _stats_cells(node: diff_tree.DiffNode) -> tuple[str, str, str]:
  if node.stats is None or node.stats.identical:
    return ("", "", "")
  s = node.stats
  return (_number(s.max_abs), _number(s.relative_l2), _percent(s.fraction_changed))


def table(result: Shown, *, width: int | None = None, color: bool = False,
          every_array: bool = False) -> str:
  """One row per change (and per array with ``every_array``), changes alike
  but for their place grouped, each row one or two lines of ``width``
  (`pz_persist.tools.diff_table`)."""
  if width is None:
    width = shutil.get_terminal_size(fallback=(120, 24)).columns
  one_line = lambda text: terminal.printable(text, newlines=False)  # noqa: E731
  if result.tree is None:
    return one_line(_header(result))
  shown = {id(node) for node in top_changes(result)}
  rows = diff_table.grouped([
      diff_table.row_of(node, _stats_cells(node)) for node in result.tree.walk()
      if id(node) in shown or (every_array and node.stats is not None)
  ])
  lines = [diff_table.elide(one_line(line), width) for line in _header(result).split("\n")]
  if rows:
    body, shortened = diff_table.render(
        ["status", "where", "what", "max|A-B|", "rel", "changed"], rows, width)
    text = "\n".join(body)
    if color:
      text = _colour(text, [row.status for row in rows])
    lines += ["", text]
    if shortened:
      lines.append(diff_table.elide("(shortened to fit; --json and --html show all)", width))
  return "\n".join(lines)


def _colour(text: str, statuses: list[str]) -> str:
  """The status word of each row coloured (continuation lines start with spaces)."""
  out, row = [], -2  # The table's header line is row -1.
  for line in text.split("\n"):
    if line and not line.startswith(" "):
      row += 1
    status = statuses[row] if 0 <= row < len(statuses) else ""
    if status in _ANSI and line.startswith(status):
      line = f"\x1b[{_ANSI[status]}m{status}\x1b[0m{line[len(status):]}"
    out.append(line)
  return "\n".join(out)


def use_colour(stream: TextIO | None = None) -> bool:
  """Colours only on a terminal, and never with ``NO_COLOR`` set or ``TERM=dumb``."""
  stream = stream or sys.stdout
  isatty = getattr(stream, "isatty", None)
  return bool(isatty and isatty()) and "NO_COLOR" not in os.environ and (
      os.environ.get("TERM") != "dumb")
