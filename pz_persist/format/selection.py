"""Selectors must select something: the one error, with close matches.

Why one module: an option naming labels or axes that matches none of them
(``load_into(path, model, only="mpl/*")``, a typo) used to load nothing and
say nothing, returning the fresh model as if loaded. Every selector (a
label, a prefix, a glob, a regex rule, a predicate, an axis name) of every
entry point (`pz_persist.open`'s ``select``/``load``, ``load_into``,
``load_into``, plain Orbax checkpoints, ``dtype=`` rules) now
refuses, pattern by pattern, what matches nothing, with the error built
here: what was asked, where, and the closest names the checkpoint has.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

from pz_persist import errors

_SYNTAX = re.compile(r"[\^$*?+()\[\]{}|\\]")
"""Glob and regex syntax, dropped from a pattern before it is compared with
names (``mpl/*`` is compared as ``mpl/``)."""


def close_matches(wanted: str, names: Sequence[str], n: int = 5) -> list[str]:
  """The names (or groups of them: each name's beginnings up to a ``/``,
  ``mlp/``, ``mlp/Affine_0/``) most like ``wanted``, best first."""
  text = _SYNTAX.sub("", wanted)
  candidates = dict.fromkeys(names)
  for name in names:
    for at, char in enumerate(name[:-1]):
      if char == "/":
        candidates.setdefault(name[: at + 1])
  return difflib.get_close_matches(text, list(candidates), n=n, cutoff=0.5)


def unmatched(
    where: str, what: str, wanted: str, names: Sequence[str], *, noun: str = "labels",
    listed_by: str = "",
) -> errors.UnknownLabelError:
  """The error for a selector ``what`` (``"only='mpl/*' matches no label"``)
  that matches none of ``names``: ``where``, ``what``, then the names most
  like ``wanted`` or, if none is close, how many there are (``listed_by``:
  where to see them).

  Example message::

    /ck/penzai: only='mpl/*' matches no label of this checkpoint, so it would
    load nothing. Close matches: 'mlp/', 'mlp/Affine_0/'.
  """
  close = close_matches(wanted, names)
  hint = (f" Close matches: {', '.join(repr(name) for name in close)}." if close
          else f" It has {len(names)} {noun}{listed_by}.")
  return errors.UnknownLabelError(f"{where}: {what}.{hint}")


def empty(where: str, option: str) -> errors.ArgumentError:
  """The error for a selector with no pattern at all (``only=[]``)."""
  return errors.ArgumentError(
      f"{where}: {option}=[] selects nothing, so nothing would be loaded; pass"
      f" None (the default) for everything, or the labels to select."
  )
