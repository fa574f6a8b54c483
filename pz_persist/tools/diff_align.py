"""Aligning the items of two lists (a ``Sequential``'s layers) in bounded time and memory.

Why this module exists: a diff must say which item of B is which item of A
after a person edited a list (blocks inserted, cut, wrapped in adapters,
relabelled, several at once), and a longest-common-subsequence table over
two whole lists costs ``len(A) * len(B)`` cells: 25,000 items ask for
gigabytes. Alignment here goes from strong identity to weak, each pass
linear or bounded (patience diff, as in Bazaar and ``git diff --patience``):

1. items equal on both sides at the start and at the end pair off;
2. items whose *exact key* (class and labels inside, or the whole
   structure if unlabelled) occurs once on each side are anchors, kept in
   order by a longest increasing subsequence (``n log n``);
3. in the gaps between anchors, items sharing most of their *labels* (a
   block whose Linears gained LoRA adapters still holds their labels)
   pair off when each is the other's best match;
4. then items whose *shape key* (classes and array shapes, no labels or
   values: a relabelled block) occurs once on each side;
5. what remains is aligned by class with a longest-common-subsequence table
   of at most `MAX_GAP_CELLS` cells, from a budget of `BUDGET` steps for one
   whole diff, and a run of as many items on each side between those pairs
   pairs in place (an item replaced by another);
6. beyond those bounds, a gap pairs by position, and the alignment says how
   many items it paired that way (the diff notes it on the list).

Every pass charges its work to the budget, so a diff of any size finishes
in time proportional to its input plus at most `BUDGET` steps.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Sequence

MAX_GAP_CELLS = 1 << 16
"""Most cells of one longest-common-subsequence table (a gap of 256 x 256)."""

BUDGET = 1 << 22
"""Most steps (table cells and items visited by the linear passes beyond the
first) spent aligning all the lists of one diff."""

Pair = tuple[int | None, int | None]


@dataclasses.dataclass(frozen=True)
class Keys:
  """What identifies each item of one side, from strong to weak.

  Attributes:
    exact: Equal for an item and its unedited self.
    labels: The labels of the variables inside each item (computed only for
      items left in a gap, as they cost a walk of the item).
    shape: Equal for items of the same structure, whatever their labels.
    kind: The item's type and class.
  """

  exact: Sequence[Hashable]
  labels: Callable[[int], Sequence[str]]
  shape: Callable[[int], Hashable]
  kind: Sequence[Hashable]


@dataclasses.dataclass
class Alignment:
  """Pairs of item indices in order (None: the item is on one side only).

  Attributes:
    pairs: Every item of both sides once, in the order of both lists.
    by_position: How many pairs were made by position only because the
      budget was spent (0 when every item was aligned by what it is).
  """

  pairs: list[Pair]
  by_position: int = 0


class Aligner:
  """Aligns lists for one diff, sharing one budget across all of them."""

  def __init__(self, budget: int = BUDGET):
    self.budget = budget
    self.spent = 0
    self.largest_table = 0

  def _charge(self, steps: int) -> bool:
    """Spends ``steps`` of the budget; False (nothing spent) if it lacks them."""
    if self.spent + steps > self.budget:
      return False
    self.spent += steps
    return True

  def align(self, a: Keys, b: Keys) -> Alignment:
    """The alignment of lists A and B (the passes in the module docstring)."""
    matched: list[tuple[int, int]] = []
    by_position = 0
    gaps = [(0, len(a.exact), 0, len(b.exact))]
    first = True
    while gaps:
      a0, a1, b0, b1 = gaps.pop()
      while a0 < a1 and b0 < b1 and a.exact[a0] == b.exact[b0]:
        matched.append((a0, b0))
        a0, b0 = a0 + 1, b0 + 1
      while a0 < a1 and b0 < b1 and a.exact[a1 - 1] == b.exact[b1 - 1]:
        matched.append((a1 - 1, b1 - 1))
        a1, b1 = a1 - 1, b1 - 1
      if a0 == a1 or b0 == b1:
        continue
      # The first gap's linear passes are free: the input's own size.
      if not first and not self._charge((a1 - a0) + (b1 - b0)):
        by_position += self._by_position(a0, a1, b0, b1, matched)
        continue
      first = False
      anchors = self._anchors(a, b, a0, a1, b0, b1)
      if anchors:
        matched.extend(anchors)
        ends = [(a0 - 1, b0 - 1), *anchors, (a1, b1)]
        gaps.extend((i + 1, k, j + 1, m) for (i, j), (k, m) in zip(ends, ends[1:])
                    if i + 1 < k or j + 1 < m)
      else:
        by_position += self._by_kind(a, b, a0, a1, b0, b1, matched)
    return Alignment(_with_one_sided(sorted(matched), len(a.exact), len(b.exact)), by_position)

  def _anchors(self, a: Keys, b: Keys, a0: int, a1: int, b0: int, b1: int
               ) -> list[tuple[int, int]]:
    """Pairs within a gap by exact key, then labels, then shape, in order."""
    found = _increasing(_unique_pairs(a.exact, b.exact, a0, a1, b0, b1))
    if found:
      return found
    found = _increasing(self._label_pairs(a, b, a0, a1, b0, b1))
    if found:
      return found
    shape_a = [a.shape(i) for i in range(a0, a1)]
    shape_b = [b.shape(j) for j in range(b0, b1)]
    return _increasing([(i + a0, j + b0) for i, j in _unique_pairs(
        shape_a, shape_b, 0, len(shape_a), 0, len(shape_b))])

  def _label_pairs(self, a: Keys, b: Keys, a0: int, a1: int, b0: int, b1: int
                   ) -> list[tuple[int, int]]:
    """Items that share the most labels, each the other's best match."""
    owner: dict[str, int | None] = {}
    for j in range(b0, b1):
      labels = b.labels(j)
      self.spent += len(labels)
      for label in labels:
        owner[label] = j if label not in owner else None  # In two items: no identity.
    shared: dict[tuple[int, int], int] = {}
    for i in range(a0, a1):
      labels = a.labels(i)
      self.spent += len(labels)
      for label in labels:
        partner = owner.get(label)
        if partner is not None:
          shared[i, partner] = shared.get((i, partner), 0) + 1
    best_a: dict[int, tuple[int, int]] = {}
    best_b: dict[int, tuple[int, int]] = {}
    for (i, j), count in shared.items():
      if count > best_a.get(i, (0, 0))[0]:
        best_a[i] = (count, j)
      if count > best_b.get(j, (0, 0))[0]:
        best_b[j] = (count, i)
    return sorted((i, j) for i, (_, j) in best_a.items() if best_b[j][1] == i)

  def _by_kind(self, a: Keys, b: Keys, a0: int, a1: int, b0: int, b1: int,
               matched: list[tuple[int, int]]) -> int:
    """A gap without anchors, aligned by class with a bounded table; what
    is left between those pairs, as many items on each side, pairs in place
    (an item replaced by another). Beyond the bounds, the whole gap pairs by
    position. Returns how many pairs were made by position for lack of budget."""
    n, m = a1 - a0, b1 - b0
    if n * m > MAX_GAP_CELLS or not self._charge(n * m):
      return self._by_position(a0, a1, b0, b1, matched)
    self.largest_table = max(self.largest_table, n * m)
    kind_a, kind_b = a.kind[a0:a1], b.kind[b0:b1]
    longest = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
      row, below = longest[i], longest[i + 1]
      for j in range(m - 1, -1, -1):
        row[j] = below[j + 1] + 1 if kind_a[i] == kind_b[j] else max(below[j], row[j + 1])
    same: list[tuple[int, int]] = []
    i = j = 0
    while i < n and j < m:
      if kind_a[i] == kind_b[j]:
        same.append((i, j))
        i, j = i + 1, j + 1
      elif longest[i + 1][j] > longest[i][j + 1]:
        i += 1
      else:  # On a tie, A's earlier items keep their partners: B's are new.
        j += 1
    start_a = start_b = 0
    for end_a, end_b in [*same, (n, m)]:
      if end_a - start_a == end_b - start_b:  # Replaced in place.
        matched.extend((a0 + x, b0 + y) for x, y in zip(range(start_a, end_a),
                                                        range(start_b, end_b)))
      if end_a < n:
        matched.append((a0 + end_a, b0 + end_b))
      start_a, start_b = end_a + 1, end_b + 1
    return 0

  @staticmethod
  def _by_position(a0: int, a1: int, b0: int, b1: int,
                   matched: list[tuple[int, int]]) -> int:
    pairs = list(zip(range(a0, a1), range(b0, b1)))
    matched.extend(pairs)
    return len(pairs)


