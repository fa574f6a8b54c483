"""The safetensors files of a Hugging Face checkpoint folder (headers only
until a tensor is read)."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from pz_persist import errors
from pz_persist.pretrained import _files
from pz_persist.pretrained import safetensors_io

CheckpointFolderError = errors.CheckpointFolderError


def _open_weights(path: str) -> dict[str, safetensors_io.SafetensorsFile]:
  """Opens the safetensors files (headers only): ``{tensor name: file}``.

  A sharded checkpoint's ``model.safetensors.index.json`` says which file
  holds which tensor; every tensor it names must really be in that file.
  Every file is checked by `_files.check_folder_file` before it is opened.
  """
  index_path = _files.check_folder_file(path, "model.safetensors.index.json")
  single = _files.check_folder_file(path, "model.safetensors")
  where: dict[str, safetensors_io.SafetensorsFile] = {}
  if index_path is not None:
    def error(what: str) -> safetensors_io.SafetensorsFormatError:
      return safetensors_io.SafetensorsFormatError(f"{index_path} {what}.")

    index = _files.read_json(index_path, _files.MAX_INDEX_BYTES, error)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
      raise error("is malformed: it needs a 'weight_map' object")
    files: dict[str, safetensors_io.SafetensorsFile] = {}
    for name, filename in weight_map.items():
      if not isinstance(filename, str) or os.path.basename(filename) != filename:
        raise safetensors_io.SafetensorsFormatError(
            f"{index_path}: tensor {name!r} maps to {filename!r}, which is not"
            " a file name in the checkpoint folder."
        )
      if filename not in files:
        file_path = _files.check_folder_file(path, filename)
        if file_path is None:
          raise CheckpointFolderError(
              f"{index_path} names {filename}, which is missing from {path}."
          )
        files[filename] = safetensors_io.SafetensorsFile(file_path)
      if name not in files[filename].entries:
        raise safetensors_io.SafetensorsFormatError(
            f"{index_path} puts tensor {name!r} in {files[filename].path}, which"
            " does not hold it."
        )
      where[name] = files[filename]
  elif single is not None:
    file = safetensors_io.SafetensorsFile(single)
    where = dict.fromkeys(file.entries, file)
  else:
    raise _no_weights(path)
  return where


def _no_weights(path: str) -> CheckpointFolderError:
  return CheckpointFolderError(
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
  validated on its own, so a broken config is reported as such first."""

  def __init__(self, path: str, dtype: Any):
    self.path = path
    self._dtype = dtype

  @functools.cached_property
  def where(self) -> dict[str, safetensors_io.SafetensorsFile]:
    return _open_weights(self.path)

  @property
  def names(self) -> set[str]:
    return set(self.where)

  @functools.cached_property
  def dtype(self) -> np.dtype:
    """The requested dtype, or the checkpoint's own floating dtype."""
    return self._dtype if self._dtype is not None else stored_float_dtype(self.where)


def stored_float_dtype(where: Mapping[str, safetensors_io.SafetensorsFile]) -> np.dtype:
  """The checkpoint's floating dtype (of its first floating tensor)."""
  for name, file in where.items():
    stored = file.entries[name][0]
    if jnp.issubdtype(stored, jnp.floating):
      return stored
  return np.dtype(np.float32)
