"""Plain Orbax checkpoints of a Penzai model's variables, read with the model
as their template.

Before pz_persist, Penzai's documented way to checkpoint a model was any pytree
checkpointer after ``pz.unbind_params(model, freeze=True)``::

  _, params = pz.unbind_params(model, freeze=True)
  ocp.StandardCheckpointer().save(path, params)   # or PyTreeCheckpointer

Orbax flattens the ``ParameterValue`` objects, so such a checkpoint holds bare
arrays at paths like ``3.value.data_array``: no labels, no axis names. The code
that built the model still knows them, and ``unbind_params`` lists a model's
parameters in a fixed order, so the model itself is the template: its variable
at position ``i`` is matched to the arrays at position ``i``, and every stored
shape and dtype is checked against the model's before anything is read (a
checkpoint of another model, or of the same model in another order, is
refused with every difference listed, through `pz_persist.binding`, like a
native checkpoint that does not fit).

Three layouts are recognised, by the paths Orbax stored (whichever matches
most of them):

* the parameters from ``pz.unbind_params(model, freeze=True)``;
* all variables from ``pz.unbind_variables(model, freeze=True)`` (parameters
  and state, for models that have state);
* the whole model with its variables frozen (``pz.freeze_variables(model)``);
  arrays a layer holds itself come from the code and are not read.

The checkpoint is untrusted like any other: its files must stay inside it, its
Orbax metadata is read and checked (shapes, dtypes, the bytes the read would
allocate) before any array is, and arrays are read through Orbax straight to
their final placement.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Hashable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from penzai import pz

from pz_persist import binding
from pz_persist import errors
from pz_persist import sharding as sharding_lib
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import nodes
from pz_persist.format import variable_kinds
from pz_persist.safety import limits
from pz_persist.storage import stores
from pz_persist.storage.integrity import containment
from pz_persist.storage.integrity import orbax_metadata_checks
from pz_persist.storage.reading import placements

_ORBAX_METADATA = "_METADATA"

StoredPath = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class UnlabeledArray:
  """An array of a plain checkpoint that no model variable accounts for.

  Stands in for a label in `pz_persist.LoadReport.unexpected` (a plain
  checkpoint has no labels): ``path`` is where Orbax stored it, in Orbax's
  own dotted form (``12.value.data_array``).
  """

  path: str

  def __repr__(self) -> str:
    return f"array at {self.path}"


@dataclasses.dataclass(frozen=True)
class _Variable:
  """A model variable as a plain checkpoint stores it: at ``paths``, one per
  array of its value, in the order ``jax.tree.leaves`` lists them."""

  kind: str
  metadata: dict[Hashable, object]
  paths: tuple[StoredPath, ...]


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where one way of saving a model puts each of its variables' arrays."""

  name: str
  variables: dict[Hashable, _Variable]
  others: frozenset[StoredPath]  # Arrays saved too, but not variables'.

  def matches(self, stored: Iterable[StoredPath]) -> int:
    known = {p for v in self.variables.values() for p in v.paths} | self.others
    return sum(path in known for path in stored)


def find_item(path: epath.PathLike) -> epath.Path | None:
  """The directory of the plain Orbax checkpoint at ``path``, or None.

  ``path`` itself (what ``StandardCheckpointer.save(path, ...)`` writes) or
  its only item directory (a ``CheckpointManager`` step) holding Orbax's
  ``_METADATA``. A pz_persist item that lost its manifest is damaged, not
  plain, and is not one.

  Raises:
    NotACheckpointError: several item directories qualify (it names them).
  """
  path = stores.open_path(path)[1]
  if not path.is_dir():
    return None
  if _is_plain_item(path):
    return path
  items = sorted(child for child in path.iterdir() if _is_plain_item(child))
  if len(items) > 1:
    names = ", ".join(item.name for item in items)
    raise errors.NotACheckpointError(
        f"{path} holds several Orbax items ({names}); pass the one holding the"
        f" model's parameters, e.g. {items[0]}."
    )
  return items[0] if items else None


def _is_plain_item(directory: epath.Path) -> bool:
  return (
      directory.is_dir()
      and (directory / _ORBAX_METADATA).is_file()
      and not (directory / manifest_lib.MANIFEST_FILENAME).exists()
      and not (directory / manifest_lib.FILE_DIGESTS_FILENAME).exists()
  )


