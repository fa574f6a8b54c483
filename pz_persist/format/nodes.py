"""The manifest's node types, as data: the one table of the tree format.

Every node of a saved tree is a JSON object ``{"t": tag, ...fields}``. Which
fields each tag has, what JSON each field holds and which fields hold child
nodes is written here once, in `NODE_TYPES`; the encoder builds nodes through
`node` (so it cannot emit a field the table does not list), the decoder
validates a node's shape with `check_shape` before its tag's decode function
runs, and the tools that walk manifests without decoding them
(`pz_persist.tools.diffing`, `pz_persist.tools.diff_tree`,
`pz_persist.tools.viewing`) find children, classes and axes through the table.
Adding a node type is one row here plus its encoding and decode function;
``tests/test_nodes.py`` fails if a consumer misses a tag.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any
from typing import Literal
from typing import NoReturn
from typing import TypeGuard

from penzai import pz

from pz_persist import errors
from pz_persist import version

Node = dict[str, Any]

PRNG_IMPLS = frozenset({"threefry2x32", "rbg", "unsafe_rbg"})
"""The PRNG implementations JAX ships; a checkpoint may name no other."""

MAX_DEPTH = 100
"""Deepest nesting a manifest may have (refused beyond, not a RecursionError).

Penzai models nest a few tens of levels; each level costs several Python
frames in the decoder, so this stays well inside the interpreter's limit."""

Json = Literal["any", "node", "list", "pairs", "ints"]
"""What JSON a field holds: anything (its decode function checks it), one
typed node, a list (of nodes), a list of ``[key, value]`` pairs, or a list of
integers."""

Holds = Literal["", "child", "static"]
"""Which nodes a field holds (for pairs: in the values): none, children
decoded like their parent (a tree's children can hold arrays), or static
values (labels, metadata, axis names, a partial's arguments)."""


@dataclasses.dataclass(frozen=True)
class Field:
  """One field of a node type.

  Attributes:
    name: The JSON key.
    json: The JSON it holds (see `Json`); checked generically by `check_shape`.
    holds: The nodes it holds (see `Holds`).
    keys: For pairs, what the first element is: ``"static"`` (a static node),
      ``"str"`` (a name) or ``""`` (nothing checked here).
  """

  name: str
  json: Json = "any"
  holds: Holds = ""
  keys: Literal["", "static", "str"] = ""


@dataclasses.dataclass(frozen=True)
class NodeType:
  """One node type of the tree format.

  Attributes:
    tag: Its ``"t"``.
    fields: Its fields besides ``"t"``, all required.
    static: Whether it may appear in a static value (a label, metadata...).
    tree: Whether it may appear in a tree (where arrays and variables live).
    axes: For named arrays, the field of ``[axis name, n]`` pairs and what
      ``n`` is: ``"size"`` (the last dimensions, in order) or ``"index"`` (a
      dimension of the data array).
    format: The manifest format that introduced it: a manifest holding it
      declares at least this ``format_version`` (see `format_needed`).
    since: The pz_persist release that first wrote it.
  """

  tag: str
  fields: tuple[Field, ...] = ()
  static: bool = True
  tree: bool = True
  axes: tuple[str, Literal["size", "index"]] | None = None
  format: int = 1
  since: str = "0.1.0"

  @functools.cached_property
  def field_names(self) -> frozenset[str]:
    return frozenset(f.name for f in self.fields)

  @functools.cached_property
  def keys(self) -> frozenset[str]:
    """The keys of its JSON object: ``"t"`` and its fields."""
    return self.field_names | {"t"}

  @functools.cached_property
  def checked_fields(self) -> tuple[Field, ...]:
    """Its fields whose JSON `check_shape` checks (a list, pairs, ints)."""
    return tuple(f for f in self.fields if f.json in ("list", "pairs", "ints"))

  def field(self, name: str) -> Field | None:
    return next((f for f in self.fields if f.name == name), None)


def _types(*types: NodeType) -> dict[str, NodeType]:
  return {t.tag: t for t in types}


