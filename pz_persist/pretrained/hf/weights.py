"""The safetensors files of a Hugging Face checkpoint folder (headers only
until a tensor is read)."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from pz_persist import extension
from pz_persist.pretrained import _files
from pz_persist.pretrained import errors
from pz_persist.pretrained import safetensors_io


def _open_weights(
    path: str, seen: list[tuple[str, _files.Identity]],
    opened: list[safetensors_io.SafetensorsFile],
) -> dict[str, safetensors_io.SafetensorsFile]:
  """Opens the safetensors files (headers only): ``{tensor name: file}``.

  A sharded checkpoint's ``model.safetensors.index.json`` says which file
  holds which tensor; every tensor it names must really be in that file.
  Every file is checked by `_files.check_folder_file` before it is opened,
  and appended to ``opened`` (to be closed whatever happens); the index is
  recorded in ``seen`` (to be checked unchanged at the end).
  """
  index_path = _files.check_folder_file(path, "model.safetensors.index.json")
  single = _files.check_folder_file(path, "model.safetensors")
  where: dict[str, safetensors_io.SafetensorsFile] = {}
  if index_path is not None:
    def error(what: str) -> safetensors_io.SafetensorsFormatError:
      return safetensors_io.SafetensorsFormatError(f"{index_path} {what}.")

    index = _files.read_json(index_path, _files.MAX_INDEX_BYTES, error, seen)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
      raise error("is malformed: it needs a 'weight_map' object")
    files: dict[str, safetensors_io.SafetensorsFile] = {}
    for name, filename in weight_map.items():
      # Each file name checked and opened on its first mention only (an
      # index of a mixture of experts names a few files 20,000 times).
      file = files.get(filename) if type(filename) is str else None
      if file is not None:
        if name not in file.entries:
          raise safetensors_io.SafetensorsFormatError(
              f"{index_path} puts tensor {name!r} in {file.path}, which does not hold it.")
        where[name] = file
        continue
      if not _files.plain_file_name(filename):
        raise safetensors_io.SafetensorsFormatError(
            f"{index_path}: tensor {name!r:.200} maps to {filename!r:.200}, which is not"
            " the name of a file in the checkpoint folder (no path, no separator, not"
            " empty, '.' or '..'); the index is damaged or forged."
        )
      if filename not in files:
        file_path = _files.check_folder_file(path, filename)
        if file_path is None:
          raise errors.CheckpointFolderError(
              f"{index_path} names {filename}, which is missing from {path}."
          )
        files[filename] = safetensors_io.SafetensorsFile(file_path)
        opened.append(files[filename])
      if name not in files[filename].entries:
        raise safetensors_io.SafetensorsFormatError(
            f"{index_path} puts tensor {name!r} in {files[filename].path}, which does not hold it.")
      where[name] = files[filename]
  elif single is not None:
    file = safetensors_io.SafetensorsFile(single)
    opened.append(file)
    where = dict.fromkeys(file.entries, file)
  else:
    raise _no_weights(path)
  return where


def _no_weights(path: str) -> errors.CheckpointFolderError:
  return errors.CheckpointFolderError(
      f"{path} has no model.safetensors nor model.safetensors.index.json"
      " (only safetensors checkpoints are supported; PyTorch .bin files"
      " would need torch to read)."
  )


def check_has_weights(path: str) -> None:
  """Says early that the weights are missing, before ``config.json`` is
  checked in detail (their files are opened, and checked, only after)."""
  if not any(os.path.exists(os.path.join(path, name))
             for name in ("model.safetensors.index.json", "model.safetensors")):
    raise _no_weights(path)


class Weights:
  """The folder's safetensors files, opened (headers only) when a builder
  first asks for their tensor names or dtype: after ``config.json`` has been
  validated on its own, so a broken config is reported as such first.

  Each file is opened once and every tensor read through that descriptor
  (`safetensors_io.SafetensorsFile`); `check_unchanged`, once the load is
  done, refuses it if any file read (``seen``: ``config.json``, the index,
  the safetensors files) was replaced or rewritten meanwhile. A context
  manager: the descriptors are closed on leaving it.
  """

  def __init__(self, path: str, dtype: npt.DTypeLike | None, seen: list[tuple[str, _files.Identity]] | None = None):
    self.path = path
    self._dtype = dtype
    self._seen = list(seen or [])
    self._opened: list[safetensors_io.SafetensorsFile] = []

  @functools.cached_property
  def where(self) -> dict[str, safetensors_io.SafetensorsFile]:
    return _open_weights(self.path, self._seen, self._opened)

  def check_unchanged(self) -> None:
    """Raises `FileChangedError` naming a file read that changed since.

    Raises:
      FileChangedError: naming the file.
    """
    for file in self._opened:
      file.check_unchanged()
    for file_path, identity in self._seen:
      _files.check_unchanged(file_path, identity)

  def close(self) -> None:
    for file in self._opened:
      file.close()

  def __enter__(self) -> Weights:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  @property
  def names(self) -> set[str]:
    return set(self.where)

  def add_views(self, views: Sequence[View]) -> None:
    """Makes each of a plan's ``views`` readable by name, as a stored tensor
    is, once its parts are checked against the headers (nothing is read)."""
    added = {}
    for view in views:
      if view.name in added:
        raise safetensors_io.SafetensorsFormatError(
            f"{view.name!r} is declared twice by the plan for {self.path} (a bug).")
      added[view.name] = _view_file(view, self.where, self.path)
    self.where.update(added)  # type: ignore[arg-type]

  def decoded(self) -> list[Decoded]:
    """The `Decoded` views added: what was stored quantised."""
    return [file.view for file in self.where.values()
            if isinstance(file, _ViewFile) and isinstance(file.view, Decoded)]

  @functools.cached_property
  def dtype(self) -> np.dtype:
    """The requested dtype, or the checkpoint's own floating dtype."""
    return np.dtype(self._dtype) if self._dtype is not None else stored_float_dtype(self.where)


