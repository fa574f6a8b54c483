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
without pz_persist (see `pz_persist.plain_orbax`); how to bind is one
`pz_persist.BindOptions` value (or its fields as keywords).
``load_model(path, into=model)``, its older spelling, warns until it is
removed on 2027-06-01.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Iterable
from typing import Any
from typing import Literal
from typing import TypeVar
from typing import Unpack
from typing import overload

import jax
from etils import epath
from penzai import pz
from typing_extensions import deprecated

from pz_persist import binding
from pz_persist import checkpoint
from pz_persist import deprecations
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
  _check_bindable(path, model)
  checkpoint.save(path, model, overwrite=overwrite, allow_modules=allow_modules)


def _check_bindable(path: epath.PathLike, model: pz.Struct) -> None:
  """Refuses a model `load_model` could not rebuild, before anything is written.

  Why: `load_model` binds the saved variables back by label, so two distinct
  mutable variables with one label cannot both come back (Penzai's own
  `pz.unbind_variables` refuses such a model, and so does the reader's label
  check); a save that succeeds must load. Penzai lets a parameter and a
  state variable share a label (their slots differ in kind), but a
  checkpoint names variables by label alone (`manifest_queries.
  check_variable_labels` refuses the pair on load), so that pair is refused
  here too. One `pz.unbind_variables` call: linear in the model's size.
  """
  try:
    _, variables = pz.unbind_variables(model)
  except pz.VariableConflictError as e:
    raise _unbindable(path, str(e)) from None
  kinds: dict[Hashable, str] = {}
  for variable in variables:
    kind = type(variable).__name__
    if kinds.setdefault(variable.label, kind) != kind:
      raise _unbindable(path, f"a {kinds[variable.label]} and a {kind} have the label"
                        f" {variable.label!r}.")


def _unbindable(path: epath.PathLike, why: str) -> errors.EncodingError:
  return errors.EncodingError(
      f"{path}: save_model cannot save this model: {why} load_model binds"
      " variables by label, so each mutable variable needs a label of its"
      " own: relabel one of them (a new pz.Parameter with its value), or use"
      " one variable at both places. Nothing was written."
  )


ModelT = TypeVar("ModelT")
"""The model given to `load_into`: the model returned is of its type."""

@overload
def load_into(
    path: opening.PathOrHandle,
    model: ModelT,
    options: binding.BindOptions | None = None,
    *,
    strict: Literal[True] = True,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    **keywords: Unpack[binding.BindKeywords],
) -> ModelT: ...


@overload
def load_into(
    path: opening.PathOrHandle,
    model: ModelT,
    options: binding.BindOptions | None = None,
    *,
    strict: Literal[False],
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    **keywords: Unpack[binding.BindKeywords],
) -> tuple[ModelT, binding.LoadReport]: ...


@overload
def load_into(
    path: opening.PathOrHandle,
    model: ModelT,
    options: binding.BindOptions | None = None,
    *,
    strict: bool,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    **keywords: Unpack[binding.BindKeywords],
) -> ModelT | tuple[ModelT, binding.LoadReport]: ...