_CLASS = Field("class")
_ITEMS = Field("items", "list", holds="child")
_VALUE = Field("v")
_LABEL = Field("label", "node", holds="static")
_DATA = Field("data", "node", holds="child")
_LABELED = (_LABEL, Field("metadata", "node", holds="static"), Field("value", "node", holds="child"))

NODE_TYPES: dict[str, NodeType] = _types(
    # Scalars.
    NodeType("none"),
    NodeType("bool", (_VALUE,)),
    NodeType("int", (_VALUE,)),
    NodeType("float", (_VALUE,)),
    NodeType("complex", (Field("re"), Field("im"))),
    NodeType("str", (_VALUE,)),
    NodeType("bytes", (Field("b64"),)),
    NodeType("np_scalar", (Field("dtype"), Field("hex")), tree=False),
    # Containers.
    NodeType("list", (_ITEMS,)),
    NodeType("tuple", (_ITEMS,)),
    NodeType("set", (_ITEMS,)),
    NodeType("frozenset", (_ITEMS,)),
    NodeType("namedtuple", (_CLASS, _ITEMS)),
    NodeType("dict", (Field("items", "pairs", holds="child", keys="static"),)),
    NodeType("ordered_dict", (Field("items", "pairs", holds="child", keys="static"),)),
    # Structure and references to code.
    NodeType("struct", (_CLASS, Field("fields", "pairs", holds="child", keys="str"))),
    NodeType("dataclass", (_CLASS, Field("fields", "pairs", holds="child", keys="str"))),
    NodeType("enum", (_CLASS, Field("name"))),
    NodeType("dtype", (Field("name"),)),
    NodeType("type", (_CLASS,)),
    NodeType("function", (Field("ref"),)),
    NodeType("partial", (
        Field("func", "node", holds="static"),
        Field("args", "list", holds="static"),
        Field("keywords", "pairs", holds="static", keys="str"),
    )),
    # Device meshes and shardings, as axis names and sizes (`meshes`).
    # Added within format 2 (before node types raised the format they need).
    NodeType(
        "mesh", (Field("axes", "pairs", keys="str"), Field("axis_types")),
        format=2, since="0.6.0",
    ),
    NodeType("partition_spec", (Field("spec"),), format=2, since="0.6.0"),
    NodeType("named_sharding", (
        Field("mesh", "node", holds="static"),
        Field("spec", "node", holds="static"),
        Field("memory_kind"),
    ), format=2, since="0.6.0"),
    # Arrays.
    NodeType("array", (Field("ref"),), static=False),
    NodeType("prng_key", (Field("impl"), _DATA), static=False),
    NodeType(
        "named_array",
        (Field("axes", "pairs", keys="static"), _DATA),
        static=False,
        axes=("axes", "size"),
    ),
    NodeType(
        "named_array_view",
        (
            Field("data_shape", "ints"),
            Field("logical_axes", "ints"),
            Field("name_axes", "pairs", keys="static"),
            _DATA,
        ),
        static=False,
        axes=("name_axes", "index"),
    ),
    # Variables.
    NodeType("parameter_value", _LABELED, static=False),
    NodeType("state_variable_value", _LABELED, static=False),
    NodeType("parameter_slot", (_LABEL,), static=False),
    NodeType("state_variable_slot", (_LABEL,), static=False),
    NodeType("variable", (Field("ref"),), static=False),
)
"""Every node type, by tag.

A new node type is a new manifest format: its row's ``format`` is one above
the newest format so far (`pz_persist.format.manifest.FORMAT_VERSION`, raised
with it), so a manifest holding it declares that format and an older reader
refuses it by its number, saying which format it needs
(`pz_persist.errors.FormatVersionError`), instead of meeting a tag it does not
know. Manifests that do not hold it keep their format and load in older
releases. (The three rows marked 0.6.0 were added within format 2, before
this rule.)
"""

_NEWEST_NODE_FORMAT = max(node_type.format for node_type in NODE_TYPES.values())


