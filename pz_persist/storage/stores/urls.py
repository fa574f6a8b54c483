"""Reading a path's kind from its spelling: the scheme, and URL checks.

Why apart from the stores: choosing a store (`stores.for_path`) needs the
scheme before any store exists, and every object store holds its URLs to the
same one spelling (`check_url`).
"""

from __future__ import annotations

import os
import urllib.parse

from etils import epath

from pz_persist import errors


def scheme(path: epath.PathLike) -> str | None:
  """``"gs"`` / ``"s3"`` / another URL scheme of ``path``; None if local.

  Every entry point asks this of its path first (`stores.for_path`), so a
  path of the wrong type, a NUL, and a local path no file system can hold
  are refused here, once, for all of them (`check_no_nul`,
  `check_local_length`).

  Raises:
    ArgumentTypeError: ``path`` is not a ``str`` or a path object naming
      one (``None``, a number, ``bytes``).
    ArgumentError: ``path`` holds a NUL, or is a local path too long.
  """
  try:
    text = os.fspath(path)
  except TypeError:
    text = None
  if type(text) is not str:
    raise errors.ArgumentTypeError(
        f"{path!r:.100}: a path must be a str or a path object (pathlib.Path,"
        f" etils.epath.Path), not {type(path).__name__}."
    )
  check_no_nul(text, text)
  if "://" not in text:
    check_local_length(text, text)
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
  decoded = urllib.parse.unquote(slash + local)
  check_no_nul(decoded, os.fspath(path))
  check_local_length(decoded, os.fspath(path))
  return decoded


NAME_MAX = 255
"""Bytes in one name of a folder or file: Linux's limit for every file system
it mounts (and macOS's), so no longer name can exist or be created."""

PATH_MAX = 4096
"""Bytes in a path handed to the system (Linux's ``PATH_MAX``)."""

MAX_FOLDERS = 256
"""Folders a local path may nest: far past any checkpoint's, and under the
interpreter's recursion limit that creating missing folders one inside
another (``os.makedirs``) runs into at about 1,000."""


def check_local_length(text: str, given: str) -> None:
  """Refuses a local path no file system can hold: a name over `NAME_MAX`
  bytes, the whole over `PATH_MAX`, or more than `MAX_FOLDERS` names.

  Why here: the system refuses such a path only when it first reaches it,
  with a bare ``OSError`` (``File name too long``) from whichever call that
  is, or, for a deep one that does not exist yet, a ``RecursionError`` from
  ``os.makedirs``; one check on the path as given covers every entry point.

  Raises:
    ArgumentError: naming the path (shortened) and the limit it passes.
  """
  encoded = os.fsencode(text)
  names = [name for name in encoded.split(b"/") if name]
  problem = None
  if len(encoded) > PATH_MAX:
    problem = f"it is {len(encoded)} bytes long, over the {PATH_MAX} a system call takes"
  elif len(names) > MAX_FOLDERS:
    problem = f"it nests {len(names)} names, over the {MAX_FOLDERS} pz_persist accepts"
  else:
    longest = max(names, key=len, default=b"")
    if len(longest) > NAME_MAX:
      problem = (f"one of its names is {len(longest)} bytes long, over the"
                 f" {NAME_MAX} a file system stores")
  if problem is not None:
    raise errors.ArgumentError(
        f"{given[:60]!r}...: no file system can hold this path: {problem}."
        " Choose a shorter path."
    )


def check_no_nul(text: str, given: str) -> None:
  """Refuses a path holding a NUL character.

  Why here: no file system stores one, and Python's ``os`` functions raise
  a bare ``ValueError`` ("embedded null byte") wherever the path first
  reaches them; a ``file://`` URL's ``%00`` becomes one once decoded. One
  check on the path as given and on the path a URL decodes to covers both.

  Raises:
    ArgumentError: naming the path as given (``repr``: a NUL does not print).
  """
  if "\0" in text:
    raise errors.ArgumentError(
        f"{given!r}: a path cannot hold a NUL character"
        f"{' (%00 in a file:// URL decodes to one)' if text != given else ''};"
        " no file system stores one. Remove it from the path."
    )


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


def key(path: epath.PathLike) -> str:
  """``bucket/name`` of the object-store URL ``path``."""
  return os.fspath(path).split("://", 1)[1].rstrip("/")