def load_into(
    path: opening.PathOrHandle,
    model: ModelT,
    options: binding.BindOptions | None = None,
    *,
    strict: bool = True,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    **keywords: Unpack[binding.BindKeywords],
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

  How to bind is one `pz_persist.BindOptions` value, given as ``options`` or
  as its fields' keywords (``only=``, ``rename=``, ``rename_axes=``,
  ``dtype=``, ``allow_lossy=``, ``overlay=``, ``sharding=``,
  ``auto_labels=``), or both: keywords win over the value's fields.

  Example::

    model = pzp.load_into("/tmp/base", model, overlay=True)
    model, report = pzp.load_into(
        "/tmp/base", model, strict=False,
        rename={r"^old/": "new/"}, dtype=jnp.bfloat16,
    )
    print(report)
    bf16 = pzp.BindOptions(dtype=jnp.bfloat16, allow_lossy=True)
    model = pzp.load_into("/tmp/base", model, bf16)

  Args:
    path: A checkpoint directory (or its item directory), or a
      `pz_persist.open` handle (the checkpoint it opened is read).
    model: The model to load the checkpoint's variables into, by label.
    options: How to bind (`pz_persist.BindOptions`; default: its defaults).
    strict: Raise `pz_persist.BindingError`, listing every missing,
      unexpected or mismatched variable, if the checkpoint does not fit. With
      False, load what fits and return ``(model, report)``.
    verify: Check every array read against its recorded checksum, before
      anything is built (see `pz_persist.load`).
    allow_modules: Extra modules the checkpoint may name, for this call.
    progress: A bar while the arrays are read (see `pz_persist.load`): None
      for one on a terminal or in a notebook once a load has taken a second,
      True, False, or a function called as ``progress(done, total)`` in
      bytes. Plain Orbax checkpoints are read in one Orbax call: no steps.
    **keywords: `pz_persist.BindOptions`' fields, each replacing the one of
      ``options``:

      * ``only``: label globs (``fnmatch``): load only the model variables
        they match; the model keeps its other values. Each glob must match a
        label of the checkpoint (as ``rename`` made them), and ``[]``
        selects nothing: refused (`pz_persist.errors.UnknownLabelError` with
        the closest labels; `ArgumentError`), as is each ``rename`` rule,
        ``rename_axes`` key and ``dtype`` rule that matches nothing.
      * ``rename``: regex rules ``{pattern: replacement}`` applied in order
        to the checkpoint's labels to get the model's labels.
      * ``rename_axes``: ``{stored name: model name}`` for renamed axes.
        Stored axes in another order than the model's are transposed
        automatically.
      * ``dtype``: a dtype to cast to on load (a floating dtype casts the
        floating arrays, an integer dtype the integer ones), or
        ``{label glob: dtype}`` rules (each casts every array of the labels
        it matches). The model's current dtype then no longer has to match.
        Narrowing floats is done as asked; a cast that changes values beyond
        rounding, decided from the values by `pz_persist.format.casts` (a
        finite value overflowing, inf or NaN into a dtype without them, a
        fraction dropped, an integer out of range or not exactly
        representable, an imaginary part dropped), is refused, listing each
        variable and a value, unless ``allow_lossy=True``.
      * ``allow_lossy``: cast even where values change (integers wrap
        around, inf becomes NaN in float8_e4m3fn...).
      * ``overlay``: the checkpoint holds only some of the model's variables
        (an adapter over a base model): the others keep their values and
        are not reported missing.
      * ``sharding``: where arrays are read to: a ``jax.sharding.Sharding``
        or `pz_persist.AxisRules` (default: the model's own placement, each
        array read straight into the sharding of the array it replaces, so a
        model larger than one device loads into itself).
      * ``auto_labels``: ``"by_position"``: match the state variables whose
        labels Penzai drew automatically (``pz.AutoStateVarLabel``, new in
        every build, so never equal to the saved ones) by their order in the
        tree: the checkpoint's first to the model's first, and so on.

  Returns:
    The model, or ``(model, report)`` when ``strict=False``.
  """
  bind = binding.BindOptions.of(options, keywords)
  with allowlist.scoped_allowance(allow_modules):
    try:
      loaded, report = opening.read(path, lambda opened: binding.load_into(
          opened, model, bind, strict=strict, verify=verify, progress=progress,
      ))
      return loaded if strict else (loaded, report)
    except errors.NotACheckpointError as e:
      not_native = e  # Raised outside this block: not the context of others.
    # Not a pz_persist checkpoint: perhaps one plain Orbax wrote.
    plain = plain_orbax.find_item(path)
    if plain is None:
      raise not_native
    loaded, report = plain_orbax.load_into(path, plain, model, bind, strict=strict)
    return loaded if strict else (loaded, report)


@overload
def load_model(
    path: opening.PathOrHandle,
    *,
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
@deprecated("load_model(path, into=model) is load_into(path, model) (removed 2027-06-01)")
def load_model(
    path: opening.PathOrHandle,
    *,
    into: ModelT,
    strict: Literal[True] = True,
    **options: Any,
) -> ModelT: ...


@overload
@deprecated("load_model(path, into=model) is load_into(path, model) (removed 2027-06-01)")
def load_model(
    path: opening.PathOrHandle,
    *,
    into: ModelT,
    strict: Literal[False],
    **options: Any,
) -> tuple[ModelT, binding.LoadReport]: ...


def load_model(
    path: opening.PathOrHandle,
    *,
    into: Any = None,
    strict: bool = True,
    dtype: binding.DTypeRules | None = None,
    allow_lossy: bool = False,
    sharding: sharding_lib.Target = None,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    mesh: jax.sharding.Mesh | None = None,
    **options: Any,
) -> Any:
  r"""Loads a model saved by `save_model`, rebuilt from the checkpoint alone.

  No model code is needed: layers are rebuilt from their saved classes and
  fields, importing only allow-listed modules. To load a checkpoint into a
  model you built, use `load_into`.

  ``load_into(path, model, ...)``, the older spelling of `load_into`
  ``(path, model, ...)``, still works until 2027-06-01 and warns
  (``DeprecationWarning``); it takes `load_into`'s options.

  Example::

    model = pzp.load_model("/tmp/mlp_lora")

  Args:
    path: A checkpoint directory (or its item directory), or a
      `pz_persist.open` handle (the checkpoint it opened is read).
    into: Deprecated (removed 2027-06-01): use `load_into`.
    strict: With False, return ``(model, report)`` (the report lists every
      variable loaded).
    dtype: A dtype to cast the rebuilt model's arrays to (a floating dtype
      casts the floating arrays, an integer dtype the integer ones), or
      ``{label glob: dtype}`` rules. A cast that changes values beyond
      rounding (`pz_persist.format.casts`) is refused unless
      ``allow_lossy=True``.
    allow_lossy: Cast even where values change.
    sharding: Where arrays are read to: a ``jax.sharding.Sharding`` or
      `pz_persist.AxisRules` (default: the first local device).
    verify: Check every array read against its recorded checksum, before
      anything is built (see `pz_persist.load`).
    allow_modules: Extra modules the checkpoint may name, for this call.
    progress: A bar while the arrays are read (see `pz_persist.load`): None
      for one on a terminal or in a notebook once a load has taken a second,
      True, False, or a function called as ``progress(done, total)`` in
      bytes.
    mesh: The ``jax.sharding.Mesh`` that the saved model's device meshes
      (those of ``ConstrainShardingByName`` layers, of
      ``NamedSharding``\ s) become; it must have their axis names. By
      default each is rebuilt from its saved axis names and sizes over the
      first devices of ``jax.devices()``, refused
      (`pz_persist.errors.MeshError`) if there are too few.
    **options: With the deprecated ``into`` only: `load_into`'s binding
      options (``only``, ``rename``, ``rename_axes``, ``overlay``,
      ``auto_labels``, or ``options=`` a `pz_persist.BindOptions`).

  Returns:
    The model, or ``(model, report)`` when ``strict=False``.
  """
  if into is not None:
    deprecations.warn("pz_persist.load_model(path, into=model)",
                      "pz_persist.load_into(path, model) (same options)")
    if mesh is not None:
      # load_into binds into the caller's model, whose meshes are its own:
      # a mesh given here would be dropped without a word.
      raise errors.ArgumentError(
          "mesh= rebuilds the meshes of a model loaded from the checkpoint alone;"
          " load_model(path, into=model) binds into your model, whose meshes stay"
          " its own. Drop mesh=, or build the model on the mesh you want.")
    value = options.pop("options", None)
    given = {"dtype": dtype, "allow_lossy": allow_lossy, "sharding": sharding}
    options.update((name, v) for name, v in given.items() if v is not None and v is not False)
    return load_into(
        path, into, value, strict=strict, verify=verify, allow_modules=allow_modules,
        progress=progress, **options,
    )
  if options:
    # An unknown keyword is named as such; a known one needs a model.
    binding.BindOptions().with_keywords(**{k: v for k, v in options.items() if k != "options"})
    raise errors.ArgumentError(
        f"{', '.join(options)} need a model to load into, as in"
        " pz_persist.load_into(path, model, ...)."
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


def _restore_model(
    opened: opening.OpenItem, *, sharding: sharding_lib.Target, verify: bool,
    progress: progress_lib.Progress,
) -> object:
  """The tree of an opened item, whose variables have unique labels.

  Why checked first: Penzai refuses a model whose variables share a label;
  checked on the manifest, before any array is read.
  """
  manifest_queries.check_variable_labels(opened.manifest, where=str(opened.item))
  return restoring.read_tree(opened, sharding=sharding, verify=verify, progress=progress)