def format_needed(tree: object, variables: Iterable[object] = (), *, at_least: int) -> int:
  """The manifest format a tree's nodes need: the newest ``format`` of the
  node types it holds, and at least ``at_least``.

  Free while no node type is newer than ``at_least`` (no walk at all);
  afterwards one walk of the JSON, only on save.
  """
  if _NEWEST_NODE_FORMAT <= at_least:
    return at_least
  needed = at_least
  pending = [tree, list(variables)]
  while pending:
    value = pending.pop()
    if isinstance(value, dict):
      node_type = NODE_TYPES.get(tag_of(value) or "")
      if node_type is not None:
        needed = max(needed, node_type.format)
      pending.extend(value.values())
    elif isinstance(value, list):
      pending.extend(value)
  return needed


def unknown_node(
    tag: str, where: str, *, format_version: int | None, writer: str | None,
    reader_version: str, reader_format: int,
) -> errors.ManifestError:
  """The error for a tag this pz_persist does not know, in a manifest of
  ``format_version`` written by ``writer``.

  A newer writer that added the tag (within a format, as 0.6.0 did) is told
  apart from damage by the writer's release: then the checkpoint needs that
  release, and the message says which one and which formats this one reads
  (`errors.FormatVersionError`). Otherwise the manifest declares a format
  this pz_persist reads, whose node types it knows: the tag is damage.
  """
  reads = (f"this pz_persist ({reader_version}) reads manifest formats 1 to {reader_format}"
           f" and their {len(NODE_TYPES)} node types")
  written = release_of(writer)
  if written is not None and written > release_tuple(reader_version):
    declared = f" in manifest format {format_version}" if format_version is not None else ""
    return errors.FormatVersionError(
        f"{where}: node type {tag!r:.60} is not one this pz_persist knows: the checkpoint"
        f" was written by pz_persist {'.'.join(map(str, written))}{declared} and needs"
        f" that release or a later one to read it; {reads}."
        f" Upgrade with: {version.install_command(upgrade=True)}"
    )
  declared = (f"manifest format {format_version}" if format_version is not None
              else "this manifest format")
  return errors.ManifestError(
      f"{where}: unknown node type {tag!r:.60}: not a node type of {declared}"
      + (f" (written by {writer!s:.60})" if writer else "")
      + f"; {reads}. The manifest is damaged or was edited; a checkpoint needing"
      " newer node types declares a newer format."
  )


def release_of(writer: str | None) -> tuple[int, ...] | None:
  """The release numbers of a manifest's ``writer`` (``"pz_persist 0.6.0"``),
  or None if it names none."""
  if not isinstance(writer, str) or not writer.startswith("pz_persist "):
    return None
  return release_tuple(writer[len("pz_persist "):])


def release_tuple(text: str) -> tuple[int, ...]:
  """``"0.6.0"`` (or ``"0.6.0.dev1"``) as ``(0, 6, 0)``: its leading numbers."""
  numbers = []
  for part in text.split("."):
    if not part.isdigit():
      break
    numbers.append(int(part))
  return tuple(numbers)

VARIABLE_ENTRY_FIELDS = frozenset({"kind", "label", "metadata", "value"})
"""The keys of an entry of the manifest's variables table."""



def node(tag: str, **fields: object) -> Node:
  """A node of type ``tag``; refuses fields the table does not list.

  The encoder builds every node through this, so what it writes and what the
  decoder expects are the same table row. Fields are written in the row's
  order (the manifest's bytes depend on it).
  """
  node_type = NODE_TYPES[tag]
  if fields.keys() != node_type.field_names:
    raise AssertionError(
        f"node {tag!r} built with fields {sorted(fields)}, the table says"
        f" {sorted(node_type.field_names)}."
    )
  return {"t": tag, **{f.name: fields[f.name] for f in node_type.fields}}


def tag_of(node_: object) -> str | None:
  """The tag of a typed node, or None if ``node_`` is not one."""
  if isinstance(node_, dict) and isinstance(node_.get("t"), str):
    return node_["t"]
  return None


