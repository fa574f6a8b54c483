"""What a checkpoint holds, by label, read from its manifest alone.

Binding a checkpoint into a model, diffing two checkpoints and printing a
checkpoint's table of arrays all need to know "which variables, with which
arrays" without decoding the whole saved tree (which may name classes this
environment should not import) and without reading array data. This module
walks the manifest's JSON to answer that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from collections.abc import Iterator
from typing import Any
from typing import Literal

from pz_persist import errors
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import decode as decode_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import nodes
from pz_persist.format import variable_kinds
from pz_persist.safety import terminal

Node = nodes.Node



@dataclasses.dataclass(frozen=True)
class Variable:
  """A Penzai variable (mutable, or a frozen value) held by a checkpoint.

  Attributes:
    label: The variable's label.
    kind: ``"parameter"`` or ``"state_variable"``.
    metadata: The variable's metadata dict.
    value: Typed-JSON node of the variable's value, as stored (unchecked:
      decoding it checks it).
    refs: Indices (into the manifest's arrays) of the arrays of its value.
    location: Where it sits in the checkpoint.
  """

  label: Hashable
  kind: Literal["parameter", "state_variable"]
  metadata: dict[Any, Any]
  value: Any
  refs: tuple[int, ...]
  location: errors.Location

  @property
  def where(self) -> str:
    """Where it sits in the checkpoint, for messages."""
    return str(self.location)

  @property
  def label_text(self) -> str:
    return nodes.describe_label(self.label)


def children(node: Any) -> Iterator[Any]:
  """The child nodes of a typed-JSON node that can hold arrays.

  The JSON is the manifest's, unchecked (decoding it is what checks it):
  anything malformed holds no children here. Which fields hold children is
  the node table's (`nodes.NODE_TYPES`).
  """
  yield from nodes.children(node)


def walk(node: Any, depth: int = 0, where: str = "tree") -> Iterator[Node]:
  """Every node of a typed-JSON tree, parents first (``where`` names it)."""
  if depth > nodes.MAX_DEPTH:
    raise errors.ManifestError(f"{where}: nesting deeper than {nodes.MAX_DEPTH}.")
  if isinstance(node, dict):
    yield node
    for child in children(node):
      yield from walk(child, depth + 1, where)


def array_refs(node: Any, where: str = "tree") -> tuple[int, ...]:
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

  def add(kind: Literal["parameter", "state_variable"], node: Node, file: str, place: str):
    label = decode_lib.decode_static(node.get("label"), f"{file}: {place}.label")
    problem = arrays_lib.label_problem(label)
    if problem:
      raise errors.ManifestError(f"{file}: {place}: label {label!r:.100} {problem}.")
    if label in found:
      return  # The same value saved twice (e.g. in two places of a tree).
    location = errors.Location(
        file, f"{place} (label {nodes.describe_label(label)!r:.100})", label
    )
    metadata = decode_lib.decode_static(node.get("metadata"), f"{location}.metadata")
    if not isinstance(metadata, dict):
      raise errors.ManifestError(f"{location}: metadata must be a dict.")
    found[label] = Variable(
        label=label,
        kind=kind,
        metadata=metadata,
        value=node.get("value"),
        refs=array_refs(node.get("value"), f"{location}.value"),
        location=location,
    )

  for index, entry in enumerate(manifest.variables):
    if not isinstance(entry, dict) or entry.get("kind") not in tuple(variable_kinds.KINDS):
      raise errors.ManifestError(f"{where}: variables[{index}] is malformed.")
    before = len(found)
    add(entry["kind"], entry, where, f"variables[{index}]")
    if len(found) == before:
      # Two distinct mutable variables with one label: binding by label
      # would silently pick one (and Penzai refuses such a model).
      label = decode_lib.decode_static(entry.get("label"), f"{where}: variables[{index}]")
      raise errors.ManifestError(
          f"{where}: variables[{index}] has label"
          f" {nodes.describe_label(label)!r:.100}, like"
          f" {found[label].location.tree_path}; labels of variables must be"
          " unique."
      )
  for node in walk(manifest.tree, where=f"{where}: tree"):
    if isinstance(node.get("t"), str) and node["t"] in variable_kinds.BY_VALUE_TAG:
      add(variable_kinds.BY_VALUE_TAG[node["t"]].name, node, where, "tree")
  return list(found.values())


def check_variable_labels(manifest: manifest_lib.Manifest, *, where: str) -> None:
  """Refuses two mutable variables with one label, as `variables` does, from
  the variables table alone (for a format 4 manifest, its compact labels:
  neither the tree nor the variables' values are expanded or walked).

  Why: ``load_model`` checks this before reading any array (Penzai refuses
  such a model); walking the whole tree for it cost as much as decoding it.
  """
  _, entries, tables = manifest.decodable()
  seen: dict[Hashable, int] = {}
  for index, entry in enumerate(entries):
    if not isinstance(entry, dict) or entry.get("kind") not in tuple(variable_kinds.KINDS):
      raise errors.ManifestError(f"{where}: variables[{index}] is malformed.")
    place = f"{where}: variables[{index}]"
    label = decode_lib.decode_static(entry.get("label"), f"{place}.label", tables)
    problem = arrays_lib.label_problem(label)
    if problem:
      raise errors.ManifestError(f"{place}: label {label!r:.100} {problem}.")
    if label in seen:
      text = nodes.describe_label(label)
      raise errors.ManifestError(
          f"{place} has label {text!r:.100}, like variables[{seen[label]}] (label"
          f" {text!r:.100}); labels of variables must be unique."
      )
    seen[label] = index


def all_nodes(manifest: manifest_lib.Manifest) -> Iterator[Node]:
  """Every node of the tree and of the mutable variables' values."""
  yield from walk(manifest.tree)
  for entry in manifest.variables:
    if isinstance(entry, dict):
      yield from walk(entry.get("value"))


def axis_names(manifest: manifest_lib.Manifest) -> dict[int, tuple[Hashable, ...]]:
  """For arrays wrapped in NamedArrays: the name of each dimension (or None)."""
  names: dict[int, tuple[Hashable, ...]] = {}
  for node in all_nodes(manifest):
    node_type = nodes.NODE_TYPES.get(nodes.tag_of(node) or "")
    data = node.get("data")
    if node_type is None or node_type.axes is None or not isinstance(data, dict):
      continue
    if data.get("t") != "array" or type(data.get("ref")) is not int:
      continue
    spec = (
        manifest.arrays[data["ref"]]
        if 0 <= data["ref"] < len(manifest.arrays) else None
    )
    field, meaning = node_type.axes
    pairs = node.get(field)
    if spec is None or not nodes.is_pairs(pairs):
      continue  # Malformed: decoding the tree refuses it, naming the node.
    dims: list[Hashable] = [None] * len(spec.shape)
    if meaning == "size":  # The last dimensions, in order.
      axes = [decode_lib.decode_static(pair[0], "axis") for pair in pairs]
      if len(axes) > len(dims):
        continue
      for offset, name in enumerate(axes):
        dims[len(dims) - len(axes) + offset] = name
    else:  # Each pair names the dimension it gives.
      for pair in pairs:
        name, index = decode_lib.decode_static(pair[0], "axis"), pair[1]
        if type(index) is int and 0 <= index < len(dims):
          dims[index] = name
    names[data["ref"]] = tuple(dims)
  return names


@dataclasses.dataclass(frozen=True)
class ArrayRow:
  """One line of a checkpoint's table of arrays."""

  label: str
  axes: tuple[Hashable, ...]
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
