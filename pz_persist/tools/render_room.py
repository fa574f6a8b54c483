"""Room on the stack for treescope to render a tree as deep as the format allows.

Why this module exists: treescope renders an object recursively, about
twenty-five Python frames for each level of a Penzai model, so a checkpoint
nested as deep as a manifest may be (`pz_persist.format.nodes.MAX_DEPTH`
levels: it loads) passes Python's default recursion limit of 1,000 frames
and `render_html` would fail with ``RecursionError`` on a valid checkpoint.
Treescope's walk cannot be made iterative from outside, so `room` raises
the limit, only as far as such a tree needs, only while the rendering runs,
and sets it back afterwards unless something else changed it meanwhile.
The diff's own tree is flattened below a fixed depth instead
(`pz_persist.tools.diff_view`) and needs no room.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator

from pz_persist.format import nodes

FRAMES_PER_LEVEL = 32
"""Python frames treescope may use for one level of a tree (measured: about
25 for a ``Sequential``, a list or a dict; the tests render each kind at the
format's limit under the default recursion limit)."""

MARGIN = 200
"""Frames left for what the rendering calls at its deepest (NumPy, JAX)."""

_lock = threading.Lock()
_active = 0
_before: int | None = None
_ours: int | None = None


def needed(levels: int = nodes.MAX_DEPTH) -> int:
  """The recursion limit that rendering ``levels`` levels from here needs."""
  depth = 0
  frame: types.FrameType | None = sys._getframe()  # pylint: disable=protected-access
  while frame is not None:
    depth, frame = depth + 1, frame.f_back
  return depth + levels * FRAMES_PER_LEVEL + MARGIN


@contextlib.contextmanager
def room(levels: int = nodes.MAX_DEPTH) -> Iterator[None]:
  """Lets the block recurse through ``levels`` levels of treescope rendering.

  The limit is only ever raised, never lowered, and is put back when the
  last block using it ends, if it still is what this module set.
  """
  global _active, _before, _ours  # pylint: disable=global-statement
  wanted = needed(levels)
  with _lock:
    if _active == 0:
      _before, _ours = sys.getrecursionlimit(), None
    _active += 1
    if sys.getrecursionlimit() < wanted:
      sys.setrecursionlimit(wanted)
      _ours = wanted
  try:
    yield
  finally:
    with _lock:
      _active -= 1
      if _active == 0 and _ours is not None and _before is not None and (
          sys.getrecursionlimit() == _ours):
        sys.setrecursionlimit(_before)
