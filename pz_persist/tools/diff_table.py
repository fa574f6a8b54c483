"""A diff as a terminal table: each change in one or two lines, whatever the width.

Why this module exists: a tree path inside a transformer is a hundred
characters (``tree.body.sublayers[1].sublayers[0].delta.sublayers[1]...``)
and an edit repeats (a LoRA adapter on every ``Linear`` is twenty identical
changes), so a table that wraps every cell fills screens with a few rows.
Here:

* an array is named by its label where it has one (what a person searches
  for), a tree path otherwise;
* three or more changes alike in all but their place (same status, kind, notes, no
  statistics of their own) are one row saying in how many places, with the
  places' shared path (``tree.body.sublayers[1,3,4]...``);
* a path too long for its column keeps its start and its end around
  ``...``; so does a description, so a row is one line when all rows fit on
  one, else two: where (with the statistics), then what;
* anything shortened says so under the table: ``--json`` and ``--html``
  (`pz_persist.tools.diffing.record`, ``to_html``) give every path whole.

Text from a checkpoint is escaped first (`pz_persist.safety.terminal`); the
rows start with their status word and only continuation lines start with a
space, so colouring a row finds its status.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from pz_persist.safety import terminal
from pz_persist.tools import diff_tree

ELLIPSIS = "..."
"""Where a shortened text lost its middle (ASCII: any terminal shows it)."""

GROUP_LEAST = 3
"""Fewest changes alike that become one row (two rows read as easily)."""

GROUP_PLACES = 4
"""Most places listed by index in a grouped row's path (``[1,3,4]``); more
show as ``[*]``."""

INDENT = "           "
"""Before a row's second line (what changed): under its path."""

_STATS = ("max|A-B|", "rel", "changed")

_PATH_PARTS = re.compile(r"\.[^.\[\]]+|\[[^\[\]]*\]|^[^.\[\]]+")
"""The parts of a tree path: ``tree``, ``.body``, ``[0]``, ``['w']``."""

_INDEX = re.compile(r"\[(\d+)\]")


@dataclasses.dataclass
class Row:
  """One line (or two) of the table.

  Attributes:
    status: The status word (``added``...).
    where: The label, tree path or grouped paths.
    what: Kind, summary and notes.
    stats: The three statistics cells ("" where there are none).
    places: The tree paths this row stands for (several when grouped).
  """

  status: str
  where: str
  what: str
  stats: tuple[str, str, str]
  places: list[str]


def path_parts(path: str) -> list[str]:
  """``path`` in its parts, or whole if it does not split cleanly."""
  parts = _PATH_PARTS.findall(path)
  return parts if "".join(parts) == path else [path]


def grouped(rows: Sequence[Row]) -> list[Row]:
  """Rows alike but for their place, `GROUP_LEAST` or more, as one row each
  (where the first was); rows with statistics or a label of their own stay
  apart."""
  alike: dict[tuple[str, str], list[Row]] = {}
  for row in rows:
    if not any(row.stats) and row.where == row.places[0]:
      alike.setdefault((row.status, row.what), []).append(row)
  out: list[Row] = []
  for row in rows:
    group = alike.get((row.status, row.what), [])
    if len(group) < GROUP_LEAST or row not in group:
      out.append(row)
    elif row is group[0]:
      places = [place for member in group for place in member.places]
      out.append(Row(row.status, f"{place_pattern(places)} ({len(places)} places)", row.what,
                     row.stats, places))
  return out


def place_pattern(paths: Sequence[str]) -> str:
  """What ``paths`` share: their common start, then the index where they
  part (``[1,3,4]``, or ``[*]``), then ``...`` if they go on, and their
  common end."""
  split = [path_parts(p) for p in paths]
  shortest = min(map(len, split))
  start = 0
  while start < shortest and len({s[start] for s in split}) == 1:
    start += 1
  head = "".join(split[0][:start])
  if start == shortest and all(len(s) == shortest for s in split):
    return head  # Not distinct: the same path twice.
  parting = list(dict.fromkeys(s[start] for s in split if len(s) > start))
  indices = [_INDEX.fullmatch(part) for part in parting]
  if all(indices) and len(parting) <= GROUP_PLACES:
    head += "[" + ",".join(m[1] for m in indices if m) + "]"
  else:
    head += "[*]" if all(indices) else ".*"
  end = 0
  while end < shortest - start - 1 and len({s[len(s) - end - 1] for s in split}) == 1:
    end += 1
  tail = "".join(split[0][len(split[0]) - end:]) if end else ""
  longer = any(len(s) > start + 1 + end for s in split)
  return head + (ELLIPSIS if longer else "") + tail


