"""Matching two saved trees as a person means it: one tree of differences.

Both sides are typed JSON trees (`pz_persist.format.nodes`), as a manifest
holds them or as a model encodes in memory, so a model and a checkpoint match
the same way. Nodes match by tree path, with Penzai's structure understood:

* a layer wrapped in another (a LoRA adapter around a ``Linear``) is the
  wrapper *added*, the original found inside it and compared with its old self
  (unchanged, if only wrapped); unwrapping is the wrapper *removed*;
* the items of a list or tuple (``Sequential.sublayers``) are aligned on
  what identifies each item (its class and the labels of the variables
  inside, the labels it shares with an edited self, its shape), so a block
  cut from the middle is *removed*, one inserted is *added*, and the blocks
  around them meet their old selves, however long the list
  (`pz_persist.tools.diff_align`, bounded in time and memory);
* a class changed at a path is *replaced*;
* variables are compared with their labels, metadata and sharing; named
  arrays with their axis names; arrays by shape and dtype here, by value
  later (`pz_persist.tools.diffing` reads them in bounded batches).

Nothing here reads an array: leaves to compare carry the manifest indices
of their two arrays (`DiffNode.refs`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Literal

from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import former_names
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import nodes
from pz_persist.tools import diff_align

Status = Literal["unchanged", "changed", "added", "removed", "replaced"]

WRAPPER_DEPTH = 12
"""How deep inside a new layer the diff looks for the layer it wraps
(``LowRankAdapter`` holds its ``Linear`` four levels down; an adapter on an
adapter, eight)."""

_TEXT = 80
"""Longest text shown for one value (a metadata dict, a function)."""


@dataclasses.dataclass
class ArrayStats:
  """How one array's values differ between A and B.

  Attributes:
    identical: Bit-identical (same dtype and bytes).
    max_abs: Largest absolute difference (NaN where one side is NaN).
    l2: Euclidean norm of the difference.
    relative_l2: ``l2`` divided by the norm of B's array (infinite if B's is
      zero and A's is not; 0 if both are).
    fraction_changed: Fraction of elements whose values differ.
  """

  identical: bool
  max_abs: float = 0.0
  l2: float = 0.0
  relative_l2: float = 0.0
  fraction_changed: float = 0.0


@dataclasses.dataclass(eq=False)
class DiffNode:
  """One node of the diff tree.

  Attributes:
    key: How its parent reaches it (``.body``, ``[2]``, ``['w']``; ``""`` at
      the root); a list item that moved says where it was (``[2] (was [3])``).
    path: Its tree path (B's; A's for something removed).
    status: ``unchanged``, ``changed`` (it or something inside it),
      ``added``, ``removed`` or ``replaced`` (another class at its path).
    kind: What it is: a class name, ``list``, ``Parameter``, ``NamedArray``...
    summary: A short text of a leaf's value (``float32[8,16]``,
      ``'gelu' -> 'relu'``).
    notes: What changed at this node itself (a label, metadata, axis names,
      a dtype or shape, a value).
    children: Its children, in B's order (removed ones where A had them).
    refs: For an array leaf: its index in A's and B's ``manifest.arrays``
      (None on a side that lacks it).
    stats: For an array compared by value: how the values differ.
    name: For an array leaf: the name `pz_persist.diff` lists it under
      (its variable's label, or its tree path).
    shared: For a variable that is shared: the path where it was shown first.
  """

  key: str
  path: str
  status: Status
  kind: str
  summary: str = ""
  notes: list[str] = dataclasses.field(default_factory=list)
  children: list[DiffNode] = dataclasses.field(default_factory=list)
  refs: tuple[int | None, int | None] = (None, None)
  stats: ArrayStats | None = None
  name: str = ""
  shared: str = ""

  def walk(self) -> list[DiffNode]:
    """This node and every node below it, parents first."""
    found, pending = [], [self]
    while pending:
      node = pending.pop()
      found.append(node)
      pending.extend(reversed(node.children))
    return found

  def settle(self) -> Status:
    """Sets ``changed`` on every node with a change inside (after the
    arrays' values are known) and returns this node's status."""
    inner = [child.settle() for child in self.children]
    if self.status == "unchanged" and (
        self.notes or any(s != "unchanged" for s in inner)
        or (self.stats is not None and not self.stats.identical)
    ):
      self.status = "changed"
    return self.status


def _tag(node: Any) -> str | None:
  return nodes.tag_of(node)


def _class_name(node: Any) -> str | None:
  if isinstance(node, dict) and nodes.names_class(_tag(node)):
    cls = node.get("class")
    if isinstance(cls, dict):
      return str(cls.get("qualname", "?"))
  return None


def _class_identity(node: Any) -> tuple[str, str] | None:
  """The class a node names, whole: ``(module, qualname)`` as loading reads it.

  Why not `_class_name`: two classes of one qualname in two modules
  (``mylib.Linear``, a former name the table does not hold) are two
  classes, and a diff calling them unchanged hides what a load refuses; a
  recorded former name (`former_names.current_name`) is the same class.
  """
  if isinstance(node, dict) and nodes.names_class(_tag(node)):
    cls = node.get("class")
    if isinstance(cls, dict):
      return former_names.current_name(str(cls.get("module", "?")), str(cls.get("qualname", "?")))
  return None


def static_text(node: Any, limit: int = _TEXT) -> str:
  """A static node (a label, metadata, an axis name) as Python-like text,
  cut at ``limit`` characters. Only text: never evaluated or trusted."""
  text = _static(node, 0)
  return text if len(text) <= limit else text[: limit - 3] + "..."


def sharding_text(node: Any, limit: int) -> str | None:
  """A ``mesh`` node by its axes (``mesh(data=2, model=4)``) or a
  ``partition_spec`` by its entries, as text; None for any other node. The
  tree's notes and `pz_persist.tools.diffing.structure_differences` both
  name meshes this way."""
  tag = _tag(node)
  if tag == "mesh" and nodes.is_pairs(node.get("axes")):
    return "mesh(" + ", ".join(f"{name}={size}" for name, size in node["axes"]) + ")"
  if tag == "partition_spec":
    return f"PartitionSpec{json.dumps(node.get('spec'))[:limit]}"
  return None


def _static(node: Any, depth: int) -> str:
  tag = _tag(node)
  if depth > 8:
    return "..."
  if tag in ("str", "int", "float", "bool"):
    return repr(node.get("v"))
  if tag == "none":
    return "None"
  if tag in ("dict", "ordered_dict") and nodes.is_pairs(node.get("items")):
    return "{" + ", ".join(
        f"{_static(k, depth + 1)}: {_static(v, depth + 1)}" for k, v in node["items"]
    ) + "}"
  if tag in ("list", "tuple", "set", "frozenset") and isinstance(node.get("items"), list):
    inner = ", ".join(_static(item, depth + 1) for item in node["items"])
    return {"list": f"[{inner}]", "tuple": f"({inner}{',' if len(node['items']) == 1 else ''})"
            }.get(str(tag), f"{tag}({{{inner}}})")
  name = _class_name(node)
  if tag == "enum":
    return f"{name}.{node.get('name')}"
  if name is not None:
    return name
  if tag == "function":
    ref = node.get("ref") if isinstance(node.get("ref"), dict) else {}
    return str(ref.get("qualname", "function"))
  if tag == "partial":
    keywords = node.get("keywords") if nodes.is_pairs(node.get("keywords")) else []
    args = [_static(a, depth + 1) for a in node.get("args") or []]
    args += [f"{k}={_static(v, depth + 1)}" for k, v in keywords]
    return f"partial({', '.join([_static(node.get('func'), depth + 1), *args])})"
  if tag == "dtype":
    return str(node.get("name"))
  sharding = sharding_text(node, _TEXT)
  if sharding is not None:
    return sharding
  if tag == "named_sharding":
    return (f"NamedSharding({_static(node.get('mesh'), depth + 1)},"
            f" {_static(node.get('spec'), depth + 1)})")
  if isinstance(node, dict) and "v" in node:
    return json.dumps(node["v"])
  return json.dumps(node, sort_keys=True)[:_TEXT] if not isinstance(node, dict) else str(tag)


def _axes(node: dict[str, Any]) -> list[tuple[str, Any]]:
  """A named array's ``(axis name, size or index)`` pairs."""
  row = nodes.NODE_TYPES[str(_tag(node))].axes
  pairs = node.get(row[0]) if row else None
  return [(static_text(name), n) for name, n in pairs] if nodes.is_pairs(pairs) else []


def _spec_text(spec: arrays_lib.ArraySpec | None) -> str:
  if spec is None:
    return "invalid array reference"
  return f"{spec.dtype}[{','.join(map(str, spec.shape))}]"


class _Side:
  """One manifest, with what matching asks of it."""

  def __init__(self, manifest: manifest_lib.Manifest, names: Mapping[int, str]):
    self.manifest = manifest
    self.names = names
    self._labels: dict[int, tuple[str, ...]] = {}
    self._digests: dict[bool, dict[int, bytes]] = {True: {}, False: {}}

  def variable(self, node: Any) -> Any:
    ref = node.get("ref")
    entries = self.manifest.variables
    return entries[ref] if type(ref) is int and 0 <= ref < len(entries) else None

  def spec(self, ref: Any) -> arrays_lib.ArraySpec | None:
    arrays = self.manifest.arrays
    return arrays[ref] if type(ref) is int and 0 <= ref < len(arrays) else None

  def labels(self, node: Any) -> tuple[str, ...]:
    """The labels of the variables inside ``node`` (what identifies a block)."""
    key = id(node)
    if key not in self._labels:
      found: list[str] = []
      pending, seen = [node], 0
      while pending and seen < 100_000:
        value = pending.pop()
        seen += 1
        if _tag(value) == "variable":
          value = self.variable(value)
        if isinstance(value, dict):
          if "label" in value:
            found.append(static_text(value.get("label")))
          pending.extend(v for k, v in value.items() if k not in ("label", "metadata"))
        elif isinstance(value, list):
          pending.extend(value)
      self._labels[key] = tuple(sorted(found))
    return self._labels[key]

  def signature(self, node: Any) -> tuple[Any, ...]:
    """What identifies a list item across an edit: its type, class and the
    labels inside; with no labels, its whole structure."""
    labels = self.labels(node)
    if labels:
      return (_tag(node), _class_name(node), labels)
    return (_tag(node), _class_name(node), self.digest(node, exact=True))

  def digest(self, node: Any, *, exact: bool) -> bytes:
    """A hash of ``node``'s structure with its variables and arrays' specs
    resolved (array values are not read); with ``exact=False`` labels and
    metadata left out, so a relabelled block hashes as its old self.

    Iterative and remembered per node: nested lists each ask for their
    items' hashes, and a manifest may nest as deep as the format allows."""
    memo = self._digests[exact]
    pending: list[tuple[Any, bool]] = [(node, False)]
    while pending:
      value, ready = pending.pop()
      if id(value) in memo:
        continue
      inner = self._inner(value, exact)
      if not ready:
        pending.append((value, True))
        pending.extend((child, False) for _, child in inner
                       if isinstance(child, (dict, list)) and id(child) not in memo)
        continue
      h = hashlib.blake2b(digest_size=16)
      h.update(self._own_text(value).encode())
      for key, child in inner:
        h.update(f"|{key}=".encode())
        if isinstance(child, (dict, list)):
          h.update(memo[id(child)])
        else:  # A plain value: its text (not remembered: values are many).
          h.update(json.dumps(child, default=str).encode())
      memo[id(value)] = h.digest()
    return memo[id(node)]

  def _inner(self, value: Any, exact: bool) -> list[tuple[str, Any]]:
    """The parts of ``value`` its digest is made of (a variable's entry in
    place of its reference; an array's spec is its own text)."""
    tag = _tag(value)
    if tag == "variable":
      entry = self.variable(value)
      return [] if entry is None else [("entry", entry)]
    if tag == "array":
      return []
    if isinstance(value, dict):
      skip = () if exact else ("label", "metadata")
      return [(key, value[key]) for key in sorted(value) if key not in skip]
    if isinstance(value, list):
      return [(str(index), item) for index, item in enumerate(value)]
    return []

  def _own_text(self, value: Any) -> str:
    tag = _tag(value)
    if tag == "array":
      return f"array {_spec_text(self.spec(value.get('ref')))}"
    if tag == "variable":
      return "variable"
    if isinstance(value, dict):
      return "dict"
    if isinstance(value, list):
      return f"list {len(value)}"
    return json.dumps(value, default=str)

  def keys(self, items: Sequence[Any]) -> diff_align.Keys:
    """What identifies each of ``items`` for `pz_persist.tools.diff_align`."""
    return diff_align.Keys(
        exact=[self.digest(item, exact=True) for item in items],  # Remembered: cheap.
        labels=lambda i: self.labels(items[i]),
        shape=lambda i: (_tag(items[i]), _class_name(items[i]),
                         self.digest(items[i], exact=False)),
        kind=[(_tag(item), _class_name(item)) for item in items],
    )


def _named_fields(node: dict[str, Any]) -> bool:
  """Whether a struct's ``fields`` are ``[name, node]`` pairs with text names
  (the manifest's JSON is unchecked until decoded: a hostile one may hold
  anything there, then compared as a plain value)."""
  fields = node.get("fields")
  return nodes.is_pairs(fields) and all(isinstance(name, str) for name, _ in fields)


def _children(node: Any) -> list[tuple[str, Any]]:
  """A node's children with the keys that reach them (for the wrapper search)."""
  tag = _tag(node)
  if tag in ("struct", "dataclass") and nodes.is_pairs(node.get("fields")):
    return [(f".{name}", value) for name, value in node["fields"]]
  if tag in ("list", "tuple", "namedtuple") and isinstance(node.get("items"), list):
    return [(f"[{i}]", value) for i, value in enumerate(node["items"])]
  return []


class Matcher:
  """Builds the `DiffNode` tree of two manifests."""

  def __init__(self, a: manifest_lib.Manifest, b: manifest_lib.Manifest,
               names: tuple[Mapping[int, str], Mapping[int, str]]):
    self.sides = (_Side(a, names[0]), _Side(b, names[1]))
    self._shared: dict[tuple[Any, Any], str] = {}
    self._seen_a: dict[Any, Any] = {}
    self.aligner = diff_align.Aligner()

  def build(self) -> DiffNode:
    a, b = self.sides[0].manifest.tree, self.sides[1].manifest.tree
    return self.compare(a, b, "", "tree", "tree")

  # One side only.

  def one_side(self, node: Any, key: str, path: str, side: int,
               status: Status) -> DiffNode:
    """A subtree only one side has: every node in it ``added`` or ``removed``."""
    owner = self.sides[side]
    tag = _tag(node)
    if tag == "variable":
      entry = owner.variable(node)
      if entry is not None:
        result = self._variable_node(entry, key, path, status, kind=str(entry.get("kind", "")))
        result.children = [self.one_side(entry.get("value"), ".value", f"{path}.value",
                                         side, status)]
        return result
    if tag in ("parameter_value", "state_variable_value"):
      result = self._variable_node(node, key, path, status, kind=str(tag))
      result.children = [self.one_side(node.get("value"), ".value", f"{path}.value",
                                       side, status)]
      return result
    leaf = self._leaf(node, side)
    if leaf is not None:
      kind, summary, ref = leaf
      refs = (ref, None) if side == 0 else (None, ref)
      name = owner.names.get(ref, "") if ref is not None else ""
      return DiffNode(key, path, status, kind, summary, refs=refs, name=name)
    result = DiffNode(key, path, status, self._kind(node))
    for child_key, child in self._all_children(node):
      result.children.append(self.one_side(child, child_key, path + child_key, side, status))
    if not result.children:
      result.summary = static_text(node)
    return result

  def _all_children(self, node: Any) -> list[tuple[str, Any]]:
    tag = _tag(node)
    if tag in ("dict", "ordered_dict") and nodes.is_pairs(node.get("items")):
      return [(f"[{static_text(k, 40)}]", v) for k, v in node["items"]]
    return _children(node)

  def _kind(self, node: Any) -> str:
    return _class_name(node) or str(_tag(node) or type(node).__name__)

  def _leaf(self, node: Any, side: int) -> tuple[str, str, int | None] | None:
    """``(kind, summary, array ref)`` of an array-like leaf, or None."""
    tag = _tag(node)
    owner = self.sides[side]
    if tag == "array":
      ref = node.get("ref")
      return "array", _spec_text(owner.spec(ref)), ref if owner.spec(ref) else None
    if tag == "prng_key" and _tag(node.get("data")) == "array":
      ref = node["data"].get("ref")
      return "PRNG key", f"{node.get('impl')} {_spec_text(owner.spec(ref))}", (
          ref if owner.spec(ref) else None)
    if tag in ("named_array", "named_array_view"):
      inner = self._leaf(node.get("data"), side)
      axes = ", ".join(f"{name}:{n}" for name, n in _axes(node))
      kind = "NamedArray" if tag == "named_array" else "NamedArrayView"
      if inner is None:
        return kind, f"{{{axes}}}", None
      return kind, f"{inner[1]} {{{axes}}}", inner[2]
    return None

  def _variable_node(self, entry: dict[str, Any], key: str, path: str, status: Status,
                     kind: str) -> DiffNode:
    names = {"parameter": "Parameter", "state_variable": "StateVariable",
             "parameter_value": "ParameterValue", "state_variable_value": "StateVariableValue"}
    return DiffNode(key, path, status, names.get(kind, kind or "variable"),
                    summary=f"label={static_text(entry.get('label'))}")

  # Both sides.

  def compare(self, a: Any, b: Any, key: str, path_a: str, path_b: str) -> DiffNode:
    tag_a, tag_b = _tag(a), _tag(b)
    if tag_a == tag_b == "variable":
      return self._variables(a, b, key, path_a, path_b)
    if tag_a == tag_b and tag_a in ("parameter_value", "state_variable_value"):
      return self._labeled(a, b, key, path_b, str(tag_a))
    leaves = self._leaf(a, 0), self._leaf(b, 1)
    if leaves[0] is not None and leaves[1] is not None:
      return self._arrays(a, b, leaves, key, path_b)
    if tag_a != tag_b or _class_identity(a) != _class_identity(b):
      return self._different_kinds(a, b, key, path_a, path_b)
    if tag_a in ("struct", "dataclass") and _named_fields(a) and _named_fields(b):
      return self._fields(a, b, key, path_a, path_b)
    if tag_a in ("list", "tuple", "namedtuple") and isinstance(a.get("items"), list) and (
        isinstance(b.get("items"), list)):
      return self._items(a, b, key, path_a, path_b)
    if tag_a in ("dict", "ordered_dict") and nodes.is_pairs(a.get("items")) and nodes.is_pairs(
        b.get("items")):
      return self._keyed(a, b, key, path_a, path_b)
    result = DiffNode(key, path_b, "unchanged", self._kind(b), static_text(b))
    if a != b:
      text_a, text_b = static_text(a), static_text(b)
      if tag_a in ("parameter_slot", "state_variable_slot"):
        result.notes.append(f"label {static_text(a.get('label'))} -> "
                            f"{static_text(b.get('label'))}")
      elif text_a == text_b:
        result.notes.append(f"{text_a} (differs in detail)")
      else:
        result.notes.append(f"{text_a} -> {text_b}")
      result.summary = ""  # The note says both.
    return result

  def _different_kinds(self, a: Any, b: Any, key: str, path_a: str, path_b: str) -> DiffNode:
    """A wrapper added or removed, or the node replaced."""
    for outer, inner, side in ((b, a, 1), (a, b, 0)):
      route = self._find_inside(outer, inner, side)
      if route is not None:
        return self._wrapper(outer, inner, route, side, key, path_a, path_b)
    kind_a, kind_b = self._kind(a), self._kind(b)
    if kind_a == kind_b and _class_identity(a) != _class_identity(b):  # Same qualname.
      kind_a, kind_b = (".".join(_class_identity(x) or ("?",)) for x in (a, b))
    if not any(_class_name(x) or _children(x) or self._leaf(x, side) or _tag(x) in (
        "variable", "dict", "ordered_dict") for x, side in ((a, 0), (b, 1))):
      # Plain values (a function swapped for a partial): changed, not replaced.
      return DiffNode(key, path_b, "unchanged", kind_b,
                      notes=[f"{static_text(a)} -> {static_text(b)}"])
    if _tag(a) == _tag(b) and _tag(a) in ("struct", "dataclass") and _named_fields(
        a) and _named_fields(b) and (
        [name for name, _ in a["fields"]] == [name for name, _ in b["fields"]]):
      # Another class with the same fields (a renamed or swapped class of the
      # same shape): replaced, and its fields still compared one by one.
      result = self._fields(a, b, key, path_a, path_b)
      result.status = "replaced"
      result.notes.append(f"was {kind_a}")
      return result
    result = DiffNode(key, path_b, "replaced", kind_b)
    result.notes.append(f"was {kind_a}")
    result.children = [
        self.one_side(a, "was", path_a, 0, "removed"),
        self.one_side(b, "now", path_b, 1, "added"),
    ]
    return result

  def _find_inside(self, outer: Any, inner: Any, side: int) -> list[str] | None:
    """The keys leading from ``outer`` (on ``side``) to a node that is
    ``inner`` (on the other side) by class and labels, within `WRAPPER_DEPTH`."""
    if _class_name(inner) is None and _tag(inner) not in ("list", "tuple"):
      return None
    owner, other = self.sides[side], self.sides[1 - side]
    wanted = other.signature(inner)
    candidates = []  # Same class, other labels: the first, if none is the same.
    level: list[tuple[list[str], Any]] = [([], outer)]
    for _ in range(WRAPPER_DEPTH):
      following = []
      for route, node in level:
        for child_key, child in _children(node):
          if _tag(child) == _tag(inner) and _class_name(child) == _class_name(inner):
            if owner.signature(child) == wanted:
              return [*route, child_key]
            candidates.append([*route, child_key])
          following.append(([*route, child_key], child))
      level = following
    return candidates[0] if candidates and _class_name(inner) is not None else None

  def _wrapper(self, outer: Any, inner: Any, route: list[str], side: int, key: str,
               path_a: str, path_b: str) -> DiffNode:
    """``outer`` (on ``side``) wraps ``inner``: the route to it is added (or
    removed), the rest of ``outer`` too, and ``inner`` is compared."""
    status: Status = "added" if side == 1 else "removed"
    outer_path = path_b if side == 1 else path_a

    def build(node: Any, steps: list[str], node_key: str, path: str) -> DiffNode:
      if not steps:
        pair = (inner, node) if side == 1 else (node, inner)
        paths = (path_a, path) if side == 1 else (path, path_b)
        return self.compare(*pair, node_key, *paths)
      result = DiffNode(node_key, path, status, self._kind(node))
      for child_key, child in _children(node):
        if child_key == steps[0]:
          result.children.append(build(child, steps[1:], child_key, path + child_key))
        else:
          result.children.append(self.one_side(child, child_key, path + child_key, side, status))
      return result

    result = build(outer, route, key, outer_path)
    where = "".join(route)
    result.notes.append(f"wraps the {self._kind(inner)} (now at {where})" if side == 1 else
                        f"unwrapped: the {self._kind(inner)} it held at {where} is here")
    return result

  def _fields(self, a: dict[str, Any], b: dict[str, Any], key: str, path_a: str,
              path_b: str) -> DiffNode:
    fields_a, fields_b = dict(map(tuple, a["fields"])), dict(map(tuple, b["fields"]))
    result = DiffNode(key, path_b, "unchanged", self._kind(b))
    for name in dict.fromkeys([*fields_b, *fields_a]):
      child_key = f".{name}"
      if name not in fields_a:
        result.children.append(self.one_side(fields_b[name], child_key, path_b + child_key, 1,
                                             "added"))
      elif name not in fields_b:
        result.children.append(self.one_side(fields_a[name], child_key, path_a + child_key, 0,
                                             "removed"))
      else:
        result.children.append(self.compare(fields_a[name], fields_b[name], child_key,
                                            path_a + child_key, path_b + child_key))
    return result

  def _keyed(self, a: dict[str, Any], b: dict[str, Any], key: str, path_a: str,
             path_b: str) -> DiffNode:
    def entries(node: dict[str, Any]) -> dict[str, Any]:
      return {json.dumps(k, sort_keys=True): (k, v) for k, v in node["items"]}

    items_a, items_b = entries(a), entries(b)
    result = DiffNode(key, path_b, "unchanged", self._kind(b))
    for name in dict.fromkeys([*items_b, *items_a]):
      shown = items_b[name] if name in items_b else items_a[name]
      child_key = f"[{static_text(shown[0], 40)}]"
      if name not in items_a:
        result.children.append(self.one_side(items_b[name][1], child_key, path_b + child_key,
                                             1, "added"))
      elif name not in items_b:
        result.children.append(self.one_side(items_a[name][1], child_key, path_a + child_key,
                                             0, "removed"))
      else:
        result.children.append(self.compare(items_a[name][1], items_b[name][1], child_key,
                                            path_a + child_key, path_b + child_key))
    return result

  def _items(self, a: dict[str, Any], b: dict[str, Any], key: str, path_a: str,
             path_b: str) -> DiffNode:
    """A list's items, aligned by what each item is (`diff_align`): an item
    inserted or cut leaves the others facing their old selves. A named
    tuple's items are its fields: by position while it has as many."""
    items_a, items_b = a["items"], b["items"]
    result = DiffNode(key, path_b, "unchanged", self._kind(b))
    if _tag(a) == "namedtuple" and len(items_a) == len(items_b):
      alignment = diff_align.Alignment(list(zip(range(len(items_a)), range(len(items_b)))))
    else:
      alignment = self.aligner.align(self.sides[0].keys(items_a), self.sides[1].keys(items_b))
    if len(items_a) != len(items_b):
      result.notes.append(f"{len(items_a)} items -> {len(items_b)}")
    if alignment.by_position:
      result.notes.append(
          f"{alignment.by_position} items paired by position only: too many alike"
          " to align in bounded time")
    for i, j in alignment.pairs:
      if i is None:
        assert j is not None
        result.children.append(self.one_side(items_b[j], f"[{j}]", f"{path_b}[{j}]", 1, "added"))
      elif j is None:
        result.children.append(self.one_side(items_a[i], f"[{i}]", f"{path_a}[{i}]", 0,
                                             "removed"))
      else:
        child_key = f"[{j}]" if i == j else f"[{j}] (was [{i}])"
        result.children.append(self.compare(items_a[i], items_b[j], child_key,
                                            f"{path_a}[{i}]", f"{path_b}[{j}]"))
    return result

  def _variables(self, a: dict[str, Any], b: dict[str, Any], key: str, path_a: str,
                 path_b: str) -> DiffNode:
    """Mutable variables: compared once; a shared one says where it was shown."""
    refs = (a.get("ref"), b.get("ref"))
    entries = self.sides[0].variable(a), self.sides[1].variable(b)
    if entries[0] is None or entries[1] is None:
      return self.compare(entries[0], entries[1], key, path_a, path_b)
    kind = str(entries[1].get("kind", ""))
    try:
      first = self._shared.get(refs)
    except TypeError:
      first = None
    if first is not None:
      result = self._variable_node(entries[1], key, path_b, "unchanged", kind)
      result.shared = first
      return result
    result = self._labeled(entries[0], entries[1], key, path_b, kind)
    if str(entries[0].get("kind")) != kind:
      result.notes.append(f"{entries[0].get('kind')} -> {kind}")
    seen_b = self._seen_a.get(refs[0])
    if seen_b is not None and seen_b != refs[1]:
      result.notes.append("sharing differs: A's variable is shared here, B's is not")
    try:
      self._shared[refs] = path_b
      self._seen_a.setdefault(refs[0], refs[1])
    except TypeError:
      pass
    return result

  def _labeled(self, a: dict[str, Any], b: dict[str, Any], key: str, path: str,
               kind: str) -> DiffNode:
    result = self._variable_node(b, key, path, "unchanged", kind)
    if a.get("label") != b.get("label"):
      result.notes.append(f"label {static_text(a.get('label'))} -> "
                          f"{static_text(b.get('label'))}")
    if a.get("metadata") != b.get("metadata"):
      result.notes.append(f"metadata {static_text(a.get('metadata'))} -> "
                          f"{static_text(b.get('metadata'))}")
    result.children = [self.compare(a.get("value"), b.get("value"), ".value",
                                    f"{path}.value", f"{path}.value")]
    return result

  def _arrays(self, a: dict[str, Any], b: dict[str, Any],
              leaves: tuple[Any, Any], key: str, path: str) -> DiffNode:
    (kind_a, summary_a, ref_a), (kind_b, summary_b, ref_b) = leaves
    result = DiffNode(key, path, "unchanged", kind_b, summary_b, refs=(ref_a, ref_b))
    result.name = self.sides[0].names.get(ref_a, "") if ref_a is not None else ""
    if kind_a != kind_b:
      result.notes.append(f"{kind_a} -> {kind_b}")
    if _tag(a) == _tag(b) and _tag(a) in ("named_array", "named_array_view"):
      axes_a, axes_b = _axes(a), _axes(b)
      if [n for n, _ in axes_a] != [n for n, _ in axes_b]:
        result.notes.append(f"axes ({', '.join(n for n, _ in axes_a)}) -> "
                            f"({', '.join(n for n, _ in axes_b)})")
      elif axes_a != axes_b:
        result.notes.append(f"axes {axes_a} -> {axes_b}")
    spec_a, spec_b = self.sides[0].spec(ref_a), self.sides[1].spec(ref_b)
    if spec_a is not None and spec_b is not None:
      if spec_a.shape != spec_b.shape:
        result.notes.append(f"shape {list(spec_a.shape)} -> {list(spec_b.shape)}")
      if spec_a.dtype != spec_b.dtype:
        result.notes.append(f"dtype {spec_a.dtype} -> {spec_b.dtype}")
    elif summary_a != summary_b:
      result.notes.append(f"{summary_a} -> {summary_b}")
    return result


def top_changes(root: DiffNode) -> list[DiffNode]:
  """The changes worth a line each: not the nodes inside an added, removed or
  replaced subtree (its root says it), nor containers only changed inside."""
  every = root.walk()
  parents = {id(child): node for node in every for child in node.children}
  return [
      node for node in every
      if node.status != "unchanged" and not _inside_its_root(node, parents) and (
          not node.children or node.notes or node.status != "changed")
  ]


def _inside_its_root(node: DiffNode, parents: dict[int, DiffNode]) -> bool:
  """Whether ``node`` (added or removed) lies in a subtree whose root says
  so already: an ancestor of its status, or a replaced node's was / now."""
  parent = parents.get(id(node))
  while parent is not None:
    if node.status in ("added", "removed") and parent.status in (node.status, "replaced"):
      return True
    parent = parents.get(id(parent))
  return False


def structure_lines(root: DiffNode) -> list[str]:
  """Where the two saved structures differ, one line per change, by tree path
  (``tree.body.sublayers[2]: replaced Dropout (was Linear)``): `top_changes`
  without the arrays that differ only in value."""
  lines = []
  for node in top_changes(root):
    if node.status == "changed" and not node.notes:
      continue  # Its values differ (its stats say how): no change of structure.
    status = "" if node.status == "changed" else f"{node.status} "
    notes = f" ({'; '.join(node.notes)})" if node.notes else ""
    lines.append(f"{node.path}: {status}{node.kind}{notes}")
  return lines


def array_names(manifest: manifest_lib.Manifest) -> dict[int, str]:
  """Stable names of a checkpoint's arrays by index: label (+ index) or tree path."""
  counts: dict[str, int] = {}
  names = {}
  for index, spec in enumerate(manifest.arrays):
    if spec.label is None:
      names[index] = spec.path
    else:
      position = counts.get(spec.label, 0)
      counts[spec.label] = position + 1
      names[index] = spec.label if position == 0 else f"{spec.label}[{position}]"
  return names


def finite(x: float) -> float | None:
  return x if math.isfinite(x) else None