def check_typed(node_: object, where: str) -> str:
  """The tag of ``node_``; refuses anything that is not a typed node."""
  tag = tag_of(node_)
  if tag is None:
    raise errors.ManifestError(f"{where}: expected a typed node, got {node_!r:.80}.")
  return tag


def _refuse_fields(node_: Node, tag: str, names: frozenset[str], where: str) -> NoReturn:
  raise errors.ManifestError(
      f"{where}: node {tag!r} has fields {sorted(node_)}, expected"
      f" {sorted({'t', *names})}."
  )


def check_shape(node_: Node, where: str, node_type: NodeType | None = None) -> NodeType:
  """Checks a node's JSON shape against its table row, once for every tag.

  The node's keys must be exactly its type's fields, and each field must hold
  the JSON its row says (a list, a list of pairs, a list of integers); what
  the values mean is left to the tag's decode function. ``node_type``, when
  given, is the node's row (the caller looked it up already).

  Every node of a manifest goes through here: it is kept to a dict lookup
  and one comparison of key sets for the rows holding no list.
  """
  if node_type is None:
    node_type = NODE_TYPES[node_["t"]]
  if node_.keys() != node_type.keys:
    _refuse_fields(node_, node_type.tag, node_type.field_names, where)
  for field in node_type.checked_fields:
    _check_json(node_[field.name], field, where)
  return node_type


def _check_json(value: object, field: Field, where: str) -> None:
  if field.json == "list" and not isinstance(value, list):
    raise errors.ManifestError(f"{where}: {field.name} must be a list.")
  if field.json == "pairs" and not is_pairs(value):
    raise errors.ManifestError(f"{where}: expected a list of pairs.")
  if field.json == "ints" and (
      not isinstance(value, list) or not all(type(v) is int for v in value)
  ):
    raise errors.ManifestError(f"{where}: expected a list of integers.")


def is_pairs(value: object) -> TypeGuard[list[list[Any]]]:
  """Whether ``value`` is a list of two-element lists."""
  return isinstance(value, list) and all(
      isinstance(p, list) and len(p) == 2 for p in value
  )


def children(node_: Any, holds: Holds = "child") -> Iterator[Any]:
  """The nodes a typed node's fields hold (by default its children).

  The JSON may be unchecked (the manifest's, before decoding): anything
  malformed holds nothing here, and an unknown tag has no children.
  """
  node_type = NODE_TYPES.get(tag_of(node_) or "")
  if node_type is None:
    return
  for field in node_type.fields:
    if field.holds != holds:
      continue
    value = node_.get(field.name)
    if field.json == "node":
      yield value
    elif field.json == "list" and isinstance(value, list):
      yield from value
    elif field.json == "pairs" and isinstance(value, list):
      yield from (p[1] for p in value if isinstance(p, list) and len(p) == 2)


