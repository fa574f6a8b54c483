"""Decoding: typed JSON plus restored arrays back to the saved tree.

The load half of the tree format (`pz_persist.format.nodes` is the table of node
types, `pz_persist.format.encode` the save half). Every node goes through one walk,
`_Walk.decode`, which checks its depth, finds its row in `nodes.NODE_TYPES`,
checks its JSON shape generically from the row (`nodes.check_shape`) and
hands it to the one decode function registered for its tag in `DECODERS`.
The pieces around the walk each do one job: `_Variables` rebuilds the shared
mutable variables once each, `_ArrayLabels` checks the arrays table's labels
against the variables holding the arrays, and `_Concrete` / `_Abstract` build
what differs when the arrays are ``jax.ShapeDtypeStruct`` stand-ins.

Nothing here evaluates or unpickles anything. Names of classes and functions
are checked and found again through `pz_persist.format.code_references`, which refuses
modules that are not allow-listed before importing them.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import enum
import functools
import operator
import types
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import TypeVar

import jax
import numpy as np
from penzai import pz

from pz_persist import errors
from pz_persist import version
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import code_references
from pz_persist.format import compact
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import meshes
from pz_persist.format import nodes
from pz_persist.format import variable_kinds

Node = nodes.Node


def _is_enum_class(cls: object) -> bool:
  return isinstance(cls, type) and issubclass(cls, enum.Enum)


def _is_dataclass_class(cls: object) -> bool:
  return isinstance(cls, type) and dataclasses.is_dataclass(cls)


def _is_struct_class(cls: object) -> bool:
  return isinstance(cls, type) and issubclass(cls, pz.Struct)


# The pieces around the walk.


class _Concrete:
  """Builds PRNG keys and variables from real arrays."""

  @staticmethod
  def prng_key(data: Any, impl: str) -> jax.Array:
    return jax.random.wrap_key_data(data, impl=impl)

  @staticmethod
  def variable(kind: str, fields: dict[str, Any]) -> pz.Parameter | pz.StateVariable:
    if kind == "parameter":
      return pz.Parameter(**fields)
    return pz.StateVariable(
        fields["value"], label=fields["label"], metadata=fields["metadata"]
    )


class _Abstract:
  """Builds PRNG keys and variables from ``jax.ShapeDtypeStruct`` stand-ins."""

  @staticmethod
  def prng_key(data: Any, impl: str) -> jax.ShapeDtypeStruct:
    return jax.eval_shape(lambda d: jax.random.wrap_key_data(d, impl=impl), data)

  @staticmethod
  def variable(kind: str, fields: dict[str, Any]) -> Any:
    # A mutable variable converts its value with jnp.asarray, which a
    # ShapeDtypeStruct cannot go through: abstract trees show frozen values.
    return variable_kinds.value_class(kind)(**fields)


class _ArrayLabels:
  """Checks that each array is held by the variable the arrays table names
  (`_Walk.labeled_parts` pushes each variable's described label on
  ``held_by`` while decoding its value).

  Tools print the arrays table's labels; they must be the labels of the
  variables that hold the arrays, not whatever the file claims.
  """

  def __init__(self, labels: Sequence[str | None] | None):
    self._labels = labels  # None: not checked.
    self.held_by: list[str] = []
    """The described labels of the variables around the node decoded."""

  def check(self, ref: int, where: str) -> None:
    if self._labels is None:
      return
    held_by = self.held_by[-1] if self.held_by else None
    if self._labels[ref] != held_by:
      raise errors.ManifestError(
          f"{where}: arrays[{ref}] is labelled"
          f" {self._labels[ref]!r:.100} in the arrays table, but"
          + (f" is held by variable {held_by!r:.100}." if held_by is not None
             else " is held by no variable.")
      )


class _Variables:
  """The manifest's variables table: each entry rebuilt once, then shared.

  A variable referenced from two places is one object after loading; an
  entry that (through its value) references itself is refused.
  """

  def __init__(self, entries: Sequence[object], where: errors.Location | str):
    self._entries = entries
    self._where = where
    self._built: dict[int, object] = {}
    self._building: set[int] = set()

  def get(self, ref: object, where: str, build: Callable[[Node, str], object]) -> object:
    """Variable ``ref``, built by ``build(entry, entry_where)`` the first time."""
    if type(ref) is not int or not 0 <= ref < len(self._entries):
      raise errors.ManifestError(f"{where}: invalid variable reference {ref!r}.")
    if ref in self._built:
      return self._built[ref]
    if ref in self._building:
      raise errors.ManifestError(f"{where}: variable {ref} contains itself.")
    self._building.add(ref)
    entry = self._entries[ref]
    entry_where = f"{self._where}[{ref}]"
    if not isinstance(entry, dict) or entry.keys() != nodes.VARIABLE_ENTRY_FIELDS:
      raise errors.ManifestError(f"{entry_where}: malformed variable entry.")
    if not isinstance(entry["kind"], str) or entry["kind"] not in variable_kinds.KINDS:
      raise errors.ManifestError(
          f"{entry_where}: unknown variable kind {entry['kind']!r}."
      )
    self._built[ref] = build(entry, entry_where)
    return self._built[ref]


def check_label(label: object, where: str) -> Hashable:
  """Refuses a decoded variable label that is unhashable or holds control
  characters (they would garble every message and table that prints it)."""
  problem = arrays_lib.label_problem(label)
  if problem:
    raise errors.ManifestError(f"{where}: label {label!r:.100} {problem}.")
  return label


# The walk.


class _Walk:
  """One decoding: the arrays, the pieces above, and the dispatch by tag."""

  def __init__(
      self,
      arrays: Sequence[object],
      variables: Sequence[object],
      *,
      abstract: bool,
      labels: Sequence[str | None] | None = None,
      variables_where: errors.Location | str = "variables",
      format_version: int | None = None,
      writer: str | None = None,
      tables: compact.Tables | None = None,
  ):
    self.arrays = arrays
    self.tables = tables  # A format 4 manifest's (`compact.Tables`), else None.
    self._decoded_shared: dict[tuple[int, bool], tuple[object, bool]] = {}
    self.written = (format_version, writer)  # The manifest's, for `unknown_node`.
    self.labels = _ArrayLabels(labels)
    self.variables = _Variables(variables, variables_where)
    self.build = _Abstract if abstract else _Concrete
    self._classes: dict[tuple[str, str, str], type] = {}

  def resolve_class(
      self, ref: object, *, where: str, accept: Callable[[object], bool], kind: str
  ) -> type[Any]:
    """`code_references.resolve_class`, once per class and kind in a decoding.

    Why: a model names the same few classes thousands of times (a layer
    class per block); checking each against the allow-list and finding it
    again cost a fifth of decoding a 64-block model. Within one decoding the
    allow-list cannot change, so the first answer is every answer; anything
    but a reference of exactly two strings is not cached (its error is
    raised by the check itself).
    """
    key = None
    if (
        isinstance(ref, dict) and len(ref) == 2
        and isinstance(ref.get("module"), str) and isinstance(ref.get("qualname"), str)
    ):  # Exactly what a reference holds: the same strings pass the same checks.
      key = (ref["module"], ref["qualname"], kind)
      found = self._classes.get(key)
      if found is not None:
        return found
    cls = code_references.resolve_class(ref, where=where, accept=accept, kind=kind)
    if key is not None:
      self._classes[key] = cls
    return cls

  def decode(self, node: Any, where: str, depth: int, in_tree: bool) -> Any:
    """Decodes ``node`` as part of a tree (``in_tree``) or a static value."""
    if self.tables is not None and type(node) is not dict:
      return self._compact(node, where, depth, in_tree)
    return self._decode(node, where, depth, in_tree)

  def _compact(self, node: Any, where: str, depth: int, in_tree: bool) -> Any:
    """A node of a format 4 manifest: a string, a shared entry's index, or
    ``[type, fields...]``, whose shape `pz_persist.format.compact` checked
    with the manifest (its fields, lists and pairs): only what depends on
    where it is used (depth, tree or static) is checked here."""
    if depth > nodes.MAX_DEPTH:
      raise errors.ManifestError(f"{where}: nesting deeper than {nodes.MAX_DEPTH}.")
    kind = type(node)
    if kind is str:  # A str node, tree or static alike.
      return node
    if kind is int:
      found = self._decoded_shared.get((node, in_tree))
      if found is not None and found[1]:  # Immutable: reused (`_shared_node`).
        return found[0]
      return self._shared_node(node, where, depth, in_tree)
    tables = self.tables
    assert tables is not None  # (`decode` calls this only then.)
    tag, node_type = tables.types[node[0]]
    if not (node_type.tree if in_tree else node_type.static):
      raise errors.ManifestError(f"{where}: unknown node type {tag!r:.60}.")
    # The nodes met once per array, decoded from their fields without the
    # typed node `Tables.shallow` builds (the order of their rows' fields).
    if tag == "array":
      return self.array(node[1], where)
    if tag == "named_array":
      return _named_array_of(_At(self, where, depth, in_tree), node[1], node[2])
    if tag == "parameter_value" or tag == "state_variable_value":
      return variable_kinds.BY_VALUE_TAG[tag].value_class(
          **self.labeled_parts(node[1], node[2], node[3], where, depth))
    return DECODERS[tag](_At(self, where, depth, in_tree), tables.shallow(node))

  def known(self, node: Any, depth: int, in_tree: bool) -> Any:
    """What `decode` returns for ``node`` at ``depth`` if that needs no
    work (a format 4 string, or an immutable shared value already decoded),
    else `_UNKNOWN`: lets the commonest nodes skip the walk, and the text
    naming where they are."""
    if self.tables is None or depth > nodes.MAX_DEPTH:
      return _UNKNOWN
    kind = type(node)
    if kind is str:
      return node
    if kind is int:
      found = self._decoded_shared.get((node, in_tree))
      if found is not None:  # As `_shared_node` returns it again.
        if found[1]:
          return found[0]
        value = _fresh(found[0])
        if value is not _AGAIN:
          return value
    return _UNKNOWN

  def array(self, ref: object, where: str) -> object:
    """The array ``ref`` of an ``array`` node, checked against the arrays
    table and against the variable holding it."""
    if type(ref) is not int or not 0 <= ref < len(self.arrays):
      raise errors.ManifestError(f"{where}: invalid array reference {ref!r}.")
    self.labels.check(ref, where)
    # Each array is referred to once: `Manifest.loads` refuses a manifest that
    # refers to one twice (`nodes.arrays_referenced_once`).
    return self.arrays[ref]

  def _shared_node(self, index: int, where: str, depth: int, in_tree: bool) -> Any:
    """Shared entry ``index`` of a format 4 manifest (`pz_persist.format.compact`):
    decoded the first time it is met (where, in a tree or static, and at
    what depth, checked as for an inline node), then reused.

    Why a copy: the entry stands for equal values written inline in
    formats 1 to 3, which loaded as distinct objects; a metadata dict shared
    by 4,000 parameters must stay 4,000 dicts, so that changing one changes
    one. Immutable values are reused as they are; what `_fresh` cannot tell
    immutable (a layer, a partial) is decoded again.
    """
    key = (index, in_tree)
    tables = self.tables
    assert tables is not None  # (Only a format 4 manifest has shared entries.)
    node = tables.shared[index]
    # A layer written as a ``struct`` node is copied as that node rebuilds it.
    struct = type(node) is list and tables.types[node[0]][0] == "struct"
    found = self._decoded_shared.get(key)
    if found is not None:
      value, immutable = found
      if immutable:  # Known at its first decoding: no walk of it again.
        return value
      value = _fresh(value, struct)
      if value is not _AGAIN:
        return value
      return self._compact(node, where, depth, in_tree)
    value = self._compact(node, where, depth, in_tree)
    fresh = _fresh(value, struct)
    self._decoded_shared[key] = (value, fresh is value)
    return value if fresh is _AGAIN else fresh

  def _decode(self, node: Any, where: str, depth: int, in_tree: bool) -> Any:
    if depth > nodes.MAX_DEPTH:
      raise errors.ManifestError(f"{where}: nesting deeper than {nodes.MAX_DEPTH}.")
    tag = nodes.check_typed(node, where)
    node_type = nodes.NODE_TYPES.get(tag)
    if node_type is None:
      raise nodes.unknown_node(
          tag, where, format_version=self.written[0], writer=self.written[1],
          reader_version=version.__version__, reader_format=manifest_lib.FORMAT_VERSION,
      )
    if not (node_type.tree if in_tree else node_type.static):
      raise errors.ManifestError(f"{where}: unknown node type {tag!r:.60}.")
    nodes.check_shape(node, where, node_type)
    return DECODERS[tag](_At(self, where, depth, in_tree), node)

  def labeled(self, node: Node, where: str, depth: int) -> dict[str, Any]:
    """The label, metadata and value of a variable or frozen value."""
    return self.labeled_parts(node["label"], node["metadata"], node["value"], where, depth)

  def labeled_parts(
      self, label_node: Any, metadata_node: Any, value_node: Any, where: str, depth: int
  ) -> dict[str, Any]:
    """`labeled`, from the node's three fields."""
    label = self.known(label_node, depth + 1, False)
    if label is _UNKNOWN:
      label = self.decode(label_node, f"{where}.label", depth + 1, False)
    check_label(label, where)
    described = nodes.describe_label(label)
    where = f"{where} (label {described!r})"
    metadata = self.known(metadata_node, depth + 1, False)
    if metadata is _UNKNOWN:
      metadata = self.decode(metadata_node, f"{where}.metadata", depth + 1, False)
    if not isinstance(metadata, dict):
      raise errors.ManifestError(f"{where}: metadata must be a dict.")
    held_by = self.labels.held_by
    held_by.append(described)  # (`_ArrayLabels.holding`, without a context manager.)
    try:
      value = self.decode(value_node, f"{where}.value", depth + 1, True)
    finally:
      held_by.pop()
    return {"label": label, "metadata": metadata, "value": value}


