"""A Hugging Face folder written whole or not at all: ``config.json``, sharded
``model-0000x-of-0000y.safetensors`` and ``model.safetensors.index.json``,
assembled beside the destination and renamed into place.
"""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
from penzai import pz

from pz_persist import extension
from pz_persist import progress as progress_lib
from pz_persist.pretrained import errors
from pz_persist.pretrained import safetensors_io
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import stored_layout
from pz_persist.pretrained.hf.weights import Stacked


class _Stored:
  """One stored tensor, laid out only when the writer asks for its bytes, so
  that the host holds one tensor at a time."""

  def __init__(self, specs: list[TensorSpec], values: list[pz.nx.NamedArrayBase]):
    self.specs, self.values = specs, values
    spec = specs[0]
    self.shape = spec.file_shape
    self.dtype = np.dtype(values[0].dtype)
    self.nbytes = math.prod(self.shape) * self.dtype.itemsize

  def __array__(self, dtype: npt.DTypeLike | None = None,
                copy: bool | None = None) -> np.ndarray:
    hosts = [np.asarray(v.unwrap(*spec.axes)) for spec, v in zip(self.specs, self.values)]
    try:
      return stored_layout(self.specs, hosts)
    except errors.LossyCastError:
      raise  # Names the tensor and the value already.
    except ValueError as e:
      raise errors.ExportError(f"{e}; they cannot be written as one Hugging Face tensor.") from None


def stored_tensors(plan: Plan, slots: Mapping[str, str],
                   values: Mapping[str, Any]) -> list[tuple[str, Any]]:
  """``(Hugging Face name, tensor)`` in plan order, each value checked
  against its spec's shape first; a `Stacked` view is written as its parts
  (transformers' per-expert tensors), bit for bit."""
  views = {view.name: view for view in plan.views}
  by_source: dict[str, list[TensorSpec]] = collections.defaultdict(list)
  for spec in plan.tensors:
    by_source[spec.source].append(spec)
  out: list[tuple[str, Any]] = []
  for source, specs in by_source.items():
    found = []
    for spec in specs:
      label = slots[spec.label]
      value = values[label]
      expected = dict(zip(spec.axes, spec.parameter_shape))
      if dict(value.named_shape) != expected or value.positional_shape:
        raise errors.ExportError(
            f"parameter {label!r} has shape {dict(value.named_shape)} where the config"
            f" derived from the model needs {expected} for {source!r}; the model's"
            " layers disagree about its sizes."
        )
      found.append(value)
    whole = _Stored(specs, found)
    stack = views.get(source)
    if isinstance(stack, Stacked):  # Written back as its parts, under their own names.
      out += [(part, _StackedPart(whole, i)) for i, part in enumerate(stack.parts)]
    else:  # A stored tensor, or a Decoded view: its dense values under its name.
      out.append((source, whole))
  return out


class _StackedPart:
  """Part ``index`` of a `Stacked` view's tensor: the whole is laid out when
  its first part is written and dropped after its last (parts are written
  in order, so the host holds one stacked tensor at a time)."""

  def __init__(self, whole: _Stored, index: int):
    self.whole, self.index = whole, index
    self.shape = whole.shape[1:]
    self.dtype = whole.dtype
    self.nbytes = math.prod(self.shape) * self.dtype.itemsize

  def __array__(self, dtype: npt.DTypeLike | None = None,
                copy: bool | None = None) -> np.ndarray:
    whole = self.whole
    cached = getattr(whole, "_laid_out", None)
    if cached is None:
      cached = whole._laid_out = np.asarray(whole)  # type: ignore[attr-defined]
    if self.index == whole.shape[0] - 1:
      whole._laid_out = None  # type: ignore[attr-defined]
    return np.ascontiguousarray(cached[self.index])


def _shards(tensors: list[tuple[str, Any]], shard_size: int) -> list[list[tuple[str, Any]]]:
  """Consecutive groups of at most ``shard_size`` bytes (a larger tensor alone)."""
  shards: list[list[tuple[str, Any]]] = [[]]
  size = 0
  for name, tensor in tensors:
    if shards[-1] and size + tensor.nbytes > shard_size:
      shards.append([])
      size = 0
    shards[-1].append((name, tensor))
    size += tensor.nbytes
  return shards


def check_destination(folder: str, overwrite: bool) -> None:
  """Refuses a ``folder`` `write_folder` may not write or replace
  (`pz_persist.extension.check_export_destination`)."""
  extension.check_export_destination(folder, overwrite=overwrite)


def write_folder(folder: str, config: Mapping[str, Any], tensors: list[tuple[str, Any]],
                 shard_size: int, overwrite: bool, progress: progress_lib.Progress) -> None:
  """Writes the files into a new folder beside ``folder``, then moves it into
  place the way checkpoints are (`pz_persist.extension.publishing_export`:
  one rename, or an atomic exchange with the folder it replaces), so an
  interrupted export leaves ``folder`` as it was and a reader never sees a
  mix. ``overwrite`` was checked by `check_destination`; if another writer
  changes ``folder`` meanwhile, nothing is replaced.

  Raises:
    ConcurrentSaveError: another writer changed ``folder`` meanwhile.
  """
  with extension.publishing_export(folder) as tmp:
    shards = _shards(tensors, shard_size)
    weight_map = {}
    total = sum(t.nbytes for _, t in tensors)
    with progress_lib.tracking(progress, f"writing {folder}", total) as tracker:
      for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors_io.write_safetensors(os.fspath(tmp / filename), shard,
                                         metadata={"format": "pt"})
        weight_map.update(dict.fromkeys((n for n, _ in shard), filename))
        tracker.advance(sum(t.nbytes for _, t in shard))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    extension.write_small_file(os.fspath(tmp / "model.safetensors.index.json"),
                               json.dumps(index, indent=2).encode())
    extension.write_small_file(os.fspath(tmp / "config.json"),
                               (json.dumps(config, indent=2) + "\n").encode())
