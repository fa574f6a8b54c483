"""A diff of long lists is bounded in memory and steps, whatever the lists hold.

Aligning two lists with one longest-common-subsequence table costs
``len(A) * len(B)`` cells: lists of 25,000 and 25,001 items asked for about
5 GB. Alignment (`pz_persist.tools.diff_align`) is near-linear with a
bounded fallback; these tests measure what it allocates (``tracemalloc``)
and the steps it counts, never the time it takes, for lists that align by
identity and for lists of look-alike items that cannot (the worst case),
through `pzp.diff` and the command line.
"""

from __future__ import annotations

import random
import tracemalloc

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

import pz_persist as pzp
from pz_persist.tools import cli
from pz_persist.tools import diff_align
from pz_persist.tools import diff_sides
from pz_persist.tools import diff_tree

N = 25_000
PEAK_BYTES = 256 * 2**20
"""Most bytes a diff of two N-item lists may allocate at once (their
encodings, trees and nodes included; one quadratic table would be gigabytes)."""


def _diff_measured(a, b):
  tracemalloc.start()
  try:
    result = pzp.diff(a, b, progress=False)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  return result, peak


def _list_node(result):
  return result.tree


def _aligner_of(a, b) -> diff_align.Aligner:
  """The aligner after matching A and B's trees (its counts)."""
  sides = [diff_sides.model_side(x) for x in (a, b)]
  matcher = diff_tree.Matcher(sides[0].manifest, sides[1].manifest, ({}, {}))
  matcher.build()
  return matcher.aligner


def test_an_item_inserted_into_25000_is_one_addition():
  a = list(range(N))
  b = [*a[:12_345], -1, *a[12_345:]]
  result, peak = _diff_measured(a, b)
  assert peak < PEAK_BYTES
  root = _list_node(result)
  assert root.notes == [f"{N} items -> {N + 1}"]
  assert [(c.status, c.key) for c in root.children if c.status != "unchanged"] == [
      ("added", "[12345]")]
  moved = [c for c in root.children if "(was" in c.key]
  assert len(moved) == N - 12_345 and moved[0].key == "[12346] (was [12345])"


def test_look_alike_items_beyond_the_bounds_pair_by_position_and_say_so():
  """The worst case: three values in random order on each side, so no item
  is unique and no table of the whole lists fits the bounds."""
  rng = random.Random(0)
  a = [rng.randrange(3) for _ in range(N)]
  b = [rng.randrange(3) for _ in range(N + 1)]
  result, peak = _diff_measured(a, b)
  assert peak < PEAK_BYTES
  notes = _list_node(result).notes
  assert notes[0] == f"{N} items -> {N + 1}"
  assert notes[1].endswith("items paired by position only: too many alike to align in"
                           " bounded time")
  aligner = _aligner_of(a, b)
  assert aligner.spent <= aligner.budget and aligner.largest_table <= diff_align.MAX_GAP_CELLS


def test_equal_items_in_a_longer_list_are_one_addition():
  result, peak = _diff_measured([0] * N, [0] * (N + 1))
  assert peak < PEAK_BYTES
  changes = [c for c in _list_node(result).children if c.status != "unchanged"]
  assert [(c.status, c.key) for c in changes] == [("added", f"[{N}]")]


def test_many_gaps_share_one_budget():
  """Unique anchors cut the lists into gaps each small enough for a table,
  but together beyond the budget: the tables stop, the rest pairs by
  position, and the steps counted never pass the budget."""
  rng = random.Random(1)
  def side(extra: int) -> list:
    items: list = []
    for k in range(60):
      items.append(f"anchor {k}")
      items.extend(rng.choice([0, "s", 0.5]) for _ in range(200 + extra))
    return items
  a, b = side(0), side(1)
  keys = [diff_align.Keys(
      exact=x, labels=lambda i: (), shape=lambda i, x=x: x[i],
      kind=[type(item).__name__ for item in x]) for x in (a, b)]
  aligner = diff_align.Aligner(budget=1_000_000)
  alignment = aligner.align(*keys)
  assert aligner.spent <= 1_000_000 and aligner.largest_table <= diff_align.MAX_GAP_CELLS
  assert alignment.by_position > 0
  _assert_complete(alignment.pairs, len(a), len(b))
  anchors = [(i, j) for i, j in alignment.pairs if i is not None and isinstance(a[i], str)
             and a[i].startswith("anchor")]
  assert all(b[j] == a[i] for i, j in anchors) and len(anchors) == 60