_UNKNOWN = object()
"""What `_Walk.known` returns for a node it leaves to `_Walk.decode`."""

_AGAIN = object()
"""What `_fresh` returns for a value it cannot copy: decode it again."""

_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
_REUSABLE = (enum.Enum, type, np.generic, np.dtype, types.FunctionType,
             types.BuiltinFunctionType, np.ufunc, type(jax.nn.silu))
"""Values reused as they are: immutable, or code found by reference (a
function, including a jitted one such as ``jax.nn.silu``)."""


def _fresh(value: Any, struct: bool = False) -> object:
  """``value`` as a new object wherever it is mutable (dicts, lists, sets),
  sharing its immutable parts; `_AGAIN` if it holds anything else.

  ``struct``: ``value`` was decoded from a ``struct`` node, so a layer
  holding mutable fields (``NamedEinsum``'s axis dicts) is rebuilt as
  `_dataclass` rebuilds it (``from_attributes``) from copies of its fields,
  without decoding it again."""
  kind = type(value)
  if struct and isinstance(value, pz.Struct):
    fields = {}
    for field in dataclasses.fields(value):
      item = getattr(value, field.name)
      copy = _fresh(item)
      if copy is _AGAIN:
        return _AGAIN
      fields[field.name] = copy
    if all(fields[name] is getattr(value, name) for name in fields):
      return value
    return kind.from_attributes(**fields)
  if kind in _ATOMS:
    return value
  if kind is dict or kind is collections.OrderedDict:
    out = kind()
    for key, item in value.items():
      copy = _fresh(item)
      if copy is _AGAIN:
        return _AGAIN
      out[key] = copy
    return out
  if kind in (list, tuple, set, frozenset):
    items = [_fresh(item) for item in value]
    if any(item is _AGAIN for item in items):
      return _AGAIN
    if kind in (tuple, frozenset) and all(a is b for a, b in zip(items, value)):
      return value
    return kind(items)
  if isinstance(value, _REUSABLE):
    return value
  params = vars(type(value)).get("__dataclass_params__")
  if params is not None and params.frozen:
    # A frozen layer (``RenameAxes``) or dataclass label: reused whole when
    # every field is reused as it is (a dict field makes it decoded again).
    for field in dataclasses.fields(value):
      item = getattr(value, field.name)
      if _fresh(item) is not item:
        return _AGAIN
    return value
  return _AGAIN


