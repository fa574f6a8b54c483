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


def unknown_label(label: Any, labels: Sequence[Hashable], where: str) -> errors.UnknownLabelError:
  """The error for a label the checkpoint does not have, with close matches."""
  text = nodes.describe_label(label)
  return selection.unmatched(
      where, f"no variable labelled {text!r:.200} in this checkpoint", text,
      [nodes.describe_label(known) for known in labels], listed_by=" (see .labels)",
  )


def select(only: Any, labels: Sequence[Hashable], where: str) -> list[Hashable]:
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
    wanted: list[Any] = [only]
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


def _is_label(value: Any, labels: Sequence[Hashable]) -> bool:
  try:
    return value in labels
  except TypeError:  # Unhashable: a list of labels.
    return False


def _matches(wanted: Any, label: Hashable) -> bool:
  if wanted == label:
    return True
  if isinstance(wanted, str) and isinstance(label, str) and label.startswith(wanted):
    return wanted[-1:] in _SEPARATORS or label[len(wanted)] in _SEPARATORS
  return False


@dataclasses.dataclass(frozen=True)
class Index:
  """One array's part, resolved against its shape.

  Attributes:
    box: ``(start, stop)`` per stored dimension: what must be read.
    local: What to index the box with (steps, and ints dropping dimensions).
    kept: Which stored dimensions the result keeps, in order.
  """

  box: tuple[tuple[int, int], ...]
  local: tuple[Any, ...]
  kept: tuple[int, ...]


def parse_index(
    index: Any, shape: tuple[int, ...], axes: Sequence[Any], *, who: str
) -> Index:
  """Resolves ``index`` (NumPy style over the stored dimensions, or a dict by
  axis name, or position, for named arrays) against ``shape``.

  ``axes`` names each stored dimension (None: positional). Ints may be
  negative; slices follow NumPy (bounds clipped) but only with positive
  steps; ``...`` stands for the dimensions not given.

  Raises:
    ArgumentError: an unknown axis name, an int out of range, a negative or
      zero step, too many indexes, or an index of another kind; each message
      names ``who`` (the label) and the axis.
  """
  rank = len(shape)
  if isinstance(index, Mapping):
    per_dim: list[Any] = [slice(None)] * rank
    for name, part in index.items():
      dim = _dim_of(name, axes, rank, who)
      per_dim[dim] = part
  else:
    parts = list(index) if isinstance(index, tuple) else [index]
    if sum(part is Ellipsis for part in parts) > 1:
      raise errors.ArgumentError(f"{who}: an index may hold one ... only.")
    dots = [at for at, part in enumerate(parts) if part is Ellipsis]
    if dots:
      at = dots[0]
      fill = rank - (len(parts) - 1)
      if fill < 0:
        raise _too_many(who, len(parts) - 1, rank)
      parts = parts[:at] + [slice(None)] * fill + parts[at + 1:]
    if len(parts) > rank:
      raise _too_many(who, len(parts), rank)
    per_dim = parts + [slice(None)] * (rank - len(parts))
  box: list[tuple[int, int]] = []
  local: list[Any] = []
  kept: list[int] = []
  for dim, (part, n) in enumerate(zip(per_dim, shape)):
    axis = _axis_text(axes, dim)
    if not isinstance(part, slice):
      part = _as_int(part, axis, who)
    if isinstance(part, slice):
      if part.step is not None and part.step <= 0:
        raise errors.ArgumentError(
            f"{who}: the slice of {axis} has step {part.step}; only positive steps"
            " are read (read it with a positive step, then reverse it: x[::-1])."
        )
      start, stop, step = part.indices(n)
      stop = max(start, stop)
      box.append((start, stop))
      local.append(slice(0, stop - start, step))
      kept.append(dim)
    else:
      at = part
      if not -n <= at < n:
        raise errors.ArgumentError(
            f"{who}: index {at} is out of range for {axis}, of size {n}."
        )
      at %= n
      box.append((at, at + 1))
      local.append(0)
  return Index(tuple(box), tuple(local), tuple(kept))


def _as_int(part: Any, axis: str, who: str) -> int:
  try:
    if isinstance(part, bool | np.bool_):
      raise TypeError
    return operator.index(part)
  except TypeError:
    raise errors.ArgumentError(
        f"{who}: the index of {axis} is {part!r:.80}; use an int or a slice with a"
        " positive step (lists, arrays and None are not read lazily: read the"
        " slice around them, then index it)."
    ) from None


def _too_many(who: str, given: int, rank: int) -> errors.ArgumentError:
  return errors.ArgumentError(
      f"{who}: {given} indexes given for an array of {rank} dimension(s)."
  )


def _axis_text(axes: Sequence[Any], dim: int) -> str:
  name = axes[dim] if dim < len(axes) else None
  return f"axis {name!r} (dimension {dim})" if name is not None else f"dimension {dim}"


def _dim_of(name: Any, axes: Sequence[Any], rank: int, who: str) -> int:
  if name in axes and name is not None:
    return list(axes).index(name)
  if type(name) is int and -rank <= name < rank and (not axes or axes[name] is None):
    return name % rank
  named = [a for a in axes if a is not None]
  close = selection.close_matches(str(name), [str(a) for a in named], n=3)
  hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
  return_axes = ", ".join(repr(a) for a in named) or "none (index it by position)"
  raise errors.ArgumentError(
      f"{who}: no axis {name!r:.80}; its named axes are {return_axes}.{hint}"
  )
