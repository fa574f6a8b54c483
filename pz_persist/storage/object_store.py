"""Object stores (``gs://``, ``s3://``): the few operations pz_persist needs.

Why a module of its own: on an object store there is no rename, no lock and
no inode, so the local commit protocol (`pz_persist.storage.commit`) cannot
work there. What object stores do have is the conditional write: create an
object only if no object has that name (GCS ``ifGenerationMatch=0``, S3
``If-None-Match: *``), decided by the store itself, atomically. That is the
one primitive the object-store commit protocol
(`pz_persist.storage.object_commit`) is built on; this module gives it, and
the plain reads, listings and deletes around it, through fsspec (``gcsfs``,
``s3fs``), the libraries ``etils.epath`` and Orbax already use for these
paths. Arrays never go through here: they are written and read by Orbax's
array handler through TensorStore.

Only ``gs://`` and ``s3://`` are accepted (`check_supported`, called by
`pz_persist.storage.commit.as_path`, which every entry point goes through):
another scheme would be a store whose atomicity nobody here has checked.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import os
import urllib.parse
from typing import Any

from etils import epath

from pz_persist import errors

EXTRAS = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}
"""Scheme -> (the fsspec package it needs, the pz_persist extra installing it)."""


def scheme(path: epath.PathLike) -> str | None:
  """``"gs"`` / ``"s3"`` / another URL scheme of ``path``; None if local."""
  text = os.fspath(path)
  if "://" not in text:
    return None
  return text.split("://", 1)[0].lower()


def file_url_path(path: epath.PathLike) -> str | None:
  """The local path a ``file://`` URL names (``file:///runs/a`` is
  ``/runs/a``), which every entry point then treats as the local path it is;
  None if ``path`` is not a ``file://`` URL.

  Raises:
    UnsupportedStorageError: the URL names a host (``file://server/...``).
  """
  if scheme(path) != "file":
    return None
  rest = os.fspath(path).split("://", 1)[1]
  host, slash, local = rest.partition("/")
  if host not in ("", "localhost"):
    raise errors.UnsupportedStorageError(
        f"{os.fspath(path)}: a file:// URL on host {host!r}; pz_persist reads"
        " file:// URLs as local paths only (file:///path). Mount it and pass"
        " the local path."
    )
  return urllib.parse.unquote(slash + local)


def is_object_store(path: epath.PathLike) -> bool:
  """Whether ``path`` is on an object store pz_persist supports."""
  return scheme(path) in EXTRAS


def check_supported(path: epath.PathLike) -> None:
  """Refuses a URL pz_persist cannot keep a checkpoint whole on.

  Every path reaches here (`pz_persist.storage.commit.as_path`, and
  `filesystem` before any request), so this is the one place an object-store
  URL is held to the one spelling that names the same objects for every
  library touching it (`check_url`).

  Raises:
    UnsupportedStorageError: a scheme other than ``gs://`` / ``s3://``, or a
      URL `check_url` refuses.
    MissingExtraError: the fsspec package of the scheme is not installed
      (names the ``pip install 'pz-persist[...]'`` that fixes it).
  """
  kind = scheme(path)
  if kind is None:
    return
  if kind == "file":
    file_url_path(path)  # Local: refused only if it names another host.
    return
  if kind not in EXTRAS:
    raise errors.UnsupportedStorageError(
        f"{os.fspath(path)}: pz_persist saves and loads on local disks, gs://"
        f" and s3:// only; {kind}:// is not supported, since a checkpoint"
        " there could not be published atomically. Copy it to a local path"
        " or one of those stores."
    )
  check_url(os.fspath(path))
  _fsspec_module(kind, os.fspath(path))


_URL_SPECIAL = "%?#\\"
"""Characters one library takes literally and another decodes or cuts at."""


def check_url(text: str) -> None:
  """Refuses an object-store URL whose objects depend on who reads it.

  Why refuse rather than tidy: the same string reaches three libraries.
  ``etils.epath`` (Orbax's paths) drops ``.`` and empty segments but keeps
  ``..``; fsspec (commit objects, manifests, listings) keeps ``..`` as a
  literal key part; TensorStore (the arrays) resolves it, and parses URLs
  (``%``, ``?``, ``#``). So ``s3://b/p/a/../ck`` put the arrays under
  ``b/p/ck`` and the rest under ``b/p/a/../ck``: a save reporting success
  that no load could read. Epath's own mapping is no refuge either: it
  raises a bare ``KeyError`` for ``S3://``. Only the
  one spelling all three agree on is accepted: a lower-case scheme, a
  bucket, then non-empty segments other than ``.`` and ``..``, without
  ``%``, ``?``, ``#`` or ``\\``; one trailing ``/`` is allowed (every
  library drops it).

  Raises:
    UnsupportedStorageError: naming the URL, what is wrong, and the spelling
      to use instead.
  """
  kind, rest = text.split("://", 1)
  problem = None
  if kind != kind.lower():
    problem = f"the scheme must be written in lower case ({kind.lower()}://)"
  elif any(c in rest for c in _URL_SPECIAL):
    problem = (
        "'%', '?', '#' and '\\' are decoded or cut at by some of the libraries"
        " reading it and taken literally by others"
    )
  else:
    segments = rest[:-1].split("/") if rest.endswith("/") else rest.split("/")
    if not segments[0]:
      problem = "it names no bucket (nothing between :// and the next /)"
    elif any(s in ("", ".", "..") for s in segments):
      problem = (
          "empty, '.' and '..' segments are resolved by some of the libraries"
          " reading it and taken literally by others, so arrays and commit"
          " objects would land under different prefixes"
      )
  if problem is not None:
    raise errors.UnsupportedStorageError(
        f"{text}: not an object-store path pz_persist can use: {problem}. Write"
        f" it as {kind.lower()}://BUCKET/FOLDER/NAME, each segment a plain name."
    )


def _fsspec_module(kind: str, shown: str) -> Any:
  package, extra = EXTRAS[kind]
  try:
    return importlib.import_module(package)
  except ImportError as e:
    raise errors.MissingExtraError(
        f"{shown}: {kind}:// paths need the {package} package, which is not"
        f" installed ({e}). Install it with: pip install 'pz-persist[{extra}]'"
    ) from None


def filesystem(path: epath.PathLike) -> Any:
  """The fsspec filesystem of ``path`` (cached by fsspec, as epath's is)."""
  import fsspec  # pylint: disable=import-outside-toplevel

  check_supported(path)
  kind = scheme(path)
  assert kind is not None
  return fsspec.filesystem(kind)


def key(path: epath.PathLike) -> str:
  """``bucket/name`` of ``path``, as fsspec names objects."""
  return os.fspath(path).split("://", 1)[1].rstrip("/")


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
  """What the store says of one object.

  Attributes:
    size: Bytes.
    generation: GCS's generation, or S3's ETag (plus version id where the
      bucket keeps versions): changes whenever the object is written again.
    checksums: The store's own checksums of the content, by name:
      ``crc32c`` / ``md5`` (GCS, raw bytes) or ``md5`` (an S3 ETag of a
      single-part upload). Empty where the store keeps none usable.
  """

  size: int
  generation: str
  checksums: dict[str, bytes]


def info(path: epath.PathLike) -> ObjectInfo | None:
  """`ObjectInfo` of the object at ``path``; None if there is none."""
  fs = filesystem(path)
  fs.invalidate_cache(key(path))  # fsspec answers from old listings otherwise.
  try:
    raw = fs.info(key(path))
  except FileNotFoundError:
    return None
  if raw.get("type") == "directory":
    return None
  return _object_info(raw)


def _object_info(raw: dict[str, Any]) -> ObjectInfo:
  checksums: dict[str, bytes] = {}
  if "generation" in raw:  # GCS
    generation = str(raw["generation"])
    for name, field in (("crc32c", "crc32c"), ("md5", "md5Hash")):
      if raw.get(field):
        checksums[name] = base64.b64decode(raw[field])
  else:  # S3
    etag = str(raw.get("ETag", raw.get("etag", ""))).strip('"')
    generation = f"{etag}:{raw.get('VersionId') or ''}"
    if etag and "-" not in etag:  # A multipart ETag is not an MD5.
      checksums["md5"] = bytes.fromhex(etag)
  return ObjectInfo(int(raw.get("size", 0)), generation, checksums)


def create_if_absent(path: epath.PathLike, data: bytes) -> bool:
  """Writes ``data`` at ``path`` only if no object is there; False if one is.

  The store decides, atomically: of any number of concurrent calls for one
  name, exactly one returns True.
  """
  fs = filesystem(path)
  try:
    fs.pipe_file(key(path), data, mode="create")
  except FileExistsError:
    return False
  return True


def write(path: epath.PathLike, data: bytes) -> None:
  """Writes the object ``path`` in one request (objects appear whole)."""
  filesystem(path).pipe_file(key(path), data)


def read(path: epath.PathLike, limit: int) -> bytes:
  """The bytes of the object ``path``; at most ``limit + 1`` are read.

  Raises:
    FileNotFoundError: no such object.
  """
  fs = filesystem(path)
  fs.invalidate_cache(key(path))  # Not an old listing's size: one ranged GET.
  return fs.cat_file(key(path), start=0, end=limit + 1)


def names(directory: epath.PathLike, prefix: str = "") -> list[str]:
  """Names directly inside ``directory`` starting with ``prefix`` (objects
  and "directories"), in one listing, never cached (another process may have
  written since)."""
  fs = filesystem(directory)
  base = key(directory)
  try:
    entries = fs.ls(base, detail=False, refresh=True)
  except FileNotFoundError:
    return []
  found = []
  for entry in entries:
    name = entry.rstrip("/").rsplit("/", 1)[-1]
    if name.startswith(prefix) and entry.rstrip("/") != base:
      found.append(name)
  return sorted(found)


def remove(path: epath.PathLike) -> None:
  """Deletes the object or the tree of objects at ``path``; missing is fine."""
  fs = filesystem(path)
  try:
    fs.rm(key(path), recursive=True)
  except FileNotFoundError:
    pass
  fs.invalidate_cache()


def tree(directory: epath.PathLike) -> dict[str, ObjectInfo]:
  """Every object under ``directory``, by its name relative to it, with what
  the store says of it (size, generation, checksums): one listing (paged by
  the store), never cached, no request per object."""
  fs = filesystem(directory)
  base = key(directory)
  fs.invalidate_cache()  # Another process may have written since.
  try:
    found = fs.find(base, detail=True)
  except FileNotFoundError:
    return {}
  return {
      name[len(base) + 1:]: _object_info(raw) for name, raw in found.items()
      if name.startswith(base + "/") and raw.get("type") != "directory"
  }