class _At(NamedTuple):
  """Where a node is being decoded: what its decode function is given.

  A named tuple, not a frozen dataclass: one is made for every node, and a
  frozen dataclass's ``__init__`` costs several times more.
  """

  walk: _Walk
  where: str
  depth: int
  in_tree: bool

  def child(self, node: Any, where: str) -> Any:
    """Decodes a child, like its parent (in a tree, or static)."""
    return self.walk.decode(node, where, self.depth + 1, self.in_tree)

  def static(self, node: Any, where: str) -> Any:
    """Decodes a static value held by the node (a label, a key, an argument)."""
    return self.walk.decode(node, where, self.depth + 1, False)

  def axis_name(self, node: object) -> Hashable:
    name = self.walk.known(node, self.depth + 1, False)
    if name is _UNKNOWN:
      name = self.static(node, f"{self.where} axis name")
    try:
      hash(name)
    except TypeError:
      raise errors.ManifestError(
          f"{self.where}: axis name {name!r} is unhashable."
      ) from None
    return name

  def rebuild(self, cls: type, make: Callable[..., object], *args: object, **kwargs: object) -> object:
    """``make(*args, **kwargs)``, building a ``cls``: the class's own checks
    may refuse the values, with any exception."""
    return code_references.call_checkpoint_code(self.where, cls, make, *args, **kwargs)


