"""What a lazy read asks for: which labels (`select`), which part of one
array (`parse_index`), each refused by name when it cannot be met."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import numpy as np

from pz_persist import errors
from pz_persist.format import nodes
from pz_persist.format import selection

Selection = Hashable | Iterable[Hashable] | Callable[[Hashable], bool] | None
"""What ``OpenedCheckpoint.load(only=...)`` selects: a label, a prefix of labels
(a string ending where a label's part ends: ``"block_1"`` selects
``"block_1/attn.w"`` and ``"block_1.w"``, not ``"block_10/..."``), a list of
either, or a predicate called with each label."""

_SEPARATORS = "/."


def unknown_label(label: object, labels: Sequence[Hashable], where: str) -> errors.UnknownLabelError:
  """The error for a label the checkpoint does not have, with close matches."""
  text = nodes.describe_label(label)
  return selection.unmatched(
      where, f"no variable labelled {text!r:.200} in this checkpoint", text,
      [nodes.describe_label(known) for known in labels], listed_by=" (see .labels)",
  )


def select(only: object, labels: Sequence[Hashable], where: str) -> list[Hashable]:
  """The labels of ``labels`` that ``only`` selects, in checkpoint order.

  Raises:
    UnknownLabelError: a label or prefix of ``only``, or the predicate
      ``only``, selects nothing.
    ArgumentError: ``only`` is an empty list.
  """
  if only is None:
    return list(labels)
  if callable(only) and not _is_label(only, labels):
    predicate: Callable[[Hashable], bool] = only
    chosen_by = [label for label in labels if predicate(label)]
    if not chosen_by:
      raise selection.unmatched(  # Nothing to compare a predicate with: a count.
          where, f"the predicate only={only!r:.80} selects no label of this checkpoint",
          "", [nodes.describe_label(label) for label in labels], listed_by=" (see .labels)")
    return chosen_by
  if _is_label(only, labels) or isinstance(only, str) or not isinstance(only, Iterable):
    wanted: list[object] = [only]
  else:
    wanted = list(only)
    if not wanted:
      raise selection.empty(where, "only")
  chosen: set[Hashable] = set()
  for one in wanted:
    matched = [label for label in labels if _matches(one, label)]
    if not matched:
      raise unknown_label(one, labels, where)
    chosen.update(matched)
  return [label for label in labels if label in chosen]


def _is_label(value: object, labels: Sequence[Hashable]) -> bool:
  try:
    return value in labels
  except TypeError:  # Unhashable: a list of labels.
    return False


def _matches(wanted: object, label: Hashable) -> bool:
  if wanted == label:
    return True
  if isinstance(wanted, str) and wanted and isinstance(label, str) and label.startswith(wanted):
    # (``wanted`` non-empty: ``""`` is no prefix; ``"" in _SEPARATORS`` held.)
    return wanted[-1] in _SEPARATORS or label[len(wanted)] in _SEPARATORS
  return False


@dataclasses.dataclass(frozen=True)
class Index:
  """One array's part, resolved against its shape.

  Attributes:
    box: ``(start, stop)`` per stored dimension: what must be read.
    local: What to index the box with (steps, and ints dropping dimensions).
    kept: Which stored dimensions the result keeps, in order.
    scalar: Whether NumPy would give a scalar rather than an array: every
      dimension indexed by an int (a dict naming them all, or a tuple with
      no ``...``; ``()`` on a 0-d array too).
  """

  box: tuple[tuple[int, int], ...]
  local: tuple[int | slice, ...]
  kept: tuple[int, ...]
  scalar: bool = False

  @property
  def empty(self) -> bool:
    """Whether the part holds no element (nothing needs reading)."""
    return any(stop == start for start, stop in self.box)


def is_whole(index: object) -> bool:
  """Whether ``index`` selects the whole value, whatever it is (a scalar
  too): ``()``, ``...``, ``(...,)`` or ``{}``."""
  if isinstance(index, Mapping):
    return not index
  return index is Ellipsis or (
      type(index) is tuple and len(index) <= 1 and all(part is Ellipsis for part in index))


def parse_index(
    index: object,
    shape: tuple[int, ...],
    axes: Sequence[Hashable],
    *,
    who: str,
    positional: Sequence[int] | None = None,
) -> Index:
  """Resolves ``index`` against ``shape``: NumPy style over the stored
  dimensions (a tuple, or one part), or a dict by axis name and by position.

  ``axes`` names each stored dimension (None: positional); ``positional``
  lists the stored dimensions of the positional axes in their logical order
  (a ``NamedArrayView``'s ``data_axis_for_logical_axis``; default: the
  unnamed dimensions in order), which a dict's int keys count, negative ones
  from the end. Ints (NumPy's too) may be negative; slices follow NumPy:
  bounds clipped, any non-zero step, negative ones included; ``...`` stands
  for the dimensions not given.

  Raises:
    ArgumentError: an unknown axis name or position, one dimension indexed
      twice, an int out of range, a zero step, too many indexes, or an index
      or bound of another kind (None, bools, floats, str, lists, arrays); each
      message names ``who`` (the label) and the axis.
  """
  rank = len(shape)
  if positional is None:
    positional = [dim for dim in range(rank) if axes[dim] is None]
  per_dim, scalar = _per_dimension(index, rank, axes, positional, who)
  box: list[tuple[int, int]] = []
  local: list[int | slice] = []
  kept: list[int] = []
  for dim, (part, n) in enumerate(zip(per_dim, shape)):
    axis = _axis_text(axes, dim)
    if isinstance(part, slice):
      start, stop, step = _slice_parts(part, axis, who).indices(n)
      count = len(range(start, stop, step))
      if count == 0:
        box.append((0, 0))
        local.append(slice(0, 0))
      else:
        last = start + step * (count - 1)
        low = min(start, last)
        box.append((low, max(start, last) + 1))
        first = start - low
        end = first + step * count
        local.append(slice(first, end if end >= 0 else None, step))
      kept.append(dim)
    else:
      at = _as_int(part, axis, who)
      if not -n <= at < n:
        raise errors.ArgumentError(
            f"{who}: index {at} is out of range for {axis}, of size {n}."
        )
      at %= n
      box.append((at, at + 1))
      local.append(0)
  return Index(tuple(box), tuple(local), tuple(kept), scalar=scalar and not kept)


def _per_dimension(
    index: object, rank: int, axes: Sequence[Hashable], positional: Sequence[int], who: str
) -> tuple[list[object], bool]:
  """``index`` (a dict, a tuple or one part) as one part per stored dimension
  (``...`` and the dimensions not given as whole slices), and whether all-int
  parts would read a scalar: a non-empty dict, or an index without ``...``.

  Why apart from `parse_index`: the three ways of writing an index end here
  in one shape, and `parse_index` resolves that shape against the sizes."""
  if isinstance(index, Mapping):
    per_dim: list[object] = [slice(None)] * rank
    given: dict[int, object] = {}
    for key, part in index.items():
      dim = _dim_of(key, axes, positional, who)
      if dim in given:
        raise errors.ArgumentError(
            f"{who}: {_axis_text(axes, dim)} is indexed twice, as {given[dim]!r:.40}"
            f" and as {key!r:.40}; give one index per dimension."
        )
      given[dim] = key
      if part is Ellipsis:
        raise errors.ArgumentError(
            f"{who}: the index of {_axis_text(axes, dim)} is ...; in a dict, give an"
            " int or a slice (leave a dimension out to keep it whole)."
        )
      per_dim[dim] = part
    return per_dim, bool(given)
  parts = list(index) if isinstance(index, tuple) else [index]
  if sum(part is Ellipsis for part in parts) > 1:
    raise errors.ArgumentError(f"{who}: an index may hold one ... only.")
  dots = [at for at, part in enumerate(parts) if part is Ellipsis]
  if dots:
    at = dots[0]
    fill = rank - (len(parts) - 1)
    if fill < 0:
      raise _too_many(who, len(parts) - 1, axes)
    parts = parts[:at] + [slice(None)] * fill + parts[at + 1:]
  if len(parts) > rank:
    raise _too_many(who, len(parts), axes)
  return parts + [slice(None)] * (rank - len(parts)), not dots


def _slice_parts(part: slice, axis: str, who: str) -> slice:
  """``part`` with its bounds and step as Python ints (NumPy's ints too)."""
  try:
    bounds = [None if value is None else _index_int(value)
              for value in (part.start, part.stop, part.step)]
  except TypeError:
    raise errors.ArgumentError(
        f"{who}: the slice of {axis} is {part!r:.120}; its start, stop and step must"
        " be ints or None."
    ) from None
  if bounds[2] == 0:
    raise errors.ArgumentError(f"{who}: the slice of {axis} has step 0.")
  return slice(*bounds)


def _index_int(value: Any) -> int:
  """``value`` as an int if it is one (``operator.index``), bools refused."""
  if isinstance(value, bool | np.bool_):
    raise TypeError(value)
  return operator.index(value)


def _as_int(part: object, axis: str, who: str) -> int:
  try:
    return _index_int(part)
  except TypeError:
    raise errors.ArgumentError(
        f"{who}: the index of {axis} is {part!r:.80}; use an int or a slice"
        " (None, bools, floats, str, lists and arrays are not read lazily: index"
        " named axes with a dict by name, or read the slice around them, then"
        " index it)."
    ) from None


def _too_many(who: str, given: int, axes: Sequence[Hashable]) -> errors.ArgumentError:
  dims = ", ".join(_axis_text(axes, dim) for dim in range(len(axes))) or "none"
  return errors.ArgumentError(
      f"{who}: {given} indexes given for an array of {len(axes)} dimension(s)"
      f" ({dims})."
  )


def _axis_text(axes: Sequence[Hashable], dim: int) -> str:
  name = axes[dim] if dim < len(axes) else None
  return f"axis {name!r} (dimension {dim})" if name is not None else f"dimension {dim}"


def _dim_of(key: object, axes: Sequence[Hashable], positional: Sequence[int], who: str) -> int:
  """The stored dimension a dict key names: an axis name, or an int counting
  the positional axes (negative ones from the end)."""
  named = [a for a in axes if a is not None]
  try:
    if key is not None and key in named:
      return list(axes).index(key)
  except TypeError:  # An unhashable or incomparable key names no axis.
    pass
  if not isinstance(key, bool | np.bool_) and isinstance(key, int | np.integer):
    at = int(key)
    if -len(positional) <= at < len(positional):
      return positional[at]
    raise errors.ArgumentError(
        f"{who}: no positional axis {at}; it has {len(positional)} positional"
        f" ax{'i' if len(positional) == 1 else 'e'}s"
        + (f" and named axes {', '.join(repr(a) for a in named)} (index those by name)."
           if named else ".")
    )
  close = selection.close_matches(str(key), [str(a) for a in named], n=3)
  hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
  return_axes = ", ".join(repr(a) for a in named) or "none (index it by position)"
  raise errors.ArgumentError(
      f"{who}: no axis {key!r:.80}; its named axes are {return_axes}.{hint}"
  )