def test_the_command_line_diffs_long_checkpoints(tmp_path, capsys, monkeypatch):
  names = [f"step number {i}" for i in range(N)]
  pzp.save(tmp_path / "a", {"steps": names, "w": np.ones(3)})
  pzp.save(tmp_path / "b", {"steps": [*names[:100], "new", *names[100:]], "w": np.ones(3)})
  monkeypatch.setenv("COLUMNS", "80")
  tracemalloc.start()
  try:
    code = cli.main(["diff", "--quiet", str(tmp_path / "a"), str(tmp_path / "b")])
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  out = capsys.readouterr().out
  assert code == 1 and peak < PEAK_BYTES
  assert "tree['steps'][100]" in out and max(map(len, out.splitlines())) <= 80


def _assert_complete(pairs, n, m):
  """Every item of each side once, both sides in order."""
  assert sorted(i for i, _ in pairs if i is not None) == list(range(n))
  assert sorted(j for _, j in pairs if j is not None) == list(range(m))
  seen_a = [i for i, _ in pairs if i is not None]
  seen_b = [j for _, j in pairs if j is not None]
  assert seen_a == sorted(seen_a) and seen_b == sorted(seen_b)


def _plain_keys(items: list) -> diff_align.Keys:
  return diff_align.Keys(exact=items, labels=lambda i: (), shape=lambda i: items[i],
                         kind=[type(x).__name__ for x in items])


EXAMPLES = 300


@hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None)
@hypothesis.given(
    items=st.lists(st.integers(0, 10_000), unique=True, max_size=60),
    edits=st.lists(st.tuples(st.booleans(), st.integers(0, 59)), max_size=8),
    budget=st.sampled_from([0, 50, diff_align.BUDGET]),
)
def test_unique_items_survive_any_edits(items, edits, budget):
  """B is A with items inserted and removed: every item left meets its old
  self, whatever the budget, and the pairs cover both sides in order."""
  b = list(items)
  for insert, at in edits:
    if insert:
      b.insert(min(at, len(b)), -1 - at)  # Negative: new, never in A.
    elif b:
      del b[at % len(b)]
  alignment = diff_align.Aligner(budget=budget).align(_plain_keys(items), _plain_keys(b))
  _assert_complete(alignment.pairs, len(items), len(b))
  for i, j in alignment.pairs:
    if i is not None and items[i] in b:
      assert j is not None and b[j] == items[i]


@hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None)
@hypothesis.given(
    a=st.lists(st.sampled_from([0, 1, "x", 2.5]), max_size=40),
    b=st.lists(st.sampled_from([0, 1, "x", 2.5]), max_size=40),
    budget=st.sampled_from([0, 200, diff_align.BUDGET]),
)
def test_any_lists_align_completely_within_the_budget(a, b, budget):
  aligner = diff_align.Aligner(budget=budget)
  alignment = aligner.align(_plain_keys(a), _plain_keys(b))
  _assert_complete(alignment.pairs, len(a), len(b))
  assert aligner.spent <= max(budget, 0) + sum(map(len, (a, b)))
  if a == b:
    assert alignment.pairs == [(i, i) for i in range(len(a))]


@pytest.mark.parametrize("n", [0, 1, 2])
def test_tiny_lists(n):
  alignment = diff_align.Aligner().align(_plain_keys(list(range(n))), _plain_keys([]))
  assert alignment.pairs == [(i, None) for i in range(n)]
