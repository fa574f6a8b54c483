"""Every renderer handles every tree the format accepts, however deep.

A manifest may nest `pz_persist.format.nodes.MAX_DEPTH` levels (readers
refuse beyond), and treescope spends about ten frames per level of the
diff's tree and twenty-five per level of a model: under Python's default
recursion limit of 1,000 (no library around to raise it) a 70-deep tree
used to fail with ``RecursionError``. Each kind of nesting is built as deep
as the format allows and rendered by every view, through the library and
the command line: the diff's HTML, its treescope rendering, its table, text
and JSON; ``render_html`` of a checkpoint (with and without arrays) and of a
model in memory; ``inspect``'s table and JSON.
"""

from __future__ import annotations

import json
import sys
import threading

import jax.numpy as jnp
import numpy as np
import pytest
import treescope
from penzai import pz

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import encode as encode_lib
from pz_persist.format import nodes
from pz_persist.tools import cli
from pz_persist.tools import diff_view
from pz_persist.tools import render_room
from pz_persist.tools import viewing

DEFAULT_LIMIT = 1000
"""Python's own recursion limit (some libraries, such as jedi, raise it when
imported; the tests must not rely on that)."""


def _linear(scale: float) -> pz.nn.Linear:
  return pz.nn.Linear(
      weights=pz.Parameter(value=pz.nx.wrap(jnp.ones((2, 3)) * scale, "i", "o"), label="w"),
      in_axis_names=("i",), out_axis_names=("o",))


KINDS = {
    "sequential": lambda inner, more: pz.nn.Sequential([inner, *more]),
    "struct in struct": lambda inner, more: pz.nn.Residual(
        pz.nn.Sequential([inner, *more]) if more else inner),
    "list": lambda inner, more: [inner, *more],
    "dict and tuple": lambda inner, more: {"k": (inner, np.arange(2), *more)},
}
"""How each kind of tree nests one more level around what it holds (and
``more`` items beside it)."""


def _tree(kind: str, depth: int, scale: float, extra: bool = False):
  """``depth`` levels of ``kind`` around a Linear; with ``extra``, one level
  holds an item more (B's list is longer there: the diff aligns it)."""
  tree = _linear(scale)
  for level in range(depth):
    more = [pz.nn.Identity()] if extra and level == depth // 2 else []
    tree = KINDS[kind](tree, more)
  return tree


def _deepest(kind: str) -> int:
  """The most levels of ``kind`` the format accepts around the leaf."""
  for depth in range(nodes.MAX_DEPTH, 0, -1):
    try:
      encode_lib.encode(_tree(kind, depth, 1.0, extra=True))
      return depth
    except errors.EncodingError:
      continue
  raise AssertionError(kind)


@pytest.fixture(params=sorted(KINDS))
def deep_pair(request, tmp_path):
  kind = request.param
  depth = _deepest(kind)
  a, b = _tree(kind, depth, 1.0), _tree(kind, depth, 2.0, extra=True)
  pzp.save(tmp_path / "a", a)
  pzp.save(tmp_path / "b", b)
  with pytest.raises(errors.EncodingError, match="nesting deeper"):
    encode_lib.encode(KINDS[kind](_tree(kind, depth, 1.0, extra=True), []))  # One more: refused.
  return tmp_path, a, b


@pytest.fixture
def default_limit():
  before = sys.getrecursionlimit()
  sys.setrecursionlimit(DEFAULT_LIMIT)
  try:
    yield
  finally:
    sys.setrecursionlimit(before)


def test_every_view_of_a_diff_at_the_format_limit(deep_pair, default_limit):
  tmp_path, a, _ = deep_pair
  result = pzp.diff(tmp_path / "a", tmp_path / "b", progress=False)
  assert not result.identical and any(not x.identical for x in result.arrays)
  page = result.to_html()
  assert "changed" in page and "Linear" in page
  assert "Linear" in treescope.render_to_html(result, roundtrip_mode=False, compressed=False)  # A notebook's view.
  assert "changed" in result.table(width=80) and "changed" in str(result)
  assert max(map(len, result.table(width=80).splitlines())) <= 80
  assert not pzp.diff(a, tmp_path / "b", progress=False).identical  # A model against a path.
  assert sys.getrecursionlimit() == DEFAULT_LIMIT


