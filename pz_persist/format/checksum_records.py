"""How a stored array's checksums are recorded: the part of checksums that is
file format (the algorithm's name, the slice each digest covers, which sets of
slices are acceptable), apart from computing them (`pz_persist.storage.integrity.checksums`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

ALGORITHM = "xxh3_128"
"""Name of the hash recorded in manifests."""

Index = tuple[tuple[int, int], ...]
"""A slice of an array: ``(start, stop)`` per dimension."""


@dataclasses.dataclass(frozen=True, slots=True)
class ShardChecksum:
  """The hash of one stored slice of an array.

  Attributes:
    index: The slice, ``(start, stop)`` per dimension.
    digest: Hex digest (`ALGORITHM`) of the slice's C-order bytes.
  """

  index: Index
  digest: str


def full_index(shape: tuple[int, ...]) -> Index:
  return tuple((0, int(n)) for n in shape)


def tiles(indices: Iterable[Index], shape: tuple[int, ...]) -> bool:
  """Whether ``indices`` cut an array of ``shape`` into a grid of slices,
  each element in exactly one slice (how every sharding stores an array).

  Why it matters: recorded checksums come from the checkpoint. Slices that
  leave part of an array out leave that part unchecked (deleting all but one
  is a downgrade that hides damage); slices that repeat or overlap make a
  reader hash the same bytes again, up to millions of times. A grid is what
  `compute` records: per dimension, a partition of ``range(n)``.
  """
  indices = list(indices)
  if len(indices) == 1:  # The commonest case (one unsharded array), quickly.
    return indices[0] == full_index(shape)
  distinct = set(indices)
  if len(distinct) != len(indices):
    return False
  parts = 1
  for dim, n in enumerate(shape):
    bounds = sorted({index[dim] for index in distinct})
    edges = [0] + [stop for _, stop in bounds]
    if [start for start, _ in bounds] != edges[:-1] or edges[-1] != n:
      return False
    if n and any(start >= stop for start, stop in bounds):
      return False
    parts *= len(bounds)
  return parts == len(distinct)
