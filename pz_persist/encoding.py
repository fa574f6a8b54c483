"""Typed JSON for Penzai trees and models: everything but the array bytes.

A saved tree becomes one JSON node tree plus a list of arrays. Every node is an
object with a type tag ``"t"``, so decoding never guesses: a tuple comes back a
tuple (not a list, as with Orbax's own metadata), a ``ScopedStateVarLabel``
comes back a ``ScopedStateVarLabel``, an Enum in a variable's metadata comes
back the same Enum member. Arrays are replaced by ``{"t": "array", "ref": i}``
and stored by Orbax; mutable ``pz.Parameter`` / ``pz.StateVariable`` objects
are stored once in a variables table and referenced, so a variable shared by two
layers is still one shared object after loading.

A model's structure is more of the same: each layer is a ``pz.Struct`` node
(its class and all its fields, including small arrays such as a
``ConstantRescale`` factor), and the code it refers to (activation functions,
dtypes, Enums) is named by module and qualified name.

Nothing here evaluates or unpickles anything. Names of classes and functions
are checked and found again through `pz_persist.references`, which refuses
modules that are not allow-listed before importing them.

Node tags::

  scalars     none bool int float complex str bytes np_scalar
  containers  list tuple dict ordered_dict namedtuple set frozenset
  structure   struct dataclass enum dtype type function partial
  arrays      array prng_key named_array named_array_view
  variables   parameter_value state_variable_value parameter_slot
              state_variable_slot variable
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from penzai import pz

from pz_persist import arrays as arrays_lib
from pz_persist import errors
from pz_persist import references
from pz_persist import variable_kinds

Node = dict[str, Any]

PRNG_IMPLS = frozenset({"threefry2x32", "rbg", "unsafe_rbg"})
"""The PRNG implementations JAX ships; a checkpoint may name no other."""

MAX_DEPTH = 100
"""Deepest nesting a manifest may have (refused beyond, not a RecursionError).

Penzai models nest a few tens of levels; each level costs several Python
frames in the decoder, so this stays well inside the interpreter's limit."""

_VALUE_CLASSES: dict[type, str] = {
    pz.ParameterValue: "parameter_value",
    pz.StateVariableValue: "state_variable_value",
}
_SLOT_CLASSES: dict[type, str] = {
    pz.ParameterSlot: "parameter_slot",
    pz.StateVariableSlot: "state_variable_slot",
}
_VARIABLE_KINDS: dict[type, str] = {
    pz.Parameter: "parameter",
    pz.StateVariable: "state_variable",
}
_SEQUENCE_TAGS: dict[str, type] = {
    "list": list,
    "tuple": tuple,
    "set": set,
    "frozenset": frozenset,
}


def _is_namedtuple_class(cls: Any) -> bool:
  return (
      isinstance(cls, type)
      and issubclass(cls, tuple)
      and isinstance(getattr(cls, "_fields", None), tuple)
  )


def _is_enum_class(cls: Any) -> bool:
  return isinstance(cls, type) and issubclass(cls, enum.Enum)


def _is_dataclass_class(cls: Any) -> bool:
  return isinstance(cls, type) and dataclasses.is_dataclass(cls)


def _is_struct_class(cls: Any) -> bool:
  return isinstance(cls, type) and issubclass(cls, pz.Struct)


def _encode_float(x: float) -> float | str:
  # JSON has no NaN or infinities; spell them out rather than emit invalid JSON.
  return x if math.isfinite(x) else repr(x)


def _decode_float(v: Any, where: str) -> float:
  if isinstance(v, str) and v in ("nan", "inf", "-inf"):
    return float(v)
  if type(v) in (int, float):
    return float(v)
  raise errors.ManifestError(f"{where}: invalid float {v!r}.")


def named_array_problem(named: Any) -> str | None:
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


def fits_its_axes(x: Any) -> bool:
  """Whether ``x`` is a NamedArray (or view) whose data fits its named axes.

  Only those are named values of their own; code that treats NamedArrays as
  leaves (binding compares them by axes and shape) must look inside the
  others, which only hold what ``tree_map`` put there (see
  `named_array_problem`).
  """
  return isinstance(x, pz.nx.NamedArrayBase) and named_array_problem(x) is None


def describe_label(label: Any) -> str:
  """A short, stable text for a label (for messages and the arrays table)."""
  return label if isinstance(label, str) else repr(label)