DecodeFunction = Callable[[_At, Node], Any]

DECODERS: dict[str, DecodeFunction] = {}
"""The decode function of every tag of `nodes.NODE_TYPES`.

A node reaches its function with its JSON shape already checked (exactly its
row's fields, lists where the row says lists)."""


def _decodes(*tags: str) -> Callable[[DecodeFunction], DecodeFunction]:
  def register(function: DecodeFunction) -> DecodeFunction:
    for tag in tags:
      assert tag in nodes.NODE_TYPES and tag not in DECODERS, tag
      DECODERS[tag] = function
    return function

  return register


# Scalars.


def _float(v: object, where: str) -> float:
  if isinstance(v, str) and v in ("nan", "inf", "-inf"):
    return float(v)
  if type(v) is int or type(v) is float:
    return float(v)
  raise errors.ManifestError(f"{where}: invalid float {v!r}.")


@_decodes("none")
def _none(at: _At, node: Node) -> None:
  del at, node


@_decodes("bool", "int", "str")
def _exact_scalar(at: _At, node: Node) -> object:
  tag = node["t"]
  if type(node["v"]) is not {"bool": bool, "int": int, "str": str}[tag]:
    raise errors.ManifestError(f"{at.where}: invalid {tag} {node['v']!r:.80}.")
  return node["v"]


