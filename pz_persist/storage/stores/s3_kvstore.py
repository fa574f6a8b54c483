"""``s3://`` for Orbax's array handler: the TensorStore S3 kvstore spec.

Why this module exists: Orbax (0.12.x) writes and reads arrays through
TensorStore, and its one spec builder
(``build_kvstore_tspec``, private to Orbax; `orbax_seam` holds the wrap)
knows ``gs://`` and local paths only. An ``s3://bucket/ck`` directory is
normalised to the relative path ``s3:/bucket/ck`` and refused ("Checkpoint
path should be absolute"), or, without OCDBT, silently turned into a local
``file`` spec. TensorStore itself has an ``s3`` kvstore driver; Orbax just
never builds its spec.

`enable_orbax_s3` wraps that one builder: for an ``s3://`` directory it asks
Orbax's own builder for the spec of the same path spelled ``gs://`` (under a
placeholder bucket, so S3 bucket names GCS would reject still pass), then
swaps every GCS base spec in the result for the S3 one. Everything else Orbax
decides (the OCDBT config, write options, target data file size, read
coalescing, per-process subdirectories, temporary metadata layers) is kept as
Orbax builds it for an object store. Any other path goes to Orbax's builder
untouched, so nothing changes for local or ``gs://`` checkpoints. Every Orbax
caller (the v0 and v1 array handlers, OCDBT merges, string leaves) reaches
the builder through the module attribute, so this one wrap covers saves and
restores alike; nothing else in Orbax needs an ``s3://`` patch for arrays
(the rest of its path handling goes through ``etils.epath``, which reaches
S3 through ``s3fs``).

Drop this module when Orbax builds S3 specs itself: `enable_orbax_s3` then
finds nothing to do (see `_orbax_knows_s3`).

Atomicity needs the same treatment. Orbax picks how a checkpoint is
published by path: ``gs://`` gets `CommitFileTemporaryPath` (write in place,
then ``commit_success.txt``; a step counts as finished only with that file),
every other path `AtomicRenameTemporaryPath` (write a ``*.orbax-checkpoint-tmp``
folder, then rename it). S3 has no rename: ``s3fs`` copies every object, and
with the ``etils`` Orbax 0.12 uses, it then fails on the folder itself (``NoSuchKey``),
leaving both copies and the save failed. So `enable_orbax_s3` also wraps
Orbax's two default-class functions
(``ocp.path.atomicity_defaults``) to answer for ``s3://`` what
they answer for ``gs://``; an explicit ``temporary_path_class`` or
``AtomicityOptions`` still wins, as on GCS. pz_persist's own saves pass
``temporary_path_class`` (`pz_persist.storage.lifecycle.steps.temporary_path_class`,
Orbax's public hook), so only Orbax's own entry points need these two wraps.
Every wrap goes through `pz_persist.storage.orbax_seam`, which holds each
wrapped function's contract.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any

from etils import epath

from pz_persist.storage import orbax_seam

_PLACEHOLDER_BUCKET = "pz-persist-s3-placeholder"
"""The bucket Orbax's builder is shown in place of the S3 one: a valid GCS
bucket name, so Orbax's spec resolution never warns about an S3 name."""

_PLACEHOLDER_URL = f"gs://{_PLACEHOLDER_BUCKET}"

_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""Where the endpoint comes from, first set wins: the variables botocore and
s3fs read too, so one setting points arrays and pz_persist's own objects at
the same store (MinIO, moto, R2, ...)."""

_REGION_VARIABLES = ("AWS_REGION", "AWS_DEFAULT_REGION")

_LOCK = threading.Lock()


def enable_orbax_s3() -> None:
  """Lets Orbax's array handler write and read ``s3://`` checkpoints.

  Plain Orbax (0.12.x) refuses every ``s3://`` path ("Checkpoint path should be
  absolute"); after this call its TensorStore spec builder gives S3 paths the
  TensorStore ``s3`` kvstore driver, with the endpoint from
  ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` and the region from
  ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` where set (read at each spec, so a
  later change of the environment counts). Credentials are TensorStore's
  usual AWS chain (environment, ``~/.aws``, instance metadata). And Orbax
  publishes ``s3://`` checkpoints as it does ``gs://`` ones, in place with a
  ``commit_success.txt`` (its default, a folder rename, fails on S3), which is
  also how a `CheckpointManager` there tells finished steps. Local and
  ``gs://`` paths get exactly what Orbax gives them.

  This changes process-wide Orbax functions, which pz_persist never does
  behind a user's back: plain Orbax users call it themselves, once in every
  process (on a cluster, each process builds its own specs); pz_persist
  calls it the first time it is handed an ``s3://`` path (handing it one is
  the opt-in; since Orbax otherwise refuses every ``s3://`` array and fails
  to publish any ``s3://`` checkpoint by default, no working behaviour
  changes).
  Calling it again does nothing; `disable_orbax_s3` undoes it.

  Needs ``s3fs`` for the non-array files Orbax writes through ``etils.epath``:
  ``pip install 'pz-persist[s3]'``.

  Example::

    import numpy as np
    import orbax.checkpoint as ocp
    import pz_persist as pzp

    pzp.enable_orbax_s3()  # Once per process, before the first s3:// save.
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save("s3://my-bucket/run1/ck", {"w": np.ones(3)})
      restored = checkpointer.restore("s3://my-bucket/run1/ck")
  """
  with _LOCK:  # Two threads' first s3:// saves must not wrap twice.
    if is_enabled() or _orbax_knows_s3():
      return
    for name, teach in _PATCHES:
      orbax_seam.wrap(name, teach)


def disable_orbax_s3() -> None:
  """Undoes `enable_orbax_s3`: Orbax's own functions are back.

  Does nothing if it was not enabled. A function something else has wrapped
  since is left alone (undoing it would remove that wrap too).
  """
  with _LOCK:
    for name, _ in _PATCHES:
      orbax_seam.unwrap(name)


def is_enabled() -> bool:
  """Whether `enable_orbax_s3` has wrapped Orbax's functions."""
  return orbax_seam.is_wrapped("build_kvstore_tspec")


