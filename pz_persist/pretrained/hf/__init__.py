"""Hugging Face folders in and out: `load_hf` reads a checkpoint folder into a
Penzai model, `export_hf` writes one back.

Each model family is one module of `pz_persist.pretrained.hf.families`
declaring one `pz_persist.pretrained.hf.record.Family` record; loading,
export, detection, the CLI's help and the README's table of families are
driven by those records. The other modules are shared by every family:
``config`` (``config.json`` read field by field), ``plan`` (which tensor
fills which Penzai parameter), ``weights`` (the safetensors headers),
``load``, and for export ``config_from_model``, ``structure_match``,
``folder_writer`` and ``export``.
"""

from pz_persist.pretrained import errors
from pz_persist.pretrained.hf.load import load_hf

# Documented here too (defined in errors, with every error class).
UnsupportedConfigError = errors.UnsupportedConfigError
CheckpointFolderError = errors.CheckpointFolderError

__all__ = ["CheckpointFolderError", "UnsupportedConfigError", "load_hf"]
