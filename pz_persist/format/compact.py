"""Manifest format 4: the same tree, variables and arrays, written compactly.

Formats 1 to 3 spell every node as a JSON object (``{"t": "str", "v": ...}``)
and every array as one object of named fields: about 500 bytes per array,
most of them field names and the same few strings again, and one Python
call per JSON object to refuse duplicate keys while parsing. Measured on
4,000 arrays (issue 31): the manifest's parse and checks and the tree's
decoding were 80% of `pz_persist.inspect`.

Format 4 writes the same content (``docs/format-spec.md`` is normative):

* a node is a JSON list ``[type, field, ...]``: ``type`` indexes the
  manifest's ``types`` table (the node tags it uses), the fields follow in
  the order of their row in `pz_persist.format.nodes.NODE_TYPES`; a JSON
  string is a ``str`` node (labels, names, dict keys);
* a ``class`` field indexes the ``classes`` table (``[module, qualname]``);
* any node may be an integer instead, indexing the ``shared`` table: static
  values that occur more than once (metadata dicts, axis names, layer
  settings), written once and decoded once per load (`SharedNodes`);
* the arrays table is columnar (one list per field), its repeated values
  (shapes, dtypes) in tables of their own, its checksums one column.

Only lists and four small objects remain, so parsing costs no Python call
per value, and validation runs per distinct table entry or over a whole
column at once (one regular expression over the joined column) rather than
per array. The decoder reads the compact nodes directly, through the
tables (`Tables.shallow`), decoding each shared entry once; the tools that
walk typed JSON (`manifest_queries`, the viewer, the diff) get the typed JSON of
formats 1 to 3 on demand (`Tables.expand`, `Manifest.tree`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Sequence
from typing import Any

from pz_persist import errors
from pz_persist import version
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import checksum_records
from pz_persist.format import json_types
from pz_persist.format import nodes

Node = nodes.Node

FIELDS = frozenset({
    "format", "format_version", "writer", "leaf_keys", "types", "classes", "shared",
    "tree", "variables", "arrays",
})
"""The keys of a format 4 manifest, all required."""

ARRAY_COLUMNS = frozenset({
    "count", "key", "path", "label", "shapes", "shape", "dtypes", "dtype", "kinds",
    "kind", "weak_type", "checksums",
})
"""The keys of a format 4 arrays table, all required."""

MIN_SHARED_CHARS = 3
"""Strings shorter than this are written inline, even when repeated (a
reference costs a few bytes itself)."""


def _frozen(value: Any) -> Hashable:
  """A hashable form of typed JSON: equal forms, equal JSON (types kept
  apart: ``1``, ``1.0`` and ``true`` are different JSON)."""
  kind = type(value)
  if kind is str:
    return value
  if kind is dict:
    return ("{", *((k, _frozen(v)) for k, v in value.items()))
  if kind is list:
    return ("[", *map(_frozen, value))
  return (kind, value)


# Writing.


@dataclasses.dataclass
class _Tables:
  types: dict[str, int] = dataclasses.field(default_factory=dict)
  classes: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
  shared: dict[Hashable, int] = dataclasses.field(default_factory=dict)
  shared_nodes: list[json_types.JSON] = dataclasses.field(default_factory=list)

  def type_index(self, tag: str) -> int:
    return self.types.setdefault(tag, len(self.types))

  def class_index(self, ref: dict[str, str]) -> int:
    key = (ref["module"], ref["qualname"])
    return self.classes.setdefault(key, len(self.classes))


def _subnodes(node: Node) -> list[Node]:
  """Every node a typed node holds directly (children, static values, static
  pair keys), for the writer's walks (its nodes are the encoder's: valid)."""
  out: list[Node] = []
  for name, json_kind, holds, static_keys in _WALKED_FIELDS[node["t"]]:
    value = node[name]
    if json_kind == "node":
      out.append(value)
    elif json_kind == "list":
      out.extend(value)
    else:  # Pairs.
      for key, item in value:
        if static_keys:
          out.append(key)
        if holds:
          out.append(item)
  return out


_WALKED_FIELDS = {
    tag: tuple(
        (f.name, f.json, bool(f.holds), f.keys == "static") for f in node_type.fields
        if (f.json in ("node", "list") and f.holds) or f.json == "pairs"
    )
    for tag, node_type in nodes.NODE_TYPES.items()
}


def _all_static(node: Node, memo: dict[int, bool]) -> bool:
  """Whether every node of ``node`` may stand in a static value."""
  found = memo.get(id(node))
  if found is None:
    node_type = nodes.NODE_TYPES.get(nodes.tag_of(node) or "")
    found = node_type is not None and node_type.static and all(
        _all_static(child, memo) for child in _subnodes(node))
    memo[id(node)] = found
  return found


class _Writer:
  """Compacts a format 3 tree: counts the static sub-trees (pass one), then
  writes each node, sharing those met more than once (pass two)."""

  def __init__(self) -> None:
    self.tables = _Tables()
    self._static: dict[int, bool] = {}
    self._keys: dict[int, Hashable | None] = {}
    self._counts: dict[Hashable, int] = {}

  def _key(self, node: object) -> Hashable | None:
    """A hashable key of a static sub-tree worth sharing (equal keys: equal
    JSON), else None."""
    if not isinstance(node, dict):
      return None
    key = self._keys.get(id(node), self)
    if key is self:
      if node.get("t") == "str" and type(node.get("v")) is str:
        # Written as a bare string: shared only where a reference is shorter.
        key = node["v"] if len(node["v"]) >= MIN_SHARED_CHARS else None
      elif _all_static(node, self._static):
        key = _frozen(node)
      else:
        key = None
      self._keys[id(node)] = key
    return key

  def count(self, node: Node) -> None:
    key = self._key(node)
    if key is not None:
      self._counts[key] = self._counts.get(key, 0) + 1
      return
    for child in _subnodes(node):
      self.count(child)

  def node(self, node: Node, *, share: bool = True) -> json_types.JSON:
    key = self._key(node) if share else None
    if key is not None and self._counts.get(key, 0) > 1:
      index = self.tables.shared.get(key)
      if index is None:
        index = len(self.tables.shared_nodes)
        self.tables.shared[key] = index
        self.tables.shared_nodes.append(None)  # Reserved; filled below.
        self.tables.shared_nodes[index] = self.node(node, share=False)
      return index
    tag = node["t"]
    if tag == "str":  # A string stands for itself.
      return node["v"]
    out: list[json_types.JSON] = [self.tables.type_index(tag)]
    for field in nodes.NODE_TYPES[tag].fields:  # Within a shared entry, nothing shared.
      value = node[field.name]
      if field.name == "class":
        out.append(self.tables.class_index(value))
      elif field.json == "node":
        out.append(self.node(value, share=share))
      elif field.json == "list":
        out.append([self.node(v, share=share) for v in value])
      elif field.json == "pairs":
        out.append([
            [self.node(k, share=share) if field.keys == "static" else k,
             self.node(v, share=share) if field.holds else v]
            for k, v in value
        ])
      else:
        out.append(value)
    return out


def to_json(
    tree: Node, variables: Sequence[Node], arrays: Sequence[arrays_lib.ArraySpec], *,
    writer: str, leaf_keys: bool, format_version: int = 4,
    compacted: json_types.JSONObject | None = None,
) -> json_types.JSONObject:
  """The format 4 JSON of a manifest's content (held as format 3 nodes);
  ``format_version`` is what it declares (4, or what a newer node type
  needs); ``compacted``: `compact_nodes` of ``tree`` and ``variables``, if
  known already."""
  if compacted is None:
    compacted = compact_nodes(tree, variables)
  return {
      "format": "pz_persist",
      "format_version": format_version,
      "writer": writer,
      "leaf_keys": leaf_keys,
      **compacted,
      "arrays": _array_columns(arrays),
  }


def compact_nodes(tree: Node, variables: Sequence[Node]) -> json_types.JSONObject:
  """The ``types``, ``classes``, ``shared``, ``tree`` and ``variables`` of a
  format 4 manifest: all of it but the arrays table (whose checksums a save
  records last), so a save compacts its tree once (`Manifest.to_json`)."""
  out = _Writer()
  out.count(tree)
  for entry in variables:
    for name in ("label", "metadata", "value"):
      out.count(entry[name])
  compact_tree = out.node(tree)
  compact_variables: list[json_types.JSON] = [
      [entry["kind"], out.node(entry["label"]), out.node(entry["metadata"]),
       out.node(entry["value"])]
      for entry in variables
  ]
  tables = out.tables
  return {
      "types": list(tables.types),
      "classes": [list(ref) for ref in tables.classes],
      "shared": tables.shared_nodes,
      "tree": compact_tree,
      "variables": compact_variables,
  }


def _array_columns(arrays: Sequence[arrays_lib.ArraySpec]) -> json_types.JSONObject:
  shapes: dict[tuple[int, ...], int] = {}
  dtypes: dict[str, int] = {}
  kinds: dict[str, int] = {}
  return {
      "count": len(arrays),
      "key": [spec.key for spec in arrays],
      "path": [spec.path for spec in arrays],
      "label": [spec.label for spec in arrays],
      "shape": [shapes.setdefault(spec.shape, len(shapes)) for spec in arrays],
      "shapes": [list(shape) for shape in shapes],
      "dtype": [dtypes.setdefault(spec.dtype, len(dtypes)) for spec in arrays],
      "dtypes": list(dtypes),
      "kind": [kinds.setdefault(spec.kind, len(kinds)) for spec in arrays],
      "kinds": list(kinds),
      "weak_type": [i for i, spec in enumerate(arrays) if spec.weak_type],
      "checksums": [_checksums_json(spec) for spec in arrays],
  }


def _checksums_json(spec: arrays_lib.ArraySpec) -> json_types.JSON:
  sums = spec.checksums
  if sums is None:
    return None
  if len(sums) == 1 and sums[0].index == checksum_records.full_index(spec.shape):
    return sums[0].digest  # One digest of the whole array: the common case.
  return [[[list(pair) for pair in c.index], c.digest] for c in sums]


# Reading.


class Tables:
  """A checked format 4 manifest's tables, and its nodes read through them.

  The decoder reads compact nodes directly (`shallow`: one temporary object
  per node, freed once the node is decoded), so loading allocates nothing
  per node that outlives the load; tools that walk the typed JSON of
  formats 1 to 3 get it from `expand`, on demand.
  """

  def __init__(self, types: list[tuple[str, nodes.NodeType]], classes: list[dict[str, str]],
               shared: list[Any]):
    self.types = types
    self.classes = classes
    self.shared = shared
    self._expanded_shared: dict[int, Node] = {}
    self._rows = [
        (tag, tuple(f.name for f in node_type.fields), node_type.field("class") is not None)
        for tag, node_type in types
    ]

  def shallow(self, node: Any) -> Node:
    """The typed node of a checked compact node, its children left compact."""
    if type(node) is str:
      return {"t": "str", "v": node}
    tag, names, has_class = self._rows[node[0]]
    out: Node = dict(zip(names, node[1:]))
    out["t"] = tag
    if has_class:
      out["class"] = self.classes[out["class"]]
    return out

  def expand(self, node: Any) -> Node:
    """The typed JSON of formats 1 to 3 of a checked compact node, whole
    (a shared entry expands to one object wherever it is used)."""
    if type(node) is int:
      found = self._expanded_shared.get(node)
      if found is None:
        found = self._expanded_shared[node] = self.expand(self.shared[node])
      return found
    shallow = self.shallow(node)
    out = {"t": shallow.pop("t"), **shallow}  # As formats 1 to 3 write it: "t" first.
    if type(node) is str:
      return out
    for field in self.types[node[0]][1].fields:
      value, name = out[field.name], field.name
      if field.json == "node":
        out[name] = self.expand(value)
      elif field.json == "list":
        out[name] = [self.expand(v) for v in value]
      elif field.json == "pairs":
        out[name] = [[self.expand(k) if field.keys == "static" else k,
                      self.expand(v) if field.holds else v] for k, v in value]
    return out


@dataclasses.dataclass(frozen=True)
class Parsed:
  """A checked format 4 manifest: its compact tree and variables, its
  tables and its array specs."""

  tree: json_types.JSON
  variables: tuple[list[json_types.JSON], ...]
  tables: Tables
  arrays: tuple[arrays_lib.ArraySpec, ...]
  writer: str
  leaf_keys: bool

  def variable_entries(self) -> list[Node]:
    """The variables table as the decoder reads it (nodes left compact)."""
    return [{"kind": e[0], "label": e[1], "metadata": e[2], "value": e[3]}
            for e in self.variables]

  def expanded(self) -> tuple[Node, tuple[Node, ...]]:
    """The tree and variables as the typed JSON of formats 1 to 3."""
    expand = self.tables.expand
    return expand(self.tree), tuple(
        {"kind": e[0], "label": expand(e[1]), "metadata": expand(e[2]), "value": expand(e[3])}
        for e in self.variables)


_OTHER, _CLASS, _NODE, _LIST, _PAIRS, _INTS = range(6)
"""What `_Checker.fast` checks of a field."""


class _Checker:
  """Checks a format 4 manifest's tables and every node, allocating nothing
  per node: what `Tables.shallow` then trusts."""

  def __init__(self, raw: dict[str, Any], where: str, reader_format: int):
    self.where = where
    self.reader_format = reader_format
    self.format_version = raw["format_version"]
    self.writer = raw["writer"]
    self.types = self._types(raw["types"])
    self.classes = self._classes(raw["classes"])
    self.used_types: set[int] = set()
    self.used_classes: set[int] = set()
    self.used_shared: set[int] = set()
    shared = raw["shared"]
    if not isinstance(shared, list):
      raise self.error("shared", "must be a list")
    self.shared = shared
    self.plans = self._plans()
    tags = [tag for tag, _ in self.types]
    self.array_type = tags.index("array") if "array" in tags else -1
    self.array_refs: list[int] = []  # Of every ``array`` node, as met once each.
    # The variables table, once `variables` checked it.
    self.entries: list[list[json_types.JSON]] = []
    self._extents: dict[int, int] = {}
    # How deep each shared entry nests below the node referring to it: the
    # decoder decodes an entry at the depth of its first reference and reuses
    # it, so the depth of every reference is checked here, through the entry.
    self.shared_heights: list[int] = []
    for i, entry in enumerate(shared):
      self.shared_heights.append(self.check_fast(entry, f"shared[{i}]", 0, in_shared=True))

  def error(self, field: str, problem: str) -> errors.ManifestError:
    return errors.ManifestError(
        f"{self.where}: {field} {problem}; the manifest is damaged or was edited"
        " (format 4, docs/format-spec.md)."
    )

  def _types(self, types: object) -> list[tuple[str, nodes.NodeType]]:
    if not isinstance(types, list):
      raise self.error("types", "must be a list of node type names")
    if len(set(map(str, types))) != len(types):
      raise self.error("types", "repeats a node type")
    out = []
    for i, tag in enumerate(types):
      if not isinstance(tag, str):
        raise self.error(f"types[{i}]", f"is {tag!r:.60}, not a node type name")
      node_type = nodes.NODE_TYPES.get(tag)
      if node_type is None:
        raise nodes.unknown_node(
            tag, f"{self.where}: types[{i}]", format_version=self.format_version,
            writer=self.writer, reader_version=version.__version__,
            reader_format=self.reader_format,
        )
      out.append((tag, node_type))
    return out

  def _classes(self, classes: object) -> list[dict[str, str]]:
    if not isinstance(classes, list):
      raise self.error("classes", "must be a list of [module, qualname]")
    out = []
    for i, ref in enumerate(classes):
      if not (isinstance(ref, list) and len(ref) == 2 and all(isinstance(s, str) for s in ref)):
        raise self.error(f"classes[{i}]", f"is {ref!r:.100}, not [module, qualname]")
      out.append({"module": ref[0], "qualname": ref[1]})
    if len({(r["module"], r["qualname"]) for r in out}) != len(out):
      raise self.error("classes", "repeats a class")
    return out

  def _plans(self) -> list[tuple[bool, bool, tuple[tuple[int, bool, bool], ...]]]:
    """Per type index: whether it is a ``variable`` node (whose entry is
    decoded where it stands), whether it is static, and per field what
    `fast` checks (`_CLASS`, `_NODE`, `_LIST`, `_PAIRS`, `_INTS` or nothing,
    whether pair keys are nodes, whether pair values are)."""
    plans = []
    for tag, node_type in self.types:
      fields = []
      for field in node_type.fields:
        code = (_CLASS if field.name == "class" else _NODE if field.json == "node"
                else _LIST if field.json == "list" else _PAIRS if field.json == "pairs"
                else _INTS if field.json == "ints" else _OTHER)
        fields.append((code, field.keys == "static", bool(field.holds)))
      plans.append((tag == "variable", node_type.static, tuple(fields)))
    return plans

  def fast(self, root: Any, depth: int, in_shared: bool = False) -> int:
    """`fast_all` of one node."""
    return self.fast_all([root], depth, in_shared)

  def fast_all(self, roots: list[Any], depth: int, in_shared: bool = False) -> int:
    """`check` without naming where: the depth of the deepest node of
    ``roots`` if they all pass it, else -1.

    Why a second walk: building each node's location text
    (``tree.fields[3][1]``) and one call per node cost as much as the checks
    themselves; this one walks with a stack, checks strings and references
    in line, and a manifest that fails it is checked again by `check`, which
    names where. It passes nothing `check` refuses and records the same
    table entries as used; what it leaves to `check` (anything at the
    deepest level), `check` decides. Depth is counted as the decoder counts
    it: through each shared entry and variable entry, from where it is used."""
    plans, shared_count, class_count = self.plans, len(self.shared), len(self.classes)
    heights, variable_count = self.shared_heights, len(self.entries)
    used_shared, used_types, used_classes = self.used_shared, self.used_types, self.used_classes
    most, array_type = nodes.MAX_DEPTH, self.array_type
    refs: list[int] = []  # Recorded if it passes (else `check` records them).
    deepest = depth
    # Strings and references are checked in line where they stand (the roots,
    # then each node's children); only nodes with fields go on the stack.
    stack: list[tuple[Any, int]] = []
    level: Sequence[Any] = roots
    below = depth
    while True:
      for child in level:
        kind = type(child)
        if kind is str:
          if below > most:
            return -1
          deepest = max(deepest, below)
        elif kind is int:
          if in_shared or not 0 <= child < shared_count:
            return -1
          reach = below + heights[child]
          if reach > most:
            return -1
          deepest = max(deepest, reach)
          used_shared.add(child)
        else:
          stack.append((child, below))
      if not stack:
        break
      node, depth = stack.pop()
      level = ()  # Its children, once its fields are checked (none if it ends early).
      if type(node) is not list or not node or type(node[0]) is not int or depth >= most:
        return -1  # (At the deepest level, left to `check`.)
      deepest = max(deepest, depth)
      index = node[0]
      if not 0 <= index < len(plans):
        return -1
      used_types.add(index)
      variable, static, fields = plans[index]
      if (in_shared and not static) or len(node) != len(fields) + 1:
        return -1
      if index == array_type:
        if type(node[1]) is int:  # (Else the decoder refuses it.)
          refs.append(node[1])
        continue
      if variable:
        ref = node[1]
        if type(ref) is int and 0 <= ref < variable_count:  # (Else the decoder refuses it.)
          reach = depth + self.variable_extent(ref)
          if reach > most:
            return -1
          deepest = max(deepest, reach)
        continue
      if not fields or (len(fields) == 1 and fields[0][0] == _OTHER):
        continue  # Nothing to check inside (an ``array`` node's reference).
      children: list[Any] = []
      for (code, static_keys, holds), value in zip(fields, node[1:]):
        if code == _NODE:
          children.append(value)
        elif code == _LIST:
          if type(value) is not list:
            return -1
          children.extend(value)
        elif code == _PAIRS:
          if type(value) is not list:
            return -1
          for pair in value:
            if type(pair) is not list or len(pair) != 2:
              return -1
            if static_keys:
              children.append(pair[0])
            if holds:
              children.append(pair[1])
        elif code == _CLASS:
          if type(value) is not int or not 0 <= value < class_count:
            return -1
          used_classes.add(value)
        elif code == _INTS:
          if type(value) is not list:
            return -1
          for v in value:
            if type(v) is not int:
              return -1
      level, below = children, depth + 1
    self.array_refs.extend(refs)
    return deepest

  def variable_extent(self, ref: int) -> int:
    """How deep variable entry ``ref`` nests below a ``variable`` node using
    it (its label, metadata and value are decoded one level below that
    node); checks the entry the first time (naming it)."""
    found = self._extents.get(ref)
    if found is None:
      # While it is measured: a variable met inside its own entry (which the
      # decoder refuses: it contains itself) adds nothing.
      self._extents[ref] = 0
      found = max(
          self.check_fast(node, f"variables[{ref}].{name}", 1)
          for name, node in zip(("label", "metadata", "value"), self.entries[ref][1:])
      )
      self._extents[ref] = found
    return found

  def check_fast(self, node: Any, where: str, depth: int, in_shared: bool = False) -> int:
    """`check`: `fast` first, `check` itself (naming where) if that fails.
    (`fast` never passes what `check` refuses; what it leaves to `check`,
    `check` decides.) Returns the depth of its deepest node."""
    deepest = self.fast(node, depth, in_shared)
    return deepest if deepest >= 0 else self.check(node, where, depth, in_shared)

  def check(self, node: Any, where: str, depth: int, in_shared: bool = False) -> int:
    """Checks a compact node (``where`` names it for errors); returns the
    depth of its deepest node, counted through the shared and variable
    entries it uses (as the decoder counts it)."""
    most = nodes.MAX_DEPTH
    if depth > most:
      raise self.error(where, f"nests deeper than {most} levels")
    kind = type(node)
    if kind is str:
      return depth
    if kind is int:
      if in_shared:
        raise self.error(where, "refers to a shared entry from a shared entry")
      if not 0 <= node < len(self.shared):
        raise self.error(where, f"refers to shared[{node}], which does not exist"
                         f" ({len(self.shared)} shared entries)")
      self.used_shared.add(node)
      height = self.shared_heights[node]
      if depth + height > most:
        raise self.error(where, f"refers to shared[{node}], which nests {height} levels below"
                         f" it, at depth {depth}: the tree nests deeper than {most} levels")
      return depth + height
    if kind is not list or not node or type(node[0]) is not int:
      raise self.error(where, f"is {str(node)[:80]}, not a node ([type, fields...])")
    index = node[0]
    if not 0 <= index < len(self.types):
      raise self.error(where, f"has type {index}, not an index of types")
    self.used_types.add(index)
    tag, node_type = self.types[index]
    if in_shared and not node_type.static:
      raise self.error(where, f"is a {tag} node: a shared entry holds static values only"
                       " (no array or variable)")
    fields = node_type.fields
    if len(node) != len(fields) + 1:
      raise self.error(where, f"is a {tag} node with {len(node) - 1} fields,"
                       f" expected {len(fields)} ({', '.join(f.name for f in fields)})")
    deepest = depth
    if tag == "array" and type(node[1]) is int:
      self.array_refs.append(node[1])
    if tag == "variable":
      ref = node[1]
      if type(ref) is int and 0 <= ref < len(self.entries):  # (Else the decoder refuses it.)
        extent = self.variable_extent(ref)
        if depth + extent > most:
          raise self.error(where, f"holds variables[{ref}], which nests {extent} levels below"
                           f" it, at depth {depth}: the tree nests deeper than {most} levels")
        deepest = depth + extent
    below = depth + 1
    for position, field in enumerate(fields, 1):
      value, name = node[position], field.name
      if name == "class":
        if type(value) is not int or not 0 <= value < len(self.classes):
          raise self.error(f"{where}.class", f"is {value!r:.40}, not an index of classes")
        self.used_classes.add(value)
      elif field.json == "node":
        deepest = max(deepest, self.check(value, f"{where}.{name}", below, in_shared))
      elif field.json == "list":
        if type(value) is not list:
          raise self.error(f"{where}.{name}", "must be a list")
        items = f"{where}[" if name == "items" else f"{where}.{name}["  # As Python indexes it.
        for i, v in enumerate(value):
          deepest = max(deepest, self.check(v, f"{items}{i}]", below, in_shared))
      elif field.json == "pairs":
        if not nodes.is_pairs(value):
          raise self.error(f"{where}.{name}", "must be a list of pairs")
        static_keys, holds = field.keys == "static", bool(field.holds)
        for i, (k, v) in enumerate(value):
          at = where + self._step(name, k, i)
          if static_keys:
            deepest = max(deepest, self.check(k, f"{at} key", below, in_shared))
          if holds:
            deepest = max(deepest, self.check(v, at, below, in_shared))
      elif field.json == "ints":
        if type(value) is not list or not all(type(v) is int for v in value):
          raise self.error(f"{where}.{name}", "must be a list of integers")
    return deepest

  def _step(self, name: str, key: object, i: int) -> str:
    """The location of pair ``i`` of field ``name``, as Python reaches its
    value where it can (``['key']`` of a dict, ``.name`` of a class's field),
    as the decoder names it, so that a writer refused for what it was about
    to publish names the path in the saved tree."""
    if type(key) is int and 0 <= key < len(self.shared):
      key = self.shared[key]  # A shared string: a dict key used more than once.
    if type(key) is str:
      if name == "items":
        return f"[{key!r:.80}]"
      if name == "fields":
        return f".{key:.80}"
    return f".{name}[{i}]"

  def variables(self, entries: object) -> tuple[list[json_types.JSON], ...]:
    """Checks the variables table (before the tree, whose ``variable`` nodes
    are checked through it): each entry, and how deep it nests."""
    if not isinstance(entries, list):
      raise self.error("variables", "must be a list")
    for i, entry in enumerate(entries):
      if type(entry) is not list or len(entry) != 4:
        raise self.error(f"variables[{i}]", "must be [kind, label, metadata, value]")
    self.entries = entries
    for i in range(len(entries)):
      self.variable_extent(i)
    return tuple(entries)

  def check_all_used(self) -> None:
    """Refuses table entries no node uses: every entry is then checked when
    the node using it is decoded, as an inline value would be."""
    for name, table, used in (
        ("types", self.types, self.used_types), ("classes", self.classes, self.used_classes),
        ("shared", self.shared, self.used_shared),
    ):
      if len(used) != len(table):
        unused = min(set(range(len(table))) - used)
        raise self.error(f"{name}[{unused}]", "is used by no node")


def parse(raw: dict[str, Any], *, where: str, reader_format: int) -> Parsed:
  """Validates a parsed format 4 manifest as a whole.

  ``reader_format``: the newest format this pz_persist reads, for messages.

  Raises:
    ManifestError: a field, table entry, column or node is malformed,
      naming it; FormatVersionError: a node type this pz_persist does not know,
      from a newer release.
  """
  if set(raw) != FIELDS:
    raise errors.ManifestError(
        f"{where}: manifest fields {sorted(raw)}, expected {sorted(FIELDS)} (format 4)."
    )
  if not isinstance(raw["writer"], str) or arrays_lib.CONTROL_CHARS.search(raw["writer"]):
    raise errors.ManifestError(f"{where}: invalid writer {raw['writer']!r:.100}.")
  leaf_keys = raw["leaf_keys"]
  if not isinstance(leaf_keys, bool):
    raise errors.ManifestError(f"{where}: leaf_keys must be true or false.")
  arrays = array_specs(raw["arrays"], where=where, leaf_keys=leaf_keys)
  checker = _Checker(raw, where, reader_format)
  if type(raw["tree"]) not in (list, str):  # A string is the str node of a str tree.
    raise checker.error("tree", "must be a node ([type, fields...]), not a reference")
  variables = checker.variables(raw["variables"])
  checker.check_fast(raw["tree"], "tree", 0)
  checker.check_all_used()
  parsed = Parsed(
      tree=raw["tree"], variables=variables,
      tables=Tables(checker.types, checker.classes, checker.shared),
      arrays=arrays, writer=raw["writer"], leaf_keys=leaf_keys,
  )
  nodes.arrays_referenced_once(
      checker.array_refs, len(arrays), lambda: nodes.array_places(*parsed.expanded()),
      lambda ref: arrays[ref].describe(), where)
  return parsed


# The arrays table.

_KEY = re.compile(r"[A-Za-z0-9_-]+")
_LEAF_KEY = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")


def _column(table: dict[str, Any], name: str, count: int, where: str) -> list[Any]:
  column = table[name]
  if type(column) is not list or len(column) != count:
    raise errors.ManifestError(
        f"{where}: arrays.{name} must be a list of {count} entries (arrays.count),"
        f" not {type(column).__name__} of {len(column) if isinstance(column, list) else '?'}."
    )
  return column


def _all_of(column: list[object], kinds: tuple[type, ...]) -> bool:
  return all(type(v) in kinds for v in column)


def _first_bad(column: list[Any], ok: Callable[[Any], object]) -> int:
  return next(i for i, v in enumerate(column) if not ok(v))


def _indexes(table: dict[str, Any], name: str, size: int, count: int, where: str) -> list[int]:
  column = _column(table, name, count, where)
  if not _all_of(column, (int,)) or (column and not (0 <= min(column) and max(column) < size)):
    i = _first_bad(column, lambda v: type(v) is int and 0 <= v < size)
    raise errors.ManifestError(
        f"{where}: arrays.{name}[{i}] is {column[i]!r:.40}, not an index of its"
        f" table of {size} entries."
    )
  return column


def array_specs(
    table: object, *, where: str, leaf_keys: bool
) -> tuple[arrays_lib.ArraySpec, ...]:
  """The array specs of a format 4 arrays table, checked as strictly as the
  per-array entries of format 3, but column by column: a check per distinct
  shape, dtype and kind, and one regular expression over each text column."""
  if not isinstance(table, dict) or set(table) != ARRAY_COLUMNS:
    found = sorted(table) if isinstance(table, dict) else type(table).__name__
    raise errors.ManifestError(
        f"{where}: arrays must be an object of the columns {sorted(ARRAY_COLUMNS)},"
        f" not {found}."
    )
  count = table["count"]
  if type(count) is not int or count < 0:
    raise errors.ManifestError(f"{where}: arrays.count is {count!r:.40}, not a count.")
  keys = _column(table, "key", count, where)
  paths = _column(table, "path", count, where)
  labels = _column(table, "label", count, where)
  _check_keys(keys, where, leaf_keys)
  if not _all_of(paths, (str,)) or arrays_lib.CONTROL_CHARS.search("".join(paths)):
    i = _first_bad(paths, lambda v: isinstance(v, str) and not arrays_lib.CONTROL_CHARS.search(v))
    raise errors.ManifestError(f"{where}: arrays.path[{i}] is an invalid path {paths[i]!r:.100}.")
  named = [label for label in labels if label is not None]
  if not _all_of(named, (str,)) or arrays_lib.CONTROL_CHARS.search("".join(named)):
    i = _first_bad(labels, lambda v: v is None or (
        isinstance(v, str) and not arrays_lib.CONTROL_CHARS.search(v)))
    raise errors.ManifestError(
        f"{where}: arrays.label[{i}] is an invalid label {labels[i]!r:.100}.")
  shapes = _table(table, "shapes", where)
  for i, shape in enumerate(shapes):
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
      raise errors.ManifestError(f"{where}: arrays.shapes[{i}] is an invalid shape {shape!r:.100}.")
    which = f" (label {labels[i]!r:.100})" if i < len(labels) and labels[i] else ""
    arrays_lib.check_shape_size(shape, f"{where}: arrays.shapes[{i}]{which}")
  dtypes = [arrays_lib.dtype_from_name(name, where=f"{where}: arrays.dtypes[{i}]").name
            for i, name in enumerate(_table(table, "dtypes", where))]
  kinds = _table(table, "kinds", where)
  for i, kind in enumerate(kinds):
    if kind not in arrays_lib.ARRAY_KINDS:
      raise errors.ManifestError(f"{where}: arrays.kinds[{i}] is an unknown array kind {kind!r:.40}.")
  shape_of = _indexes(table, "shape", len(shapes), count, where)
  dtype_of = _indexes(table, "dtype", len(dtypes), count, where)
  kind_of = _indexes(table, "kind", len(kinds), count, where)
  for name, entries, used in (("shapes", shapes, shape_of), ("dtypes", dtypes, dtype_of),
                              ("kinds", kinds, kind_of)):
    if len(set(used)) != len(entries):
      raise errors.ManifestError(f"{where}: arrays.{name} holds entries no array uses.")
  scalar = kinds.index("numpy_scalar") if "numpy_scalar" in kinds else -1
  for kind, shape in set(zip(kind_of, shape_of)):
    if kind == scalar and shapes[shape]:
      raise errors.ManifestError(
          f"{where}: arrays.kinds: a NumPy scalar must have shape [], not {shapes[shape]}.")
  first_of: dict[tuple[int, int], int] = {}
  for i, pair in enumerate(zip(shape_of, dtype_of)):
    first_of.setdefault(pair, i)
  for (shape, dtype), i in first_of.items():  # Once per distinct shape and dtype.
    which = f" (label {labels[i]!r:.100})" if labels[i] else ""
    arrays_lib.check_representable(
        shapes[shape], arrays_lib.SUPPORTED_DTYPES[dtypes[dtype]], f"{where}: arrays[{i}]{which}")
  weak = table["weak_type"]
  if type(weak) is not list or not _all_of(weak, (int,)) or weak != sorted(set(weak)) or (
      weak and not (0 <= weak[0] and weak[-1] < count)):
    raise errors.ManifestError(
        f"{where}: arrays.weak_type must list distinct array indexes in increasing order.")
  weak_set = set(weak)
  shape_tuples = [tuple(shape) for shape in shapes]
  sums = _checksums(_column(table, "checksums", count, where), shape_tuples, shape_of, where)
  make = arrays_lib.ArraySpec.trusted
  return tuple(
      make(keys[i], shape_tuples[shape_of[i]], dtypes[dtype_of[i]], kinds[kind_of[i]],
           i in weak_set, paths[i], labels[i], sums[i])
      for i in range(count)
  )


def _table(table: dict[str, Any], name: str, where: str) -> list[Any]:
  entries = table[name]
  if type(entries) is not list:
    raise errors.ManifestError(f"{where}: arrays.{name} must be a list.")
  return entries


def _check_keys(keys: list[Any], where: str, leaf_keys: bool) -> None:
  pattern = _LEAF_KEY if leaf_keys else _KEY
  if not _all_of(keys, (str,)) or not all(pattern.fullmatch(k) for k in keys):
    i = _first_bad(keys, lambda k: isinstance(k, str) and pattern.fullmatch(k))
    raise errors.ManifestError(f"{where}: arrays.key[{i}] is an invalid array key {keys[i]!r:.200}.")
  if len(set(keys)) != len(keys):
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
      if key in first:
        raise errors.ManifestError(
            f"{where}: arrays {first[key]} and {i} share the storage key {key!r}.")
      first[key] = i


_DIGESTS = re.compile(r"(?:[0-9a-f]{32})*")


def _checksums(
    column: list[Any], shapes: list[tuple[int, ...]], shape_of: list[int], where: str
) -> list[tuple[checksum_records.ShardChecksum, ...] | None]:
  """The checksums of each array: none (an array with no data), one digest
  of the whole array (a string), or ``[[index, digest], ...]`` of its slices.

  Every stored array has checksums in format 4, as in formats 2 and 3."""
  whole = [d for d in column if type(d) is str]
  if not _DIGESTS.fullmatch("".join(whole)) or any(len(d) != 32 for d in whole):
    i = _first_bad(column, lambda d: type(d) is not str or (
        len(d) == 32 and _DIGESTS.fullmatch(d)))
    raise errors.ManifestError(
        f"{where}: arrays.checksums[{i}] is not an {checksum_records.ALGORITHM} digest: {column[i]!r:.100}.")
  full = [checksum_records.full_index(shape) for shape in shapes]
  out: list[tuple[checksum_records.ShardChecksum, ...] | None] = []
  for i, (sums, shape) in enumerate(zip(column, shape_of)):
    if type(sums) is str:
      out.append((checksum_records.ShardChecksum(full[shape], sums),))
    elif sums is None:
      if 0 not in shapes[shape]:
        raise errors.ManifestError(
            f"{where}: arrays.checksums[{i}] is missing; every stored array of"
            " manifest format 4 has checksums. The manifest is damaged or was edited.")
      out.append(None)
    else:
      out.append(_slices(sums, shapes[shape], f"{where}: arrays.checksums[{i}]"))
  return out


def _slices(
    sums: object, shape: tuple[int, ...], where: str
) -> tuple[checksum_records.ShardChecksum, ...]:
  if type(sums) is not list or not sums:
    raise errors.ManifestError(f"{where}: must be a digest or a list of [index, digest].")
  parsed = []
  for j, entry in enumerate(sums):
    if not (type(entry) is list and len(entry) == 2 and arrays_lib.valid_checksum_entry(
        {"index": entry[0], checksum_records.ALGORITHM: entry[1]}, shape)):
      raise errors.ManifestError(
          f"{where}[{j}] is not an {checksum_records.ALGORITHM} digest of a slice of an array of shape"
          f" {list(shape)}: {str(entry)[:200]}")
    parsed.append(checksum_records.ShardChecksum(
        tuple((p[0], p[1]) for p in entry[0]), entry[1]))
  if not checksum_records.tiles((c.index for c in parsed), shape):
    raise errors.ManifestError(
        f"{where}: the checksums' slices do not cut the array of shape {list(shape)}"
        " into a grid covering each element once; the manifest is damaged or forged.")
  return tuple(parsed)
