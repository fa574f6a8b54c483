"""A save that succeeds always loads (issue 36), property-tested.

Generated trees (every value kind pz_persist saves: arrays of every dtype,
including bfloat16, int4 and float8, NumPy scalars, JAX arrays including
weakly typed ones, NamedArrays and views, frozen and mutable variables, PRNG
keys, strings, bytes, bools, None, containers; plus long lists of scalars,
``None`` and empty tuples, deep nesting, and one static value shared at
several depths) go through every save path. Each either saves, and then
loads bit for bit and passes ``inspect``, ``pzp.open`` and ``verify``; or the
save refuses with a `pz_persist.errors.EncodingError` before anything is
published. Never saved, then refused.

What makes it hold is one check (`pz_persist.format.manifest.check_publishable`):
every save parses the manifest it is about to publish with the reader's own
code and limits, before it writes anything.

Profile: ``PZ_PERSIST_HYPOTHESIS_EXAMPLES`` (default 150) examples of the
main property, a sixth as many per other save path (about 70 s and 20 s
each on a quiet 2-core machine); set it higher to search longer (issue 36's
run: 200, and 50 per other path, 400 cases, all passing).
"""

from __future__ import annotations

import os
import pathlib

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import test_random_trees as generated
from orbax.checkpoint import v1 as ocp_v1
from penzai import pz
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist import errors
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import nodes
from pz_persist.safety import allowlist

EXAMPLES = int(os.environ.get("PZ_PERSIST_HYPOTHESIS_EXAMPLES", "150"))
"""Examples of the main property (~0.5 s each here); other paths get a sixth."""

GENERATED_MODULE = generated.__name__
"""The module of the generated trees' own namedtuple, allowed when loading."""

SURELY_LOADABLE = 60
"""Containers a value may be nested in and be certain to save: the generated
values below nest at most ~25 node levels (far under `nodes.MAX_DEPTH`)."""

SURELY_TOO_DEEP = nodes.MAX_DEPTH + 5
"""Containers past which a save must be refused: each is a node level."""

_REPEATED = [None, (), [], {}, 0, 1, -7, 0.5, -0.0, True, False, "", "é", "abc"]


def _nest(value, kinds: str):
  """``value`` inside one container per letter of ``kinds``: l(ist),
  t(uple), d(ict)."""
  for kind in kinds:
    value = [value] if kind == "l" else (value,) if kind == "t" else {"k": value}
  return value


bulky = st.one_of(
    st.builds(lambda x, n: [x] * n, st.sampled_from(_REPEATED), st.integers(1000, 20000)),
    st.integers(1000, 8000).map(lambda n: list(range(n))),  # A step counter's history.
    st.integers(1000, 8000).map(lambda n: [i / 7 for i in range(n)]),  # A loss history.
    st.integers(100, 2000).map(lambda n: [None, (), 1, "ab", 2.5, []] * n),
)

weak = st.sampled_from([
    lambda: jnp.asarray(1.0), lambda: jnp.asarray(3), lambda: jnp.asarray(2.5j),
    lambda: jnp.asarray(True),
]).map(lambda make: make())


@st.composite
def deep(draw):
  """``(tree, containers)``: a value nested in up to 120 containers, with a
  static value (metadata) shared between a shallow and a deep variable, so
  the manifest's shared-value table holds it once for both depths."""
  containers = draw(st.integers(0, 120))
  kinds = "".join(draw(st.lists(st.sampled_from("ltd"), min_size=containers,
                                max_size=containers)))
  height = draw(st.integers(0, 10))
  shared = {"m": _nest(draw(generated.static_leaves), "l" * height), "n": "shared value"}
  make = lambda label: pz.ParameterValue(  # noqa: E731
      value=pz.nx.wrap(jnp.arange(3.0)).tag("x"), label=label, metadata=shared)
  inner = draw(st.one_of(generated.values, st.just(None).map(lambda _: make("deep"))))
  return {"shallow": make("shallow"), "deep": _nest(inner, kinds)}, containers + height


@st.composite
def cases(draw):
  """``(tree, must_save, must_refuse)``."""
  parts = {"tree": draw(generated.trees())}
  nesting = 0
  if draw(st.booleans()):
    parts["bulky"] = draw(bulky)
  if draw(st.booleans()):
    parts["weak"] = draw(weak)
  if draw(st.booleans()):  # Keys of any script, as a dict of values.
    parts["unicode"] = draw(st.dictionaries(generated.text, generated.values, max_size=4))
  if draw(st.integers(0, 3)) == 0:
    parts["deep"], nesting = draw(deep())
  return parts, nesting <= SURELY_LOADABLE, nesting > SURELY_TOO_DEEP