@_decodes("float")
def _float_node(at: _At, node: Node) -> float:
  return _float(node["v"], at.where)


@_decodes("complex")
def _complex(at: _At, node: Node) -> complex:
  return complex(_float(node["re"], at.where), _float(node["im"], at.where))


@_decodes("bytes")
def _bytes(at: _At, node: Node) -> bytes:
  try:
    return base64.b64decode(node["b64"], validate=True)
  except (TypeError, ValueError):
    raise errors.ManifestError(f"{at.where}: invalid base64 data.") from None


@_decodes("np_scalar")
def _np_scalar(at: _At, node: Node) -> np.generic:
  dtype = arrays_lib.dtype_from_name(node["dtype"], where=at.where)
  try:
    raw = bytes.fromhex(node["hex"])
  except (TypeError, ValueError):
    raise errors.ManifestError(f"{at.where}: invalid hex data.") from None
  if len(raw) != dtype.itemsize:
    raise errors.ManifestError(f"{at.where}: {len(raw)} bytes for a {dtype}.")
  return np.frombuffer(raw, dtype)[0]


# Containers.


def _items(at: _At, node: Node) -> list[Any]:
  return [at.child(v, f"{at.where}[{i}]") for i, v in enumerate(node["items"])]


@_decodes(*nodes.SEQUENCE_TYPES)
def _sequence(at: _At, node: Node) -> Any:
  items = _items(at, node)
  try:
    return nodes.SEQUENCE_TYPES[node["t"]](items)
  except TypeError:
    raise errors.ManifestError(f"{at.where}: unhashable set element.") from None