def load_into(
    path: epath.PathLike,
    item: epath.Path,
    model: binding.ModelT,
    options: binding.BindOptions,
    *,
    strict: bool = True,
) -> tuple[binding.ModelT, binding.LoadReport]:
  """Loads the plain Orbax checkpoint at ``item`` into ``model``.

  ``options`` are those of `pz_persist.load_into`, checked and reported the
  same way (by `binding.bind`). ``rename``, ``rename_axes`` and ``overlay``
  are refused: the checkpoint has no labels or axis names to rename, and its
  arrays are matched to the model's variables by position, so all of them
  must be there; ``auto_labels`` changes nothing (every variable is matched
  by position already). (``verify`` has nothing to check: plain Orbax
  records no checksums.)

  Args:
    path: The directory the user gave (checked for symlinks leading out).
    item: Its Orbax item directory (from `find_item`).
    model: The model, built by its code: it supplies the labels, axis names,
      shapes, dtypes and placement of every array.
    options: How to bind (see `pz_persist.BindOptions`).
    strict: Raise `BindingError` if the checkpoint does not fit.

  Raises:
    BindingError: with ``strict``, the checkpoint does not fit the model
      (every difference listed); nothing was read.
    NotACheckpointError: no array is where saving the model would put one.
    ArgumentError: ``rename``, ``rename_axes`` or ``overlay`` was given.
  """
  given = {"rename": options.rename, "rename_axes": options.rename_axes,
           "overlay": options.overlay}
  refused = [name for name, value in given.items() if value]
  if refused:
    raise errors.ArgumentError(
        f"{item} is a plain Orbax checkpoint (no labels, no axis names; matched"
        f" to the model by position), so {', '.join(refused)} cannot apply to"
        " it. Load it without, then save it with pz_persist.save_model (or"
        " convert it with pz_persist.migrate) to get a checkpoint that"
        " supports them."
    )
  snapshot = containment.check_contained(path)
  containment.check_checkpoint_metadata(item)
  # Orbax opens every file by path: all must still be the ones checked once
  # the metadata and arrays are read (a copy or sync replacing files
  # mid-load is refused, never mixed), as for pz_persist's own checkpoints.
  with containment.files_unchanged(path, before=snapshot):
    source = _PlainSource(item, model)
    return binding.bind(
        f"{item} (a plain Orbax checkpoint of {source.layout.name}, matched to"
        " the model's variables by position)",
        model, source, options, strict=strict,
    )


def _path_of(keys: Sequence[object]) -> StoredPath:
  """A tree path as Orbax names it: dict keys, indices and field names."""
  parts = []
  for key in keys:
    for attribute in ("key", "idx", "name"):
      if hasattr(key, attribute):
        parts.append(str(getattr(key, attribute)))
        break
    else:
      parts.append(str(key))
  return tuple(parts)


def _dotted(path: StoredPath) -> str:
  return ".".join(path)


def _is_variable(x: object) -> bool:
  return isinstance(x, pz.AbstractVariableValue)


def _layout(name: str, tree: object) -> _Layout:
  """Where saving ``tree`` (frozen variables inside) puts each array."""
  variables: dict[Hashable, _Variable] = {}
  others = set()
  for keys, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)[0]:
    if not _is_variable(node):
      others.add(_path_of(keys))
      continue
    paths = tuple(
        _path_of((*keys, *inner))
        for inner, _ in jax.tree_util.tree_flatten_with_path(node)[0]
    )
    if node.label in variables:  # Shared: saved again, read once.
      others.update(paths)
      continue
    kind = variable_kinds.kind_of(node)
    variables[node.label] = _Variable(kind, dict(node.metadata), paths)
  return _Layout(name, variables, frozenset(others))


def _layouts(model: object) -> list[_Layout]:
  """The ways of saving ``model`` a plain checkpoint may have used."""
  _, params = pz.unbind_params(model, freeze=True)
  _, variables = pz.unbind_variables(model, freeze=True)
  layouts = [_layout("pz.unbind_params(model, freeze=True)", params)]
  if len(variables) != len(params):
    layouts.append(_layout("pz.unbind_variables(model, freeze=True)", variables))
  layouts.append(_layout("pz.freeze_variables(model)", pz.freeze_variables(model)))
  return layouts


def _check_bound(model: object, where: epath.Path) -> None:
  """A plain checkpoint is matched by position against the model's values,
  so every variable needs one."""
  unbound = [
      leaf.label
      for leaf in jax.tree.leaves(
          model, is_leaf=lambda x: isinstance(x, pz.AbstractVariableSlot)
      )
      if isinstance(leaf, pz.AbstractVariableSlot)
  ]
  if unbound:
    raise errors.PzPersistError(
        f"{where} is a plain Orbax checkpoint, matched to the model's variables"
        " by position and checked against their shapes, so the model must hold"
        f" a value for each; it has none for {len(unbound)} (first:"
        f" {nodes.describe_label(unbound[0])}). Pass the model as its code"
        " builds it."
    )
  if not pz.unbind_variables(model)[1]:
    raise errors.PzPersistError(
        f"{where} is a plain Orbax checkpoint, loaded into a model's variables,"
        " but the model has none (pz.Parameter or pz.StateVariable; frozen"
        " values are not variables). Pass the model as its code builds it."
    )


