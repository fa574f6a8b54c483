"""A selector that matches nothing is an error, never a silent empty load.

``load_into(path, model, only="mpl/*")`` (a typo) returned the fresh model,
random weights and all, with no error or warning. Every selector of every
entry point now refuses, pattern by pattern, one that matches nothing, with
the one error `pz_persist.format.selection.unmatched` builds (the close
matches the checkpoint has): ``only=`` globs, ``rename=`` rules (each in its
turn), ``rename_axes=`` keys and ``dtype=`` rules, through ``load_into``,
``load_into`` (keywords or a ``BindOptions``), ``load_model(dtype=)``, plain Orbax checkpoints and
`pz_persist.open` (labels, prefixes, lists, predicates); an empty list
selects nothing and is refused too. The model passed in is never changed.
"""

from __future__ import annotations

import fnmatch
import re

import hypothesis
import jax
import model_zoo
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import strategies as st
from penzai import pz

import pz_persist as pzp
from pz_persist import errors
from pz_persist.tools import cli


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A native checkpoint of `model_zoo.mlp` and a plain Orbax one of its params."""
  root = tmp_path_factory.mktemp("selectors")
  pzp.save_model(root / "native", model_zoo.mlp())
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(root / "plain", pz.unbind_params(model_zoo.mlp(), freeze=True)[1])
  return {"native": str(root / "native"), "plain": str(root / "plain"),
          "item": str(root / "native" / "penzai")}


def _values(model):
  return [np.asarray(x) for x in jax.tree.leaves(pz.unbind_variables(model, freeze=True)[1])]


CLOSE = "Close matches: 'mlp/'."

REFUSED = [
    # (entry point, options, error, the exact message after "<item>: ")
    ("load_into", {"only": "mpl/*"}, errors.UnknownLabelError,
     "only='mpl/*' matches no label of this checkpoint (labels are matched whole, as"
     f" fnmatch globs). {CLOSE}"),
    ("load_into", {"only": ["mlp/*", "mpl/Affine_0/*"]}, errors.UnknownLabelError,
     "only='mpl/Affine_0/*' matches no label of this checkpoint (labels are matched whole,"
     " as fnmatch globs). Close matches: 'mlp/Affine_0/', 'mlp/Affine_1/',"
     " 'mlp/Affine_0/AddBias.bias', 'mlp/Affine_0/Linear.weights',"
     " 'mlp/Affine_1/AddBias.bias'."),
    ("load_into", {"only": []}, errors.ArgumentError,
     "only=[] selects nothing, so nothing would be loaded; pass None (the default) for"
     " everything, or the labels to select."),
    ("BindOptions", {"only": ("mlp/Afine_1/*",)}, errors.UnknownLabelError,
     "only='mlp/Afine_1/*' matches no label of this checkpoint (labels are matched whole,"
     " as fnmatch globs). Close matches: 'mlp/Affine_1/', 'mlp/Affine_0/',"
     " 'mlp/Affine_1/AddBias.bias', 'mlp/Affine_1/Linear.weights',"
     " 'mlp/Affine_0/AddBias.bias'."),
    ("load_into", {"rename": {"^mpl/": "mlp/"}}, errors.UnknownLabelError,
     f"the rename= rule '^mpl/' matches no label of this checkpoint. {CLOSE}"),
    ("load_into", {"rename": [("^mlp/", "net/"), ("^mlp/", "mlp/")]}, errors.UnknownLabelError,
     "the rename= rule '^mlp/' matches no label of this checkpoint (as the rules before it"
     " renamed them). It has 4 labels (pz_persist.open(path).labels lists them)."),
    ("load_into", {"rename_axes": {"fetures": "features"}}, errors.UnknownLabelError,
     "rename_axes={'fetures': ...} names no axis of this checkpoint. Close matches:"
     " 'features', 'features_out'."),
    ("load_into", {"dtype": {"mpl/*": "bfloat16"}}, errors.UnknownLabelError,
     "the dtype= rule 'mpl/*' matches no label of this checkpoint (labels are matched whole,"
     f" as fnmatch globs). {CLOSE}"),
    ("BindOptions", {"dtype": {"*": "float32", "zzz": "bfloat16"}},
     errors.UnknownLabelError,
     "the dtype= rule 'zzz' matches no label of this checkpoint (labels are matched whole,"
     " as fnmatch globs). It has 4 labels (pz_persist.open(path).labels lists them)."),
]


def _call(entry: str, path: str, model, options):
  if entry == "load_into":
    return pzp.load_into(path, model, **options)
  return pzp.load_into(path, model, pzp.BindOptions(**options))


@pytest.mark.parametrize("entry,options,error,message", REFUSED,
                         ids=[f"{e}-{sorted(o)[0]}-{i}" for i, (e, o, _, _) in enumerate(REFUSED)])
def test_a_selector_matching_nothing_is_refused(saved, entry, options, error, message):
  model = model_zoo.mlp()
  before = _values(model)
  with pytest.raises(error) as raised:
    _call(entry, saved["native"], model, options)
  assert str(raised.value) == f"{saved['item']}: {message}"
  assert all(np.array_equal(a, b) for a, b in zip(_values(model), before))
  with pytest.raises(error):  # A handle for the path: the same rule.
    _call(entry, pzp.open(saved["native"]), model, options)


def test_dtype_rules_without_into_are_checked_too(saved):
  with pytest.raises(errors.UnknownLabelError) as raised:
    pzp.load_model(saved["native"], dtype={"mlp/Affine_0/*": "bfloat16", "mpl/*": "float16"})
  assert str(raised.value) == (
      f"{saved['native']}: the dtype= rule 'mpl/*' matches no label of this checkpoint"
      f" (labels are matched whole, as fnmatch globs). {CLOSE}")


def test_plain_orbax_checkpoints_refuse_the_same(saved):
  model = model_zoo.mlp()
  for options, match in (({"only": "mpl/*"}, r"only='mpl/\*' matches no label.*Close matches"),
                         ({"only": []}, r"only=\[\] selects nothing"),
                         ({"dtype": {"mpl/*": "bfloat16"}}, "the dtype= rule 'mpl/.*'")):
    with pytest.raises(errors.PzPersistError, match=match) as raised:
      pzp.load_into(saved["plain"], model, **options)
    assert "a plain Orbax checkpoint" in str(raised.value)
  pzp.load_into(saved["plain"], model, only="mlp/Affine_0/*", strict=False)  # Matches.


@pytest.mark.parametrize("only,message", [
    ("mlp/Afine_0", "no variable labelled 'mlp/Afine_0' in this checkpoint. Close matches:"
                    " 'mlp/Affine_0/', 'mlp/Affine_1/', 'mlp/Affine_0/AddBias.bias',"
                    " 'mlp/Affine_0/Linear.weights', 'mlp/Affine_1/AddBias.bias'."),
    (["mlp/Affine_0", "mlp/Affine_9"], "no variable labelled 'mlp/Affine_9' in this"
                                       " checkpoint. Close matches: 'mlp/Affine_1/',"
                                       " 'mlp/Affine_0/', 'mlp/Affine_1/AddBias.bias',"
                                       " 'mlp/Affine_0/AddBias.bias',"
                                       " 'mlp/Affine_1/Linear.weights'."),
    (lambda label: label.startswith("net/"), None),
    ([], "only=[] selects nothing, so nothing would be loaded; pass None (the default)"
         " for everything, or the labels to select."),
], ids=["prefix", "list", "predicate", "empty"])
def test_the_lazy_handle_refuses_the_same(saved, only, message):
  with pzp.open(saved["native"]) as ckpt:
    for read in (ckpt.select, ckpt.load, ckpt.nbytes_of):
      with pytest.raises((errors.UnknownLabelError, errors.ArgumentError)) as raised:
        read(only)
      if message is None:
        assert str(raised.value).startswith(f"{saved['item']}: the predicate only=<function")
        assert str(raised.value).endswith(
            "selects no label of this checkpoint. It has 4 labels (see .labels).")
      else:
        assert str(raised.value) == f"{saved['item']}: {message}"


def test_the_command_line_has_no_selector_to_check():
  """If a command gains one (--only, --rename...), it must come here."""
  parser = cli.build_parser()
  commands = next(a for a in parser._actions if a.dest == "command").choices  # pylint: disable=protected-access
  options = {option for sub in commands.values() for action in sub._actions  # pylint: disable=protected-access
             for option in action.option_strings}
  assert not {o for o in options if any(w in o for w in ("only", "rename", "select", "axes"))}


_LABELS = ["mlp/Affine_0/Linear.weights", "mlp/Affine_0/AddBias.bias",
           "mlp/Affine_1/Linear.weights", "mlp/Affine_1/AddBias.bias"]
_PIECES = st.sampled_from(["mlp", "mpl", "/", "Affine_", "0", "1", "2", "*", "?", ".", "Linear",
                           "weights", "AddBias", "bias", "[01]"])
_CUT = st.sampled_from(_LABELS).flatmap(
    lambda label: st.integers(0, len(label)).map(lambda at: label[:at] + "*"))
"""A label's beginning and ``*``: matches it (and perhaps others)."""
_TYPO = st.tuples(_CUT, st.integers(0, 20), st.sampled_from("xA/.")).map(
    lambda t: t[0][:t[1]] + t[2] + t[0][t[1] + 1:])
"""The same with one character changed: matches something or nothing."""
_GLOBS = st.lists(st.one_of(_CUT, _TYPO, st.lists(_PIECES, min_size=1, max_size=6).map("".join)),
                  min_size=1, max_size=3)


@hypothesis.settings(max_examples=80, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(globs=_GLOBS)
def test_only_loads_exactly_what_every_glob_matches_or_refuses(saved, globs):
  """Against fnmatch itself: refused (naming the first glob matching no label)
  exactly when one matches nothing; otherwise exactly the labels some glob
  matches are loaded, the others kept."""
  empty = [glob for glob in globs if not fnmatch.filter(_LABELS, glob)]
  hypothesis.event("refused" if empty else "loaded")
  model = model_zoo.mlp()
  if empty:
    with pytest.raises(errors.UnknownLabelError, match=re.escape(f"only={empty[0]!r} ")):
      pzp.load_into(saved["native"], model, only=globs)
    return
  _, report = pzp.load_into(saved["native"], model, only=globs, strict=False)
  assert set(report.loaded) == {label for label in _LABELS
                                if any(fnmatch.fnmatchcase(label, g) for g in globs)}