def enable_for(path: epath.PathLike) -> None:
  """`enable_orbax_s3` if ``path`` is an ``s3://`` path; nothing otherwise.

  What pz_persist's entry points call on every path they are handed, so the
  registration happens exactly when a user first names an S3 checkpoint.
  """
  if _is_s3(path):
    enable_orbax_s3()


def _is_s3(path: epath.PathLike) -> bool:
  """Whether ``path`` is an ``s3://`` URL (Orbax hands these wrappers every
  path it builds a spec for; `stores.s3.S3Store` is what installs them)."""
  text = os.fspath(path)
  return "://" in text and text.split("://", 1)[0].lower() == "s3"


def s3_spec(url: str) -> dict[str, Any]:
  """The TensorStore ``s3`` kvstore spec of the object or prefix ``url``.

  The path keeps no trailing slash, as Orbax's GCS specs (callers that need
  one, such as kvstack layers, add it).
  """
  bucket, _, key = url.split("://", 1)[1].partition("/")
  spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key}
  endpoint = _first_set(_ENDPOINT_VARIABLES)
  if endpoint:
    spec["endpoint"] = endpoint
  region = _first_set(_REGION_VARIABLES)
  if region:
    spec["aws_region"] = region
  return spec


def _first_set(names: tuple[str, ...]) -> str | None:
  for name in names:
    if os.environ.get(name):
      return os.environ[name]
  return None


def _with_s3(original: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
  """Orbax's builder ``original``, taught ``s3://`` directories."""

  @functools.wraps(original)
  def build_kvstore_tspec(directory: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    text = os.fspath(directory)
    if not _is_s3(text):
      return original(directory, *args, **kwargs)
    bucket, _, key = text.split("://", 1)[1].partition("/")
    # Orbax normalises the key (os.path.normpath) as it does for gs:// paths.
    spec = original(f"{_PLACEHOLDER_URL}/{key}", *args, **kwargs)
    return _swap_gcs_for_s3(spec, bucket)

  return build_kvstore_tspec


def _swap_gcs_for_s3(spec: Any, bucket: str) -> Any:
  """``spec`` with every GCS base under the placeholder bucket made S3.

  Orbax's specs name the GCS base as a dict (``{"driver": "gcs", "bucket":
  ..., "path": ...}``) or, in some layers, as a URL string (``gs://...``);
  both are replaced, at any depth (OCDBT's ``base``, ``manifest``, kvstack
  layers).
  """
  if isinstance(spec, dict):
    if spec.get("driver") in ("gcs", "gcs_grpc") and spec.get("bucket") == _PLACEHOLDER_BUCKET:
      extra = {k: v for k, v in spec.items() if k not in ("driver", "bucket", "path")}
      return {**s3_spec(f"s3://{bucket}/{spec.get('path', '')}"), **extra}
    return {k: _swap_gcs_for_s3(v, bucket) for k, v in spec.items()}
  if isinstance(spec, list):
    return [_swap_gcs_for_s3(item, bucket) for item in spec]
  if isinstance(spec, str) and spec.startswith(f"{_PLACEHOLDER_URL}/"):
    return s3_spec(f"s3://{bucket}/{spec.removeprefix(_PLACEHOLDER_URL + '/')}")
  if spec == _PLACEHOLDER_URL:
    return s3_spec(f"s3://{bucket}/")
  return spec


def _as_gcs(path: Any) -> Any:
  """``path`` spelled ``gs://`` (under the placeholder bucket) if it is S3."""
  text = os.fspath(path)
  if not _is_s3(text):
    return path
  return epath.Path(f"{_PLACEHOLDER_URL}/{text.split('://', 1)[1]}")


def _with_s3_as_gcs(original: Callable[..., Any]) -> Callable[..., Any]:
  """An Orbax function of a path, answering for ``s3://`` what it does for
  ``gs://`` (only for functions whose answer does not contain the path)."""

  @functools.wraps(original)
  def answer(path: Any, *args: Any, **kwargs: Any) -> Any:
    return original(_as_gcs(path), *args, **kwargs)

  return answer


_PATCHES: tuple[tuple[str, Callable[..., Callable[..., Any]]], ...] = (
    ("build_kvstore_tspec", _with_s3),
    ("get_default_temporary_path_class", _with_s3_as_gcs),
    ("get_item_default_temporary_path_class", _with_s3_as_gcs),
)
"""Every Orbax function `enable_orbax_s3` wraps (through `orbax_seam`, which
says where each lives): (name, wrapper)."""


def _orbax_knows_s3() -> bool:
  """Whether this Orbax already builds S3 specs (then there is nothing to do)."""
  try:
    spec = orbax_seam.orbax_function("build_kvstore_tspec")("s3://bucket/probe", use_ocdbt=False)
  except ValueError:
    return False
  return isinstance(spec, dict) and spec.get("driver") == "s3"