def test_the_diff_tree_below_its_nested_levels_is_one_list_of_lines(deep_pair):
  tmp_path, _, _ = deep_pair
  result = pzp.diff(tmp_path / "a", tmp_path / "b", progress=False)
  deepest = max(result.tree.walk(), key=lambda n: n.path.count("[") + n.path.count("."))
  page = result.to_html()
  # Every node is still shown: the deepest changed array with its statistics.
  assert deepest.stats is not None and not deepest.stats.identical
  assert diff_view.stats_text(deepest.stats) in page


def test_render_html_at_the_format_limit(deep_pair, default_limit):
  tmp_path, a, _ = deep_pair
  for source, arrays in ((tmp_path / "a", True), (tmp_path / "a", False), (a, True)):
    out = pzp.render_html(source, tmp_path / "view.html", arrays=arrays)
    assert "Linear" in out.read_text()
    assert sys.getrecursionlimit() == DEFAULT_LIMIT  # Raised only while rendering.
  assert viewing.describe_checkpoint(tmp_path / "a", width=80).count("\n") >= 4
  assert viewing.checkpoint_record(tmp_path / "a")["arrays"]


def test_the_command_line_at_the_format_limit(deep_pair, default_limit, capsys, monkeypatch):
  tmp_path, _, _ = deep_pair
  monkeypatch.setenv("COLUMNS", "80")
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  assert cli.main(["diff", "--quiet", a, b, "--html", str(tmp_path / "d.html")]) == 1
  out = capsys.readouterr().out
  assert "wrote" in out and max(map(len, out.splitlines())) <= 80
  assert "Linear" in (tmp_path / "d.html").read_text()
  assert cli.main(["diff", "--quiet", "--json", a, b]) == 1
  assert json.loads(capsys.readouterr().out)["changes"]
  for extra in ([], ["--arrays"]):
    assert cli.main(["inspect", a, "--html", str(tmp_path / "i.html"), *extra]) == 0
    assert "Linear" in (tmp_path / "i.html").read_text()
  assert cli.main(["inspect", "--json", a]) == 0
  assert json.loads(capsys.readouterr().out.splitlines()[-1])["items"]
  assert sys.getrecursionlimit() == DEFAULT_LIMIT


def test_room_is_only_raised_and_put_back_unless_changed_meanwhile(default_limit):
  with render_room.room():
    raised = sys.getrecursionlimit()
    assert raised >= render_room.needed() - 5 > DEFAULT_LIMIT
    with render_room.room():  # Nested: no lower.
      assert sys.getrecursionlimit() >= raised
  assert sys.getrecursionlimit() == DEFAULT_LIMIT
  with render_room.room():
    sys.setrecursionlimit(50_000)  # Someone else's choice: kept.
  assert sys.getrecursionlimit() == 50_000


def test_a_model_deeper_than_any_checkpoint_says_so(tmp_path, default_limit):
  too_deep = _tree("sequential", 4 * nodes.MAX_DEPTH, 1.0)
  with pytest.raises(errors.ArgumentError, match="nests deeper than the 100 levels"):
    pzp.render_html(too_deep, tmp_path / "x.html")
  assert sys.getrecursionlimit() == DEFAULT_LIMIT


def test_overlapping_rooms_in_threads_put_the_limit_back(default_limit):
  """Threads inside `room` at once (treescope itself renders one tree at a
  time: its settings are process-wide): each has room while inside, and
  the limit is Python's default again once the last one leaves."""
  inside = threading.Barrier(3)
  seen: list[int] = []

  def enter(levels: int) -> None:
    with render_room.room(levels):
      inside.wait()  # All three inside together.
      seen.append(sys.getrecursionlimit())
      inside.wait()

  threads = [threading.Thread(target=enter, args=(levels,)) for levels in (50, 100, 70)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert len(seen) == 3 and min(seen) >= 100 * render_room.FRAMES_PER_LEVEL
  assert sys.getrecursionlimit() == DEFAULT_LIMIT