@_decodes("namedtuple")
def _namedtuple(at: _At, node: Node) -> Any:
  items = _items(at, node)
  cls = at.walk.resolve_class(
      node["class"], where=at.where, accept=nodes.is_namedtuple_class, kind="a namedtuple"
  )
  if len(items) != len(cls._fields):
    raise errors.ManifestError(
        f"{at.where}: {cls.__qualname__} has {len(cls._fields)} fields, the"
        f" checkpoint has {len(items)} values."
    )
  return at.rebuild(cls, cls, *items)


@_decodes("dict", "ordered_dict")
def _dict(at: _At, node: Node) -> Any:
  out = {} if node["t"] == "dict" else collections.OrderedDict()
  for key_node, value_node in node["items"]:
    key = at.static(key_node, f"{at.where} key")
    try:
      duplicate = key in out
    except TypeError:
      raise errors.ManifestError(f"{at.where}: unhashable dict key {key!r}.") from None
    if duplicate:
      raise errors.ManifestError(f"{at.where}: duplicate dict key {key!r}.")
    out[key] = at.child(value_node, f"{at.where}[{key!r}]")
  return out


# Structure and references to code.


@_decodes("struct", "dataclass")
def _dataclass(at: _At, node: Node) -> Any:
  """A layer (rebuilt with ``from_attributes``, which bypasses ``__init__``)
  or another dataclass (rebuilt from its ``__init__`` fields)."""
  is_struct = node["t"] == "struct"
  cls = at.walk.resolve_class(
      node["class"],
      where=at.where,
      accept=_is_struct_class if is_struct else _is_dataclass_class,
      kind="a pz.Struct class" if is_struct else "a dataclass",
  )
  names = _field_names(cls, is_struct)
  values = {}
  for name, value in node["fields"]:
    if isinstance(name, str) and name in values:
      raise errors.ManifestError(f"{at.where}: field {name!r:.100} repeats.")
    if not isinstance(name, str) or name not in names:
      raise errors.ManifestError(
          f"{at.where}: {cls.__qualname__} has no field {name!r:.100}"
          f"{_class_changed(cls, names)}"
      )
    values[name] = at.child(value, f"{at.where}.{name}")
  missing = sorted(names - set(values)) if is_struct else []
  if missing:
    raise errors.ManifestError(
        f"{at.where}: the checkpoint sets no field {', '.join(map(repr, missing))}"
        f" of {cls.__qualname__}{_class_changed(cls, names)}"
    )
  return at.rebuild(cls, cls.from_attributes if is_struct else cls, **values)


def _class_changed(cls: type, names: frozenset[str]) -> str:
  """The end of a message about a class whose fields are not the saved ones:
  its code changed since the save (a field renamed, added or removed), so
  the saved structure cannot be rebuilt, but its variables can be loaded."""
  return (
      f" (its fields are now {', '.join(sorted(names)) or 'none'}): its code"
      " changed since the checkpoint was saved. Build the model with the"
      " current code and load the checkpoint's variables into it by label:"
      " pz_persist.load_into(path, new_model) (rename= maps labels that"
      " changed too)."
  )


_FIELD_NAMES: dict[tuple[type, bool], frozenset[str]] = {}


def _field_names(cls: type, is_struct: bool) -> frozenset[str]:
  """The fields a ``struct`` (all) or ``dataclass`` (its ``__init__``'s)
  node of ``cls`` may set; cached: every layer of a model asks again."""
  names = _FIELD_NAMES.get((cls, is_struct))
  if names is None:
    names = frozenset(f.name for f in dataclasses.fields(cls) if is_struct or f.init)
    _FIELD_NAMES[(cls, is_struct)] = names
  return names


@_decodes("enum")
def _enum(at: _At, node: Node) -> Any:
  cls = at.walk.resolve_class(
      node["class"], where=at.where, accept=_is_enum_class, kind="an Enum"
  )
  name = node["name"]
  if isinstance(name, str) and name in cls.__members__:
    return cls[name]
  parts = name.split("|") if isinstance(name, str) and name else []
  if (isinstance(name, str) and issubclass(cls, enum.Flag)
      and all(part in cls.__members__ for part in parts)):
    # A combination of flags (``"A|B"``), as `encode` writes one.
    return functools.reduce(operator.or_, (cls[part] for part in parts), cls(0))
  raise errors.ManifestError(
      f"{at.where}: {cls.__qualname__} has no member {name!r:.100} (it has"
      f" {', '.join(cls.__members__)}); was it renamed since the save?"
  )