def check_depth_through_variables(tree: object, variables: object, where: str) -> list[int]:
  """Refuses typed JSON (formats 1 to 3) in which a ``variable`` node uses a
  variable entry deeper than `MAX_DEPTH` allows; returns the reference of
  every ``array`` node of the tree and of each variable entry (each entry
  walked once, however many places use it), for `arrays_referenced_once`.

  Why: the decoder decodes a variable's entry (label, metadata and value one
  level below the ``variable`` node) where it first meets it and reuses it
  for every other use, so its depth check sees the first use only: an entry
  first used near the root and again under deep nesting loaded deeper than
  readers accept. This counts every use (format 4's check,
  `pz_persist.format.compact`, counts shared entries so too). Anything else
  too deep, or malformed, is left to the decoder, which refuses it where it
  meets it.

  Raises:
    ManifestError: naming the entry, and how deep it is used.
  """
  entries = variables if isinstance(variables, (list, tuple)) else ()
  extents: dict[int, int] = {}
  refs: list[int] = []

  def deepest(root: Any, start: int) -> int:
    reached = start
    stack = [(root, start)]
    while stack:
      node, depth = stack.pop()
      reached = max(reached, depth)
      if depth > MAX_DEPTH:
        continue  # The decoder refuses it, naming where.
      tag = tag_of(node)
      if tag == "array":
        ref = node.get("ref")
        if type(ref) is int:  # (Else the decoder refuses it.)
          refs.append(ref)
        continue
      if tag == "variable":
        ref = node.get("ref")
        if type(ref) is int and 0 <= ref < len(entries):
          below = extent(ref)
          if depth + below > MAX_DEPTH:
            raise errors.ManifestError(
                f"{where}: a variable node {depth} levels deep uses variables[{ref}],"
                f" which nests {below} levels below it: nesting deeper than {MAX_DEPTH}.")
          reached = max(reached, depth + below)
        continue
      stack.extend((child, depth + 1) for child in _held_nodes(node, tag))
    return reached

  def extent(ref: int) -> int:
    found = extents.get(ref)
    if found is None:
      extents[ref] = 0  # While measured: a variable inside its own entry (refused when decoded).
      entry = entries[ref]
      found = max((deepest(entry.get(name), 1) for name in ("label", "metadata", "value")),
                  default=1) if isinstance(entry, dict) else 1
      extents[ref] = found
    return found

  deepest(tree, 0)
  for ref in range(len(entries)):  # An entry no node uses is decoded by none, but counted.
    extent(ref)
  return refs


def arrays_referenced_once(
    refs: list[int], count: int, places: Callable[[], Iterable[tuple[int, str]]],
    describe: Callable[[int], str], where: str
) -> None:
  """Refuses a manifest whose ``array`` nodes refer to one array entry twice.

  Why: a save writes every array it meets as an entry of its own, even the
  same array at two places (and a shared variable as one variable entry,
  referenced from each place, its array referenced once), so no saved
  manifest refers to an array twice. Loaded, such a manifest would give one
  writable array at two places: an optimizer state updated in place at one
  would change the other. Checked here, as the manifest is parsed, every
  reader (and a save, `pz_persist.format.manifest.check_publishable`)
  refuses it alike.

  Args:
    refs: The reference of every ``array`` node, as the parse met them
      (each variable entry's once).
    count: How many array entries there are (a reference out of range is
      the decoder's to refuse).
    places: Called only on failure: ``(ref, place)`` of each array node, in
      the order of `array_places`, to name both places.
    describe: ``describe(ref)``: the array entry, for the message.
    where: The manifest's file.

  Raises:
    ManifestError: naming the array entry and both places referring to it.
  """
  if len(set(refs)) == len(refs):
    return
  first: dict[int, str] = {}
  for ref, place in places():
    if ref in first and 0 <= ref < count:
      raise errors.ManifestError(
          f"{where}: {place} refers to arrays[{ref}] ({describe(ref)}), which {first[ref]}"
          " refers to already; a saved checkpoint refers to each array once (a shared"
          " variable is one variable entry). The manifest was edited or damaged; loading"
          " it would return one array at two places."
      )
    first.setdefault(ref, place)
  raise AssertionError(f"{where}: an array referenced twice was not found again.")


def array_places(tree: Any, variables: Iterable[object]) -> Iterator[tuple[int, str]]:
  """``(ref, place)`` of every ``array`` node of typed JSON: the tree's, then
  each variable entry's value (``place`` as ``tree.items[1]``)."""
  roots = [(tree, "tree")] + [
      (entry.get("value"), f"variables[{i}].value")
      for i, entry in enumerate(variables) if isinstance(entry, dict)
  ]
  for root, name in roots:
    stack = [(root, name, 0)]
    while stack:
      node, place, depth = stack.pop()
      tag = tag_of(node)
      if tag == "array" and type(node.get("ref")) is int:
        yield node["ref"], place
      node_type = NODE_TYPES.get(tag or "")
      if node_type is None or tag == "variable" or depth > MAX_DEPTH:
        continue
      found = []
      for field in node_type.fields:
        value = node.get(field.name)
        if field.json == "node" and field.holds:
          found.append((value, f"{place}.{field.name}"))
        elif field.json in ("list", "pairs") and field.holds and isinstance(value, list):
          for i, item in enumerate(value):
            pair = field.json == "pairs" and isinstance(item, list) and len(item) == 2
            found.append((item[1] if pair else item, place + _step(field.name, item, i, pair)))
      stack.extend((child, at, depth + 1) for child, at in reversed(found))


