"""How much one load may allocate, as a setting scoped to a block of code.

Why this module exists: an array entry, or the Orbax metadata beside it,
declares a shape, and TensorStore allocates what is declared before it reads
a byte, so a few bytes of JSON can ask for terabytes. `check_allocation`
refuses a read whose arrays could not fit before anything is allocated. The
cap is the machine's memory unless a `limits` block says otherwise, for that
block, thread and task only (``contextvars``): a limit is a decision about
one load, not about the process.
"""


from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import numbers
import os
import sys
import warnings
from collections.abc import Collection
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any
from typing import Protocol

from pz_persist import errors


@dataclasses.dataclass(frozen=True)
class Limits:
  """Limits of the loads made in the current context (see `limits`).

  Attributes:
    max_allocation_bytes: Most bytes one load may allocate for arrays; None
      (the default) means the machine's physical memory. A checkpoint
      declaring more is refused before anything is allocated.
  """

  max_allocation_bytes: int | None = None


_DEFAULTS = Limits()  # Frozen: one shared instance is safe as the default.
_limits: contextvars.ContextVar[Limits] = contextvars.ContextVar(
    "pz_persist_limits", default=_DEFAULTS
)
_UNSET: Any = object()


class DescribedArray(Protocol):
  """What `check_allocation` names of an array (a manifest's ``ArraySpec``,
  which sits above this module)."""

  @property
  def key(self) -> str: ...

  @property
  def dtype(self) -> object: ...  # A name or a NumPy dtype: only printed.

  @property
  def shape(self) -> tuple[int, ...]: ...

  def describe(self) -> str: ...


@contextlib.contextmanager
def limits(*, max_allocation_bytes: int | None = _UNSET) -> Iterator[Limits]:
  """Sets load limits for the ``with`` block, in this thread or task only.

  Why a context and not a module setting: a limit is a decision about one
  load (a big model onto devices with more memory than the host), and a
  global changed for it would also apply to every other load of the process,
  in other threads too, until someone remembers to set it back. Like
  ``allow_modules=``, the setting is scoped: it holds inside the block (and
  in code it calls), nested blocks override the settings they name, and
  other threads and asyncio tasks keep their own (``contextvars``).

  Example::

    with pzp.limits(max_allocation_bytes=200 * 2**30):
      params = pzp.load(path, sharding=rules)

  Args:
    max_allocation_bytes: Most bytes one load may allocate for arrays; None
      means the machine's physical memory (the default). Omitted: unchanged.

  Yields:
    The `Limits` in force inside the block.

  Raises:
    ValueError: ``max_allocation_bytes`` is not a positive int or None.
  """
  changes = {}
  if max_allocation_bytes is not _UNSET:
    if max_allocation_bytes is not None and (
        isinstance(max_allocation_bytes, bool)
        or not isinstance(max_allocation_bytes, int)
        or max_allocation_bytes <= 0
    ):
      raise ValueError(
          "max_allocation_bytes must be a positive number of bytes or None"
          f" (the machine's memory), not {max_allocation_bytes!r}."
      )
    changes["max_allocation_bytes"] = max_allocation_bytes
  inside = dataclasses.replace(_limits.get(), **changes)
  token = _limits.set(inside)
  try:
    yield inside
  finally:
    _limits.reset(token)

def allocation_limit() -> int:
  """The ``max_allocation_bytes`` of `limits`, or the machine's physical
  memory by default.

  Why: no load can succeed that needs more memory than the machine has, so a
  checkpoint declaring more is either damaged or an attempt to exhaust memory.
  """
  scoped = _limits.get().max_allocation_bytes
  if scoped is not None:
    return scoped
  deprecated = _package_setting()
  if deprecated is not None:
    warnings.warn(
        "pz_persist.safety.MAX_ALLOCATION_BYTES is deprecated and will be"
        " ignored in the next release; use"
        " `with pz_persist.limits(max_allocation_bytes=...):` around the load.",
        DeprecationWarning, stacklevel=2,
    )
    return deprecated
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (AttributeError, ValueError, OSError):
    return 2**50  # Unknown platform: only absurd sizes are refused.


def _package_setting() -> int | None:
  """``pz_persist.safety.MAX_ALLOCATION_BYTES``, the deprecated global, read
  from the package where users set it (imported by then: this is its module)."""
  return sys.modules["pz_persist.safety"].MAX_ALLOCATION_BYTES


def check_allocation(
    specs: Collection[DescribedArray], sizes: Mapping[str, int], *, where: str,
    limit: int | None = None,
) -> None:
  """Refuses to read arrays whose bytes would exceed the allocation limit.

  Why: shapes come from the checkpoint, and reading allocates them in full
  before a byte is read; ``[2**31, 2**31]`` costs a few bytes of JSON.

  Args:
    specs: The manifest's `ArraySpec` entries of the arrays to read.
    sizes: Bytes this process allocates for each, by storage key.
    where: The item directory, for messages.
    limit: Defaults to `allocation_limit`.

  Raises:
    UnsafeCheckpointError: naming the largest arrays and the total.
  """
  limit = allocation_limit() if limit is None else limit
  given: Mapping[str, object] = sizes  # From a loader: checked, not trusted.
  for key, size in given.items():  # A negative size would hide others' bytes from the sum.
    if not isinstance(size, numbers.Integral) or size < 0:
      raise errors.UnsafeCheckpointError(
          f"{where}: array {key!r} would allocate {size!r} bytes, not a count of bytes"
          " (a negative or non-integer size comes from a damaged shape); refusing to read it."
      )
  total = sum(sizes.values())
  if total <= limit:
    return
  largest = sorted(specs, key=lambda s: sizes.get(s.key, 0), reverse=True)[:3]
  named = "; ".join(
      f"{s.describe()}: {s.dtype}{list(s.shape)}, {sizes.get(s.key, 0)} bytes"
      for s in largest
  )
  raise errors.UnsafeCheckpointError(
      f"{where}: reading these arrays would allocate {total} bytes, more than"
      f" the {limit}-byte limit (this machine's memory unless raised with"
      " `with pz_persist.limits(max_allocation_bytes=...):` around the"
      f" load). Largest: {named}."
  )


