"""pz_persist: save, inspect and load Penzai values through Orbax, with no template.

Orbax flattens Penzai's ``NamedArray`` and ``ParameterValue`` objects to bare
arrays, so a checkpoint restored without a template loses axis names, labels
and metadata. pz_persist stores them as a typed JSON manifest next to the
arrays, which Orbax's own array handler writes, and rebuilds exactly the saved
objects on load. Importing this package registers its handlers with Orbax (v0
and v1), so plain ``orbax.checkpoint`` code benefits as well.

Example::

  import jax
  import pz_persist as pzp
  from penzai import pz
  from penzai.models import simple_mlp

  model = simple_mlp.MLP.from_config(
      name="mlp", init_base_rng=jax.random.key(0), feature_sizes=[8, 32, 8]
  )
  unbound, params = pz.unbind_params(model, freeze=True)
  pzp.save("/tmp/mlp_params", params, overwrite=True)

  abstract = pzp.inspect("/tmp/mlp_params")  # No array is read.
  restored = pz.bind_variables(unbound, pzp.load("/tmp/mlp_params"))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING
from typing import Any

from pz_persist import errors
from pz_persist.binding import BindOptions
from pz_persist.binding import LoadReport
from pz_persist.binding import Mismatch
from pz_persist.binding import assign_variables
from pz_persist.checkpoint import inspect
from pz_persist.checkpoint import load
from pz_persist.checkpoint import save
from pz_persist.errors import BindingError
from pz_persist.errors import PzPersistError
from pz_persist.lazy.opened import OpenedCheckpoint
from pz_persist.lazy.opened import open_checkpoint as open  # pylint: disable=redefined-builtin
from pz_persist.model import load_into
from pz_persist.model import load_model
from pz_persist.model import save_model
from pz_persist.orbax.handler_registry import handler_registry
from pz_persist.orbax.registration import register_handlers
from pz_persist.orbax.v0_handler import PenzaiCheckpointHandler
from pz_persist.orbax.v0_handler import PenzaiRestore
from pz_persist.orbax.v0_handler import PenzaiSave
from pz_persist.orbax.v1_handler import PenzaiCheckpointableHandler
from pz_persist.safety.allowlist import allow_modules
from pz_persist.safety.limits import limits
from pz_persist.sharding import AxisRules
from pz_persist.storage.reading.host_memory import release_buffers as release_read_buffers
from pz_persist.storage.reading.host_memory import tune_host_allocator
from pz_persist.storage.stores.s3_kvstore import disable_orbax_s3
from pz_persist.storage.stores.s3_kvstore import enable_orbax_s3
from pz_persist.training.manager import CheckpointManager
from pz_persist.training.trainer import restore_trainer
from pz_persist.training.trainer import trainer_items
from pz_persist.version import __version__

if TYPE_CHECKING:  # Imported on first use (`__getattr__`); seen by type checkers.
  from pz_persist import pretrained
  from pz_persist.pretrained.gemma import load_gemma
  from pz_persist.pretrained.hf.export import export_hf
  from pz_persist.pretrained.hf.load import load_hf
  from pz_persist.pretrained.safetensors_io import export_safetensors
  from pz_persist.pretrained.safetensors_io import load_safetensors
  from pz_persist.tools.diffing import diff
  from pz_persist.tools.migrating import migrate
  from pz_persist.tools.verifying import VerifyReport
  from pz_persist.tools.verifying import verify
  from pz_persist.tools.viewing import render_html

_LAZY: dict[str, tuple[str, str | None]] = {
    "pretrained": ("pz_persist.pretrained", None),
    "export_hf": ("pz_persist.pretrained.hf.export", "export_hf"),
    "export_safetensors": ("pz_persist.pretrained.safetensors_io", "export_safetensors"),
    "load_gemma": ("pz_persist.pretrained.gemma", "load_gemma"),
    "load_hf": ("pz_persist.pretrained.hf.load", "load_hf"),
    "load_safetensors": ("pz_persist.pretrained.safetensors_io", "load_safetensors"),
    "diff": ("pz_persist.tools.diffing", "diff"),
    "migrate": ("pz_persist.tools.migrating", "migrate"),
    "VerifyReport": ("pz_persist.tools.verifying", "VerifyReport"),
    "verify": ("pz_persist.tools.verifying", "verify"),
    "render_html": ("pz_persist.tools.viewing", "render_html"),
}
"""Public names from subpackages most programs do not use (pretrained weights,
the tools), by module and attribute: imported on first use (PEP 562), so
``import pz_persist`` does not pay for safetensors parsing, the model families
or treescope rendering."""


def __getattr__(name: str) -> Any:
  if name not in _LAZY:
    raise AttributeError(f"module 'pz_persist' has no attribute {name!r}")
  module_name, attribute = _LAZY[name]
  module = importlib.import_module(module_name)
  value = module if attribute is None else getattr(module, attribute)
  globals()[name] = value  # Found directly from now on.
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AxisRules",
    "BindOptions",
    "BindingError",
    "CheckpointManager",
    "LoadReport",
    "Mismatch",
    "OpenedCheckpoint",
    "PenzaiCheckpointHandler",
    "PenzaiCheckpointableHandler",
    "PenzaiRestore",
    "PenzaiSave",
    "PzPersistError",
    "VerifyReport",
    "__version__",
    "allow_modules",
    "assign_variables",
    "diff",
    "disable_orbax_s3",
    "enable_orbax_s3",
    "errors",
    "export_hf",
    "export_safetensors",
    "handler_registry",
    "inspect",
    "limits",
    "load",
    "load_gemma",
    "load_hf",
    "load_into",
    "load_model",
    "load_safetensors",
    "migrate",
    "open",
    "pretrained",
    "register_handlers",
    "release_read_buffers",
    "render_html",
    "restore_trainer",
    "save",
    "save_model",
    "trainer_items",
    "tune_host_allocator",
    "verify",
]

register_handlers()