def stored_float_dtype(where: Mapping[str, safetensors_io.SafetensorsFile]) -> np.dtype:
  """The checkpoint's floating dtype (of its first floating tensor wider
  than a byte: float8 tensors are quantised storage, as in DeepSeek-V3's
  FP8 folders, whose other tensors are bfloat16)."""
  for name, file in where.items():
    stored = file.entries[name][0]
    if jnp.issubdtype(stored, jnp.floating) and stored.itemsize > 1:
      return stored
  return np.dtype(np.float32)


# --- stored views: tensors a plan computes from several stored ones ----------
#
# A family's plan declares them (`Plan.views`) and names one as the ``source``
# of a `TensorSpec` like any stored tensor; `Weights.add_views` checks their
# parts against the headers and puts a `_ViewFile` answering for each in
# `Weights.where`, so the rest of `load_hf` (the size checks, progress,
# reading) treats it as one more stored tensor. `export_hf` writes a
# `Stacked` view back as its parts and a `Decoded` one as its dense result
# (`pz_persist.pretrained.hf.folder_writer`).


@dataclasses.dataclass(frozen=True)
class Stacked:
  """A tensor stacked, on a new first dimension, from stored tensors of one
  dtype and shape (transformers' per-expert tensors
  ``...experts.{e}.gate_proj.weight`` of a mixture of experts).

  Attributes:
    name: The name the plan's specs read it by (not a stored tensor's).
    parts: The stored tensors, in stacking order.
  """

  name: str
  parts: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Decoded:
  """A tensor computed from several stored tensors: quantised storage
  (MXFP4 blocks and scales; FP8 weights and their block scales).

  Attributes:
    name: The name the plan's specs read it by, and the name `export_hf`
      writes the dense result under.
    parts: The stored tensors ``decode`` needs.
    shape: The decoded tensor's shape.
    dtype: The decoded tensor's dtype (before the load's own cast).
    decode: ``{part name: array as stored} -> array`` of ``shape`` and ``dtype``.
    description: What was decoded, for people (``"MXFP4 (blocks of 32,
      E8M0 scales)"``).
    working_bytes: At most what ``decode`` allocates besides its result (the
      parts as read, its intermediates), derived from the checked shapes
      only: the load's allocation check counts it (`pz_persist.pretrained.hf.load`),
      so the total it checks covers the intermediates too.
  """

  name: str
  parts: tuple[str, ...]
  shape: tuple[int, ...]
  dtype: np.dtype
  decode: Callable[[dict[str, np.ndarray]], np.ndarray]
  description: str
  working_bytes: int


View = Stacked | Decoded
"""A tensor a plan declares as computed from stored ones."""


def stacked(name: str, parts: Sequence[str]) -> Stacked:
  """A `Stacked` view ``name`` of the stored tensors ``parts``."""
  return Stacked(name, tuple(parts))


def decoded(name: str, parts: Sequence[str], shape: Sequence[int], dtype: npt.DTypeLike,
            decode: Callable[[dict[str, np.ndarray]], np.ndarray], description: str,
            working_bytes: int) -> Decoded:
  """A `Decoded` view ``name`` of the stored tensors ``parts``."""
  return Decoded(name, tuple(parts), tuple(int(n) for n in shape), np.dtype(dtype), decode,
                 description, int(working_bytes))


