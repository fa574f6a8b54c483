"""`save_model`, `load_model` and `load_into`: whole Penzai models, after surgery too.

A model edited in a notebook (LoRA adapters inserted, layers cut, activations
swapped, parameters relabeled) has no code that can rebuild it, so a checkpoint
of its parameters alone cannot bring it back. `save_model` saves the model's
structure as typed JSON next to its variables: every layer by class and fields,
functions and dtypes by name, the small arrays a layer holds itself.
`load_model` rebuilds it with no code from the user, importing only
allow-listed modules.

`load_into(path, model)` instead binds the checkpoint's variables into a
given model by label, checking and reporting every difference (see
`pz_persist.binding`); it also reads checkpoints of bare parameters written by
`pz_persist.save`, and plain Orbax checkpoints of a model's parameters written
without pz_persist (see `pz_persist.plain_orbax`). ``load_model(path,
into=model)`` is its older spelling, kept working.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import Literal
from typing import TypeVar
from typing import overload

import jax
from etils import epath
from penzai import pz

from pz_persist import binding
from pz_persist import checkpoint
from pz_persist import errors
from pz_persist import plain_orbax
from pz_persist import progress as progress_lib
from pz_persist import sharding as sharding_lib
from pz_persist.format import manifest_queries
from pz_persist.format import meshes
from pz_persist.safety import allowlist
from pz_persist.storage.reading import opening
from pz_persist.storage.reading import restoring


def save_model(
    path: epath.PathLike,
    model: pz.Struct,
    *,
    overwrite: bool = False,
    allow_modules: Iterable[str] | None = None,
) -> None:
  """Saves a whole Penzai model: its structure and its variables.

  Layers, their fields, the functions and dtypes they name and the arrays they
  hold are saved as typed JSON and Orbax arrays; variables used in several
  places stay shared. A layer class or function from a module that is not
  allow-listed (``penzai``, ``jax``, ``numpy`` by default) is refused here,
  naming its place in the model, before anything is written.

  Example::

    import jax
    import pz_persist as pzp
    from penzai import pz
    from penzai.models import simple_mlp
    from penzai.toolshed import lora

    model = simple_mlp.MLP.from_config(
        name="mlp", init_base_rng=jax.random.key(0), feature_sizes=[8, 32, 8]
    )
    model = lora.loraify_linears_in_selection(
        pz.select(model).at_instances_of(pz.nn.Linear), rank=2,
        init_base_rng=jax.random.key(1),
    )
    pzp.save_model("/tmp/mlp_lora", model, overwrite=True)
    restored = pzp.load_model("/tmp/mlp_lora")   # No code needed.

  Args:
    path: Directory to create.
    model: The model, a ``pz.Struct`` (usually a ``pz.nn.Layer``). Its
      variables may be mutable or frozen.
    overwrite: Replace an existing pz_persist checkpoint at ``path``.
    allow_modules: Extra modules the model's classes and functions may come
      from, for this call (e.g. your own layer definitions).
  """
  if not isinstance(model, pz.Struct):
    raise errors.ArgumentTypeError(
        f"save_model takes a Penzai model (a pz.Struct such as a pz.nn.Layer),"
        f" not a {type(model).__name__}; use pz_persist.save for other trees."
    )
  checkpoint.save(path, model, overwrite=overwrite, allow_modules=allow_modules)


ModelT = TypeVar("ModelT")
"""The model given to `load_into`: the model returned is of its type."""


@overload
def load_into(
    path: opening.PathOrHandle,
    model: ModelT,
    *,
    strict: Literal[True] = True,
    only: binding.LabelGlobs | None = None,
    rename: binding.RenameRules | None = None,
    rename_axes: Mapping[Any, Any] | None = None,
    dtype: binding.DTypeRules | None = None,
    allow_lossy: bool = False,
    overlay: bool = False,
    sharding: sharding_lib.Target = None,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    auto_labels: binding.AutoLabels = None,
) -> ModelT: ...


@overload
def load_into(
    path: opening.PathOrHandle,
    model: ModelT,
    *,
    strict: Literal[False],
    only: binding.LabelGlobs | None = None,
    rename: binding.RenameRules | None = None,
    rename_axes: Mapping[Any, Any] | None = None,
    dtype: binding.DTypeRules | None = None,
    allow_lossy: bool = False,
    overlay: bool = False,
    sharding: sharding_lib.Target = None,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    auto_labels: binding.AutoLabels = None,
) -> tuple[ModelT, binding.LoadReport]: ...


@overload
def load_into(
    path: opening.PathOrHandle,
    model: ModelT,
    *,
    strict: bool,
    only: binding.LabelGlobs | None = None,
    rename: binding.RenameRules | None = None,
    rename_axes: Mapping[Any, Any] | None = None,
    dtype: binding.DTypeRules | None = None,
    allow_lossy: bool = False,
    overlay: bool = False,
    sharding: sharding_lib.Target = None,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    auto_labels: binding.AutoLabels = None,
) -> ModelT | tuple[ModelT, binding.LoadReport]: ...


def load_into(
    path: opening.PathOrHandle,
    model: ModelT,
    *,
    strict: bool = True,
    only: binding.LabelGlobs | None = None,
    rename: binding.RenameRules | None = None,
    rename_axes: Mapping[Any, Any] | None = None,
    dtype: binding.DTypeRules | None = None,
    allow_lossy: bool = False,
    overlay: bool = False,
    sharding: sharding_lib.Target = None,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    auto_labels: binding.AutoLabels = None,
) -> ModelT | tuple[ModelT, binding.LoadReport]:
  r"""Loads a checkpoint's variables into ``model``, by label.

  ``model`` is a freshly built model, or one unbound with
  ``pz.unbind_variables``; it is not changed, a new one is returned. Every
  difference between the checkpoint and the model is checked and reported
  (see `pz_persist.binding`). Reads checkpoints of whole models written by
  `save_model`, of bare parameters written by `pz_persist.save`, and plain
  Orbax checkpoints of a model's parameters written without pz_persist
  (``ocp.StandardCheckpointer`` or ``PyTreeCheckpointer`` saving the params of
  ``pz.unbind_params(model, freeze=True)``): having no labels, the arrays of
  those are matched to the model's variables by position, with every shape
  and dtype checked first; ``only``, ``dtype``, ``allow_lossy``, ``sharding``
  and ``strict`` work as for native checkpoints; ``rename``, ``rename_axes``
  and ``overlay`` are refused (`pz_persist.migrate` turns such a checkpoint
  into a native one).

  ``load_model(path, into=model, ...)`` is the older spelling of this call,
  and still works.

  Example::

    model = pzp.load_into("/tmp/base", model, overlay=True)
    model, report = pzp.load_into(
        "/tmp/base", model, strict=False,
        rename={r"^old/": "new/"}, dtype=jnp.bfloat16,
    )
    print(report)

  Args:
    path: A checkpoint directory (or its item directory), or a
      `pz_persist.open` handle (the checkpoint it opened is read).
    model: The model to load the checkpoint's variables into, by label.
    strict: Raise `pz_persist.binding.BindingError`, listing every missing,
      unexpected or mismatched variable, if the checkpoint does not fit. With
      False, load what fits and return ``(model, report)``.
    only: Label globs (``fnmatch``): load only the model variables they
      match; the model keeps its other values. Each glob must match a label
      of the checkpoint (as ``rename`` made them), and ``[]`` selects
      nothing: refused (`pz_persist.errors.UnknownLabelError` with the
      closest labels; `ArgumentError`), as is each ``rename`` rule,
      ``rename_axes`` key and ``dtype`` rule that matches nothing.
    rename: Regex rules ``{pattern: replacement}`` applied in order to the
      checkpoint's labels to get the model's labels.
    rename_axes: ``{stored name: model name}`` for renamed axes. Stored axes
      in another order than the model's are transposed automatically.
    dtype: A dtype to cast to on load (a floating dtype casts the floating
      arrays, an integer dtype the integer ones), or ``{label glob: dtype}``
      rules (each casts every array of the labels it matches). The model's
      current dtype then no longer has to match. Narrowing floats is done as
      asked; a cast that changes values beyond rounding, decided from the
      values by `pz_persist.format.casts` (a finite value overflowing, inf or
      NaN into a dtype without them, a fraction dropped, an integer out of
      range or not exactly representable, an imaginary part dropped), is
      refused, listing each variable and a value, unless ``allow_lossy=True``.
    allow_lossy: Cast even where values change (integers wrap around, inf
      becomes NaN in float8_e4m3fn...).
    overlay: The checkpoint holds only some of the model's variables (an
      adapter over a base model): the others keep their values and are not
      reported missing.
    sharding: Where arrays are read to: a ``jax.sharding.Sharding`` or
      `pz_persist.AxisRules` (default: the model's own placement, each array
      read straight into the sharding of the array it replaces, so a model
      larger than one device loads into itself).
    verify: Check every array read against its recorded checksum, before
      anything is built (see `pz_persist.load`).
    allow_modules: Extra modules the checkpoint may name, for this call.
    progress: A bar while the arrays are read (see `pz_persist.load`): None
      for one on a terminal or in a notebook once a load has taken a second,
      True, False, or a function called as ``progress(done, total)`` in
      bytes. Plain Orbax checkpoints are read in one Orbax call: no steps.
    auto_labels: ``"by_position"``: match the state variables whose labels
      Penzai drew automatically (``pz.AutoStateVarLabel``, new in every
      build, so never equal to the saved ones) by their order in the tree:
      the checkpoint's first to the model's first, and so on.

  Returns:
    The model, or ``(model, report)`` when ``strict=False``.
  """
  with allowlist.scoped_allowance(allow_modules):
    try:
      loaded, report = opening.read(path, lambda opened: binding.load_into(
          opened,
          model,
          strict=strict,
          only=only,
          rename=rename,
          rename_axes=rename_axes,
          dtype=dtype,
          allow_lossy=allow_lossy,
          overlay=overlay,
          sharding=sharding,
          verify=verify,
          progress=progress,
          auto_labels=auto_labels,
      ))
      return loaded if strict else (loaded, report)
    except errors.NotACheckpointError as e:
      not_native = e  # Raised outside this block: not the context of others.
    # Not a pz_persist checkpoint: perhaps one plain Orbax wrote.
    plain = plain_orbax.find_item(path)
    if plain is None:
      raise not_native
    loaded, report = plain_orbax.load_into(
        path, plain, model, strict=strict, only=only, rename=rename,
        rename_axes=rename_axes, dtype=dtype, allow_lossy=allow_lossy,
        overlay=overlay, sharding=sharding,
    )
    return loaded if strict else (loaded, report)


@overload
def load_model(
    path: opening.PathOrHandle,
    *,
    into: None = None,
    strict: Literal[True] = True,
    dtype: binding.DTypeRules | None = None,
    allow_lossy: bool = False,
    sharding: sharding_lib.Target = None,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    mesh: jax.sharding.Mesh | None = None,
) -> pz.Struct: ...


@overload
def load_model(
    path: opening.PathOrHandle,
    *,
    into: None = None,
    strict: Literal[False],
    dtype: binding.DTypeRules | None = None,
    allow_lossy: bool = False,
    sharding: sharding_lib.Target = None,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[pz.Struct, binding.LoadReport]: ...


@overload
def load_model(
    path: opening.PathOrHandle,
    *,
    into: ModelT,
    strict: Literal[True] = True,
    only: binding.LabelGlobs | None = None,
    rename: binding.RenameRules | None = None,
    rename_axes: Mapping[Any, Any] | None = None,
    dtype: binding.DTypeRules | None = None,
    allow_lossy: bool = False,
    overlay: bool = False,
    sharding: sharding_lib.Target = None,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    auto_labels: binding.AutoLabels = None,
) -> ModelT: ...


@overload
def load_model(
    path: opening.PathOrHandle,
    *,
    into: ModelT,
    strict: Literal[False],
    only: binding.LabelGlobs | None = None,
    rename: binding.RenameRules | None = None,
    rename_axes: Mapping[Any, Any] | None = None,
    dtype: binding.DTypeRules | None = None,
    allow_lossy: bool = False,
    overlay: bool = False,
    sharding: sharding_lib.Target = None,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    auto_labels: binding.AutoLabels = None,
) -> tuple[ModelT, binding.LoadReport]: ...


@overload
def load_model(
    path: opening.PathOrHandle,
    *,
    into: ModelT | None = None,
    strict: bool = True,
    only: binding.LabelGlobs | None = None,
    rename: binding.RenameRules | None = None,
    rename_axes: Mapping[Any, Any] | None = None,
    dtype: binding.DTypeRules | None = None,
    allow_lossy: bool = False,
    overlay: bool = False,
    sharding: sharding_lib.Target = None,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    auto_labels: binding.AutoLabels = None,
    mesh: jax.sharding.Mesh | None = None,
) -> (
    pz.Struct | tuple[pz.Struct, binding.LoadReport]
    | ModelT | tuple[ModelT, binding.LoadReport]
): ...


def load_model(
    path: opening.PathOrHandle,
    *,
    into: ModelT | None = None,
    strict: bool = True,
    only: binding.LabelGlobs | None = None,
    rename: binding.RenameRules | None = None,
    rename_axes: Mapping[Any, Any] | None = None,
    dtype: binding.DTypeRules | None = None,
    allow_lossy: bool = False,
    overlay: bool = False,
    sharding: sharding_lib.Target = None,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    auto_labels: binding.AutoLabels = None,
    mesh: jax.sharding.Mesh | None = None,
) -> (
    pz.Struct | tuple[pz.Struct, binding.LoadReport]
    | ModelT | tuple[ModelT, binding.LoadReport]
):
  r"""Loads a model saved by `save_model`, rebuilt from the checkpoint alone.

  No model code is needed: layers are rebuilt from their saved classes and
  fields, importing only allow-listed modules.

  ``load_model(path, into=model, ...)`` is the older spelling of
  `load_into` ``(path, model, ...)``, and still works: ``into``, ``only``,
  ``rename``, ``rename_axes``, ``overlay`` and ``auto_labels`` are
  `load_into`'s, documented there.

  Example::

    model = pzp.load_model("/tmp/mlp_lora")

  Args:
    path: A checkpoint directory (or its item directory), or a
      `pz_persist.open` handle (the checkpoint it opened is read).
    into: The older spelling of `load_into`: a model to load the
      checkpoint's variables into, by label.
    strict: With False, return ``(model, report)`` (the report lists every
      variable loaded).
    only: With ``into``: see `load_into`.
    rename: With ``into``: see `load_into`.
    rename_axes: With ``into``: see `load_into`.
    dtype: A dtype to cast the rebuilt model's arrays to (a floating dtype
      casts the floating arrays, an integer dtype the integer ones), or
      ``{label glob: dtype}`` rules. A cast that changes values beyond
      rounding (`pz_persist.format.casts`) is refused unless
      ``allow_lossy=True``.
    allow_lossy: Cast even where values change.
    overlay: With ``into``: see `load_into`.
    sharding: Where arrays are read to: a ``jax.sharding.Sharding`` or
      `pz_persist.AxisRules` (default: the first local device; with ``into``,
      the model's own placement).
    verify: Check every array read against its recorded checksum, before
      anything is built (see `pz_persist.load`).
    allow_modules: Extra modules the checkpoint may name, for this call.
    progress: A bar while the arrays are read (see `pz_persist.load`): None
      for one on a terminal or in a notebook once a load has taken a second,
      True, False, or a function called as ``progress(done, total)`` in
      bytes.
    auto_labels: With ``into``: see `load_into`.
    mesh: Without ``into``: the ``jax.sharding.Mesh`` that the saved model's
      device meshes (those of ``ConstrainShardingByName`` layers, of
      ``NamedSharding``\ s) become; it must have their axis names. By
      default each is rebuilt from its saved axis names and sizes over the
      first devices of ``jax.devices()``, refused
      (`pz_persist.errors.MeshError`) if there are too few.

  Returns:
    The model, or ``(model, report)`` when ``strict=False``.
  """
  if into is not None:
    return load_into(
        path, into, strict=strict, only=only, rename=rename, rename_axes=rename_axes,
        dtype=dtype, allow_lossy=allow_lossy, overlay=overlay, sharding=sharding,
        verify=verify, allow_modules=allow_modules, progress=progress,
        auto_labels=auto_labels,
    )
  unsupported = {
      "only": only, "rename": rename, "rename_axes": rename_axes,
      "overlay": overlay or None, "auto_labels": auto_labels,
  }
  given = [name for name, value in unsupported.items() if value is not None]
  if given:
    raise errors.ArgumentError(
        f"{', '.join(given)} need into=model: a model to load into, as in"
        " pz_persist.load_into(path, model)."
    )
  with allowlist.scoped_allowance(allow_modules), meshes.using(mesh):
    model = opening.read(path, lambda opened: _restore_model(
        opened, sharding=sharding, verify=verify, progress=progress
    ))
  if not isinstance(model, pz.Struct):
    raise errors.PzPersistError(
        f"{path} holds a {type(model).__name__}, not a model. Load it with"
        " pz_persist.load, or bind its variables into a model with"
        " pz_persist.load_into(path, model)."
    )
  if dtype is not None:
    model = binding.cast_model(model, dtype, allow_lossy=allow_lossy,
                               where=str(opening.checkpoint_path(path)))
  if strict:
    return model
  _, variables = pz.unbind_variables(model)
  return model, binding.LoadReport(loaded=tuple(v.label for v in variables))


def _restore_model(opened: opening.OpenItem, **read_args: Any) -> Any:
  """The tree of an opened item, whose variables have unique labels.

  Why checked first: Penzai refuses a model whose variables share a label;
  checked on the manifest, before any array is read.
  """
  manifest_queries.check_variable_labels(opened.manifest, where=str(opened.item))
  return restoring.read_tree(opened, **read_args)
