"""Splitting a read into batches of bounded size.

Why: reading every array at once holds each array's read buffer and its
final copy alive together, doubling peak memory; reading batches of about a
fixed number of bytes bounds that to one batch. Loading, diffing and verifying
all read this way.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


def batches(items: Iterable[T], size_of: Callable[[T], int], budget: int) -> Iterator[list[T]]:
  """``items`` in order, grouped so each group holds about ``budget`` bytes.

  A group closes before an item that would take it over ``budget``; an item
  larger than ``budget`` forms a group of its own.
  """
  batch: list[T] = []
  used = 0
  for item in items:
    size = size_of(item)
    if batch and used + size > budget:
      yield batch
      batch, used = [], 0
    batch.append(item)
    used += size
  if batch:
    yield batch
