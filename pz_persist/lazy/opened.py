"""`pz_persist.open`: a checkpoint opened lazily, read only where looked at.

Why a handle: a notebook user with a checkpoint larger than they want to load
wants to see it at once, then read one layer, one variable or a few rows of
an embedding. `open` reads the manifest only (what `pz_persist.inspect`
reads, through `pz_persist.storage.reading.opening`, the one way in), and the handle
reads arrays only when asked, each read through the same reader every load
uses (`pz_persist.storage.reading.reader.read_arrays`, or for part of one array
`pz_persist.storage.reading.slices`): the same checksums, allocation limits,
containment checks and object-store retries.

A handle never mixes two checkpoints: every read holds the shared lock a
save's final move waits for (local disks) and checks, before and after it
reads, that the path still holds the checkpoint opened (the identity and
manifest digest `opening` took, or on an object store the commit it pinned);
if a save replaced it, the read raises `CheckpointReplacedError` and the
handle must be opened again. A handle holds no file open between reads;
``with pz_persist.open(path) as ckpt:`` only marks it closed at the end.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import TYPE_CHECKING
from typing import Any
from typing import TypeVar

import jax
import numpy as np
from etils import epath

from pz_persist import errors
from pz_persist import progress as progress_lib
from pz_persist import sharding as sharding_lib
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import decode as decode_lib
from pz_persist.format import folding
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import manifest_queries
from pz_persist.format import nodes
from pz_persist.lazy import indexing
from pz_persist.safety import allowlist
from pz_persist.storage.reading import opening
from pz_persist.storage.reading import reader
from pz_persist.storage.reading import restoring
from pz_persist.storage.reading import slices

if TYPE_CHECKING:  # For annotations (the functions import Penzai where they use it).
  from penzai import pz

_T = TypeVar("_T")

_MAX_SIZE_GROUPS = 32
"""How many label groups (`OpenedCheckpoint.sizes`) the rendering lists."""


def open_checkpoint(
    path: epath.PathLike,
    *,
    allow_modules: Iterable[str] | None = None,
    verify: bool = True,
) -> OpenedCheckpoint:
  """Opens a checkpoint lazily: reads its manifest only, as `inspect` does.

  The handle renders in treescope at once (structure, labels, shapes, dtypes,
  named axes, sizes; no array read) and reads arrays only when asked: one
  variable (``ckpt[label]``), part of one array (``ckpt.read(label, index)``),
  a labelled part of the tree (``ckpt.load(only=...)``) or all of it
  (``ckpt.load()``, the same as `pz_persist.load`).

  Example::

    import numpy as np
    import pz_persist as pzp
    from penzai import pz

    table = pz.nx.wrap(np.ones((1000, 16), np.float32), "vocabulary", "embedding")
    pzp.save("/tmp/lazy_demo", [pz.ParameterValue(value=table, label="embed")],
             overwrite=True)
    with pzp.open("/tmp/lazy_demo") as ckpt:
      print(ckpt)                               # Nothing read yet.
      rows = ckpt.read("embed", {"vocabulary": slice(0, 100)})
      assert rows.named_shape == {"vocabulary": 100, "embedding": 16}

  Args:
    path: A checkpoint directory (local, ``gs://`` or ``s3://``), its item
      directory, or a `CheckpointManager` step holding one item.
    allow_modules: Extra modules the checkpoint may name classes from, for
      every decode of this handle; see `pz_persist.allow_modules`.
    verify: The default of every read: check the bytes read against the
      checksums recorded when they were saved.

  Raises:
    NotACheckpointError, ManifestError, FormatVersionError,
    UnsafeCheckpointError: as `pz_persist.inspect`.
  """
  allowed = tuple(allow_modules or ())
  with allowlist.scoped_allowance(allowed):
    opened = opening.read(path, _checked)
  return OpenedCheckpoint(opened, allowed, verify)


def _checked(opened: opening.OpenItem) -> tuple[opening.OpenItem, Any]:
  """The opened item and its abstract tree: the manifest decoded (and so
  checked) once, as `inspect` does."""
  return opened, restoring.abstract_tree(opened.manifest, where=str(opened.item))


class OpenedCheckpoint:
  """A checkpoint opened by `pz_persist.open`: its structure now, its arrays
  when asked.

  Example::

    ckpt = pzp.open("/tmp/lazy_demo")
    ckpt.sizes()                          # bytes by group of labels; nothing read
    table = ckpt["embed"]                 # one variable, verified
    part = ckpt.load(only="embed")        # the tree, that variable read
    tree = ckpt.load()                    # everything: pzp.load("/tmp/lazy_demo")

  Attributes:
    path: The path it was opened from.
    tree: The saved tree with ``jax.ShapeDtypeStruct`` for every array (what
      `pz_persist.inspect` returns); also ``abstract``.
    labels: The labels of its variables (parameters and state variables), in
      checkpoint order; ``len``, iteration and ``in`` go over them.
    nbytes: The bytes of all its arrays.
  """

  def __init__(self, opened: tuple[opening.OpenItem, Any], allow_modules: tuple[str, ...] = (), verify: bool = True):
    item, abstract = opened
    self._opened: opening.OpenItem = item
    self._allow = allow_modules
    self._verify = verify
    self._closed = False
    self.tree = abstract

  @functools.cached_property
  def _variables(self) -> dict[Hashable, manifest_queries.Variable]:
    """The variables by label, from the manifest (on first use: `open` costs
    what `inspect` costs)."""
    where = str(self._opened.item)
    found = manifest_queries.variables(self._opened.manifest, where=where)
    return {variable.label: variable for variable in found}

  # ---- What the manifest says. -------------------------------------------

  @property
  def path(self) -> epath.Path:
    return self._opened.path

  @property
  def abstract(self) -> Any:
    return self.tree

  @property
  def labels(self) -> tuple[Hashable, ...]:
    return tuple(self._variables)

  @property
  def nbytes(self) -> int:
    return sum(spec.nbytes for spec in self._opened.manifest.arrays)

  def nbytes_of(self, only: indexing.Selection = None) -> int:
    """The bytes of the arrays of the variables ``only`` selects."""
    return sum(self._opened.manifest.arrays[ref].nbytes for ref in self._refs(only))

  def sizes(self) -> dict[str, str]:
    """The bytes of the arrays under each group of labels, readable, largest
    first; what the treescope rendering shows beside the tree. A group is
    the labels' first ``/``-separated parts, as many as it takes to make
    more than one group (``"transformer/block_3"`` when every label starts
    with ``transformer/``). From the manifest alone; arrays outside
    variables count under ``"(no label)"``."""
    labels = [spec.label for spec in self._opened.manifest.arrays]
    parts = [label.split("/") if label else None for label in labels]
    depth = 1
    while depth < max((len(p) - 1 for p in parts if p), default=0) and len(
        {"/".join(p[:depth]) for p in parts if p}) < 2:
      depth += 1
    totals: dict[str, int] = {}
    for spec, split in zip(self._opened.manifest.arrays, parts):
      group = "/".join(split[:depth]) if split else "(no label)"
      totals[group] = totals.get(group, 0) + spec.nbytes
    ordered = sorted(totals.items(), key=lambda item: -item[1])
    return {group: _size_text(n) for group, n in ordered}

  def __len__(self) -> int:
    return len(self._variables)

  def __iter__(self) -> Iterator[Hashable]:
    return iter(self._variables)

  def __contains__(self, label: object) -> bool:
    try:
      return label in self._variables
    except TypeError:
      return False

  def __repr__(self) -> str:
    manifest = self._opened.manifest
    state = ", closed" if self._closed else ""
    return (
        f"<OpenedCheckpoint {self.path}: {len(self)} variables,"
        f" {len(manifest.arrays)} arrays, {_size_text(self.nbytes)}{state}>"
    )

  def __treescope_repr__(
      self, path: str | None, subtree_renderer: Callable[..., Any]
  ) -> Any:
    """Renders the structure (the abstract tree), the sizes and the path; no
    array is read."""
    from treescope import repr_lib  # pylint: disable=import-outside-toplevel

    sizes = self.sizes()
    if len(sizes) > _MAX_SIZE_GROUPS:  # A long flat list tells nothing: the largest.
      sizes = dict(list(sizes.items())[:_MAX_SIZE_GROUPS]) | {"...": f"{len(sizes)} groups"}
    return repr_lib.render_object_constructor(
        object_type=type(self),
        attributes={
            "path": str(self.path),
            "variables": len(self),
            "size": _size_text(self.nbytes),
            "sizes": sizes,
            "tree": folding.fold(self.tree),  # Any depth renders (see folding).
        },
        path=path,
        subtree_renderer=subtree_renderer,
    )

  # ---- Reading. -----------------------------------------------------------

  def __getitem__(self, label: Hashable) -> Any:
    """The value of the variable labelled ``label``, as `pz_persist.load`
    returns it (a ``NamedArray``, say): only its arrays are read."""
    return self.value(label)

  def value(self, label: Hashable, *, verify: bool | None = None) -> Any:
    """``self[label]``, with ``verify`` for this read only."""
    variable = self._variable(label)
    where = str(self._opened.item)

    def read() -> Any:
      values = self._read_arrays(set(variable.refs), verify)
      return decode_lib.decode(
          variable.value, self._opened.manifest.variables, values,
          root=errors.Location(where, variable.location.tree_path, variable.label),
          format_version=self._opened.manifest.format_version,
          writer=self._opened.manifest.writer,
      )

    return self._guarded(read)

  def read(self, label: Hashable, index: object = ..., *, verify: bool | None = None) -> Any:
    """Part of the one array of the variable ``label``, reading only the
    bytes that part needs (and, verified, the checksum tiles it overlaps):
    what ``ckpt[label]`` indexed by ``index`` would be.

    Args:
      label: A variable whose value holds one array (a ``NamedArray``, a
        ``NamedArrayView``, an array, a NumPy scalar), or a Python scalar
        (then ``index`` must select it whole).
      index: NumPy style over the stored dimensions (ints, NumPy's too,
        negative ones too; slices with any non-zero step, bounds clipped;
        ``...``), or a dict by axis name and, for positional axes, by
        position as ``positional_shape`` counts them, e.g.
        ``{"vocabulary": slice(0, 100)}``. ``...`` (the default) and ``{}``
        select the whole value; ``()`` too, but on a 0-d NumPy array it
        gives a NumPy scalar, as NumPy does.
      verify: Check what is read against its checksums (default: the
        handle's). A checkpoint saved before 0.7 records one checksum per
        array: a verified read of part of it reads the whole array, an
        unverified one (``verify=False``) only the part.

    Returns:
      The part as ``ckpt[label]`` holds it: a ``NamedArray`` stays a
      ``NamedArray`` and a ``NamedArrayView`` a view (its positional axes in
      their logical order), keeping the names of the dimensions not indexed
      by an int; an array keeps its kind (``jax.Array``; NumPy, where ints
      in every dimension and no ``...`` give a NumPy scalar, as NumPy
      does; a NumPy scalar stays one); dtypes are the saved ones.

    Raises:
      UnknownLabelError: no such label (close matches listed).
      ArgumentError: the variable holds several arrays, or the index names
        an unknown axis, indexes a dimension twice, is out of range, has a
        zero step or is of another kind (None, bools, floats, str, lists,
        arrays).
      IntegrityError: a tile read does not match its checksum.
    """
    variable = self._variable(label)
    who = f"{self._opened.item}: {variable.label_text!r}"
    stored = list(variable.refs)
    shaped, alone = self._shaped(variable, stored[0]) if len(stored) == 1 else (None, False)
    if indexing.is_whole(index) and not alone:  # A value around (or without) its array.
      return self.value(label, verify=verify)
    if shaped is None:
      what = (f"holds {len(stored)} arrays" if len(stored) > 1
              else "holds no array (a Python value)" if not stored
              else "holds its array inside another value (a PRNG key, say)")
      raise errors.ArgumentError(
          f"{who} {what}; read(label, index) reads part of one array or named"
          " array. Use ckpt[label] (or read(label)) for the whole value."
      )
    ref = stored[0]
    spec = self._opened.manifest.arrays[ref]
    axes, positional = _dims_of(shaped, len(spec.shape))
    parsed = indexing.parse_index(index, spec.shape, axes, who=who, positional=positional)
    verify = self._verify if verify is None else verify

    def read() -> Any:
      if not spec.is_stored or parsed.empty:
        data = box = np.zeros(tuple(b - a for a, b in parsed.box), spec.storage_dtype)
      else:
        box, at = slices.read_box(
            self._opened.item, spec, parsed.box, verify=verify,
            snapshot=self._opened.snapshot,
        )
        data = box[tuple(slice(a - b0, a - b0 + (b - a))
                         for (a, b), (b0, _) in zip(parsed.box, at))]
      part = data[parsed.local]
      if not (isinstance(part, np.ndarray) and part.flags.c_contiguous
              and part.nbytes == box.nbytes):
        part = np.array(part, order="C")  # Its own memory: never a view pinning the box.
      return _as_saved(part, spec, shaped, parsed.kept, scalar=parsed.scalar)

    return self._guarded(read)

  def load(
      self,
      only: indexing.Selection = None,
      *,
      sharding: sharding_lib.Target = None,
      verify: bool | None = None,
      progress: progress_lib.Progress = None,
  ) -> Any:
    """The saved tree, its selected variables read.

    With no ``only``, exactly what `pz_persist.load` returns (bit for bit).
    With ``only`` (a label, a prefix of labels such as ``"block_3"``, a list
    of them, or a predicate on labels), the saved tree with the arrays of
    the selected variables read and every other array left as a
    ``jax.ShapeDtypeStruct``, as ``tree`` shows it: the same structure and
    paths, so it renders in treescope beside ``tree``; mutable variables then
    come back as their frozen values, as in ``tree``. For the values alone
    by label, use ``{label: ckpt[label] for label in ckpt.select(only)}``.

    Raises:
      UnknownLabelError: a label or prefix of ``only`` selects nothing.
    """
    verify = self._verify if verify is None else verify
    if only is None:
      with allowlist.scoped_allowance(self._allow):
        return self._guarded(lambda: restoring.read_tree(
            self._opened, sharding=sharding, verify=verify, progress=progress))
    refs = self._refs(only)
    manifest = self._opened.manifest
    where = str(self._opened.item)

    def read() -> Any:
      values = self._read_arrays(refs, verify, sharding=sharding, progress=progress)
      whole = len(refs) == len(manifest.arrays)
      filled = [
          value if index in refs else spec.abstract()
          for index, (value, spec) in enumerate(zip(values, manifest.arrays))
      ]
      with allowlist.scoped_allowance(self._allow):
        return decode_lib.decode(
            manifest.tree, manifest.variables, filled, abstract=not whole,
            root=errors.Location(where, "tree"),
            labels=[spec.label for spec in manifest.arrays],
            format_version=manifest.format_version, writer=manifest.writer,
        )

    return self._guarded(read)

  def select(self, only: indexing.Selection) -> list[Hashable]:
    """The labels ``only`` selects (see `load`), in checkpoint order."""
    return indexing.select(only, self.labels, str(self._opened.item))

  # ---- Lifetime. ----------------------------------------------------------

  def close(self) -> None:
    """Marks the handle closed: later reads refuse. It holds no open file."""
    self._closed = True

  def __enter__(self) -> OpenedCheckpoint:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  # ---- Inside. ------------------------------------------------------------

  def _variable(self, label: Hashable) -> manifest_queries.Variable:
    try:
      return self._variables[label]
    except (KeyError, TypeError):
      raise indexing.unknown_label(label, self.labels, str(self._opened.item)) from None

  def _shaped(
      self, variable: manifest_queries.Variable, ref: int
  ) -> tuple[pz.nx.NamedArrayBase | jax.ShapeDtypeStruct | None, bool]:
    """The abstract form of the one array ``ref`` of ``variable``: the
    ``NamedArray``, ``NamedArrayView`` or ``jax.ShapeDtypeStruct`` that
    ``self[label]`` would fill, decoded (and so checked) as a load decodes it,
    and whether it is the whole value (not inside a container). None where
    the array is not a value of its own (a PRNG key, say), so a part of it is
    not what the loaded value holds."""
    from penzai import pz  # pylint: disable=import-outside-toplevel

    manifest = self._opened.manifest
    spec = manifest.arrays[ref]
    arrays: list[jax.ShapeDtypeStruct | None] = [None] * len(manifest.arrays)
    arrays[ref] = spec.abstract()
    with allowlist.scoped_allowance(self._allow):
      value = decode_lib.decode(
          variable.value, manifest.variables, arrays, abstract=True,
          root=errors.Location(str(self._opened.item), variable.location.tree_path,
                               variable.label),
          format_version=manifest.format_version, writer=manifest.writer,
      )
    # Named arrays whose data does not fit their axes (optax's states) are
    # only structures holding an array (`nodes.named_array_problem`).
    leaves = jax.tree_util.tree_leaves(value, is_leaf=nodes.fits_its_axes)
    found = [leaf for leaf in leaves
             if nodes.fits_its_axes(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)]
    if len(found) == 1:
      leaf = found[0]
      array = leaf.data_array if isinstance(leaf, pz.nx.NamedArrayBase) else leaf
      if (isinstance(array, jax.ShapeDtypeStruct) and tuple(array.shape) == spec.shape
          and np.dtype(array.dtype) == spec.np_dtype):
        return found[0], found[0] is value
    return None, False

  def _refs(self, only: indexing.Selection) -> set[int]:
    return {ref for label in self.select(only) for ref in self._variables[label].refs}

  def _read_arrays(
      self, refs: set[int], verify: bool | None, *, sharding: sharding_lib.Target = None,
      progress: progress_lib.Progress = False,
  ) -> list[Any]:
    """The arrays of ``refs`` (aligned with the manifest; None elsewhere),
    read by the one reader every load uses."""
    item = self._opened.item
    with progress_lib.tracking(progress, f"reading {item}",
                               delay=reader.LOAD_PROGRESS_DELAY) as tracker:
      return reader.read_arrays(
          item, self._opened.manifest, sharding=sharding, refs=refs,
          verify=self._verify if verify is None else verify, tracker=tracker,
          snapshot=self._opened.snapshot,
      )

  def __pz_persist_diff_side__(self) -> _DiffSide:
    """What `pz_persist.diff` reads of this checkpoint (a diff `Side`): its
    manifest, and its arrays by manifest index, under this handle's checks
    (replacement, lock, verification), so a diff of a handle sees what
    reading the handle would."""
    return _DiffSide(str(self.path), self._opened.manifest, self)

  def __pz_persist_read__(self, use: Callable[[opening.OpenItem], _T]) -> _T:
    """What `pz_persist.storage.reading.opening.read` does with this handle given for
    a path (``pzp.load(handle)``, ``pzp.verify(handle)``...): ``use`` of the
    checkpoint opened, under this handle's checks (closed, replaced, lock)."""
    return self._guarded(lambda: use(self._opened))

  def _guarded(self, read: Callable[[], _T]) -> _T:
    """``read()``, never of a checkpoint other than the one opened.

    Under the shared lock a save's final move waits for (where the store has
    one), the path must hold the opened checkpoint before and after the read;
    a read that failed while it changed reports the replacement, not the
    failure it caused.
    """
    if self._closed:
      raise errors.ArgumentError(
          f"{self.path} was closed; open it again with pz_persist.open."
      )
    opened = self._opened
    with opened.store.reading(opened.path):
      self._check_current()
      try:
        with allowlist.scoped_allowance(self._allow):
          result = read()
      except Exception as e:
        if not self._current():
          raise self._replaced() from e
        raise
      self._check_current()
    return result

  def _current(self) -> bool:
    opened = self._opened
    try:
      if opened.pinned is not None:
        now = opened.store.pin(opened.path)
        if now is None or (now.sequence, now.generation) != (
            opened.pinned.sequence, opened.pinned.generation):
          return False
      return opened.unchanged()
    except (OSError, errors.PzPersistError):
      return False

  def _check_current(self) -> None:
    if not self._current():
      raise self._replaced()

  def _replaced(self) -> errors.CheckpointReplacedError:
    return errors.CheckpointReplacedError(
        f"{self.path} was replaced since it was opened (saved again, or its step"
        " replaced or deleted); open it again with pz_persist.open to read the"
        " new one. Nothing of the new one was returned."
    )


def _as_saved(
    data: np.ndarray, spec: arrays_lib.ArraySpec,
    shaped: pz.nx.NamedArrayBase | jax.ShapeDtypeStruct, kept: tuple[int, ...],
    *, scalar: bool,
) -> Any:
  """Stored bytes of part of an array as the value was saved (``shaped``,
  its abstract value): its dtype and kind and, for a named array, the same
  class with the axes of the ``kept`` stored dimensions, in their order."""
  part = dataclasses.replace(spec, shape=data.shape)
  value = jax.device_put(data) if spec.kind == "jax" else data
  value = arrays_lib.from_storage(value, part)
  from penzai import pz  # pylint: disable=import-outside-toplevel

  if isinstance(shaped, pz.nx.NamedArray | pz.nx.NamedArrayView):
    new_dim = {dim: at for at, dim in enumerate(kept)}
    if isinstance(shaped, pz.nx.NamedArray):
      first_named = len(shaped.positional_shape)
      names = list(shaped.named_axes)
      return pz.nx.NamedArray(
          named_axes=collections.OrderedDict(
              (names[dim - first_named], data.shape[new_dim[dim]])
              for dim in kept if dim >= first_named
          ),
          data_array=value,
      )
    return pz.nx.NamedArrayView(
        data_shape=data.shape,
        data_axis_for_logical_axis=tuple(
            new_dim[dim] for dim in shaped.data_axis_for_logical_axis if dim in new_dim),
        data_axis_for_name={
            name: new_dim[dim] for name, dim in shaped.data_axis_for_name.items()
            if dim in new_dim
        },
        data_array=value,
    )
  if spec.kind == "numpy" and scalar:
    return value[()]  # As NumPy indexes: ints in every dimension give a scalar.
  return value


def _dims_of(
    shaped: pz.nx.NamedArrayBase | jax.ShapeDtypeStruct, rank: int
) -> tuple[tuple[Hashable, ...], tuple[int, ...]]:
  """The axis name of each stored dimension of ``shaped`` (None:
  positional), and the stored dimensions of its positional axes in their
  logical order."""
  from penzai import pz  # pylint: disable=import-outside-toplevel

  if isinstance(shaped, pz.nx.NamedArrayView):
    names: list[Hashable] = [None] * rank
    for name, dim in shaped.data_axis_for_name.items():
      names[dim] = name
    return tuple(names), tuple(shaped.data_axis_for_logical_axis)
  if isinstance(shaped, pz.nx.NamedArray):
    first_named = len(shaped.positional_shape)
    return (None,) * first_named + tuple(shaped.named_axes), tuple(range(first_named))
  return (None,) * rank, tuple(range(rank))


def _size_text(n: int) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.1f} {unit}"
  return f"{n} B"


@dataclasses.dataclass(frozen=True)
class _DiffSide:
  """`OpenedCheckpoint` as one side of `pz_persist.diff` (the `Side` protocol
  of `pz_persist.tools.diff_sides`, which sits above this module)."""

  description: str
  manifest: manifest_lib.Manifest
  handle: OpenedCheckpoint

  def read(self, refs: Iterable[int]) -> dict[int, Any]:
    wanted = set(refs)
    values = self.handle._guarded(lambda: self.handle._read_arrays(wanted, None))
    return {ref: values[ref] for ref in wanted}
