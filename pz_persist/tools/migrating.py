"""`migrate`: a checkpoint written the old way to a native one, once.

A plain Orbax checkpoint of a model's parameters (Penzai's documented way
before pz_persist: ``pz.unbind_params(model, freeze=True)`` saved with
``ocp.StandardCheckpointer`` or ``PyTreeCheckpointer``) needs the code that
builds the model every time it is loaded, since it has no labels or axis
names. `migrate` loads it into that model once (checking every shape and
dtype, see `pz_persist.plain_orbax`) and saves the whole model with
`pz_persist.save_model`, which `pz_persist.load_model` then reloads with no
code at all.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any
from typing import TypeVar
from typing import Unpack

from etils import epath
from penzai import pz

from pz_persist import binding
from pz_persist import errors
from pz_persist import model as model_lib
from pz_persist.storage import destinations
from pz_persist.storage import stores

ModelT = TypeVar("ModelT")
"""The model given to `migrate`: the model returned is of its type."""


def migrate(
    src: epath.PathLike,
    dst: epath.PathLike,
    model: ModelT,
    options: binding.BindOptions | None = None,
    *,
    overwrite: bool = False,
    allow_modules: Iterable[str] | None = None,
    **keywords: Unpack[binding.BindKeywords],
) -> ModelT:
  """Converts the checkpoint at ``src`` into a native checkpoint at ``dst``.

  Loads ``src`` into ``model`` with ``load_into(src, model)`` (strict:
  any missing, extra or mismatched array raises
  `pz_persist.BindingError`, and nothing is written), then saves the loaded
  model with `pz_persist.save_model`. ``src`` is left as it is.

  Example::

    model = build_my_model()                  # The code that built the params.
    pzp.migrate("/ckpts/old_params", "/ckpts/native", model)
    model = pzp.load_model("/ckpts/native")   # From now on, no code needed.

  Args:
    src: A plain Orbax checkpoint of the model's parameters (or of all its
      variables, or of the frozen model), or any checkpoint `load_model`
      can load into ``model``.
    dst: The native checkpoint to write.
    model: The model as its code builds it: it supplies the labels, axis
      names, shapes and dtypes the checkpoint lacks.
    overwrite: Replace an existing pz_persist checkpoint at ``dst`` (never
      anything else; and ``dst`` may never be ``src``, hold it or lie inside
      it, even through links or relative paths).
    options: How to bind ``src`` into ``model`` (`pz_persist.BindOptions`),
      as for `load_into`: ``dtype=`` and ``allow_lossy=`` cast while
      loading, ``sharding=`` places the arrays read, ``rename=`` and the
      others apply to native checkpoints.
    allow_modules: Modules the model's own layer classes come from, if they
      are not Penzai's (see `pz_persist.allow_modules`); loading ``dst`` will
      need them allowed too.
    **keywords: `pz_persist.BindOptions`' fields, as for `load_into`
      (``dtype=``, ``allow_lossy=``, ``sharding=``...); each replaces the
      one of ``options``.

  Returns:
    The loaded model (as saved at ``dst``).

  Raises:
    ArgumentError: ``dst`` is ``src``, holds it, lies inside it or inside any
      checkpoint (the destination rule,
      `pz_persist.storage.destinations.check_output`).
    CheckpointExistsError: ``dst`` exists and ``overwrite`` is False, or it
      is neither empty nor a pz_persist checkpoint.
  """
  dst = destinations.check_output(dst, [src])  # The destination rule, before the load.
  if not overwrite and stores.for_path(dst).identity(dst) is not None:
    raise errors.CheckpointExistsError(  # Said before the (long) load.
        f"{dst} already exists; pass overwrite=True to replace it."
    )
  loaded = model_lib.load_into(src, model, options, allow_modules=allow_modules, **keywords)
  model_lib.save_model(dst, loaded, overwrite=overwrite, allow_modules=allow_modules)
  return loaded


def build_model(spec: str) -> pz.Struct:
  """Imports and calls the function ``spec`` names, ``module:function``
  (``function`` may be dotted, e.g. ``my_models:Config.build``), which must
  return a Penzai model.

  This runs the user's code: only for a name the user typed (the CLI's
  ``migrate --model``), never one a checkpoint holds.

  Raises:
    PzPersistError: ``spec`` is malformed, cannot be imported, names nothing
      callable, or its function returned no model.
  """
  module_name, _, attribute = spec.partition(":")
  if not module_name or not attribute:
    raise errors.PzPersistError(
        f"--model {spec!r}: expected module:function, e.g. my_models:build_mlp."
    )
  try:
    target: Any = importlib.import_module(module_name)
  except ImportError as e:
    raise errors.PzPersistError(
        f"--model {spec!r}: cannot import {module_name} ({e}); run from the"
        " directory that holds it, or add that directory to PYTHONPATH."
    ) from e
  for part in attribute.split("."):
    if not hasattr(target, part):
      raise errors.PzPersistError(f"--model {spec!r}: {module_name} has no {attribute}.")
    target = getattr(target, part)
  if not callable(target):
    raise errors.PzPersistError(f"--model {spec!r}: {attribute} is not callable.")
  model = target()
  if not isinstance(model, pz.Struct):
    raise errors.PzPersistError(
        f"--model {spec!r} returned a {type(model).__name__}, not a Penzai"
        " model (a pz.Struct such as a pz.nn.Layer)."
    )
  return model