def _unique_pairs(keys_a: Sequence[Hashable], keys_b: Sequence[Hashable],
                  a0: int, a1: int, b0: int, b1: int) -> list[tuple[int, int]]:
  """``(i, j)`` for each key that occurs once in ``keys_a[a0:a1]`` and once in
  ``keys_b[b0:b1]``, in A's order."""
  where_a: dict[Hashable, int | None] = {}
  for i in range(a0, a1):
    where_a[keys_a[i]] = i if keys_a[i] not in where_a else None
  where_b: dict[Hashable, int | None] = {}
  for j in range(b0, b1):
    where_b[keys_b[j]] = j if keys_b[j] not in where_b else None
  pairs = []
  for key, at_a in where_a.items():
    at_b = where_b.get(key)
    if at_a is not None and at_b is not None:
      pairs.append((at_a, at_b))
  return pairs


def _increasing(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """The longest run of ``pairs`` (sorted by A) whose B indices increase too
  (patience sorting: ``n log n``)."""
  tails: list[int] = []  # B index ending the best run of each length.
  tail_at: list[int] = []  # Which pair ends it.
  before: list[int] = []
  for k, (_, j) in enumerate(pairs):
    length = bisect.bisect_left(tails, j)
    if length == len(tails):
      tails.append(j)
      tail_at.append(k)
    else:
      tails[length], tail_at[length] = j, k
    before.append(tail_at[length - 1] if length else -1)
  run = []
  k = tail_at[-1] if tail_at else -1
  while k >= 0:
    run.append(pairs[k])
    k = before[k]
  return run[::-1]


def _with_one_sided(matched: list[tuple[int, int]], n: int, m: int) -> list[Pair]:
  """The matched pairs (in order) with every unmatched item between them."""
  pairs: list[Pair] = []
  i = j = 0
  for x, y in [*matched, (n, m)]:
    pairs.extend((k, None) for k in range(i, x))
    pairs.extend((None, k) for k in range(j, y))
    if x < n:
      pairs.append((x, y))
    i, j = x + 1, y + 1
  return pairs
