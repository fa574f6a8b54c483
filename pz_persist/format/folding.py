"""Deep parts of a tree folded into lists, so treescope renders any tree.

Why this module exists: treescope renders a value recursively, a dozen or
more Python frames for each level of nesting, so a tree as deep as a
checkpoint may hold (`pz_persist.format.nodes.MAX_DEPTH` levels) would pass
Python's default recursion limit of 1,000 frames and its rendering fail
with ``RecursionError``. Raising the limit would change the process behind
the user's back; instead `fold` replaces each part of a tree below
`NESTED_LEVELS` levels by a `Folded` leaf, which treescope renders as one
list of lines, each part keyed by its path from the folded one (arrays with
treescope's own summary: shape, dtype, statistics). The list is walked
without recursion (`flattened`, which the diff's tree uses for its own deep
parts too), so the rendering's depth is bounded whatever the tree.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import types
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import TypeAlias
from typing import TypeVar

from penzai import pz

from pz_persist.format import nodes

NESTED_LEVELS = 18
"""Levels of a tree treescope renders nested before `fold` lists the rest.
Treescope spends about 24 Python frames per level (a list and its item, a
struct and its field: measured in tests/hostile/test_deep_renderers.py), so
18 levels take under 450 frames, more than half the default limit of 1,000
left to the caller (a notebook, a test runner); Penzai's own transformers
nest 16 levels (their axis names, below the arrays) and render unfolded."""

Node = TypeVar("Node")
Line = TypeVar("Line")


def flattened(
    root: Node,
    children: Callable[[Node], Sequence[tuple[str, Node]]],
    line: Callable[[str, Node, Node], Line],
) -> list[Line]:
  """Every node below ``root``, parents first, as ``line(path, node, parent)``
  where ``path`` joins the keys from ``root`` down (``.sublayers[0].w``).

  Iterative: any depth takes the same few frames.
  """
  lines = []
  pending = [(key, child, root) for key, child in reversed(children(root))]
  while pending:
    path, node, parent = pending.pop()
    lines.append(line(path, node, parent))
    pending.extend((path + key, child, node) for key, child in reversed(children(node)))
  return lines


def children(obj: Any) -> list[tuple[str, object]]:
  """The parts of ``obj`` a rendering nests, keyed as a path step; none for
  a leaf (an array, a ``NamedArray``, a scalar, code)."""
  if isinstance(obj, pz.nx.NamedArrayBase):
    return []  # Treescope shows it as one array.
  if isinstance(obj, pz.AbstractVariable):
    return [(".value", obj.value)]
  if isinstance(obj, tuple) and nodes.is_namedtuple_class(type(obj)):
    return [(f".{name}", value) for name, value in zip(obj._fields, obj)]  # type: ignore[attr-defined]  # A namedtuple (checked above).
  if type(obj) in (list, tuple):
    return [(f"[{i}]", value) for i, value in enumerate(obj)]
  if type(obj) in (dict, collections.OrderedDict):
    return [(f"[{key!r}]", value) for key, value in obj.items()]
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    return [(f".{name}", value) for name, value in _fields(obj).items()]
  return []


def _fields(obj: Any) -> dict[str, object]:
  if isinstance(obj, pz.Struct):
    return obj.attributes_dict()
  return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if hasattr(obj, f.name)}


def _rebuilt(obj: Any, values: list[Any]) -> object:
  """``obj`` of the same type holding ``values`` (in `children`'s order)."""
  if isinstance(obj, tuple) and nodes.is_namedtuple_class(type(obj)):
    return type(obj)(*values)
  if type(obj) in (list, tuple):
    return type(obj)(values)
  if type(obj) in (dict, collections.OrderedDict):
    return type(obj)(zip(obj.keys(), values))
  if isinstance(obj, pz.Struct):  # Penzai's own way round ``__init__``.
    return type(obj).from_attributes(**dict(zip(obj.attributes_dict(), values)))
  new = copy.copy(obj)
  for name, value in zip(_fields(obj), values):
    object.__setattr__(new, name, value)  # Frozen dataclasses too.
  return new


@dataclasses.dataclass(frozen=True)
class Folded:
  """A part of a tree nested too deep to render nested; treescope shows it
  as its type and a list of what it holds, one line per part.

  Attributes:
    value: The part folded (kept as it is: nothing is copied or changed).
    level: How many levels down the tree it sits.
  """

  value: object
  level: int

  def __treescope_repr__(
      self, path: str | None, subtree_renderer: Callable[..., Any]
  ) -> Any:
    """The folded part's type, a note saying it was folded, and its parts."""
    from treescope import rendering_parts as parts  # pylint: disable=import-outside-toplevel

    lines = flattened(_Listed(self.value, None, False), _listed_children,
                      lambda key, node, parent: _line(key, node, subtree_renderer, parts))
    note = (f" (folded: the {len(lines)} parts it holds, listed by path; nested"
            f" {self.level} levels deep already, rendering them nested too would"
            " pass Python's recursion limit)")
    return parts.build_custom_foldable_tree_node(
        label=parts.siblings(_kind(self.value, parts), parts.comment_color(parts.text(note)), " {"),
        contents=parts.fold_condition(
            collapsed=parts.text("...}"),
            expanded=parts.siblings(parts.indented_children(lines), "}")),
        path=path,
        expand_state=parts.ExpandState.EXPANDED,
    )


def _listed_children(entry: _Listed) -> list[tuple[str, _Listed]]:
  """`children` of a `_Listed` part (the folded value at the top), each with
  the chain of ids above it: a part holding one of its ancestors (a model in
  memory may) is listed once, as such, and not entered."""
  if entry.looped:
    return []
  here = (id(entry.value), entry.chain)
  return [(key, _Listed(value, here, _on_chain(value, here))) for key, value in children(entry.value)]


class _Listed(NamedTuple):
  """A part being listed, the ids of the parts above it (a linked chain, so
  each costs one pair), and whether it is one of them."""

  value: object
  chain: _Chain
  looped: bool


_Chain: TypeAlias = "tuple[int, _Chain] | None"
"""The ids of the parts above one, innermost first, as nested pairs."""


def _on_chain(value: object, chain: _Chain) -> bool:
  while chain is not None:
    if chain[0] == id(value):
      return True
    chain = chain[1]
  return False


def _line(
    key: str, entry: _Listed, subtree_renderer: Callable[..., Any], parts: types.ModuleType
) -> Any:
  """One listed part: containers by type (their parts follow, one line
  each), leaves as treescope renders them."""
  if entry.looped:
    return parts.build_one_line_tree_node(parts.siblings(f"{key}: ", parts.comment_color(
        parts.text(f"<{type(entry.value).__name__}: holds itself, listed above>"))))
  if children(entry.value):
    return parts.build_one_line_tree_node(parts.siblings(f"{key}: ", _kind(entry.value, parts)))
  return parts.build_full_line_with_annotations(
      f"{key}: ", subtree_renderer(entry.value, path=None))


def _kind(obj: object, parts: types.ModuleType) -> Any:
  """A container's type (and a variable's label: what tells variables apart)."""
  name = parts.maybe_qualified_type_name(type(obj))
  if isinstance(obj, pz.AbstractVariable):
    return parts.siblings(name, parts.text(f"(label={obj.label!r})"))
  return name


def fold(tree: object, levels: int = NESTED_LEVELS) -> object:
  """``tree`` with every part ``levels`` levels down that holds more replaced
  by a `Folded` leaf; ``tree`` itself when nothing is that deep.

  The parts above are rebuilt (same types, same values), never changed in
  place; a variable holding a part that deep is folded whole (its value
  cannot be swapped without changing the variable).
  """
  return _fold(tree, levels, 0)


def _fold(obj: object, levels: int, level: int) -> object:
  parts = children(obj)
  if not parts:
    return obj
  if level >= levels:
    return Folded(obj, level)
  values = [_fold(value, levels, level + 1) for _, value in parts]
  if all(new is old for new, (_, old) in zip(values, parts)):
    return obj
  if isinstance(obj, pz.AbstractVariable):
    return Folded(obj, level)
  return _rebuilt(obj, values)