@_decodes("mesh")
def _mesh(at: _At, node: Node) -> jax.sharding.Mesh | jax.sharding.AbstractMesh:
  return meshes.rebuild(
      node["axes"], node["axis_types"], at.where, abstract=at.walk.build is _Abstract
  )


@_decodes("partition_spec")
def _partition_spec(at: _At, node: Node) -> jax.sharding.PartitionSpec:
  return meshes.decode_spec(node["spec"], at.where)


@_decodes("named_sharding")
def _named_sharding(at: _At, node: Node) -> jax.sharding.NamedSharding:
  mesh = at.static(node["mesh"], f"{at.where}.mesh")
  spec = at.static(node["spec"], f"{at.where}.spec")
  memory_kind = node["memory_kind"]
  if not meshes.is_mesh(mesh) or not isinstance(spec, jax.sharding.PartitionSpec) or not (
      memory_kind is None or isinstance(memory_kind, str)):
    raise errors.ManifestError(f"{at.where}: malformed NamedSharding.")
  with code_references.running_checkpoint_code(at.where, "cannot rebuild NamedSharding"):
    return jax.sharding.NamedSharding(mesh, spec, memory_kind=memory_kind)


@_decodes("dtype")
def _dtype(at: _At, node: Node) -> np.dtype:
  return arrays_lib.dtype_from_name(node["name"], where=at.where)


@_decodes("type")
def _type(at: _At, node: Node) -> type:
  return code_references.resolve_class_value(node["class"], where=at.where)


@_decodes("function")
def _function(at: _At, node: Node) -> Callable[..., object]:
  return code_references.resolve_function(node["ref"], where=at.where)


@_decodes("partial")
def _partial(at: _At, node: Node) -> functools.partial:
  func = at.static(node["func"], f"{at.where}.func")
  if not callable(func):
    raise errors.ManifestError(f"{at.where}: partial of a non-callable.")
  args = [at.static(a, f"{at.where}.args") for a in node["args"]]
  keywords = {}
  for key, value in node["keywords"]:
    if not isinstance(key, str) or key in keywords:
      raise errors.ManifestError(f"{at.where}: invalid keyword {key!r}.")
    keywords[key] = at.static(value, f"{at.where}.keywords")
  return functools.partial(func, *args, **keywords)


# Arrays.


@_decodes("array")
def _array(at: _At, node: Node) -> object:
  return at.walk.array(node["ref"], at.where)


@_decodes("prng_key")
def _prng_key(at: _At, node: Node) -> Any:
  impl = node["impl"]
  if not isinstance(impl, str) or impl not in nodes.PRNG_IMPLS:
    raise errors.ManifestError(f"{at.where}: unknown PRNG implementation {impl!r:.80}.")
  data = at.child(node["data"], f"{at.where}.data")
  try:
    return at.walk.build.prng_key(data, impl)
  except (TypeError, ValueError) as e:
    raise errors.ManifestError(f"{at.where}: invalid PRNG key data: {e}") from None


_Named = TypeVar("_Named", pz.nx.NamedArray, pz.nx.NamedArrayView)


def _fitting(named: _Named, where: str) -> _Named:
  problem = nodes.named_array_problem(named)
  if problem is not None:
    raise errors.ManifestError(
        f"{where}: axis names disagree with the stored array: {problem}"
    )
  return named


@_decodes("named_array")
def _named_array(at: _At, node: Node) -> pz.nx.NamedArray:
  return _named_array_of(at, node["axes"], node["data"])


def _named_array_of(at: _At, axes_node: Any, data_node: object) -> pz.nx.NamedArray:
  """A ``named_array`` node, from its fields."""
  axes = collections.OrderedDict()
  for name_node, size in axes_node:
    name = at.axis_name(name_node)
    if name in axes or type(size) is not int or size < 0:
      raise errors.ManifestError(
          f"{at.where}: axis {name!r} repeats or has an invalid size {size!r}."
      )
    axes[name] = size
  data = at.child(data_node, f"{at.where}.data_array")
  return _fitting(pz.nx.NamedArray(named_axes=axes, data_array=data), at.where)