def _step(name: str, item: Any, i: int, pair: bool) -> str:
  """Item ``i`` of field ``name`` as Python reaches it where it can (``['key']``
  of a dict, ``.name`` of a class's field, ``[i]`` of a sequence)."""
  key = item[0].get("v") if pair and tag_of(item[0]) == "str" else None
  if isinstance(key, str):
    if name == "items":
      return f"[{key!r:.80}]"
    if name == "fields":
      return f".{key:.80}"
  return f"[{i}]" if name == "items" else f".{name}[{i}]"


def _held_nodes(node_: Any, tag: str | None) -> Iterator[Any]:
  """Every node a typed node's fields hold (children, static values, static
  pair keys); nothing for what is malformed."""
  node_type = NODE_TYPES.get(tag or "")
  if node_type is None:
    return
  for field in node_type.fields:
    value = node_.get(field.name)
    if field.json == "node" and field.holds:
      yield value
    elif field.json == "list" and field.holds and isinstance(value, list):
      yield from value
    elif field.json == "pairs" and isinstance(value, list):
      for pair in value:
        if isinstance(pair, list) and len(pair) == 2:
          if field.keys == "static":
            yield pair[0]
          if field.holds:
            yield pair[1]


def names_class(tag: object) -> bool:
  """Whether nodes of ``tag`` name a class (in their ``"class"`` field)."""
  node_type = NODE_TYPES.get(tag) if isinstance(tag, str) else None
  return node_type is not None and node_type.field("class") is not None


def keyed_items(tag: object) -> bool:
  """Whether nodes of ``tag`` hold ``items`` as ``[key, value]`` pairs."""
  node_type = NODE_TYPES.get(tag) if isinstance(tag, str) else None
  items = node_type.field("items") if node_type is not None else None
  return items is not None and items.json == "pairs"


def describe_label(label: object) -> str:
  """A short, stable text for a label (for messages and the arrays table)."""
  return label if isinstance(label, str) else repr(label)


def named_array_problem(named: pz.nx.NamedArrayBase) -> str | None:
  """Why ``named`` (a ``NamedArray`` / ``NamedArrayView``) does not fit its
  named axes, or None if it does.

  The one test both directions apply: the encoder stores a fitting value as a
  ``named_array`` node, which the decoder refuses unless it fits. A value that
  does not fit is still a legitimate pytree node: optax's states are built by
  ``tree_map`` over the parameters, so they hold NamedArrays around Adafactor's
  factored moments, NovoGrad's scalars, SM3's lists or optax's ``MaskedNode``.
  Those are stored as plain ``struct`` nodes, rebuilt field for field (with
  no claim that their axes describe their data).
  """
  try:
    named.check_valid()
  except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
    return str(e)
  return None


def fits_its_axes(x: object) -> TypeGuard[pz.nx.NamedArrayBase]:
  """Whether ``x`` is a NamedArray (or view) whose data fits its named axes.

  Only those are named values of their own; code that treats NamedArrays as
  leaves (binding compares them by axes and shape) must look inside the
  others, which only hold what ``tree_map`` put there (see
  `named_array_problem`).
  """
  return isinstance(x, pz.nx.NamedArrayBase) and named_array_problem(x) is None


SEQUENCE_TYPES: dict[str, Any] = {
    "list": list,
    "tuple": tuple,
    "set": set,
    "frozenset": frozenset,
}
"""The Python sequence type each sequence tag stands for (both directions)."""


def is_namedtuple_class(cls: object) -> bool:
  """Whether ``cls`` is a namedtuple class (a tuple subclass with ``_fields``)."""
  return (
      isinstance(cls, type)
      and issubclass(cls, tuple)
      and isinstance(getattr(cls, "_fields", None), tuple)
  )
