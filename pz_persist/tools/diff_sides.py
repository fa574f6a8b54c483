"""The two sides of a diff: a model in memory, a checkpoint path, or an opened handle.

A diff needs of each side only two things, so every kind of side is one small
`Side`: its structure (a manifest: the typed JSON tree, the variables table
and the arrays' specs) and a way to read some of its arrays by manifest index.
A model is encoded in memory (`pz_persist.format.encode`, nothing written, no
array copied); a checkpoint path is opened the one way every read opens one
(`pz_persist.storage.reading.opening`: lock, containment, retry) and read through the
one array reader (checksums verified); anything else offering
``__pz_persist_diff_side__()`` (a lazy checkpoint handle) returns its own
`Side`, or a factory registered with `register` builds one. Reading by index
is what keeps a diff's memory bounded: the caller asks for one batch at a
time and drops it before the next.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Protocol
from typing import TypeGuard
from typing import TypeVar

import numpy as np
from etils import epath

from pz_persist import errors
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import encode as encode_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.storage.reading import opening
from pz_persist.storage.reading import reader

T = TypeVar("T")


class Side(Protocol):
  """One side of a diff.

  Attributes:
    description: How the diff names this side (a path, or a model's class).
    manifest: Its structure: ``tree``, ``variables`` and ``arrays`` as a
      checkpoint's manifest holds them.
  """

  description: str

  @property
  def manifest(self) -> manifest_lib.Manifest: ...

  def read(self, refs: Collection[int]) -> dict[int, Any]:
    """The arrays of ``manifest.arrays`` at ``refs`` in their logical dtype
    (NumPy or JAX arrays; the diff copies each to the host to compare it)."""


@dataclasses.dataclass
class ModelSide:
  """A model or any tree pz_persist can save, encoded in memory."""

  description: str
  manifest: manifest_lib.Manifest
  values: list[Any]

  def read(self, refs: Collection[int]) -> dict[int, Any]:
    found = {}
    for ref in refs:
      spec = self.manifest.arrays[ref]
      value = self.values[ref]
      if value is None:  # Zero-size arrays are not stored.
        found[ref] = np.zeros(spec.shape, spec.np_dtype)
      else:
        found[ref] = arrays_lib.from_storage(value, spec)
    return found


@dataclasses.dataclass
class PathSide:
  """An opened checkpoint item; valid inside its `opening.read` call."""

  description: str
  opened: opening.OpenItem

  @property
  def manifest(self) -> manifest_lib.Manifest:
    return self.opened.manifest

  def read(self, refs: Collection[int]) -> dict[int, Any]:
    values = reader.read_arrays(
        self.opened.item, self.opened.manifest, refs=set(refs), snapshot=self.opened.snapshot,
    )
    return {ref: values[ref] for ref in refs}


@dataclasses.dataclass
class FunctionSide:
  """A side from its parts, for an adapter of a few lines: a lazy handle's
  ``__pz_persist_diff_side__`` returns
  ``FunctionSide(str(self.path), manifest, lambda refs: read_arrays(refs))``
  with its reads kept under its own lock and verification."""

  description: str
  manifest: manifest_lib.Manifest
  reads: Callable[[Collection[int]], Mapping[int, Any] | Sequence[Any]]
  """Returns the arrays at ``refs`` by index: a mapping, or a list indexed
  like ``manifest.arrays`` (what `pz_persist.storage.reading.reader.read_arrays` returns)."""

  def read(self, refs: Collection[int]) -> dict[int, Any]:
    values = self.reads(refs)
    return {ref: values[ref] for ref in refs}


_FACTORIES: list[tuple[type, Callable[[Any], Side]]] = []


def register(kind: type, factory: Callable[[Any], Side]) -> None:
  """Makes values of ``kind`` diffable: ``factory(value)`` returns its `Side`.

  For kinds that cannot carry ``__pz_persist_diff_side__`` themselves."""
  _FACTORIES.append((kind, factory))


def is_path(obj: object) -> TypeGuard[str | os.PathLike[str]]:
  """Whether a diff reads ``obj`` as a checkpoint path (strings and path
  objects; a model is never a string)."""
  return isinstance(obj, (str, os.PathLike))


def with_side(obj: object, use: Callable[[Side], T], name: str = "A") -> T:
  """Runs ``use`` with ``obj``'s side (``name``: A or B, for messages); a
  path stays opened (locked, pinned) until ``use`` returns, so a diff never
  sees a mix of two saves."""
  if is_path(obj):
    return opening.read(obj, lambda opened: use(PathSide(str(opened.item), opened)))
  adapter = getattr(obj, "__pz_persist_diff_side__", None)
  if adapter is not None:
    return use(adapter())
  for kind, factory in _FACTORIES:
    if isinstance(obj, kind):
      return use(factory(obj))
  return use(model_side(obj, name))


def model_side(obj: object, name: str = "A") -> ModelSide:
  """``obj`` encoded as `pz_persist.save` would encode it (the same checks:
  what cannot be saved cannot be diffed either, and says why)."""
  try:
    encoded = encode_lib.encode(obj)
  except errors.EncodingError as e:
    raise errors.EncodingError(
        f"pzp.diff compares what pz_persist can save, and {name} (a"
        f" {type(obj).__name__}) cannot be: {e} Pass a checkpoint path, or a"
        " model or tree pz_persist.save accepts."
    ) from None
  manifest = manifest_lib.Manifest(
      tree=encoded.tree, variables=tuple(encoded.variables), arrays=tuple(encoded.arrays)
  )
  return ModelSide(f"{type(obj).__name__} in memory", manifest, list(encoded.values))


def describe(obj: object) -> str:
  if is_path(obj):
    return os.fspath(epath.Path(obj)) if not isinstance(obj, str) else obj
  return f"{type(obj).__name__} in memory"
