"""Every renderer handles every tree the format accepts, however deep.

A manifest may nest `pz_persist.format.nodes.MAX_DEPTH` levels (readers
refuse beyond), and treescope spends about ten frames per level of the
diff's tree and twenty-five per level of a model: under Python's default
recursion limit of 1,000 (no library around to raise it) a 70-deep tree
used to fail with ``RecursionError``. Each kind of nesting is built as deep
as the format allows and rendered by every view, through the library and
the command line: the diff's HTML, its treescope rendering, its table, text
and JSON; ``render_html`` of a checkpoint (with and without arrays) and of a
model in memory; the lazy handle's treescope view; ``inspect``'s table and
JSON. None of it may touch the recursion limit (nothing process-wide changes
behind the user's back): the parts nested deeper than
`pz_persist.format.folding.NESTED_LEVELS` are folded into lists instead.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import treescope
from penzai import pz

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import encode as encode_lib
from pz_persist.format import folding
from pz_persist.format import nodes
from pz_persist.tools import cli
from pz_persist.tools import diff_view
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
    assert "folded:" in out.read_text()  # The rendering says so.
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
  assert cli.main(["inspect", a]) == 0
  assert "float32" in capsys.readouterr().out  # The text view lists the deepest array.
  assert cli.main(["inspect", "--json", a]) == 0
  assert json.loads(capsys.readouterr().out.splitlines()[-1])["items"]
  assert sys.getrecursionlimit() == DEFAULT_LIMIT


class _Probe:
  """A leaf that records, as treescope renders it, the recursion limit and
  how many frames deep the rendering has gone."""

  seen: list[tuple[int, int]] = []

  def __treescope_repr__(self, path, subtree_renderer):
    del path, subtree_renderer
    from treescope import rendering_parts as parts  # pylint: disable=import-outside-toplevel
    _Probe.seen.append((sys.getrecursionlimit(), _depth()))
    return parts.text("probe")


def _depth() -> int:
  frame, depth = sys._getframe(), 0  # pylint: disable=protected-access
  while frame is not None:
    frame, depth = frame.f_back, depth + 1
  return depth


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_rendering_leaves_the_recursion_limit_alone(kind, tmp_path, default_limit):
  """The deepest leaf is rendered (listed in the fold) with the limit as the
  user set it, and well within it: the fold bounds the stack whatever the depth."""
  _Probe.seen.clear()
  tree = KINDS[kind](_Probe(), [])
  for _ in range(2 * nodes.MAX_DEPTH):  # Deeper than any checkpoint: a model in memory.
    tree = KINDS[kind](tree, [])
  start = _depth()
  page = pzp.render_html(tree, tmp_path / "probe.html").read_text()
  assert "probe" in page and "folded:" in page
  assert _Probe.seen and all(limit == DEFAULT_LIMIT for limit, _ in _Probe.seen)
  assert max(depth for _, depth in _Probe.seen) - start < DEFAULT_LIMIT // 2
  assert sys.getrecursionlimit() == DEFAULT_LIMIT


def test_every_fold_is_rendered_under_the_users_limit(deep_pair, default_limit, monkeypatch):
  """Mid-render (while a fold lists its parts) the limit is what the user set,
  through render_html, the lazy handle's view and the diff."""
  tmp_path, a, _ = deep_pair
  seen: list[int] = []
  listing = folding.flattened

  def recording(*args, **kwargs):
    seen.append(sys.getrecursionlimit())
    return listing(*args, **kwargs)

  monkeypatch.setattr(folding, "flattened", recording)
  pzp.render_html(tmp_path / "a", tmp_path / "v.html")
  assert seen
  with pzp.open(tmp_path / "a") as handle:
    view = treescope.render_to_html(handle, roundtrip_mode=False, compressed=False)
  assert "folded:" in view and "Linear" in view and len(seen) >= 2
  pzp.diff(tmp_path / "a", tmp_path / "b", progress=False).to_html()
  assert len(seen) >= 3 and set(seen) == {DEFAULT_LIMIT}
  assert sys.getrecursionlimit() == DEFAULT_LIMIT


def test_folding_changes_nothing_shallow_and_keeps_the_tree():
  model = _tree("sequential", 3, 1.0)
  assert folding.fold(model) is model  # Shallow: rendered exactly as before.
  from penzai.models.transformer.variants import llamalike_common  # pylint: disable=import-outside-toplevel
  transformer = llamalike_common.build_llamalike_transformer(
      llamalike_common.LlamalikeTransformerConfig(
          num_kv_heads=2, query_head_multiplier=1, embedding_dim=16, projection_dim=8,
          mlp_hidden_dim=32, num_decoder_blocks=2, vocab_size=50, mlp_variant="geglu_approx",
          tie_embedder_and_logits=False),
      init_base_rng=jax.random.key(0))
  assert folding.fold(transformer) is transformer  # A real model is shown whole.
  deep = _tree("dict and tuple", 30, 1.0)
  folded = folding.fold(deep, levels=4)
  assert folded is not deep and deep["k"][0]["k"][0] is not None  # The original is untouched.
  below = folded["k"][0]["k"][0]  # Four levels down: a dict in a tuple in a dict in a tuple.
  assert isinstance(below, folding.Folded) and below.value is deep["k"][0]["k"][0]
  assert below.level == 4 and type(folded["k"]) is tuple and type(folded["k"][0]) is dict
  assert isinstance(folded["k"][1], np.ndarray)  # Leaves beside the path stay.


@dataclasses.dataclass
class _Node:
  """A mutable dataclass: a model in memory may hold itself."""

  child: Any = None


def test_a_variable_or_a_cycle_deep_in_a_model_renders(tmp_path, default_limit):
  deep: Any = 7.5
  for _ in range(3 * nodes.MAX_DEPTH):
    deep = [deep]
  variable = pz.StateVariable(value=deep, label="counter")
  held = variable.value
  page = pzp.render_html({"state": variable}, tmp_path / "v.html").read_text()
  assert "folded:" in page and "7.5" in page and "counter" in page
  assert variable.value is held  # Folded whole, never changed.
  looped = _Node()
  nested: Any = looped
  for _ in range(2 * folding.NESTED_LEVELS):
    nested = _Node(nested)
  looped.child = nested  # A cycle below the fold.
  page = pzp.render_html(nested, tmp_path / "c.html").read_text()
  assert "holds itself" in page
  assert sys.getrecursionlimit() == DEFAULT_LIMIT