@_decodes("named_array_view")
def _named_array_view(at: _At, node: Node) -> pz.nx.NamedArrayView:
  by_name = {}
  for name_node, index in node["name_axes"]:
    name = at.axis_name(name_node)
    if name in by_name or type(index) is not int:
      raise errors.ManifestError(f"{at.where}: axis {name!r} repeats or is invalid.")
    by_name[name] = index
  data = at.child(node["data"], f"{at.where}.data_array")
  view = pz.nx.NamedArrayView(
      data_shape=tuple(node["data_shape"]),
      data_axis_for_logical_axis=tuple(node["logical_axes"]),
      data_axis_for_name=by_name,
      data_array=data,
  )
  return _fitting(view, at.where)


# Variables.


@_decodes("parameter_value", "state_variable_value")
def _value(at: _At, node: Node) -> Any:
  cls = variable_kinds.BY_VALUE_TAG[node["t"]].value_class
  return cls(**at.walk.labeled(node, at.where, at.depth))


@_decodes("parameter_slot", "state_variable_slot")
def _slot(at: _At, node: Node) -> pz.AbstractVariableSlot:
  cls = variable_kinds.BY_SLOT_TAG[node["t"]].slot_class
  label = at.static(node["label"], f"{at.where}.label")
  return cls(label=check_label(label, at.where))


@_decodes("variable")
def _variable(at: _At, node: Node) -> object:
  walk = at.walk

  def build(entry: Node, entry_where: str) -> object:
    return walk.build.variable(entry["kind"], walk.labeled(entry, entry_where, at.depth))

  return walk.variables.get(node["ref"], at.where, build)


# Entry points.


def decode(
    tree: Node,
    variables: Sequence[object],
    arrays: Sequence[object],
    *,
    abstract: bool = False,
    root: errors.Location | str = "tree",
    labels: Sequence[str | None] | None = None,
    format_version: int | None = None,
    writer: str | None = None,
    tables: compact.Tables | None = None,
) -> Any:
  """Rebuilds the saved tree from its JSON and its (restored) arrays.

  Args:
    tree: The root JSON node.
    variables: The manifest's variables table.
    arrays: The restored arrays, or ``jax.ShapeDtypeStruct`` stand-ins, indexed
      like the manifest's ``arrays`` list.
    abstract: Whether ``arrays`` are stand-ins; mutable variables are then
      returned as frozen values (a mutable variable cannot hold a stand-in).
    root: Where the root is, for error messages: a `errors.Location` (whose
      file's variables table is then named too) or a plain name.
    labels: The manifest's ``label`` of each array, if given checked against
      the label of the variable (or frozen value) that holds the array.
    format_version, writer: The manifest's, so that a node type this
      pz_persist does not know is reported as needing a newer release or as
      damage (`pz_persist.format.nodes.unknown_node`).
    tables: A format 4 manifest's tables (`pz_persist.format.compact.Tables`,
      from `Manifest.decodable`), when ``tree`` and ``variables`` hold its
      compact nodes.

  Raises:
    ManifestError: a node is malformed or disagrees with its arrays.
    FormatVersionError: a node type is newer than this pz_persist.
  """
  variables_where: errors.Location | str = "variables"
  if isinstance(root, errors.Location) and root.file is not None:
    variables_where = errors.Location(root.file, "variables")
  walk = _Walk(
      arrays, variables, abstract=abstract, labels=labels,
      variables_where=variables_where, format_version=format_version, writer=writer,
      tables=tables,
  )
  try:
    return walk.decode(tree, str(root), 0, True)
  except RecursionError:  # A deep stack at the call site: still refused cleanly.
    raise errors.ManifestError(f"{root}: nesting too deep to decode.") from None


def decode_static(node: object, where: str, tables: compact.Tables | None = None) -> Any:
  """Decodes a plain Python value (no arrays) stored as typed JSON (a label,
  metadata); ``tables``: a format 4 manifest's, for its compact nodes."""
  return _Walk((), (), abstract=False, tables=tables).decode(node, where, 0, False)