class _ViewFile:
  """Answers for one view as a `safetensors_io.SafetensorsFile` answers for
  its tensors (``entries``, ``path``, ``get``), reading the parts from their
  own files. Its entry's byte range spans the parts' stored bytes (for
  progress); its dtype and shape are the view's."""

  def __init__(self, view: View, where: Mapping[str, safetensors_io.SafetensorsFile],
               dtype: np.dtype, shape: tuple[int, ...]):
    self.view = view
    # The parts grouped by file: (file, the parts' indices in the view, their
    # names); no object per part (a model of 128 experts x 48 layers has
    # 18,432 parts, and as many small objects living through the load
    # cost the garbage collector a full pass over the process).
    groups: dict[int, tuple[safetensors_io.SafetensorsFile, list[int], list[str]]] = {}
    stored = 0
    for i, part in enumerate(view.parts):
      file = where[part]
      group = groups.get(id(file))
      if group is None:
        group = groups[id(file)] = (file, [], [])
      group[1].append(i)
      group[2].append(part)
      entry = file.entries[part]
      stored += entry[3] - entry[2]
    self._groups = list(groups.values())
    self.entries = {view.name: (dtype, shape, 0, stored)}
    self.path = self._groups[0][0].path if self._groups else "(no file)"

  def get(self, name: str, dtype: npt.DTypeLike | None = None, *,
          allow_lossy: bool = False) -> np.ndarray:
    stored, shape, _, _ = self.entries[name]
    dtype = stored if dtype is None else np.dtype(dtype)
    view = self.view
    if isinstance(view, Stacked):
      # One buffer, each part read straight into its slice (cast while
      # read), each file checked unchanged once around all its parts.
      out = extension.aligned_empty(shape, dtype)
      for file, indices, names in self._groups:
        file.read_stack_into(names, indices, out, allow_lossy=allow_lossy)
      return out
    arrays = {part: file.get(part) for file, _, names in self._groups for part in names}
    result = np.asarray(view.decode(arrays))
    del arrays
    if result.shape != view.shape or result.dtype != view.dtype:
      raise safetensors_io.SafetensorsFormatError(
          f"{self.path}: decoding {view.description} into {view.name!r} gave"
          f" {result.dtype}{list(result.shape)}, not the {view.dtype}{list(view.shape)} declared;"
          " the decoder and the plan disagree (a bug: please report it).")
    return extension.cast(result, dtype, allow_lossy=allow_lossy,
                      where=f"{view.description} tensor {view.name!r} decoded from {self.path}")


def _view_file(view: View, where: Mapping[str, safetensors_io.SafetensorsFile],
               folder: str) -> _ViewFile:
  """Checks a view's parts against the headers (present; for `Stacked`,
  one dtype and shape) before anything is read."""
  if view.name in where:
    raise safetensors_io.SafetensorsFormatError(
        f"{where[view.name].path} holds a tensor {view.name!r}, and the checkpoint also holds"
        f" the parts {list(view.parts[:3])}... that it would be made from; a folder holds one"
        " layout or the other: it is damaged or two checkpoints were mixed.")
  if not view.parts:
    raise safetensors_io.SafetensorsFormatError(f"{view.name!r} is made from no tensors.")
  for part in view.parts:
    if part not in where:
      files = sorted({f.path for f in where.values()})
      raise safetensors_io.SafetensorsFormatError(
          f"tensor {part!r} (a part of {view.name!r}) is in none of the checkpoint's files"
          f" {files[:4]}{'...' if len(files) > 4 else ''} in {folder}.")
  if isinstance(view, Decoded):
    return _ViewFile(view, where, view.dtype, view.shape)
  first = view.parts[0]
  dtype, shape = where[first].entries[first][:2]
  if len({where[part].entries[part][:2] for part in view.parts}) == 1:
    return _ViewFile(view, where, dtype, (len(view.parts), *shape))
  for part in view.parts[1:]:
    other = where[part].entries[part][:2]
    if other != (dtype, shape):
      raise safetensors_io.SafetensorsFormatError(
          f"safetensors file {where[part].path}, tensor {part!r}: {other[0]}{list(other[1])}"
          f" where {first!r} is {dtype}{list(shape)}; the parts of {view.name!r} must have one"
          " dtype and shape.")
  return _ViewFile(view, where, dtype, (len(view.parts), *shape))
