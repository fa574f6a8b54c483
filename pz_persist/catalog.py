"""What a checkpoint holds, by label, read from its manifest alone.

Binding a checkpoint into a model, diffing two checkpoints and printing a
checkpoint's table of arrays all need to know "which variables, with which
arrays" without decoding the whole saved tree (which may name classes this
environment should not import) and without reading array data. This module
walks the manifest's JSON to answer that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator
from typing import Any, Literal

from pz_persist import arrays as arrays_lib
from pz_persist import encoding
from pz_persist import errors
from pz_persist import manifest as manifest_lib
from pz_persist import terminal

Node = dict[str, Any]

_VALUE_TAGS = {"parameter_value": "parameter", "state_variable_value": "state_variable"}


@dataclasses.dataclass(frozen=True)
class Variable:
  """A Penzai variable (mutable, or a frozen value) held by a checkpoint.

  Attributes:
    label: The variable's label.
    kind: ``"parameter"`` or ``"state_variable"``.
    metadata: The variable's metadata dict.
    value: Typed-JSON node of the variable's value.
    refs: Indices (into the manifest's arrays) of the arrays of its value.
    where: Where it sits in the checkpoint, for messages.
  """

  label: Hashable
  kind: Literal["parameter", "state_variable"]
  metadata: dict[Any, Any]
  value: Node
  refs: tuple[int, ...]
  where: str

  @property
  def label_text(self) -> str:
    return encoding.describe_label(self.label)


def children(node: Any) -> Iterator[Any]:
  """The child nodes of a typed-JSON node that can hold arrays.

  The JSON is the manifest's, unchecked (decoding it is what checks it):
  anything malformed holds no children here.
  """
  if not isinstance(node, dict) or not isinstance(node.get("t"), str):
    return
  tag = node["t"]
  if tag in ("list", "tuple", "namedtuple"):
    yield from _list(node.get("items"))
  elif tag in ("dict", "ordered_dict"):
    yield from (pair[1] for pair in _pairs(node.get("items")))
  elif tag in ("struct", "dataclass"):
    yield from (pair[1] for pair in _pairs(node.get("fields")))
  elif tag in ("named_array", "named_array_view", "prng_key"):
    yield node.get("data")
  elif tag in _VALUE_TAGS:
    yield node.get("value")


def _list(value: Any) -> list[Any]:
  return value if isinstance(value, list) else []


def _pairs(value: Any) -> list[list[Any]]:
  return [pair for pair in _list(value) if isinstance(pair, list) and len(pair) == 2]


def walk(node: Any, depth: int = 0, where: str = "tree") -> Iterator[Node]:
  """Every node of a typed-JSON tree, parents first (``where`` names it)."""
  if depth > encoding.MAX_DEPTH:
    raise errors.ManifestError(f"{where}: nesting deeper than {encoding.MAX_DEPTH}.")
  if isinstance(node, dict):
    yield node
    for child in children(node):
      yield from walk(child, depth + 1, where)


def array_refs(node: Node, where: str = "tree") -> tuple[int, ...]:
  """Indices of the arrays a node's subtree uses, in order."""
  return tuple(
      n["ref"] for n in walk(node, where=where) if n.get("t") == "array" and type(n.get("ref")) is int
  )


def variables(manifest: manifest_lib.Manifest, *, where: str) -> list[Variable]:
  """Every variable in the checkpoint, first occurrence of each label first.

  Covers the mutable variables of the variables table and the frozen
  ``ParameterValue`` / ``StateVariableValue`` nodes anywhere in the tree.
  """
  found: dict[Hashable, Variable] = {}

  def add(kind: str, node: Node, place: str):
    label = encoding.decode_static(node.get("label"), f"{place}.label")
    problem = arrays_lib.label_problem(label)
    if problem:
      raise errors.ManifestError(f"{place}: label {label!r:.100} {problem}.")
    if label in found:
      return  # The same value saved twice (e.g. in two places of a tree).
    place = f"{place} (label {encoding.describe_label(label)!r:.100})"
    metadata = encoding.decode_static(node.get("metadata"), f"{place}.metadata")
    if not isinstance(metadata, dict):
      raise errors.ManifestError(f"{place}: metadata must be a dict.")
    found[label] = Variable(
        label=label,
        kind=kind,
        metadata=metadata,
        value=node.get("value"),
        refs=array_refs(node.get("value"), f"{place}.value"),
        where=place,
    )

  for index, entry in enumerate(manifest.variables):
    if not isinstance(entry, dict) or entry.get("kind") not in _VALUE_TAGS.values():
      raise errors.ManifestError(f"{where}: variables[{index}] is malformed.")
    before = len(found)
    add(entry["kind"], entry, f"{where}: variables[{index}]")
    if len(found) == before:
      # Two distinct mutable variables with one label: binding by label
      # would silently pick one (and Penzai refuses such a model).
      label = encoding.decode_static(entry.get("label"), f"{where}: variables[{index}]")
      raise errors.ManifestError(
          f"{where}: variables[{index}] has label"
          f" {encoding.describe_label(label)!r:.100}, like"
          f" {found[label].where.split(': ')[-1]}; labels of variables must be"
          " unique."
      )
  for node in walk(manifest.tree, where=f"{where}: tree"):
    if isinstance(node.get("t"), str) and node["t"] in _VALUE_TAGS:
      add(_VALUE_TAGS[node["t"]], node, f"{where}: tree")
  return list(found.values())


def all_nodes(manifest: manifest_lib.Manifest) -> Iterator[Node]:
  """Every node of the tree and of the mutable variables' values."""
  yield from walk(manifest.tree)
  for entry in manifest.variables:
    if isinstance(entry, dict):
      yield from walk(entry.get("value"))


def axis_names(manifest: manifest_lib.Manifest) -> dict[int, tuple[Any, ...]]:
  """For arrays wrapped in NamedArrays: the name of each dimension (or None)."""
  names: dict[int, tuple[Any, ...]] = {}
  for node in all_nodes(manifest):
    tag, data = node.get("t"), node.get("data")
    if tag not in ("named_array", "named_array_view") or not isinstance(data, dict):
      continue
    if data.get("t") != "array" or type(data.get("ref")) is not int:
      continue
    spec = (
        manifest.arrays[data["ref"]]
        if 0 <= data["ref"] < len(manifest.arrays) else None
    )
    pairs = node.get("axes" if tag == "named_array" else "name_axes")
    if spec is None or not isinstance(pairs, list) or not all(
        isinstance(pair, list) and len(pair) == 2 for pair in pairs
    ):
      continue  # Malformed: decoding the tree refuses it, naming the node.
    dims: list[Any] = [None] * len(spec.shape)
    if tag == "named_array":
      axes = [encoding.decode_static(pair[0], "axis") for pair in pairs]
      if len(axes) > len(dims):
        continue
      for offset, name in enumerate(axes):
        dims[len(dims) - len(axes) + offset] = name
    else:
      for pair in pairs:
        name, index = encoding.decode_static(pair[0], "axis"), pair[1]
        if type(index) is int and 0 <= index < len(dims):
          dims[index] = name
    names[data["ref"]] = tuple(dims)
  return names


@dataclasses.dataclass(frozen=True)
class ArrayRow:
  """One line of a checkpoint's table of arrays."""

  label: str
  axes: tuple[Any, ...]
  spec: arrays_lib.ArraySpec

  @property
  def axes_text(self) -> str:
    # Axis names come from the checkpoint: none may start a line of its own.
    names = ("-" if a is None else str(a) for a in self.axes)
    return "(" + ", ".join(terminal.printable(n, newlines=False) for n in names) + ")"


def array_rows(manifest: manifest_lib.Manifest) -> list[ArrayRow]:
  """One row per stored array: label (or tree path), axes, shape, dtype."""
  names = axis_names(manifest)
  return [
      ArrayRow(
          label=spec.label if spec.label is not None else spec.path,
          axes=names.get(index, (None,) * len(spec.shape)),
          spec=spec,
      )
      for index, spec in enumerate(manifest.arrays)
  ]