def elide(text: str, width: int, *, path: bool = False) -> str:
  """``text`` in at most ``width`` characters: its start and its end around
  `ELLIPSIS` (for a path, whole parts of the end where they fit)."""
  if len(text) <= width:
    return text
  room = width - len(ELLIPSIS)
  if room < 2:
    return text[:width]
  if path:
    parts = path_parts(text)
    if len(parts) > 2 and len(parts[0]) < room // 2:
      end = ""
      for part in reversed(parts[1:]):
        if len(parts[0]) + len(part) + len(end) > room:
          break
        end = part + end
      if end:
        return parts[0] + ELLIPSIS + end
  head = _boundary(text, (room + 1) // 2, before=True)
  tail = _boundary(text, len(text) - (room - head), before=False)
  return text[:head] + ELLIPSIS + text[tail:]


_BOUNDARY = re.compile(r"(?=[ ./\[(])")


def _boundary(text: str, at: int, *, before: bool) -> int:
  """The nearest place to cut ``text`` before a space, ``.``, ``/``, ``[``
  or ``(`` at or before ``at`` (``before``) or after it, if within half of
  the way; else ``at``."""
  places = [m.start() for m in _BOUNDARY.finditer(text)]
  if before:
    near = [k for k in places if at // 2 <= k <= at]
    return max(near, default=at)
  near = [k for k in places if at <= k <= at + (len(text) - at) // 2]
  return min(near, default=at)


def render(header: Sequence[str], rows: Sequence[Row], width: int) -> tuple[list[str], bool]:
  """The table's lines and whether anything was shortened: one line per row
  if every row fits, else two (where and statistics; then what)."""
  status_w = max(len("status"), *(len(r.status) for r in rows))
  with_stats = any(any(r.stats) for r in rows)
  stat_w = [max(len(name), *(len(r.stats[k]) for r in rows)) for k, name in enumerate(_STATS)]
  stats_room = sum(stat_w) + 2 * len(stat_w) if with_stats else 0
  where_w = max(len("where"), *(len(r.where) for r in rows))
  what_w = max(len("what"), *(len(r.what) for r in rows))

  def stats_text(cells: Sequence[str]) -> str:
    return "".join(f"  {c:>{w}}" for c, w in zip(cells, stat_w)) if with_stats else ""

  if status_w + 2 + where_w + 2 + what_w + stats_room <= width:  # One line each.
    def line(status: str, where: str, what: str, cells: Sequence[str]) -> str:
      return f"{status:<{status_w}}  {where:<{where_w}}  {what:<{what_w}}{stats_text(cells)}"
    lines = [line(header[0], header[1], header[2], header[3:]).rstrip()]
    lines += [line(r.status, r.where, r.what, r.stats).rstrip() for r in rows]
    return lines, False
  if with_stats and width - status_w - 2 - stats_room < NARROW_WHERE:
    return _narrow(header, rows, width, status_w)
  where_w = max(1, width - status_w - 2 - stats_room)
  what_w = max(1, width - len(INDENT))
  shortened = False
  lines = [elide(f"{header[0]:<{status_w}}  {header[1] + ' (then ' + header[2] + ')':<{where_w}}"
                 f"{stats_text(header[3:])}".rstrip(), width)]
  for r in rows:
    where, what = elide(r.where, where_w, path=True), elide(r.what, what_w)
    shortened |= (where, what) != (r.where, r.what)
    lines.append(f"{r.status:<{status_w}}  {where:<{where_w}}{stats_text(r.stats)}".rstrip())
    if what:
      lines.append(f"{INDENT}{what}".rstrip())
  return lines, shortened


NARROW_WHERE = 16
"""Fewest columns left for a path beside the statistics; on a narrower
terminal the statistics start the second line instead."""


def _narrow(header: Sequence[str], rows: Sequence[Row], width: int,
            status_w: int) -> tuple[list[str], bool]:
  """Two lines a row for a narrow terminal: status and where; then the
  statistics (``max|A-B| 2, rel 0.5, 100%``) and what."""
  indent = INDENT[:max(2, min(len(INDENT), width // 4))]
  where_w = max(1, width - status_w - 2)
  lines = [elide(f"{header[0]:<{status_w}}  {header[1]} (then {header[2]})", width)]
  shortened = False
  for r in rows:
    where = elide(r.where, where_w, path=True)
    stats = (f"{header[3]} {r.stats[0]}, {header[4]} {r.stats[1]}, {r.stats[2]}"
             if any(r.stats) else "")
    room = max(1, width - len(indent))
    if stats and len(stats) + 1 + min(len(r.what), 8) <= room:  # The statistics whole.
      what = " ".join(filter(None, [stats, elide(r.what, room - len(stats) - 1)]))
    else:
      what = elide(" ".join(filter(None, [stats, r.what])), room)
    shortened |= (where, what) != (r.where, " ".join(filter(None, [stats, r.what])))
    lines.append(f"{r.status:<{status_w}}  {where}".rstrip())
    if what:
      lines.append(f"{indent}{what}".rstrip())
  return lines, shortened


def row_of(node: diff_tree.DiffNode, stats: tuple[str, str, str]) -> Row:
  """A node's row: an array or variable named by its label where it has one
  (a relabelled one by its new label, saying the old), described without the
  axes of a named array unless they changed (a note says so)."""
  one_line = lambda text: terminal.printable(text, newlines=False)  # noqa: E731
  path = one_line(node.path)
  where, summary, notes = path, node.summary, list(node.notes)
  if node.name and node.name != node.path:
    where = one_line(node.name)
  elif summary.startswith("label="):  # A variable.
    label = summary[len("label="):]
    quoted = len(label) > 1 and label[0] == label[-1] == "'"
    where, summary = one_line(label[1:-1] if quoted else label), ""
    notes = [re.sub(r"^label (.*) -> .*$", r"was labelled \1", note) for note in notes]
  if node.stats is not None and " {" in summary:
    summary = summary[:summary.index(" {")]  # Axes: in the notes if they changed.
  if summary == node.kind:
    summary = ""
  what = " ".join(filter(None, [node.kind, summary, *notes]))
  if node.stats is not None and node.stats.identical:
    what += " (identical)"
  return Row(node.status, where, one_line(what), stats, [path])
