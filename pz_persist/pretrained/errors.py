"""The errors the pretrained loaders raise: their own, and the library's they share.

Why here: a Gemma preset, a safetensors header, a Hugging Face folder or an
export are `pz_persist.pretrained`'s business, so the classes naming what
went wrong with them live with it, beside the loaders that raise them. Each
is a subclass of the library's `pz_persist.errors.PzPersistError` (and of
the built-in class such failures always raised), so ``except
PzPersistError`` still catches every one. The library's own classes a loader
raises too (`ArgumentError`, `UnsafeCheckpointError`, ...) are re-exported,
as the same classes, so a loader imports one errors module.

Its own classes were defined in `pz_persist.errors` in releases up to 0.7;
they are still found there, with a `DeprecationWarning` naming this module,
until 2027-06-01.

Example::

  from pz_persist.pretrained import errors

  try:
    model = pzp.load_gemma(path)
  except errors.GemmaCheckpointError as e:
    print(e)  # What the checkpoint holds, and which preset= to pass.
"""

from __future__ import annotations

from pz_persist.errors import ArgumentError
from pz_persist.errors import EncodingError
from pz_persist.errors import FormatVersionError
from pz_persist.errors import IntegrityError
from pz_persist.errors import LossyCastError
from pz_persist.errors import NotACheckpointError
from pz_persist.errors import PzPersistError
from pz_persist.errors import UnsafeCheckpointError
from pz_persist.errors import UnsupportedConfigError

__all__ = [
    # The pretrained loaders' own.
    "CheckpointFolderError", "DequantizedWeightsWarning", "ExportError", "FileChangedError",
    "GemmaCheckpointError", "SafetensorsFormatError", "UnreadTensorsError",
    # The library's, which they raise too (the same classes).
    "ArgumentError", "EncodingError", "FormatVersionError", "IntegrityError", "LossyCastError",
    "NotACheckpointError", "PzPersistError", "UnsafeCheckpointError", "UnsupportedConfigError",
]


class SafetensorsFormatError(PzPersistError, ValueError):
  """A safetensors file is malformed, truncated, or lacks what was asked of it.

  The message always names the file (and the tensor, when one is at fault).
  Also ``pz_persist.pretrained.safetensors_io.SafetensorsFormatError``.
  """


class UnreadTensorsError(SafetensorsFormatError):
  """A Hugging Face folder stores tensors the model its config describes
  never reads, and its family does not declare them knowingly left out.

  Raised by `pz_persist.pretrained.load_hf` before any tensor is read: such
  a folder (a ``q_proj.bias`` where the config says no bias, a misspelled
  name, another model's tensors) would otherwise load as a model other than
  its files describe. The message names the folder, the first few unread
  tensors, how many there are, and what to change.
  """


class FileChangedError(PzPersistError):
  """A file of a pretrained checkpoint changed while it was being loaded.

  Raised by `pz_persist.pretrained.load_hf` (and `load_safetensors`) when a
  file read (``config.json``, the index, a safetensors file) was replaced or
  rewritten during the load: a download or an rsync finishing mid-load would
  otherwise give a model holding tensors of both versions. Nothing read is
  returned; the message names the file. Load again once the writer is done.
  """


class GemmaCheckpointError(PzPersistError, ValueError):
  """The checkpoint is not a Gemma checkpoint the installed Penzai can build.

  Raised for a preset that does not exist (Gemma 3 among them: Penzai 0.2.5
  has no Gemma 3 architecture), for checkpoints whose shapes match no preset,
  and for Gemma 3 checkpoints (query/key norms, vision encoder). Also
  ``pz_persist.pretrained.gemma.GemmaCheckpointError``.
  """


class DequantizedWeightsWarning(UserWarning):
  """`pz_persist.pretrained.load_hf` read quantised tensors (MXFP4, FP8
  block-scaled) and dequantised them: the message says which and into what.
  `pz_persist.export_hf` writes such a model dense (its ``config.json``
  without ``quantization_config``) and warns the same way."""


class CheckpointFolderError(PzPersistError, FileNotFoundError):
  """The folder is not a usable Hugging Face checkpoint (files missing).

  Also ``pz_persist.pretrained.hf.CheckpointFolderError``.
  """


class ExportError(PzPersistError, ValueError):
  """A model cannot be written in the requested format (`pz_persist.export_hf`):
  its structure is not one the target family can express."""
