"""What Orbax says is stored, checked against what the manifest promises.

Why: TensorStore allocates each array (and decodes each chunk whole) as its
metadata declares, before reading a byte. An array whose stored shape, dtype
or chunk differs from the manifest's is refused here, by label, before Orbax
or a direct read allocates anything for it.
"""


from __future__ import annotations

from collections.abc import Collection
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
from etils import epath

from pz_persist import errors


def read_stored_metadata(handler: Any, directory: epath.Path) -> dict[str, Any]:
  """What Orbax says it stored: ``{key: metadata with .shape and .dtype}``.

  Why: Orbax's metadata (``_METADATA`` and TensorStore's per-array metadata)
  is what TensorStore will trust when it allocates; reading it costs no array
  data, so it can be checked against the manifest first.

  Args:
    handler: The ``ocp.PyTreeCheckpointHandler`` that wrote the arrays.
    directory: The item directory.

  Raises:
    IntegrityError: the metadata is missing or unreadable; the message names
      ``_METADATA`` and TensorStore's own words, which name the file it
      failed on (the files are damaged or incomplete, as for array data).
    ManifestError: the metadata is not what pz_persist writes.
  """
  try:
    tree = handler.metadata(directory).tree
  except (KeyboardInterrupt, MemoryError):
    raise
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise unreadable_stored_metadata(directory, e) from None
  if not isinstance(tree, Mapping):
    raise errors.ManifestError(
        f"{directory / '_METADATA'}: Orbax's metadata is not a flat dict of"
        " arrays, as pz_persist writes it."
    )
  return dict(tree)


def unreadable_stored_metadata(
    directory: epath.Path, error: Exception
) -> errors.IntegrityError:
  """The error for Orbax metadata that cannot be read, naming ``_METADATA``
  and the first line of the reader's own words."""
  detail = (str(error).strip().splitlines() or [""])[0][:400]
  return errors.IntegrityError(
      f"{directory}: Orbax's metadata of the stored arrays (_METADATA, and"
      " TensorStore's per-array metadata in the array files) cannot be"
      f" read; the checkpoint's files are damaged or incomplete"
      f" ({type(error).__name__}: {detail})",
      damaged=(f"{directory / '_METADATA'}: cannot be read",),
  )


def check_stored_metadata(
    specs: Collection[Any], stored: Mapping[str, Any], *, where: str
) -> None:
  """Refuses arrays whose stored shape or dtype differs from the manifest's.

  Why: TensorStore reads (and allocates) what Orbax's metadata declares, not
  what the manifest says; if the two disagree the checkpoint is damaged or
  forged, for instance a tiny file declaring a huge shape. Checking before the
  read means no such array is ever allocated.

  Raises:
    ManifestError: naming the label, tree path and both shapes and dtypes.
  """
  for spec in specs:
    if spec.key not in stored:
      raise errors.ManifestError(
          f"{where}: the array of {spec.describe()} (key {spec.key}) is"
          " missing from Orbax's metadata."
      )
    meta = stored[spec.key]
    shape: Any = getattr(meta, "shape", None)  # Unchecked: None fails below.
    dtype = getattr(meta, "dtype", None)
    try:
      found = (tuple(int(d) for d in shape), _dtype(dtype))
    except (TypeError, ValueError):
      found = None
    if found is None or found != (spec.shape, spec.storage_dtype):
      stored_text = f"{found[1]}{list(found[0])}" if found else f"{meta!r:.80}"
      raise errors.ManifestError(
          f"{where}: {spec.describe()} (key {spec.key}) should be"
          f" {spec.storage_dtype}{list(spec.shape)} by the manifest, but the"
          f" stored array is {stored_text}."
      )
    _check_chunk_shape(spec, meta, where=where)


def _check_chunk_shape(spec: Any, meta: Any, *, where: str) -> None:
  """Refuses a stored chunk larger than its array.

  Why: TensorStore decodes a chunk whole, allocating the chunk shape Orbax's
  metadata declares, whatever the array's shape: a ``[4, 2]`` array whose
  ``.zarray`` declares chunks of ``[2**20, 2**20]`` aborts the interpreter.
  Orbax and pz_persist never write a chunk beyond the array (a dimension of
  size 0 is stored in chunks of 1), so anything larger is forged or damaged.
  """
  storage = getattr(meta, "storage", None)
  chunks = getattr(storage, "chunk_shape", None)
  if chunks is None:
    return
  try:
    chunk_shape = tuple(int(d) for d in chunks)
  except (TypeError, ValueError):
    chunk_shape = None
  fits = chunk_shape is not None and len(chunk_shape) == len(spec.shape) and all(
      0 < c <= max(d, 1) for c, d in zip(chunk_shape, spec.shape)
  )
  if not fits:
    raise errors.UnsafeCheckpointError(
        f"{where}: {spec.describe()} (key {spec.key}) is stored in chunks of"
        f" {list(chunks)!r:.80}, which do not fit its shape {list(spec.shape)};"
        " reading it would allocate the whole chunk. The checkpoint is"
        " damaged or forged."
    )


def _dtype(dtype: npt.DTypeLike | None) -> np.dtype:
  if dtype is None:
    raise ValueError("no dtype")
  return np.dtype(dtype)
