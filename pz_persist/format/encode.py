"""Encoding: a Penzai tree or model to typed JSON plus its arrays.

The save half of the tree format (`pz_persist.format.nodes` is the table of node
types, `pz_persist.format.decode` the load half). A saved tree becomes one JSON node
tree plus a list of arrays. Every node is built through `nodes.node`, so it has
exactly the fields its table row lists. Arrays are replaced by
``{"t": "array", "ref": i}`` and stored by Orbax; mutable ``pz.Parameter`` /
``pz.StateVariable`` objects are stored once in a variables table and
referenced, so a variable shared by two layers is still one shared object after
loading. Code a model refers to (classes, functions, Enums) is named by module
and qualified name through `pz_persist.format.code_references`, which refuses modules that
are not allow-listed.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import enum
import functools
import math
import operator
from collections.abc import Callable
from typing import Any
from typing import Protocol

import jax
import numpy as np
from penzai import pz

from pz_persist import errors
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import code_references
from pz_persist.format import decode as decode_lib
from pz_persist.format import meshes
from pz_persist.format import nodes
from pz_persist.format import variable_kinds

Node = nodes.Node

_VALUE_CLASSES: dict[type, str] = {k.value_class: k.value_tag for k in variable_kinds.KINDS.values()}
_SLOT_CLASSES: dict[type, str] = {k.slot_class: k.slot_tag for k in variable_kinds.KINDS.values()}
_VARIABLE_KINDS: dict[type, str] = {k.variable_class: k.name for k in variable_kinds.KINDS.values()}
def _encode_float(x: float) -> float | str:
  # JSON has no NaN or infinities; spell them out rather than emit invalid JSON.
  return x if math.isfinite(x) else repr(x)


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
  values: list[arrays_lib.Array | None]

  def stored_arrays(self) -> dict[str, arrays_lib.Array | None]:
    """The ``{key: array}`` dict that Orbax saves."""
    return {
        spec.key: value
        for spec, value in zip(self.arrays, self.values)
        if spec.is_stored
    }


class _Labeled(Protocol):
  """What `_Encoder._labeled` reads of a variable or a frozen variable value."""

  @property
  def label(self) -> object: ...

  @property
  def metadata(self) -> object: ...

  @property
  def value(self) -> object: ...


class _Encoder:
  """Walks a tree once, emitting JSON nodes and collecting arrays."""

  def __init__(self) -> None:
    self.arrays: list[arrays_lib.ArraySpec] = []
    self.values: list[arrays_lib.Array | None] = []
    self.variables: list[Node] = []
    self.originals: list[arrays_lib.Array] = []  # The arrays as given, for `_check_decodable`.
    self._variable_refs: dict[int, int] = {}  # id(variable) -> ref.
    self._depth = 0  # Values being encoded, each inside the one before.

  def _deeper(self, encode: Callable[..., Node], obj: object, where: str, *rest: Any) -> Node:
    """``encode(obj, where, *rest)`` one level deeper, refused past what a
    reader loads.

    Why here: each value nests its node one level inside its container's, so
    a value more than `nodes.MAX_DEPTH` + 1 levels in is one every reader
    refuses; refusing it while walking (rather than by the decoder's check
    after the walk) bounds the walk itself, so a tree nested thousands deep
    or holding itself (``l.append(l)``) is an `EncodingError` naming where,
    not a RecursionError. Shallower trees get the decoder's exact check.
    """
    if self._depth > nodes.MAX_DEPTH:
      raise errors.EncodingError(
          f"{where:.300}: nesting deeper than {nodes.MAX_DEPTH} (or a value that"
          " contains itself). This value could never be loaded, so it is not saved."
      )
    self._depth += 1
    try:
      return encode(obj, where, *rest)
    finally:
      self._depth -= 1

  # Static values: labels, metadata, axis names. No arrays allowed.

  def static(self, obj: object, where: str) -> Node:
    """Encodes a plain Python value (a label, a metadata entry, an axis name)."""
    return self._deeper(self._static_value, obj, where)

  def _static_value(self, obj: object, where: str) -> Node:
    node = self._scalar(obj)
    if node is not None:
      return node
    if isinstance(obj, np.generic):
      value = np.asarray(obj)
      return nodes.node(
          "np_scalar",
          dtype=arrays_lib.dtype_name(value.dtype, where=where),
          hex=value.tobytes().hex(),
      )
    return (
        self._container(obj, where, self.static, sets=True)
        or self._dataclass(obj, where, self.static)
        or self._code(obj, where)
    )

  def _code(self, obj: object, where: str) -> Node:
    """Encodes references to code: Enums, dtypes, classes, functions, partials.

    These are the values a model's structure holds besides containers and
    arrays; anything else cannot be saved.
    """
    if meshes.is_mesh(obj):  # Axis names and sizes; never devices.
      return nodes.node("mesh", **meshes.mesh_fields(obj, where))
    if isinstance(obj, jax.sharding.PartitionSpec):
      return nodes.node("partition_spec", spec=meshes.spec_entries(obj, where))
    if isinstance(obj, jax.sharding.NamedSharding):
      return nodes.node(
          "named_sharding",
          mesh=self.static(obj.mesh, f"{where}.mesh"),
          spec=self.static(obj.spec, f"{where}.spec"),
          memory_kind=obj.memory_kind,
      )
    meshes.refuse_sharding(obj, where)
    if isinstance(obj, enum.Enum):
      return nodes.node(
          "enum",
          name=_enum_name(obj, where),
          **{"class": code_references.class_reference(type(obj), where=where)},
      )
    if isinstance(obj, np.dtype):
      return nodes.node("dtype", name=arrays_lib.dtype_name(obj, where=where))
    if isinstance(obj, type):  # A class as a value is a callable: checked as one.
      return nodes.node("type", **{"class": code_references.class_value_reference(obj, where=where)})
    if type(obj) is functools.partial:
      return nodes.node(
          "partial",
          func=self.static(obj.func, f"{where}.func"),
          args=[self.static(a, f"{where}.args[{i}]") for i, a in enumerate(obj.args)],
          keywords=[
              [k, self.static(v, f"{where}.keywords[{k!r}]")]
              for k, v in obj.keywords.items()
          ],
      )
    if callable(obj):
      try:
        ref = code_references.function_reference(obj, where=where)
      except errors.EncodingError:
        _refuse_compiled(obj, where)  # With what to do, if that is what it is.
        raise
      return nodes.node("function", ref=ref)
    return self._refuse(obj, where)

  def _dataclass(
      self, obj: object, where: str, encode: Callable[[object, str], Node]
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
    return nodes.node(
        tag,
        fields=[[name, encode(v, f"{where}.{name}")] for name, v in fields.items()],
        **{"class": code_references.class_reference(type(obj), where=where)},
    )

  @staticmethod
  def _scalar(obj: object) -> Node | None:
    if obj is None:
      return nodes.node("none")
    if type(obj) is bool:
      return nodes.node("bool", v=obj)
    if type(obj) is int:
      return nodes.node("int", v=obj)
    if type(obj) is float:
      return nodes.node("float", v=_encode_float(obj))
    if type(obj) is complex:
      return nodes.node("complex", re=_encode_float(obj.real), im=_encode_float(obj.imag))
    if type(obj) is str:
      return nodes.node("str", v=obj)
    if type(obj) is bytes:
      return nodes.node("bytes", b64=base64.b64encode(obj).decode("ascii"))
    return None

  def _container(
      self,
      obj: Any,
      where: str,
      encode: Callable[[object, str], Node],
      sets: bool = False,
  ) -> Node | None:
    """Encodes the containers shared by static values and trees.

    Sets are not pytree nodes, so only static values (``sets=True``) hold them.
    """
    if isinstance(obj, tuple) and nodes.is_namedtuple_class(type(obj)):
      return nodes.node(
          "namedtuple",
          items=[encode(v, f"{where}.{name}") for name, v in zip(obj._fields, obj)],  # type: ignore[attr-defined]  # A namedtuple (checked above).
          **{"class": code_references.class_reference(type(obj), where=where)},
      )
    for tag, cls in nodes.SEQUENCE_TYPES.items():
      is_set = tag in ("set", "frozenset")
      if type(obj) is cls and (sets or not is_set):
        items = sorted(obj, key=repr) if is_set else obj
        return nodes.node(
            tag, items=[encode(v, f"{where}[{i}]") for i, v in enumerate(items)]
        )
    if type(obj) in (dict, collections.OrderedDict):
      return nodes.node(
          "dict" if type(obj) is dict else "ordered_dict",
          items=[
              [self.static(k, f"{where} key {k!r}"), encode(v, f"{where}[{k!r}]")]
              for k, v in obj.items()
          ],
      )
    return None

  @staticmethod
  def _refuse(obj: object, where: str) -> Node:
    kind = type(obj)
    raise errors.EncodingError(
        f"{where}: cannot save a value of type {kind.__module__}.{kind.__qualname__}"
        f" ({obj!r:.80})."
    )

  # Trees: any pytree pz_persist supports.

  def tree(self, obj: object, where: str, label: str | None = None) -> Node:
    """Encodes a pytree, collecting its arrays and variables."""
    return self._deeper(self._tree_value, obj, where, label)

  def _tree_value(self, obj: Any, where: str, label: str | None) -> Node:
    node = self._scalar(obj)
    if node is not None:
      return node
    array_kind = arrays_lib.kind_of(obj)
    if array_kind is not None:
      return self._array(obj, array_kind, where, label)
    kind = type(obj)
    fits_axes = kind in (pz.nx.NamedArray, pz.nx.NamedArrayView) and (
        nodes.named_array_problem(obj) is None
    )
    if kind is pz.nx.NamedArray and fits_axes:
      return nodes.node(
          "named_array",
          axes=[
              [self._axis_name(name, where, label), size]
              for name, size in obj.named_axes.items()
          ],
          data=self.tree(obj.data_array, f"{where}.data_array", label),
      )
    if kind is pz.nx.NamedArrayView and fits_axes:
      return nodes.node(
          "named_array_view",
          data_shape=list(obj.data_shape),
          logical_axes=list(obj.data_axis_for_logical_axis),
          name_axes=[
              [self._axis_name(name, where, label), index]
              for name, index in obj.data_axis_for_name.items()
          ],
          data=self.tree(obj.data_array, f"{where}.data_array", label),
      )
    if kind in _VALUE_CLASSES:
      return nodes.node(_VALUE_CLASSES[kind], **self._labeled(obj, where))
    if kind in _SLOT_CLASSES:
      return nodes.node(_SLOT_CLASSES[kind], label=self._label(obj.label, where))
    if kind in _VARIABLE_KINDS:
      return nodes.node("variable", ref=self._variable(obj, where))

    def child(value: object, at: str) -> Node:  # Children keep the enclosing label.
      return self.tree(value, at, label)

    node = self._container(obj, where, child) or self._dataclass(obj, where, child)
    if node is not None:
      return node
    if isinstance(obj, pz.AbstractVariable):
      return self._refuse(obj, where)  # A variable class pz_persist does not know.
    return self._code(obj, where + (f" (label {label!r})" if label else ""))

  def _label(self, label: object, where: str) -> Node:
    problem = arrays_lib.label_problem(label)  # Loading refuses the same ones.
    if problem:
      raise errors.EncodingError(f"{where}: variable label {label!r} {problem}.")
    return self.static(label, f"{where}.label")

  def _labeled(self, obj: _Labeled, where: str) -> Node:
    label_text = nodes.describe_label(obj.label)
    label_where = f"{where} (label {label_text!r})"
    return {
        "label": self._label(obj.label, label_where),
        "metadata": self.static(obj.metadata, f"{label_where}.metadata"),
        "value": self.tree(obj.value, f"{where}.value", label_text),
    }

  def _variable(self, var: pz.AbstractVariable, where: str) -> int:
    ref = self._variable_refs.get(id(var))
    if ref is None:
      ref = len(self.variables)
      self._variable_refs[id(var)] = ref
      entry = {"kind": _VARIABLE_KINDS[type(var)]}
      self.variables.append(entry)  # Reserve the slot before recursing.
      entry.update(self._labeled(var, where))
    return ref

  def _axis_name(self, name: object, where: str, label: str | None) -> Node:
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

  def _array(
      self, obj: Any, kind: arrays_lib.ArrayKind, where: str, label: str | None
  ) -> Node:
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
      if impl not in nodes.PRNG_IMPLS:
        raise errors.EncodingError(
            f"{where}: PRNG keys of implementation {impl!r} are not supported."
        )
      return nodes.node(
          "prng_key",
          impl=impl,
          data=self._array(jax.random.key_data(obj), "jax", where, label),
      )
    context = f"{where} (label {label!r})" if label else where
    index = len(self.arrays)
    spec = arrays_lib.ArraySpec(
        key=arrays_lib.storage_key(index, label or where),
        shape=tuple(int(d) for d in np.shape(obj)),
        dtype=arrays_lib.dtype_name(obj.dtype, where=context),
        kind=kind,
        weak_type=bool(getattr(obj, "weak_type", False)),
        path=where,
        label=label,
    )
    self.arrays.append(spec)
    self.values.append(_snapshot(arrays_lib.to_storage(obj, spec), obj) if spec.is_stored else None)
    self.originals.append(obj)
    return nodes.node("array", ref=index)


def _snapshot(value: arrays_lib.Array, given: arrays_lib.Array) -> arrays_lib.Array:
  """``value`` (what is stored of the array ``given``), made safe from later
  changes to ``given``.

  Why here: every save path (`pz_persist.save`, ``save_model``, the manager,
  `PenzaiSave` in Orbax's own checkpointers, the v1 handler, the
  mutable-variable ``TypeHandler``) encodes its tree through `encode` before
  it returns, and an async save writes and hashes the arrays afterwards, in
  the background. A NumPy array is mutable: ``w[:] = 7`` after ``save``
  returned would otherwise change what is written (and what is hashed, so
  the checksum would not even notice). JAX arrays are immutable and need no
  copy; a NumPy array is copied unless the storage conversion already made a
  fresh array of its own (a widening cast), so at most one copy is made.
  """
  if isinstance(value, jax.Array):
    return value
  if value is given or np.may_share_memory(value, given):
    return np.array(value, copy=True)
  return value


def encode(tree: object, root: str = "tree") -> EncodedTree:
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


def _check_decodable(
    encoded: EncodedTree, originals: list[arrays_lib.Array], root: str
) -> None:
  """Refuses to save what loading would refuse.

  The decoder validates every node (axes against arrays, labels against the
  arrays table, classes' own checks when rebuilt); running it here, on the
  very arrays being saved, applies exactly the checks a load applies, so a
  checkpoint that could never be loaded is never written. (Abstract mode
  only keeps mutable variables frozen: nothing is copied.)
  """
  try:
    decode_lib.decode(
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


def _enum_name(member: enum.Enum, where: str) -> str:
  """The name an ``enum`` node stores: the member's own, or for a combination
  of `enum.Flag` members (``Mode.A | Mode.B``) their names joined by ``|``
  (``"A|B"``; ``""`` for no flag), which the decoder ORs together again."""
  cls = type(member)
  if member.name in cls.__members__:
    return member.name
  if isinstance(member, enum.Flag):
    flags = type(member)
    parts = [m for m in flags if m.value and m in member]  # Single-bit members.
    combined = functools.reduce(operator.or_, parts, flags(0))
    if combined == member:
      return "|".join(str(m.name) for m in parts)
  raise errors.EncodingError(
      f"{where}: {member!r:.80} is not a member of {cls.__qualname__} nor a"
      f" combination of its members ({', '.join(cls.__members__)}), so it could"
      " not be loaded by name; use one of its members."
  )


def _refuse_compiled(fn: object, where: str) -> None:
  """Refuses ``jax.jit(f)`` (or ``jax.pmap(f)``) that cannot be found by name,
  with what to do instead: its name leads back to the plain ``f``, so loading
  could not rebuild the compiled wrapper, and saving ``f`` loses nothing.
  (Functions JAX itself publishes jitted, such as ``jax.nn.silu``, are found
  by name and saved as they are.)"""
  wrapped = getattr(fn, "__wrapped__", None)
  if wrapped is None or not callable(getattr(fn, "lower", None)):
    return
  try:  # Its public name (jax.nn.relu), as the plain function would be saved.
    ref = code_references.function_reference(wrapped, where=where)
    name = f"{ref['module']}.{ref['qualname']}"
  except errors.PzPersistError:
    name = f"{getattr(wrapped, '__module__', '?')}.{getattr(wrapped, '__qualname__', '?')}"
  raise errors.EncodingError(
      f"{where}: a jax.jit-compiled function ({name}) cannot be saved: it is"
      " compiled for one process, and its name leads to the plain function, not"
      " to it."
      f" Hold the plain function instead (e.g. pz.nn.Elementwise({name})) and"
      " compile the whole model's call, jax.jit(lambda model, x: model(x)),"
      " which compiles the activation with it."
  )