def _item(path: pathlib.Path) -> pathlib.Path:
  (manifest,) = path.rglob(manifest_lib.MANIFEST_FILENAME)
  return manifest.parent


def _nothing_published(path: pathlib.Path) -> bool:
  return not path.exists() or not any(path.rglob(manifest_lib.MANIFEST_FILENAME))


def _check_saved(item: pathlib.Path, expected) -> None:
  """Every reader accepts what was saved, and ``load`` returns it bit for bit."""
  assert_identical(pzp.load(item, allow_modules=[GENERATED_MODULE]), expected)
  abstract = pzp.inspect(item, allow_modules=[GENERATED_MODULE])
  assert jax.tree.structure(abstract) == jax.tree.structure(pz.freeze_variables(expected))
  with allowlist.scoped_allowance([GENERATED_MODULE]):
    assert_identical(pzp.open(item).load(), expected)
  report = pzp.verify(item)
  assert report.ok and not report.unverified, report


def _save_and_check(save, path: pathlib.Path, tree, expected, must_save, must_refuse):
  try:
    with allowlist.scoped_allowance([GENERATED_MODULE]):
      save(path, tree)
  except errors.PzPersistError as e:
    assert not must_save, f"refused a tree every reader accepts: {e}"
    assert isinstance(e, errors.EncodingError), repr(e)
    assert _nothing_published(path), "refused, but a manifest was published"
    hypothesis.event("refused before publishing")
    return
  assert not must_refuse, "saved a tree nested deeper than readers accept"
  _check_saved(_item(path), expected)
  hypothesis.event("saved, and every reader accepted it")


@hypothesis.settings(
    max_examples=EXAMPLES, deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.data_too_large],
)
@hypothesis.given(case=cases())
def test_a_tree_pzp_save_saves_always_loads(case, tmp_path_factory):
  tree, must_save, must_refuse = case
  path = tmp_path_factory.mktemp("saved") / "ckpt"
  _save_and_check(pzp.save, path, tree, tree, must_save, must_refuse)


def _manager(path, tree):
  with pzp.CheckpointManager(path) as manager:
    manager.save(1, params=tree)
    manager.wait_until_finished()


def _v0(path, tree):
  with ocp.Checkpointer(pzp.PenzaiCheckpointHandler()) as checkpointer:
    checkpointer.save(path, args=pzp.PenzaiSave(tree))


def _v1(path, tree):
  ocp_v1.save_checkpointables(path, {"model": tree})


MARKER = pz.nx.wrap(np.zeros(2, np.float32)).tag("m")
"""Held beside each tree saved through Orbax's v1 API: its registry hands
pz_persist only what holds a Penzai value."""

OTHER_PATHS = {"pzp.CheckpointManager": _manager, "v0 Checkpointer": _v0, "v1": _v1}


@pytest.mark.parametrize("name", list(OTHER_PATHS))
def test_a_tree_any_save_path_saves_always_loads(name, tmp_path_factory):
  save = OTHER_PATHS[name]

  @hypothesis.settings(
      max_examples=max(EXAMPLES // 6, 10), deadline=None,
      suppress_health_check=[hypothesis.HealthCheck.too_slow,
                             hypothesis.HealthCheck.data_too_large],
  )
  @hypothesis.given(case=cases())
  def check(case):
    tree, must_save, must_refuse = case
    tree = [tree, MARKER]
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    _save_and_check(save, path, tree, tree, must_save, must_refuse)

  check()


@hypothesis.settings(max_examples=max(EXAMPLES // 6, 10), deadline=None)
@hypothesis.given(
    variables=st.lists(
        st.builds(
            lambda cls, label, value, metadata: cls(label=label, value=value, metadata=metadata),
            st.sampled_from([pz.Parameter, pz.StateVariable]),
            generated.labels, generated.array_values, generated.metadata),
        min_size=1, max_size=4),
    bulky_metadata=st.one_of(st.none(), bulky),
)
def test_variables_the_type_handler_saves_always_load(variables, bulky_metadata, tmp_path_factory):
  """Orbax's ``PyTreeCheckpointer`` saving mutable variables through
  pz_persist's type handler: its manifest and records file are checked as
  every other save's."""
  if bulky_metadata is not None:
    variables[0] = type(variables[0])(
        label=variables[0].label, value=variables[0].value, metadata={"history": bulky_metadata})
  tree = {f"v{i}": variable for i, variable in enumerate(variables)}
  path = tmp_path_factory.mktemp("saved") / "ckpt"

  def save(path, tree):
    with ocp.PyTreeCheckpointer() as checkpointer:
      checkpointer.save(path, tree)

  _save_and_check(save, path, tree, tree, True, False)