@dataclasses.dataclass
class EncodedTree:
  """A tree split into its typed-JSON description and its arrays.

  Attributes:
    tree: The root JSON node.
    variables: JSON entries of the mutable variables the tree holds.
    arrays: One `ArraySpec` per array, indexed by the ``ref`` of array nodes.
    values: The arrays themselves, converted to their storage dtype, aligned
      with ``arrays`` (``None`` for zero-size arrays, which are not stored).
  """

  tree: Node
  variables: list[Node]
  arrays: list[arrays_lib.ArraySpec]
  values: list[Any]

  def stored_arrays(self) -> dict[str, Any]:
    """The ``{key: array}`` dict that Orbax saves."""
    return {
        spec.key: value
        for spec, value in zip(self.arrays, self.values)
        if spec.is_stored
    }


class _Encoder:
  """Walks a tree once, emitting JSON nodes and collecting arrays."""

  def __init__(self):
    self.arrays: list[arrays_lib.ArraySpec] = []
    self.values: list[Any] = []
    self.variables: list[Node] = []
    self.originals: list[Any] = []  # The arrays as given, for `_check_decodable`.
    self._variable_refs: dict[int, int] = {}  # id(variable) -> ref.

  # Static values: labels, metadata, axis names. No arrays allowed.

  def static(self, obj: Any, where: str) -> Node:
    """Encodes a plain Python value (a label, a metadata entry, an axis name)."""
    node = self._scalar(obj)
    if node is not None:
      return node
    if isinstance(obj, np.generic):
      value = np.asarray(obj)
      return {
          "t": "np_scalar",
          "dtype": arrays_lib.dtype_name(value.dtype, where=where),
          "hex": value.tobytes().hex(),
      }
    return (
        self._container(obj, where, self.static, sets=True)
        or self._dataclass(obj, where, self.static)
        or self._code(obj, where)
    )

  def _code(self, obj: Any, where: str) -> Node:
    """Encodes references to code: Enums, dtypes, classes, functions, partials.

    These are the values a model's structure holds besides containers and
    arrays; anything else cannot be saved.
    """
    if isinstance(obj, enum.Enum):
      return {
          "t": "enum",
          "class": references.class_reference(type(obj), where=where),
          "name": obj.name,
      }
    if isinstance(obj, np.dtype):
      return {"t": "dtype", "name": arrays_lib.dtype_name(obj, where=where)}
    if isinstance(obj, type):  # A class as a value is a callable: checked as one.
      return {"t": "type", "class": references.class_value_reference(obj, where=where)}
    if type(obj) is functools.partial:
      return {
          "t": "partial",
          "func": self.static(obj.func, f"{where}.func"),
          "args": [self.static(a, f"{where}.args[{i}]") for i, a in enumerate(obj.args)],
          "keywords": [
              [k, self.static(v, f"{where}.keywords[{k!r}]")]
              for k, v in obj.keywords.items()
          ],
      }
    if callable(obj):
      return {"t": "function", "ref": references.function_reference(obj, where=where)}
    return self._refuse(obj, where)

  def _dataclass(
      self, obj: Any, where: str, encode: Callable[[Any, str], Node]
  ) -> Node | None:
    """Encodes a dataclass instance by class and field values.

    A ``pz.Struct`` (a layer) keeps every field and is rebuilt with
    ``from_attributes``, Penzai's own hook for deserialization, which bypasses
    ``__init__``; other dataclasses are rebuilt from their ``__init__`` fields.
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
      return None
    if isinstance(obj, pz.Struct):
      tag, fields = "struct", obj.attributes_dict()
    else:
      tag = "dataclass"
      fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    return {
        "t": tag,
        "class": references.class_reference(type(obj), where=where),
        "fields": [[name, encode(v, f"{where}.{name}")] for name, v in fields.items()],
    }

  @staticmethod
  def _scalar(obj: Any) -> Node | None:
    if obj is None:
      return {"t": "none"}
    if type(obj) is bool:
      return {"t": "bool", "v": obj}
    if type(obj) is int:
      return {"t": "int", "v": obj}
    if type(obj) is float:
      return {"t": "float", "v": _encode_float(obj)}
    if type(obj) is complex:
      return {
          "t": "complex",
          "re": _encode_float(obj.real),
          "im": _encode_float(obj.imag),
      }
    if type(obj) is str:
      return {"t": "str", "v": obj}
    if type(obj) is bytes:
      return {"t": "bytes", "b64": base64.b64encode(obj).decode("ascii")}
    return None

  def _container(
      self,
      obj: Any,
      where: str,
      encode: Callable[[Any, str], Node],
      sets: bool = False,
  ) -> Node | None:
    """Encodes the containers shared by static values and trees.

    Sets are not pytree nodes, so only static values (``sets=True``) hold them.
    """
    if isinstance(obj, tuple) and _is_namedtuple_class(type(obj)):
      return {
          "t": "namedtuple",
          "class": references.class_reference(type(obj), where=where),
          "items": [
              encode(v, f"{where}.{name}") for name, v in zip(obj._fields, obj)
          ],
      }
    for tag, cls in _SEQUENCE_TAGS.items():
      is_set = tag in ("set", "frozenset")
      if type(obj) is cls and (sets or not is_set):
        items = sorted(obj, key=repr) if is_set else obj
        return {
            "t": tag,
            "items": [encode(v, f"{where}[{i}]") for i, v in enumerate(items)],
        }
    if type(obj) in (dict, collections.OrderedDict):
      return {
          "t": "dict" if type(obj) is dict else "ordered_dict",
          "items": [
              [self.static(k, f"{where} key {k!r}"), encode(v, f"{where}[{k!r}]")]
              for k, v in obj.items()
          ],
      }
    return None

  @staticmethod
  def _refuse(obj: Any, where: str) -> Node:
    kind = type(obj)
    raise errors.EncodingError(
        f"{where}: cannot save a value of type {kind.__module__}.{kind.__qualname__}"
        f" ({obj!r:.80})."
    )

  # Trees: any pytree pz_persist supports.

  def tree(self, obj: Any, where: str, label: str | None = None) -> Node:
    """Encodes a pytree, collecting its arrays and variables."""
    node = self._scalar(obj)
    if node is not None:
      return node
    if arrays_lib.kind_of(obj) is not None:
      return self._array(obj, where, label)
    kind = type(obj)
    fits_axes = kind in (pz.nx.NamedArray, pz.nx.NamedArrayView) and (
        named_array_problem(obj) is None
    )
    if kind is pz.nx.NamedArray and fits_axes:
      return {
          "t": "named_array",
          "axes": [
              [self._axis_name(name, where, label), size]
              for name, size in obj.named_axes.items()
          ],
          "data": self.tree(obj.data_array, f"{where}.data_array", label),
      }
    if kind is pz.nx.NamedArrayView and fits_axes:
      return {
          "t": "named_array_view",
          "data_shape": list(obj.data_shape),
          "logical_axes": list(obj.data_axis_for_logical_axis),
          "name_axes": [
              [self._axis_name(name, where, label), index]
              for name, index in obj.data_axis_for_name.items()
          ],
          "data": self.tree(obj.data_array, f"{where}.data_array", label),
      }
    if kind in _VALUE_CLASSES:
      return {"t": _VALUE_CLASSES[kind], **self._labeled(obj, where)}
    if kind in _SLOT_CLASSES:
      return {
          "t": _SLOT_CLASSES[kind],
          "label": self._label(obj.label, where),
      }
    if kind in _VARIABLE_KINDS:
      return {"t": "variable", "ref": self._variable(obj, where)}
    child = lambda v, w: self.tree(v, w, label)  # pylint: disable=unnecessary-lambda-assignment
    node = self._container(obj, where, child) or self._dataclass(obj, where, child)
    if node is not None:
      return node
    if isinstance(obj, pz.AbstractVariable):
      return self._refuse(obj, where)  # A variable class pz_persist does not know.
    return self._code(obj, where + (f" (label {label!r})" if label else ""))

  def _label(self, label: Any, where: str) -> Node:
    problem = arrays_lib.label_problem(label)  # Loading refuses the same ones.
    if problem:
      raise errors.EncodingError(f"{where}: variable label {label!r} {problem}.")
    return self.static(label, f"{where}.label")

  def _labeled(self, obj: Any, where: str) -> Node:
    label_text = describe_label(obj.label)
    label_where = f"{where} (label {label_text!r})"
    return {
        "label": self._label(obj.label, label_where),
        "metadata": self.static(obj.metadata, f"{label_where}.metadata"),
        "value": self.tree(obj.value, f"{where}.value", label_text),
    }

  def _variable(self, var: Any, where: str) -> int:
    ref = self._variable_refs.get(id(var))
    if ref is None:
      ref = len(self.variables)
      self._variable_refs[id(var)] = ref
      entry = {"kind": _VARIABLE_KINDS[type(var)]}
      self.variables.append(entry)  # Reserve the slot before recursing.
      entry.update(self._labeled(var, where))
    return ref

  def _axis_name(self, name: Any, where: str, label: str | None) -> Node:
    context = f"{where} (label {label!r})" if label else where
    try:
      hash(name)
    except TypeError:
      raise errors.EncodingError(
          f"{context}: axis name {name!r} is not hashable."
      ) from None
    try:
      return self.static(name, f"{context} axis {name!r}")
    except errors.EncodingError as e:
      raise errors.EncodingError(
          f"{context}: axis name {name!r} cannot be saved: {e}"
      ) from None

  def _array(self, obj: Any, where: str, label: str | None) -> Node:
    if isinstance(obj, jax.core.Tracer):
      raise errors.EncodingError(
          f"{where}: cannot save a traced value (save outside jax.jit / grad)."
      )
    if isinstance(obj, jax.Array) and obj.is_deleted():
      raise errors.EncodingError(
          f"{where}: the array was deleted (donated to a jitted function?)."
      )
    if isinstance(obj, jax.Array) and jax.dtypes.issubdtype(
        obj.dtype, jax.dtypes.prng_key
    ):
      impl = str(jax.random.key_impl(obj))
      if impl not in PRNG_IMPLS:
        raise errors.EncodingError(
            f"{where}: PRNG keys of implementation {impl!r} are not supported."
        )
      return {
          "t": "prng_key",
          "impl": impl,
          "data": self._array(jax.random.key_data(obj), where, label),
      }
    context = f"{where} (label {label!r})" if label else where
    index = len(self.arrays)
    spec = arrays_lib.ArraySpec(
        key=arrays_lib.storage_key(index, label or where),
        shape=tuple(int(d) for d in np.shape(obj)),
        dtype=arrays_lib.dtype_name(obj.dtype, where=context),
        kind=arrays_lib.kind_of(obj),
        weak_type=bool(getattr(obj, "weak_type", False)),
        path=where,
        label=label,
    )
    self.arrays.append(spec)
    self.values.append(arrays_lib.to_storage(obj, spec) if spec.is_stored else None)
    self.originals.append(obj)
    return {"t": "array", "ref": index}


def encode(tree: Any, root: str = "tree") -> EncodedTree:
  """Splits ``tree`` into typed JSON and arrays, validating everything.

  Raises `pz_persist.errors.EncodingError` (or `DisallowedModuleError`) naming
  the tree path and label of the first value that cannot be saved; nothing is
  written by this function, so a save can call it before touching the disk.
  """
  encoder = _Encoder()
  node = encoder.tree(tree, root)
  encoded = EncodedTree(node, encoder.variables, encoder.arrays, encoder.values)
  _check_decodable(encoded, encoder.originals, root)
  return encoded


def _check_decodable(encoded: EncodedTree, originals: list[Any], root: str) -> None:
  """Refuses to save what loading would refuse.

  The decoder validates every node (axes against arrays, labels against the
  arrays table, classes' own checks when rebuilt); running it here, on the
  very arrays being saved, applies exactly the checks a load applies, so a
  checkpoint that could never be loaded is never written. (Abstract mode
  only keeps mutable variables frozen: nothing is copied.)
  """
  try:
    decode(
        encoded.tree,
        encoded.variables,
        originals,
        abstract=True,
        root=root,
        labels=[spec.label for spec in encoded.arrays],
    )
  except Exception as e:  # pylint: disable=broad-except
    # Whatever a load would raise (a ManifestError, or a class's own error).
    raise errors.EncodingError(
        f"{e} This value could be written but never loaded, so it is not"
        " saved."
    ) from None


def encode_static(value: Any, where: str) -> Node:
  """Encodes a plain Python value (no arrays) as typed JSON."""
  return _Encoder().static(value, where)


class _Decoder:
  """Rebuilds Python objects from JSON nodes, validating every node."""

  def __init__(
      self,
      arrays: Sequence[Any],
      variables: Sequence[Any],
      *,
      abstract: bool,
      labels: Sequence[str | None] | None = None,
  ):
    self._arrays = arrays
    # The manifest's label of each array, checked against the variable that
    # holds it (None: not checked); the labels of the values being decoded.
    self._array_labels = labels
    self._label_stack: list[str] = []
    self.variables_where = "variables"
    self._variable_nodes = variables
    self._variables: dict[int, Any] = {}
    self._decoding_variables: set[int] = set()
    self._abstract = abstract

  @staticmethod
  def _expect(node: Any, where: str, *fields: str) -> str:
    if not isinstance(node, dict) or not isinstance(node.get("t"), str):
      raise errors.ManifestError(f"{where}: expected a typed node, got {node!r:.80}.")
    if set(node) != {"t", *fields}:
      raise errors.ManifestError(
          f"{where}: node {node['t']!r} has fields {sorted(node)}, expected"
          f" {sorted({'t', *fields})}."
      )
    return node["t"]

  @staticmethod
  def _depth_check(depth: int, where: str):
    if depth > MAX_DEPTH:
      raise errors.ManifestError(f"{where}: nesting deeper than {MAX_DEPTH}.")

  def static(self, node: Any, where: str, depth: int = 0) -> Any:
    self._depth_check(depth, where)
    if not isinstance(node, dict) or not isinstance(node.get("t"), str):
      raise errors.ManifestError(f"{where}: expected a typed node, got {node!r:.80}.")
    tag = node.get("t")
    result = self._scalar(node, where)
    if result is not _NOT_SCALAR:
      return result
    if tag == "np_scalar":
      self._expect(node, where, "dtype", "hex")
      dtype = arrays_lib.dtype_from_name(node["dtype"], where=where)
      try:
        raw = bytes.fromhex(node["hex"])
      except (TypeError, ValueError):
        raise errors.ManifestError(f"{where}: invalid hex data.") from None
      if len(raw) != dtype.itemsize:
        raise errors.ManifestError(f"{where}: {len(raw)} bytes for a {dtype}.")
      return np.frombuffer(raw, dtype)[0]
    child = lambda n, w: self.static(n, w, depth + 1)  # pylint: disable=unnecessary-lambda-assignment
    return self._structural(node, where, child, depth)

  def _structural(
      self, node: Node, where: str, decode: Callable[[Any, str], Any], depth: int
  ) -> Any:
    """Decodes what static values and trees share: containers, dataclasses,
    layers and references to code. ``decode`` decodes children."""
    tag = node.get("t")
    if tag in ("struct", "dataclass"):
      return self._dataclass(node, where, decode)
    if tag == "enum":
      self._expect(node, where, "class", "name")
      cls = references.resolve_class(
          node["class"], where=where, accept=_is_enum_class, kind="an Enum"
      )
      if not isinstance(node["name"], str) or node["name"] not in cls.__members__:
        raise errors.ManifestError(
            f"{where}: {cls.__qualname__} has no member {node['name']!r}."
        )
      return cls[node["name"]]
    if tag == "dtype":
      self._expect(node, where, "name")
      return arrays_lib.dtype_from_name(node["name"], where=where)
    if tag == "type":
      self._expect(node, where, "class")
      return references.resolve_class_value(node["class"], where=where)
    if tag == "function":
      self._expect(node, where, "ref")
      return references.resolve_function(node["ref"], where=where)
    if tag == "partial":
      self._expect(node, where, "func", "args", "keywords")
      func = self.static(node["func"], f"{where}.func", depth + 1)
      if not callable(func):
        raise errors.ManifestError(f"{where}: partial of a non-callable.")
      if not isinstance(node["args"], list):
        raise errors.ManifestError(f"{where}: args must be a list.")
      args = [self.static(a, f"{where}.args", depth + 1) for a in node["args"]]
      keywords = {}
      for key, value in self._pairs(node["keywords"], where):
        if not isinstance(key, str) or key in keywords:
          raise errors.ManifestError(f"{where}: invalid keyword {key!r}.")
        keywords[key] = self.static(value, f"{where}.keywords", depth + 1)
      return functools.partial(func, *args, **keywords)
    return self._container(node, where, decode, depth)

  def _dataclass(
      self, node: Node, where: str, decode: Callable[[Any, str], Any]
  ) -> Any:
    self._expect(node, where, "class", "fields")
    is_struct = node["t"] == "struct"
    cls = references.resolve_class(
        node["class"],
        where=where,
        accept=_is_struct_class if is_struct else _is_dataclass_class,
        kind="a pz.Struct class" if is_struct else "a dataclass",
    )
    names = {
        f.name for f in dataclasses.fields(cls) if is_struct or f.init
    }
    values = {}
    for name, value in self._pairs(node["fields"], where):
      if not isinstance(name, str) or name not in names or name in values:
        raise errors.ManifestError(
            f"{where}: {cls.__qualname__} has no field {name!r} (or it repeats)."
        )
      values[name] = decode(value, f"{where}.{name}")
    # The class's own checks may refuse the values, with any exception.
    rebuilding = f"cannot rebuild {cls.__qualname__}"
    with references.running_checkpoint_code(where, rebuilding):
      return cls.from_attributes(**values) if is_struct else cls(**values)

  def _scalar(self, node: Node, where: str) -> Any:
    tag = node.get("t")
    if tag == "none":
      self._expect(node, where)
      return None
    if tag in ("bool", "int", "str"):
      self._expect(node, where, "v")
      expected = {"bool": bool, "int": int, "str": str}[tag]
      if type(node["v"]) is not expected:
        raise errors.ManifestError(f"{where}: invalid {tag} {node['v']!r:.80}.")
      return node["v"]
    if tag == "float":
      self._expect(node, where, "v")
      return _decode_float(node["v"], where)
    if tag == "complex":
      self._expect(node, where, "re", "im")
      return complex(
          _decode_float(node["re"], where), _decode_float(node["im"], where)
      )
    if tag == "bytes":
      self._expect(node, where, "b64")
      try:
        return base64.b64decode(node["b64"], validate=True)
      except (TypeError, ValueError):
        raise errors.ManifestError(f"{where}: invalid base64 data.") from None
    return _NOT_SCALAR

  @staticmethod
  def _pairs(items: Any, where: str) -> list[tuple[Any, Any]]:
    if not isinstance(items, list) or not all(
        isinstance(p, list) and len(p) == 2 for p in items
    ):
      raise errors.ManifestError(f"{where}: expected a list of pairs.")
    return [tuple(p) for p in items]

  def _container(
      self,
      node: Node,
      where: str,
      decode: Callable[[Any, str], Any],
      depth: int,
  ) -> Any:
    tag = node.get("t")
    if tag in _SEQUENCE_TAGS or tag == "namedtuple":
      fields = ("class", "items") if tag == "namedtuple" else ("items",)
      self._expect(node, where, *fields)
      if not isinstance(node["items"], list):
        raise errors.ManifestError(f"{where}: items must be a list.")
      items = [decode(v, f"{where}[{i}]") for i, v in enumerate(node["items"])]
      if tag != "namedtuple":
        try:
          return _SEQUENCE_TAGS[tag](items)
        except TypeError:
          raise errors.ManifestError(f"{where}: unhashable set element.") from None
      cls = references.resolve_class(
          node["class"], where=where, accept=_is_namedtuple_class, kind="a namedtuple"
      )
      if len(items) != len(cls._fields):
        raise errors.ManifestError(
            f"{where}: {cls.__qualname__} has {len(cls._fields)} fields, the"
            f" checkpoint has {len(items)} values."
        )
      rebuilding = f"cannot rebuild {cls.__qualname__}"
      with references.running_checkpoint_code(where, rebuilding):
        return cls(*items)
    if tag in ("dict", "ordered_dict"):
      self._expect(node, where, "items")
      out = {} if tag == "dict" else collections.OrderedDict()
      for key_node, value_node in self._pairs(node["items"], where):
        key = self.static(key_node, f"{where} key", depth + 1)
        try:
          duplicate = key in out
        except TypeError:
          raise errors.ManifestError(f"{where}: unhashable dict key {key!r}.") from None
        if duplicate:
          raise errors.ManifestError(f"{where}: duplicate dict key {key!r}.")
        out[key] = decode(value_node, f"{where}[{key!r}]")
      return out
    raise errors.ManifestError(f"{where}: unknown node type {tag!r}.")

  def tree(self, node: Any, where: str, depth: int = 0) -> Any:
    self._depth_check(depth, where)
    if not isinstance(node, dict) or not isinstance(node.get("t"), str):
      raise errors.ManifestError(f"{where}: expected a typed node, got {node!r:.80}.")
    tag = node.get("t")
    result = self._scalar(node, where)
    if result is not _NOT_SCALAR:
      return result
    child = lambda n, w: self.tree(n, w, depth + 1)  # pylint: disable=unnecessary-lambda-assignment
    if tag == "array":
      self._expect(node, where, "ref")
      return self._array(node["ref"], where)
    if tag == "prng_key":
      self._expect(node, where, "impl", "data")
      impl = node["impl"]
      if not isinstance(impl, str) or impl not in PRNG_IMPLS:
        raise errors.ManifestError(f"{where}: unknown PRNG implementation {impl!r:.80}.")
      data = child(node["data"], f"{where}.data")
      try:
        if self._abstract:
          return jax.eval_shape(
              lambda d: jax.random.wrap_key_data(d, impl=impl), data
          )
        return jax.random.wrap_key_data(data, impl=impl)
      except (TypeError, ValueError) as e:
        raise errors.ManifestError(f"{where}: invalid PRNG key data: {e}") from None
    if tag == "named_array":
      self._expect(node, where, "axes", "data")
      axes = collections.OrderedDict()
      for name_node, size in self._pairs(node["axes"], where):
        name = self._axis_name(name_node, where, depth)
        if name in axes or type(size) is not int or size < 0:
          raise errors.ManifestError(
              f"{where}: axis {name!r} repeats or has an invalid size {size!r}."
          )
        axes[name] = size
      data = child(node["data"], f"{where}.data_array")
      return self._checked(
          pz.nx.NamedArray(named_axes=axes, data_array=data), where
      )
    if tag == "named_array_view":
      self._expect(node, where, "data_shape", "logical_axes", "name_axes", "data")
      data_shape = self._int_list(node["data_shape"], where)
      logical = self._int_list(node["logical_axes"], where)
      by_name = {}
      for name_node, index in self._pairs(node["name_axes"], where):
        name = self._axis_name(name_node, where, depth)
        if name in by_name or type(index) is not int:
          raise errors.ManifestError(f"{where}: axis {name!r} repeats or is invalid.")
        by_name[name] = index
      data = child(node["data"], f"{where}.data_array")
      return self._checked(
          pz.nx.NamedArrayView(
              data_shape=tuple(data_shape),
              data_axis_for_logical_axis=tuple(logical),
              data_axis_for_name=by_name,
              data_array=data,
          ),
          where,
      )
    if tag in ("parameter_value", "state_variable_value"):
      self._expect(node, where, "label", "metadata", "value")
      cls = pz.ParameterValue if tag == "parameter_value" else pz.StateVariableValue
      return cls(**self._labeled(node, where, depth))
    if tag in ("parameter_slot", "state_variable_slot"):
      self._expect(node, where, "label")
      cls = pz.ParameterSlot if tag == "parameter_slot" else pz.StateVariableSlot
      return cls(label=self._label(node["label"], where, depth))
    if tag == "variable":
      self._expect(node, where, "ref")
      return self._variable(node["ref"], where, depth)
    return self._structural(node, where, child, depth)

  def _axis_name(self, node: Any, where: str, depth: int) -> Any:
    name = self.static(node, f"{where} axis name", depth + 1)
    try:
      hash(name)
    except TypeError:
      raise errors.ManifestError(f"{where}: axis name {name!r} is unhashable.") from None
    return name

  def _label(self, node: Any, where: str, depth: int) -> Any:
    label = self.static(node, f"{where}.label", depth + 1)
    problem = arrays_lib.label_problem(label)
    if problem:
      raise errors.ManifestError(f"{where}: label {label!r:.100} {problem}.")
    return label

  def _labeled(self, node: Node, where: str, depth: int) -> dict[str, Any]:
    label = self._label(node["label"], where, depth)
    where = f"{where} (label {describe_label(label)!r})"
    metadata = self.static(node["metadata"], f"{where}.metadata", depth + 1)
    if not isinstance(metadata, dict):
      raise errors.ManifestError(f"{where}: metadata must be a dict.")
    self._label_stack.append(describe_label(label))
    try:
      value = self.tree(node["value"], f"{where}.value", depth + 1)
    finally:
      self._label_stack.pop()
    return {"label": label, "metadata": metadata, "value": value}

  def _variable(self, ref: Any, where: str, depth: int) -> Any:
    if type(ref) is not int or not 0 <= ref < len(self._variable_nodes):
      raise errors.ManifestError(f"{where}: invalid variable reference {ref!r}.")
    if ref in self._variables:
      return self._variables[ref]
    if ref in self._decoding_variables:
      raise errors.ManifestError(f"{where}: variable {ref} contains itself.")
    self._decoding_variables.add(ref)
    entry = self._variable_nodes[ref]
    entry_where = f"{self.variables_where}[{ref}]"
    if not isinstance(entry, dict) or set(entry) != {
        "kind", "label", "metadata", "value"
    }:
      raise errors.ManifestError(f"{entry_where}: malformed variable entry.")
    kind = entry["kind"]
    if not variable_kinds.is_kind(kind):
      raise errors.ManifestError(f"{entry_where}: unknown variable kind {kind!r}.")
    fields = self._labeled(entry, entry_where, depth)
    if self._abstract:
      # A mutable variable converts its value with jnp.asarray, which a
      # ShapeDtypeStruct cannot go through: abstract trees show frozen values.
      variable = variable_kinds.value_class(kind)(**fields)
    elif kind == "parameter":
      variable = pz.Parameter(**fields)
    else:
      variable = pz.StateVariable(
          fields["value"], label=fields["label"], metadata=fields["metadata"]
      )
    self._variables[ref] = variable
    return variable

  def _array(self, ref: Any, where: str) -> Any:
    if type(ref) is not int or not 0 <= ref < len(self._arrays):
      raise errors.ManifestError(f"{where}: invalid array reference {ref!r}.")
    if self._array_labels is not None:
      # Tools print the arrays table's labels; they must be the labels of
      # the variables that hold the arrays, not whatever the file claims.
      held_by = self._label_stack[-1] if self._label_stack else None
      if self._array_labels[ref] != held_by:
        raise errors.ManifestError(
            f"{where}: arrays[{ref}] is labelled"
            f" {self._array_labels[ref]!r:.100} in the arrays table, but"
            + (f" is held by variable {held_by!r:.100}." if held_by is not None
               else " is held by no variable.")
        )
    return self._arrays[ref]

  @staticmethod
  def _int_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
      raise errors.ManifestError(f"{where}: expected a list of integers.")
    return value

  @staticmethod
  def _checked(named: Any, where: str) -> Any:
    problem = named_array_problem(named)
    if problem is not None:
      raise errors.ManifestError(
          f"{where}: axis names disagree with the stored array: {problem}"
      )
    return named


_NOT_SCALAR = object()


def decode(
    tree: Node,
    variables: Sequence[Any],
    arrays: Sequence[Any],
    *,
    abstract: bool = False,
    root: str = "tree",
    labels: Sequence[str | None] | None = None,
) -> Any:
  """Rebuilds the saved tree from its JSON and its (restored) arrays.

  Args:
    tree: The root JSON node.
    variables: The manifest's variables table.
    arrays: The restored arrays, or ``jax.ShapeDtypeStruct`` stand-ins, indexed
      like the manifest's ``arrays`` list.
    abstract: Whether ``arrays`` are stand-ins; mutable variables are then
      returned as frozen values (a mutable variable cannot hold a stand-in).
    root: Name of the root in error messages.
    labels: The manifest's ``label`` of each array, if given checked against
      the label of the variable (or frozen value) that holds the array.

  Raises:
    ManifestError: a node is malformed or disagrees with its arrays.
  """
  decoder = _Decoder(arrays, variables, abstract=abstract, labels=labels)
  if ": " in root:  # "<item path>: tree": name the file's variables table too.
    decoder.variables_where = root.rsplit(": ", 1)[0] + ": variables"
  try:
    return decoder.tree(tree, root)
  except RecursionError:  # A deep stack at the call site: still refused cleanly.
    raise errors.ManifestError(f"{root}: nesting too deep to decode.") from None


def decode_static(node: Node, where: str) -> Any:
  """Decodes a plain Python value encoded by `encode_static`."""
  return _Decoder((), (), abstract=False).static(node, where)