class _PlainSource:
  """The variables of a plain Orbax checkpoint, by the model's labels.

  Implements `pz_persist.binding.Source`: labels and structure come from the
  model; shapes and dtypes from Orbax's metadata, read on construction.
  """

  def __init__(self, item: epath.Path, model: object):
    _check_bound(model, item)
    self._item = item
    self._tree, self._stored = self._read_metadata()
    layouts = _layouts(model)
    self.layout = max(layouts, key=lambda layout: layout.matches(self._stored))  # First wins ties.
    if not self.layout.matches(self._stored):
      shown = ", ".join(_dotted(p) for p in list(self._stored)[:3]) or "none"
      raise errors.NotACheckpointError(
          f"{item} is an Orbax checkpoint written without pz_persist, but no"
          " array in it is where saving this model's variables would put it"
          f" (its arrays are at {shown}...; tried the layouts of"
          f" {', '.join(layout.name for layout in layouts)}). Check that it was saved from"
          " this model, or restore it with orbax.checkpoint and a template."
      )
    known = {p for v in self.layout.variables.values() for p in v.paths}
    self.stored: dict[Hashable, _Variable] = {
        label: variable
        for label, variable in self.layout.variables.items()
        if all(p in self._stored for p in variable.paths)
    }
    for path in self._stored:
      if path not in known and path not in self.layout.others:
        self.stored[UnlabeledArray(_dotted(path))] = _Variable("?", {}, (path,))

  def _read_metadata(self) -> tuple[Any, dict[StoredPath, Any]]:
    """Orbax's metadata tree, and its leaves by path; reads no array."""
    try:
      with _handler() as handler:
        tree = handler.metadata(self._item).tree
      leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    except (KeyboardInterrupt, MemoryError):
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise orbax_metadata_checks.unreadable_stored_metadata(self._item, e) from None
    return tree, {_path_of(keys): leaf for keys, leaf in leaves}

  def _shape_dtype(self, path: StoredPath) -> tuple[tuple[int, ...], np.dtype] | None:
    meta = self._stored[path]
    try:
      return (
          tuple(int(d) for d in meta.shape),
          arrays_lib.SUPPORTED_DTYPES[np.dtype(meta.dtype).name],
      )
    except (AttributeError, TypeError, ValueError, KeyError):
      return None

  def abstract(self, label: Hashable, current: Any) -> Any:
    """The model's value with the stored shapes and dtypes, if they fit."""
    leaves, treedef = jax.tree.flatten(current.value)
    abstract = []
    for path, leaf in zip(self.stored[label].paths, leaves):
      found = self._shape_dtype(path)
      if found is None:
        return binding.Mismatch(
            label, "structure", f"{self._stored[path]!r:.80} at {_dotted(path)}",
            "an array",
        )
      shape, dtype = found
      if shape != tuple(np.shape(leaf)):
        return binding.Mismatch(
            label, "shape", f"{dtype}{list(shape)} at {_dotted(path)}",
            f"{getattr(leaf, 'dtype', type(leaf).__name__)}{list(np.shape(leaf))}",
        )
      if dtype.itemsize == 8 and dtype.kind in "iuf" and not jax.config.jax_enable_x64:  # type: ignore[attr-defined]  # JAX sets flags at run time.
        return binding.Mismatch(
            label, "dtype", f"{dtype} at {_dotted(path)}, which JAX would narrow"
            " silently (enable jax_enable_x64 to read it)",
            str(getattr(leaf, "dtype", type(leaf).__name__)),
        )
      abstract.append(jax.ShapeDtypeStruct(shape, dtype))
    return jax.tree.unflatten(treedef, abstract)

  def read(self, labels, *, sharding, verify, bound):
    """Reads the arrays of ``labels``, each straight to its placement."""
    del verify  # Plain Orbax records no checksums.
    specs, targets = [], {}  # Path -> (its spec, where it goes).
    for label in labels:
      current = bound[label].value
      for path, (dims, leaf) in zip(self.stored[label].paths, _dim_names(current)):
        found = self._shape_dtype(path)
        assert found is not None, "abstract() refused this label: not read"
        shape, dtype = found
        target = _placement(leaf, dims, shape, sharding, label)
        spec = arrays_lib.ArraySpec(
            key=_dotted(path), shape=shape, dtype=dtype.name,
            kind="jax" if target is not None else "numpy", path=_dotted(path),
            label=nodes.describe_label(label),
            # Orbax drops JAX's weak-type flag; the model's code sets it.
            weak_type=target is not None and bool(getattr(leaf, "weak_type", False)),
        )
        specs.append(spec)
        targets[path] = (spec, target)
    sizes = {s.key: placements.local_bytes(s, t) for s, t in targets.values()}
    limits.check_allocation(specs, sizes, where=str(self._item))
    arrays = self._restore(targets) if targets else {}
    return {
        label: jax.tree.unflatten(jax.tree.structure(bound[label].value), [
            arrays_lib.from_storage(arrays[path], targets[path][0])
            for path in self.stored[label].paths
        ])
        for label in labels
    }

  def _restore(self, targets) -> dict[StoredPath, Any]:
    """Reads the arrays at the paths of ``targets`` (the others are skipped)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(self._tree)
    items, restore_args = [], []
    for keys, _ in flat:
      path = _path_of(keys)
      if path not in targets:
        items.append(ocp.PLACEHOLDER)
        restore_args.append(ocp.PLACEHOLDER)
        continue
      spec, target = targets[path]
      if target is None:
        items.append(np.ndarray)
        restore_args.append(ocp.RestoreArgs(restore_type=np.ndarray))
      else:
        items.append(jax.ShapeDtypeStruct(spec.shape, spec.np_dtype, sharding=target))
        restore_args.append(ocp.ArrayRestoreArgs(
            restore_type=jax.Array, sharding=target, global_shape=spec.shape,
            dtype=spec.np_dtype,
        ))
    try:
      with _handler() as handler:
        restored = handler.restore(self._item, args=ocp.args.PyTreeRestore(
            item=jax.tree.unflatten(treedef, items),
            restore_args=jax.tree.unflatten(treedef, restore_args),
        ))
      leaves = jax.tree_util.tree_flatten_with_path(restored)[0]
    except (KeyboardInterrupt, MemoryError):
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      detail = (str(e).strip().splitlines() or [""])[0][:400]
      paths = ", ".join(_dotted(p) for p in list(targets)[:5])
      raise errors.IntegrityError(
          f"{self._item}: cannot read the stored arrays ({paths}"
          f"{'...' if len(targets) > 5 else ''}): the checkpoint's files are"
          f" damaged or incomplete ({type(e).__name__}: {detail})",
          damaged=tuple(f"{_dotted(p)}: cannot be read" for p in targets),
      ) from e
    arrays = {_path_of(keys): leaf for keys, leaf in leaves}
    missing = [p for p in targets if p not in arrays]
    if missing:
      raise errors.IntegrityError(
          f"{self._item}: Orbax returned no array at {_dotted(missing[0])}; the"
          " checkpoint is damaged or incomplete.",
          damaged=tuple(f"{_dotted(p)}: not read" for p in missing),
      )
    return arrays


@contextlib.contextmanager
def _handler() -> Iterator[ocp.PyTreeCheckpointHandler]:
  """Orbax's handler of plain pytree checkpoints (Standard and PyTree
  checkpointers both write through it), closed after use."""
  handler = ocp.PyTreeCheckpointHandler()
  try:
    yield handler
  finally:
    handler.close()


def _dim_names(value: object) -> list[tuple[tuple[Hashable, ...], Any]]:
  """For each array of ``value`` (in ``jax.tree.leaves`` order), the name of
  each of its dimensions (None for positional ones) and the array itself."""
  out: list[tuple[tuple[Hashable, ...], Any]] = []
  for x in jax.tree.leaves(value, is_leaf=pz.nx.is_namedarray):
    if isinstance(x, pz.nx.NamedArrayBase):
      view = x.as_namedarrayview()
      dims: list[Hashable] = [None] * len(view.data_shape)
      for name, axis in view.data_axis_for_name.items():
        dims[axis] = name
      out.append((tuple(dims), view.data_array))
    else:
      out.extend(((None,) * np.ndim(leaf), leaf) for leaf in jax.tree.leaves(x))
  return out


def _placement(
    leaf: object, dims: tuple[Hashable, ...], shape: tuple[int, ...],
    target: sharding_lib.Target, label: Hashable,
) -> jax.sharding.Sharding | None:
  """Where one array goes: None for a NumPy array (the model holds one), else
  the requested sharding, or by default where the model's array is."""
  if isinstance(leaf, (np.ndarray, np.generic)):
    return None
  if isinstance(target, sharding_lib.AxisRules):
    return target.sharding(dims, shape, what=nodes.describe_label(label))
  if target is not None:
    return target
  return getattr(leaf, "sharding", None) or sharding_lib.default_sharding()
