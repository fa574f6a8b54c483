"""Loading a checkpoint's variables into a given model, by label, with a report.

``pz.bind_variables`` silently leaves a slot unbound when a label is missing,
and raises on the first extra label. Loading pretrained or fine-tuned weights
into a freshly built (or edited) model needs more: every difference found at
once, in one readable report, and control over what to do about each:

* ``only=`` globs select which labels to load (the model keeps its other values);
* ``rename=`` regex rules map checkpoint labels to model labels;
* stored axes in another order are transposed to the model's order, and
  ``rename_axes=`` maps stored axis names to the model's;
* ``dtype=`` casts on load, refusing casts that change values beyond rounding
  unless ``allow_lossy=True``;
* ``overlay=True`` loads a checkpoint that holds only some of the model's
  variables (an adapter over a base model).

These options are one value, `BindOptions`, which every entry point hands
down to `bind` (the keywords are its fields, typed by `BindKeywords`).

Nothing is mutated: the model passed in is left as it was, and a new model is
returned only once every check passed (or with ``strict=False``, together with
the report of what was not loaded).
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import re
from collections.abc import Hashable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Literal
from typing import Protocol
from typing import TypedDict
from typing import TypeVar
from typing import Unpack

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from pz_persist import deprecations
from pz_persist import errors
from pz_persist import progress as progress_lib
from pz_persist import sharding as sharding_lib
from pz_persist.format import casts
from pz_persist.format import decode
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import manifest_queries
from pz_persist.format import nodes
from pz_persist.format import selection
from pz_persist.format import variable_kinds
from pz_persist.storage.reading import opening
from pz_persist.storage.reading import placements
from pz_persist.storage.reading import reader

LabelGlobs = str | Sequence[str]
RenameRules = Mapping[str, str] | Sequence[tuple[str, str]]
DTypeRules = jax.typing.DTypeLike | Mapping[str, jax.typing.DTypeLike]

ModelT = TypeVar("ModelT")
"""A model bound into: the model returned is of its type."""

AxisRenames = Mapping[str, str]
"""``rename_axes=``: ``{stored axis name: model axis name}``."""

AutoLabels = Literal["by_position"] | None
"""How state variables with automatic labels are matched (`load_into`)."""

# Former spellings: `pz_persist.BindingError` (defined in `pz_persist.errors`).
__getattr__ = deprecations.module_getattr(__name__, {
    "BindingError": "pz_persist.errors.BindingError",
})


@dataclasses.dataclass(frozen=True, kw_only=True)
class BindOptions:
  """How a checkpoint's variables are bound into a model: one value for all of it.

  Every way of loading into a built model (`pz_persist.load_into`, plain
  Orbax checkpoints through it, `pz_persist.migrate`) takes these options
  either as this value (``options=``) or as the same keywords, and hands
  them down as this one value to `bind`, the one place they are applied.
  Why a value: a choice made once (a rename table, dtype rules) is kept and
  reused across calls, and a new option is added in one place instead of in
  the signature of every entry point. Frozen: a value handed to a load is
  never changed by it. Keywords given beside ``options`` win over its
  fields (`with_keywords`).

  Example::

    import jax.numpy as jnp
    import pz_persist as pzp

    finetune = pzp.BindOptions(rename={r"^base/": ""}, dtype=jnp.bfloat16)
    assert finetune.with_keywords(overlay=True).overlay
    # model = pzp.load_into(path, model, finetune)           # as a value
    # model = pzp.load_into(path, model, rename={r"^base/": ""})  # as keywords

  Attributes:
    only: Label globs (``fnmatch``): bind only the model variables they
      match; the model keeps its other values. Each glob must match a
      checkpoint label, and ``[]`` selects nothing: both refused.
    rename: Regex rules ``{pattern: replacement}`` applied in order to the
      checkpoint's labels to get the model's.
    rename_axes: ``{stored axis name: model axis name}``; stored axes in
      another order than the model's are transposed automatically.
    dtype: A dtype to cast to, or ``{label glob: dtype}`` rules; a cast that
      changes values beyond rounding is refused unless ``allow_lossy``.
    allow_lossy: Cast even where values change.
    overlay: The checkpoint holds only some of the model's variables (an
      adapter): the others keep their values and are not reported missing.
    sharding: Where arrays are read to (a ``jax.sharding.Sharding`` or
      `pz_persist.AxisRules`; default: the model's own placement).
    auto_labels: ``"by_position"``: match state variables with automatic
      labels (``pz.AutoStateVarLabel``) by their order in the tree.
  """

  only: LabelGlobs | None = None
  rename: RenameRules | None = None
  rename_axes: AxisRenames | None = None
  dtype: DTypeRules | None = None
  allow_lossy: bool = False
  overlay: bool = False
  sharding: sharding_lib.Target = None
  auto_labels: AutoLabels = None

  def __post_init__(self) -> None:
    """Refuses a mistyped option when the value is made, whichever entry point
    it came through (a value, keywords, the deprecated ``into=``).

    Why: ``overlay="no"`` is truthy, so it hid missing variables; a list
    for ``rename_axes`` or a string for ``sharding`` failed deep in the read
    with an ``AttributeError``. (What the globs, rules and dtypes match is
    checked against the checkpoint, by `bind`.)
    """
    casts.lossy_allowed(self.allow_lossy, "pz_persist.BindOptions")
    if not isinstance(self.overlay, bool):
      raise errors.ArgumentTypeError(
          f"overlay={self.overlay!r:.100} must be True or False (pz_persist.BindOptions),"
          f" not a {type(self.overlay).__name__}.")
    if self.rename_axes is not None and not (
        isinstance(self.rename_axes, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in self.rename_axes.items())):
      raise errors.ArgumentTypeError(
          f"rename_axes={self.rename_axes!r:.100} must be a dict"
          " {stored axis name: model axis name} of str (pz_persist.BindOptions).")
    sharding_lib.check_target(self.sharding)

  def with_keywords(self, **keywords: Unpack[BindKeywords]) -> BindOptions:
    """These options with ``keywords`` (`BindKeywords`) replacing fields.

    Raises:
      ArgumentTypeError: a keyword is no field of `BindOptions` (named, with
        the fields there are).
    """
    unknown = sorted(set(keywords) - _FIELDS)
    if unknown:
      close = [m for name in unknown for m in difflib.get_close_matches(name, _FIELDS, n=1)]
      raise errors.ArgumentTypeError(
          f"unknown binding option(s) {', '.join(unknown)}"
          f"{' (did you mean ' + ', '.join(close) + '?)' if close else ''}; the options are"
          f" {', '.join(sorted(_FIELDS))} (pz_persist.BindOptions)."
      )
    return dataclasses.replace(self, **keywords) if keywords else self

  @classmethod
  def of(cls, options: BindOptions | None, keywords: BindKeywords) -> BindOptions:
    """The options an entry point was given: ``options`` (or the defaults)
    with the keyword spellings beside it applied."""
    if options is not None and not isinstance(options, BindOptions):
      raise errors.ArgumentTypeError(
          f"options must be a pz_persist.BindOptions, not a {type(options).__name__}"
          " (or pass the options as keywords)."
      )
    return (options or cls()).with_keywords(**keywords)


class BindKeywords(TypedDict, total=False):
  """`BindOptions`' fields as keywords (``**keywords: Unpack[BindKeywords]``):
  what entry points accept beside ``options=``, typed field for field."""

  only: LabelGlobs | None
  rename: RenameRules | None
  rename_axes: AxisRenames | None
  dtype: DTypeRules | None
  allow_lossy: bool
  overlay: bool
  sharding: sharding_lib.Target
  auto_labels: AutoLabels


_FIELDS = frozenset(field.name for field in dataclasses.fields(BindOptions))


@dataclasses.dataclass(frozen=True)
class Mismatch:
  """One variable the checkpoint has but cannot load into the model as is.

  Attributes:
    label: The model's label of the variable.
    what: What differs: ``"kind"``, ``"structure"``, ``"shape"``, ``"axes"``,
      ``"dtype"`` or ``"lossy cast"``.
    checkpoint: What the checkpoint has.
    model: What the model wants.
  """

  label: Hashable
  what: str
  checkpoint: str
  model: str

  def __str__(self) -> str:
    if self.what == "lossy cast":
      return (
          f"{nodes.describe_label(self.label)}: casting to {self.model} would change"
          f" values: the checkpoint's {self.checkpoint}"
      )
    return (
        f"{nodes.describe_label(self.label)}: {self.what} differs: checkpoint has"
        f" {self.checkpoint}, model wants {self.model}"
    )


@dataclasses.dataclass(frozen=True)
class LoadReport:
  """What loading a checkpoint into a model did, label by label.

  Attributes:
    loaded: Model labels that received values from the checkpoint.
    missing: Model labels the checkpoint has no value for (within ``only``).
    unexpected: Checkpoint labels the model has no variable for.
    mismatched: Variables present in both that could not be loaded.
    renamed: ``(checkpoint label, model label)`` pairs changed by ``rename=``.
    transposed: Model labels whose stored axes were reordered to fit.
    cast: ``(model label, from dtype, to dtype)`` for each cast done.
    matched: Labels both the checkpoint and the model have (within
      ``only``), loaded or not: what the hints weigh the mismatch against.
  """

  loaded: tuple[Hashable, ...] = ()
  missing: tuple[Hashable, ...] = ()
  unexpected: tuple[Hashable, ...] = ()
  mismatched: tuple[Mismatch, ...] = ()
  renamed: tuple[tuple[Hashable, Hashable], ...] = ()
  transposed: tuple[Hashable, ...] = ()
  cast: tuple[tuple[Hashable, str, str], ...] = ()
  matched: tuple[Hashable, ...] = ()

  @property
  def ok(self) -> bool:
    """True when nothing is missing, unexpected or mismatched."""
    return not (self.missing or self.unexpected or self.mismatched)

  def problems(self) -> list[str]:
    """Lines describing what is missing, unexpected or mismatched."""
    lines = []
    for title, labels in (("missing from the checkpoint", self.missing),
                          ("not in the model", self.unexpected)):
      if labels:
        lines.append(f"{len(labels)} {title}:")
        lines += [f"  {nodes.describe_label(label)}" for label in labels]
    if self.mismatched:
      lines.append(f"{len(self.mismatched)} could not be loaded:")
      lines += [f"  {mismatch}" for mismatch in self.mismatched]
    return lines + _hints(self.missing, self.unexpected, self.matched)

  def __str__(self) -> str:
    lines = [f"loaded {len(self.loaded)} variable(s)", *self.problems()]
    for title, items in (("renamed", self.renamed), ("cast", self.cast)):
      if items:
        lines.append(f"{len(items)} {title}:")
        lines += ["  " + " -> ".join(nodes.describe_label(x) for x in item) for item in items]
    if self.transposed:
      lines.append(f"{len(self.transposed)} transposed to the model's axis order:")
      lines += [f"  {nodes.describe_label(label)}" for label in self.transposed]
    return "\n".join(lines)


def _hints(
    missing: tuple[Hashable, ...], unexpected: tuple[Hashable, ...],
    matched: tuple[Hashable, ...] = (),
) -> list[str]:
  """What to do when labels do not match: automatic labels of state
  variables (never equal between builds); labels whose prefix changed, when
  one prefix change explains most of the mismatch; otherwise, when the two
  have few labels in common, whether this is the model's checkpoint at all
  (a rename= guessed from a few similar endings would only mislead)."""
  hints = []
  auto = sum(isinstance(label, pz.AutoStateVarLabel) for label in missing)
  if auto and any(isinstance(label, pz.AutoStateVarLabel) for label in unexpected):
    hints.append(
        f"hint: {auto} of the model's state variables have automatic labels"
        " (AutoStateVarLabel), which Penzai draws anew each time a model is"
        " built, so they never match a saved model's. Match them by position"
        " with load_into(path, model, auto_labels='by_position'), or give"
        " them fixed labels (pz.StateVariable(value, label='...'))."
    )
  rule = _prefix_rule(
      [label for label in missing if isinstance(label, str)],
      [label for label in unexpected if isinstance(label, str)],
  )
  if rule is not None and 2 * rule[2] > max(len(missing), len(unexpected)):
    old, new, count = rule
    hints.append(
        f"hint: {count} label(s) not in the model match missing ones once their"
        f" prefix {old!r} becomes {new!r}: load_into(path, model,"
        f" rename={{{'^' + re.escape(old)!r}: {new!r}}})"
    )
  elif unexpected and not hints and 2 * len(matched) < len(matched) + len(unexpected):
    hints.append(_foreign_hint(len(matched), len(matched) + len(unexpected),
                               len(matched) + len(missing) if missing else None))
  return hints


def _foreign_hint(common: int, checkpoint: int, model: int | None) -> str:
  """The hint for a checkpoint sharing few labels with the model: perhaps
  another model's (``model``: how many labels the model has; None if unknown,
  as with ``overlay``)."""
  share = "none" if not common else f"only {common}"
  counts = (f"the checkpoint has {checkpoint} label(s) and the model {model}, {share} of"
            " them in both" if model is not None
            else f"the checkpoint has {checkpoint} label(s), {share} of them in the model")
  return (
      f"hint: {counts}, and no one change of label prefix explains the difference:"
      " is this the checkpoint of this model? `pz-persist inspect PATH` lists its"
      " labels and the class it was saved from."
  )


_SEPARATORS = "/."


def _prefix_rule(missing: list[str], unexpected: list[str]) -> tuple[str, str, int] | None:
  """The prefix change (``"mlp/"`` to ``"net/"``) that turns the most
  checkpoint labels the model lacks into labels it misses, with how many;
  None if none does. Candidates come from pairing a few of the checkpoint's
  labels with each missing one and keeping their common ending (from a
  separator on), so a model of thousands of labels is checked quickly."""
  wanted = set(missing)
  best: tuple[str, str, int] | None = None
  candidates = {
      pair for label in unexpected[:3] for target in missing[:500]
      if (pair := _prefixes(label, target)) is not None
  }
  for old, new in candidates:
    count = sum(
        label.startswith(old) and new + label[len(old):] in wanted for label in unexpected
    )
    if count and (best is None or count > best[2]):
      best = (old, new, count)
  return best


def _prefixes(a: str, b: str) -> tuple[str, str] | None:
  """The different beginnings of ``a`` and ``b`` before their common ending,
  which starts after a separator (``mlp/x`` and ``net/x``: ``mlp/``, ``net/``)."""
  common = 0
  while common < min(len(a), len(b)) and a[-1 - common] == b[-1 - common]:
    common += 1
  cut_a, cut_b = len(a) - common, len(b) - common
  while cut_a < len(a) and (cut_a and a[cut_a - 1] not in _SEPARATORS):
    cut_a, cut_b = cut_a + 1, cut_b + 1  # Move the cut after a separator.
  if cut_a >= len(a) or not a[:cut_a] or a[:cut_a] == b[:cut_b]:
    return None
  return a[:cut_a], b[:cut_b]


def _globs(only: LabelGlobs | None, where: str) -> tuple[str, ...] | None:
  if only is None:
    return None
  globs = (only,) if isinstance(only, str) else _sequence(only, "only", where)
  if not globs:
    raise selection.empty(where, "only")
  for glob in globs:
    if not isinstance(glob, str):
      raise errors.ArgumentTypeError(
          f"{where}: only= holds {glob!r:.60}, not a str; give label globs"
          " (only='blocks/*' or a list of them).")
  return globs


def _sequence(value: Any, option: str, where: str) -> tuple[Any, ...]:
  """``value`` as a tuple, if it is a list, tuple or other sized iterable;
  else an `ArgumentTypeError` naming ``option`` (a number or a function
  would otherwise fail deep inside with ``TypeError: not iterable``)."""
  if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
    raise errors.ArgumentTypeError(
        f"{where}: {option}= is a {type(value).__name__} ({value!r:.60}); give"
        f" {'a str or a list of str' if option == 'only' else 'a dict or a list of pairs'}."
    )
  return tuple(value)


def _check_selectors(
    where: str, stored: Mapping[Hashable, Any], globs: tuple[str, ...] | None,
    dtype: DTypeRules | None,
) -> None:
  """Refuses each ``only=`` glob and ``dtype=`` rule matching no label the
  checkpoint has (as ``rename=`` made them): it would load, or cast, nothing."""
  names = [nodes.describe_label(label) for label in stored]
  rules = [(f"only={glob!r}", glob) for glob in globs or ()]
  for glob, rule in (dtype.items() if isinstance(dtype, Mapping) else [(None, dtype)]):
    if glob is not None and not isinstance(glob, str):
      raise errors.ArgumentTypeError(
          f"{where}: the dtype= rule {glob!r:.60} is not a str; key rules by label glob.")
    try:
      np.dtype(rule)
    except TypeError as e:
      raise errors.ArgumentError(
          f"{where}: dtype={rule!r:.60}{'' if glob is None else f' (for {glob!r})'}"
          f" is not a dtype ({e}); give one such as jnp.bfloat16 or 'float32'.") from None
  if isinstance(dtype, Mapping):
    rules += [(f"the dtype= rule {glob!r}", glob) for glob in dtype]
  for option, glob in rules:
    if not any(fnmatch.fnmatchcase(name, glob) for name in names):
      raise selection.unmatched(
          where, f"{option} matches no label of this checkpoint (labels are matched"
          " whole, as fnmatch globs)", glob, names,
          listed_by=" (pz_persist.open(path).labels lists them)")


def _selected(label: Hashable, globs: tuple[str, ...] | None) -> bool:
  return globs is None or any(fnmatch.fnmatchcase(nodes.describe_label(label), g) for g in globs)


def _rules(rename: RenameRules | None, where: str) -> list[tuple[re.Pattern[str], str]]:
  """``rename=``'s (pattern, replacement) rules compiled; each pattern a
  regular expression, refused by name if it is not one (or not a str)."""
  if rename is None:
    return []
  items = tuple(rename.items()) if isinstance(rename, Mapping) else _sequence(
      rename, "rename", where)
  rules = []
  for item in items:
    if not (isinstance(item, tuple | list) and len(item) == 2
            and all(isinstance(part, str) for part in item)):
      raise errors.ArgumentTypeError(
          f"{where}: rename= holds {item!r:.80}; each rule is a pair of str"
          " (pattern, replacement), as in rename={'^old/': 'new/'}.")
    try:
      rules.append((re.compile(item[0]), item[1]))
    except re.error as e:
      raise errors.ArgumentError(
          f"{where}: the rename= pattern {item[0]!r:.80} is not a regular expression"
          f" ({e}); escape it with re.escape to match it literally.") from None
  return rules


def _rename(label: Hashable, rules) -> Hashable:
  if not isinstance(label, str):
    return label
  for pattern, replacement in rules:
    label = pattern.sub(replacement, label)
  return label


def _target_dtype(
    label: Hashable, dtype: DTypeRules | None, current: np.dtype
) -> np.dtype | None:
  """The dtype ``dtype=`` asks for an array of ``label`` and dtype ``current``.

  A single dtype casts the arrays of its own kind (a floating dtype the
  floating arrays, an integer dtype the integer arrays), so ``dtype=bfloat16``
  leaves integer state such as a KV cache's index alone. A ``{glob: dtype}``
  rule casts every numeric array of the labels it matches.
  """
  if dtype is None or current == np.bool_:
    return None
  if isinstance(dtype, Mapping):
    for glob, rule in dtype.items():
      if fnmatch.fnmatchcase(nodes.describe_label(label), glob):
        target = np.dtype(rule)
        return target if target != current else None
    return None
  target = np.dtype(dtype)
  same_kind = any(
      jnp.issubdtype(target, kind) and jnp.issubdtype(current, kind)
      for kind in (jnp.floating, jnp.integer, jnp.complexfloating)
  )
  return target if same_kind and target != current else None


def _cast_value(label, value, dtype, allow_lossy, cast, problems):
  """Casts the arrays of a variable's value as ``dtype=`` asks.

  Works on abstract values too (``jax.ShapeDtypeStruct`` leaves), where only
  the dtype changes and no values can be checked.
  """

  def cast_array(x):
    if not hasattr(x, "dtype") or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return x
    target = _target_dtype(label, dtype, np.dtype(x.dtype))
    if target is None:
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      cast.append((label, str(x.dtype), str(target)))
      return jax.ShapeDtypeStruct(x.shape, target)
    reason = None if casts.lossy_allowed(allow_lossy, nodes.describe_label(label)) else (
        casts.check(x, target))
    if reason:
      problems.append(Mismatch(
          label, "lossy cast", f"{reason} (pass allow_lossy=True to cast anyway)", str(target),
      ))
      return x
    cast.append((label, str(x.dtype), str(target)))
    with np.errstate(all="ignore"):  # NumPy warns of what allow_lossy allowed.
      return x.astype(target)

  return jax.tree.map(cast_array, value)


def _rename_axes(value: Any, mapping: Mapping[Any, Any] | None) -> Any:
  if not mapping:
    return value

  def rename(x):
    if not isinstance(x, pz.nx.NamedArrayBase):
      return x
    view = x.as_namedarrayview()
    return dataclasses.replace(
        view,
        data_axis_for_name={
            mapping.get(name, name): index
            for name, index in view.data_axis_for_name.items()
        },
    )

  return jax.tree.map(rename, value, is_leaf=nodes.fits_its_axes)


def _describe_array(x: Any) -> str:
  if isinstance(x, pz.nx.NamedArrayBase):
    positional = "".join(f"{n}, " for n in x.positional_shape)
    named = ", ".join(f"{k}:{v}" for k, v in x.named_shape.items())
    return f"{x.dtype}({positional}| {named})"
  return f"{getattr(x, 'dtype', type(x).__name__)}{list(np.shape(x))}"


def _data(x: Any) -> Any:
  return x.data_array if isinstance(x, pz.nx.NamedArrayBase) else x


def _misfit(
    label: Hashable, value: Any, target: Any, *, check_dtype: bool = True
) -> tuple[Mismatch | None, bool]:
  """Whether ``value`` fits ``target`` (the model's current value).

  Compares structure, axis names, shapes and dtypes only, so it works on
  abstract values before any array is read. Returns the mismatch, if any, and
  whether the stored axes must be reordered to the model's order.
  """
  values, value_def = jax.tree.flatten(value, is_leaf=nodes.fits_its_axes)
  targets, target_def = jax.tree.flatten(target, is_leaf=nodes.fits_its_axes)
  if value_def != target_def:  # type: ignore[operator]  # jax's PyTreeDef alias is opaque to mypy.
    return Mismatch(label, "structure", str(value_def), str(target_def)), False
  reorder = False
  for v, t in zip(values, targets):
    if isinstance(v, pz.nx.NamedArrayBase) != isinstance(t, pz.nx.NamedArrayBase):
      return Mismatch(label, "structure", _describe_array(v), _describe_array(t)), False
    if isinstance(v, pz.nx.NamedArrayBase):
      if set(v.named_shape) != set(t.named_shape):
        return Mismatch(label, "axes", _describe_array(v), _describe_array(t)), False
      if v.named_shape != t.named_shape or v.positional_shape != t.positional_shape:
        return Mismatch(label, "shape", _describe_array(v), _describe_array(t)), False
      reorder |= jax.tree.structure(v) != jax.tree.structure(t)  # type: ignore[operator]  # As above.
    elif np.shape(v) != np.shape(t):
      return Mismatch(label, "shape", _describe_array(v), _describe_array(t)), False
    dtypes = [getattr(_data(x), "dtype", None) for x in (v, t)]
    if check_dtype and None not in dtypes and dtypes[0] != dtypes[1]:
      return Mismatch(
          label, "dtype", str(_data(v).dtype), f"{_data(t).dtype} (pass dtype= to cast)"
      ), False
  return None, reorder


def _stored_dims(value: Any, target: Any) -> tuple[int, ...]:
  """For each data dimension of ``target`` (the model's array), the data
  dimension of ``value`` (as stored) holding the same axis (after `_misfit`
  passed: same axis names and shapes)."""
  if not isinstance(value, pz.nx.NamedArrayBase):
    return tuple(range(np.ndim(value)))
  stored, model = value.as_namedarrayview(), target.as_namedarrayview()
  dims = dict(zip(model.data_axis_for_logical_axis, stored.data_axis_for_logical_axis))
  for name, dim in model.data_axis_for_name.items():
    dims[dim] = stored.data_axis_for_name[name]
  return tuple(dims[dim] for dim in range(len(model.data_shape)))


def _in_stored_order(
    sharding: jax.sharding.Sharding, stored_dims: tuple[int, ...]
) -> jax.sharding.Sharding | None:
  """``sharding`` (of the model's array) for the array as stored, whose
  dimension ``stored_dims[i]`` is the model's dimension ``i``; None (read it
  to the host) when it cannot be permuted."""
  if stored_dims == tuple(range(len(stored_dims))) or len(sharding.device_set) == 1:
    return sharding
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return None
  spec = tuple(sharding.spec) + (None,) * (len(stored_dims) - len(sharding.spec))
  permuted: list[Any] = [None] * len(stored_dims)
  for model_dim, stored_dim in enumerate(stored_dims):
    permuted[stored_dim] = spec[model_dim]
  return jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec(*permuted),
      memory_kind=sharding.memory_kind,
  )


def _fit(value: Any, target: Any, *, place: bool) -> Any:
  """``value`` laid out like ``target`` (after `_misfit` passed), and placed
  like it (same devices and sharding) if ``place``."""

  def fit(v, t):
    data, target_data = _data(v), _data(t)
    if place and isinstance(target_data, jax.Array) and not isinstance(data, jax.Array):
      # Host data is transposed on the host, then sent to the model's shards
      # (a transpose on a device would first put it whole on the default one).
      placed = jax.device_put(np.transpose(data, _stored_dims(v, t)), target_data.sharding)
      return (
          dataclasses.replace(t, data_array=placed)
          if isinstance(t, pz.nx.NamedArrayBase)
          else placed
      )
    if isinstance(v, pz.nx.NamedArrayBase):
      v = v.order_like(t)
    data = _data(v)
    if place and isinstance(target_data, jax.Array) and (
        not isinstance(data, jax.Array) or data.sharding != target_data.sharding
    ):  # Follow the model's placement (device, sharding).
      placed = jax.device_put(data, target_data.sharding)
      v = (
          dataclasses.replace(v, data_array=placed)
          if isinstance(v, pz.nx.NamedArrayBase)
          else placed
      )
    return v

  return jax.tree.map(fit, value, target, is_leaf=nodes.fits_its_axes)


def _model_variables(
    model: object,
) -> tuple[Any, dict[Hashable, pz.AbstractVariable], dict[Hashable, pz.AbstractVariableSlot]]:
  """The model's structure with slots, its bound variables and its slots."""
  structure, bound = pz.unbind_variables(model)
  slots = {
      leaf.label: leaf
      for leaf in jax.tree.leaves(
          structure, is_leaf=lambda x: isinstance(x, pz.AbstractVariableSlot)
      )
      if isinstance(leaf, pz.AbstractVariableSlot)
  }
  return structure, {var.label: var for var in bound}, slots


def _kind_of_slot(slot: pz.AbstractVariableSlot) -> str:
  return variable_kinds.kind_of(slot)


def load_into(
    opened: opening.OpenItem,
    model: ModelT,
    options: BindOptions,
    *,
    strict: bool = True,
    verify: bool = True,
    progress: progress_lib.Progress = None,
) -> tuple[ModelT, LoadReport]:
  """Loads the variables of the opened checkpoint item into ``model``.

  See `pz_persist.load_into` for the options. Returns the new model and the
  report. With ``strict``, raises `BindingError` before reading any array if
  labels are missing or unexpected or a variable's structure, axes, shapes or
  dtypes do not fit, and before building anything if a cast would be lossy.
  """
  where = str(opened.item)
  stored, renamed = _checkpoint_variables(opened.manifest, where, _rules(options.rename, where))
  _check_axis_names(where, opened.manifest, options.rename_axes)
  if options.auto_labels is not None:
    stored, renamed = _auto_labels_by_position(
        where, model, stored, renamed, options.auto_labels)
  return bind(
      where, model, _ManifestSource(opened, stored, options.rename_axes, progress), options,
      renamed=renamed, strict=strict, verify=verify,
  )


def _check_axis_names(
    where: str, manifest: manifest_lib.Manifest, rename_axes: AxisRenames | None
) -> None:
  """Refuses each ``rename_axes=`` key that is no axis name of the
  checkpoint: it would rename nothing."""
  if not rename_axes:
    return
  stored = {axis for axes in manifest_queries.axis_names(manifest).values()
            for axis in axes if axis is not None}
  for name in rename_axes:
    if name not in stored:
      raise selection.unmatched(
          where, f"rename_axes={{{name!r}: ...}} names no axis of this checkpoint",
          str(name), sorted(map(str, stored)), noun="axis names",
          listed_by=" (pz_persist.inspect(path) shows them)")


class Source(Protocol):
  """Where `bind` gets variables from: a checkpoint, by label.

  Attributes:
    stored: The checkpoint's variables by (model) label; each has ``kind``
      (``"parameter"`` or ``"state_variable"``) and ``metadata``.
  """

  @property
  def stored(self) -> Mapping[Hashable, Any]:  # Read-only: any mapping will do.
    ...

  def abstract(self, label: Hashable, current: Any) -> Any:
    """The stored value of ``label`` with ``jax.ShapeDtypeStruct`` arrays, or
    the `Mismatch` that rules it out already; reads no array. ``current`` is
    the model's value (None for an unbound slot)."""

  def read(
      self, labels: Sequence[Hashable], *, sharding: sharding_lib.Target,
      verify: bool, bound: Mapping[Hashable, Any],
  ) -> dict[Hashable, Any]:
    """The stored values of ``labels``, as read (before any cast). With
    ``sharding`` None, each array is read where the model's array it
    replaces is (``bound``: the model's variables), never whole onto one
    device on its way there."""


def bind(
    where: str,
    model: ModelT,
    source: Source,
    options: BindOptions,
    *,
    renamed: tuple[tuple[Hashable, Hashable], ...] = (),
    strict: bool = True,
    verify: bool = True,
) -> tuple[ModelT, LoadReport]:
  """Loads the variables ``source`` holds into ``model``, checked and reported.

  The one place every way of loading into a model goes through (native
  checkpoints, plain Orbax ones), so each gets the same checks, options,
  report and strictness. See `load_into`. (``options.rename``,
  ``rename_axes`` and ``auto_labels`` are the source's to apply: they
  decide the labels ``source.stored`` has.)
  """
  stored = source.stored
  structure, bound, slots = _model_variables(model)
  globs = _globs(options.only, where)
  _check_selectors(where, stored, globs, options.dtype)
  wanted = [label for label in slots if _selected(label, globs)]
  missing = () if options.overlay else tuple(label for label in wanted if label not in stored)
  unexpected = tuple(
      label for label in stored if _selected(label, globs) and label not in slots
  )

  matched = tuple(label for label in wanted if label in stored)
  # Everything that needs no array data is checked first: one error lists all.
  plan = _Plan(source, options.dtype)
  for label in matched:
    plan.check(label, stored[label], slots[label], bound.get(label))
  if strict and (missing or unexpected or plan.problems):
    raise errors.BindingError(where, LoadReport(
        missing=missing, unexpected=unexpected, mismatched=tuple(plan.problems),
        renamed=renamed, transposed=tuple(plan.transposed), matched=matched,
    ))

  values, cast = plan.read(
      bound, allow_lossy=options.allow_lossy, sharding=options.sharding, verify=verify
  )
  report = LoadReport(
      loaded=tuple(values),
      missing=missing,
      unexpected=unexpected,
      mismatched=tuple(plan.problems),
      renamed=renamed,
      transposed=tuple(label for label in plan.transposed if label in values),
      cast=tuple(cast),
      matched=matched,
  )
  if strict and not report.ok:
    raise errors.BindingError(where, report)
  return _rebind(structure, bound, stored, values), report


def _auto_labels_by_position(
    where: str,
    model: object,
    stored: dict[Hashable, Any],
    renamed: tuple[tuple[Hashable, Hashable], ...],
    how: str,
) -> tuple[dict[Hashable, Any], tuple[tuple[Hashable, Hashable], ...]]:
  """The checkpoint's variables with their automatic labels replaced by the
  model's, the first saved one by the model's first, and so on: Penzai
  draws a new `AutoStateVarLabel` for each state variable of each build, so
  a fresh model's never equal a saved one's, while their order (the tree's)
  does not change between builds of the same code."""
  if how != "by_position":
    raise errors.ArgumentError(f"auto_labels={how!r}: the only choice is 'by_position'.")
  _, _, slots = _model_variables(model)
  ours = [label for label in slots if isinstance(label, pz.AutoStateVarLabel)]
  theirs = [label for label in stored if isinstance(label, pz.AutoStateVarLabel)]
  if len(ours) != len(theirs):
    raise errors.ArgumentError(
        f"{where}: auto_labels='by_position' pairs state variables with automatic"
        f" labels in order, but the checkpoint has {len(theirs)} and the model"
        f" {len(ours)}; the model is not built as the saved one was."
    )
  mapping = dict(zip(theirs, ours))
  return (
      {mapping.get(label, label): variable for label, variable in stored.items()},
      (*renamed, *mapping.items()),
  )


def _checkpoint_variables(manifest, where, rules):
  """The checkpoint's variables by (renamed) label, and the renames done.

  Raises:
    UnknownLabelError: a ``rename=`` rule matches no label (as the rules
      before it left them): it would rename nothing.
  """
  by_label: dict[Hashable, manifest_queries.Variable] = {}
  renamed = []
  variables = manifest_queries.variables(manifest, where=where)
  labels = [variable.label for variable in variables]
  for index, (pattern, replacement) in enumerate(rules):
    texts = [label for label in labels if isinstance(label, str)]
    if not any(pattern.search(label) for label in texts):
      raise selection.unmatched(
          where, f"the rename= rule {pattern.pattern!r} matches no label of this"
          f" checkpoint{' (as the rules before it renamed them)' if index else ''}",
          pattern.pattern, texts, listed_by=" (pz_persist.open(path).labels lists them)")
    labels = [_rename(label, [(pattern, replacement)]) for label in labels]
  for variable in variables:
    label = _rename(variable.label, rules)
    if label != variable.label:
      renamed.append((variable.label, label))
    if label in by_label:
      raise errors.BindingError(where, LoadReport(mismatched=(Mismatch(
          label, "label", f"{nodes.describe_label(by_label[label].label)} and"
          f" {nodes.describe_label(variable.label)} both renamed to it", "one variable"),)))
    by_label[label] = variable
  return by_label, tuple(renamed)


class _ManifestSource:
  """A pz_persist checkpoint's variables: decoded from its manifest, read
  through `pz_persist.storage.reading.reader`."""

  def __init__(self, opened: opening.OpenItem, stored, rename_axes,
               progress: progress_lib.Progress = None):
    self._item = opened.item
    self._manifest = manifest = opened.manifest
    self._snapshot = opened.snapshot
    self._rename_axes = rename_axes
    self._progress = progress
    self._abstract_arrays = [spec.abstract() for spec in manifest.arrays]
    self.stored = stored

  def _value(self, variable: manifest_queries.Variable, arrays, **kwargs: Any) -> Any:
    value = decode.decode(
        variable.value, self._manifest.variables, arrays,
        root=variable.location.joined(".value"),
        format_version=self._manifest.format_version, writer=self._manifest.writer, **kwargs,
    )
    return _rename_axes(value, self._rename_axes)

  def abstract(self, label, current) -> Any:
    del current  # The manifest says everything.
    return self._value(self.stored[label], self._abstract_arrays, abstract=True)

  def read(self, labels, *, sharding, verify, bound):
    refs = {ref for label in labels for ref in self.stored[label].refs}
    if sharding is None:  # Each array straight into the model's own sharding.
      sharding = self._model_placements(labels, bound)
    with progress_lib.tracking(self._progress, f"loading {self._item}",
                               delay=reader.LOAD_PROGRESS_DELAY) as tracker:
      arrays = reader.read_arrays(
          self._item, self._manifest, sharding=sharding, refs=refs, verify=verify,
          tracker=tracker, snapshot=self._snapshot,
      )
    return {label: self._value(self.stored[label], arrays) for label in labels}

  def _model_placements(self, labels, bound) -> placements.PerArray:
    """Where to read each array of ``labels`` so that it lands where the
    model's own array is, by manifest index.

    Stored axes in another order (or renamed) are read in the model's
    sharding permuted to the stored order, then transposed where they are
    (`_fit`); a dtype cast happens on the shards too. An array whose sharding
    cannot be permuted is read to the host, and `_fit` places it: never
    whole on one device on its way to a sharded one.
    """
    index_of = {id(array): index for index, array in enumerate(self._abstract_arrays)}
    placed = {}
    for label in labels:
      if label not in bound:
        continue  # An unbound slot: no placement to follow.
      stored = jax.tree.leaves(self.abstract(label, None), is_leaf=nodes.fits_its_axes)
      model = jax.tree.leaves(bound[label].value, is_leaf=nodes.fits_its_axes)
      for value, target in zip(stored, model):  # `_misfit` checked they pair.
        index, target_data = index_of.get(id(_data(value))), _data(target)
        if index is not None and isinstance(target_data, jax.Array):
          placed[index] = _in_stored_order(
              target_data.sharding, _stored_dims(value, target)
          )
    return placed


class _Plan:
  """Which checkpoint variables fit the model, decided without array data,
  then the reading, casting and placing of those that fit."""

  def __init__(self, source: Source, dtype):
    self._source = source
    self._dtype = dtype
    self.fitting: list[Hashable] = []
    self.problems: list[Mismatch] = []
    self.transposed: list[Hashable] = []

  def check(self, label, variable, slot, current) -> None:
    if variable.kind != _kind_of_slot(slot):
      self.problems.append(Mismatch(label, "kind", variable.kind, _kind_of_slot(slot)))
      return
    abstract = self._source.abstract(label, current)
    if isinstance(abstract, Mismatch):
      self.problems.append(abstract)
      return
    planned_casts: list = []
    abstract = _cast_value(label, abstract, self._dtype, True, planned_casts, [])
    if current is not None:
      # A dtype the user asked for wins over the model's current one.
      mismatch, reorder = _misfit(
          label, abstract, current.value, check_dtype=not planned_casts
      )
      if mismatch:
        self.problems.append(mismatch)
        return
      if reorder:
        self.transposed.append(label)
    self.fitting.append(label)

  def read(self, bound, *, allow_lossy, sharding, verify):
    """Reads the arrays of the fitting variables only; casts and places them."""
    read = self._source.read(
        self.fitting, sharding=sharding, verify=verify,
        bound={label: bound[label] for label in self.fitting if label in bound},
    )
    values: dict[Hashable, Any] = {}
    cast: list[Hashable] = []
    for label in self.fitting:
      before = len(self.problems)
      value = read[label]
      if label in bound:  # Placed first: a cast then runs where it lands.
        value = _fit(value, bound[label].value, place=sharding is None)
      value = _cast_value(label, value, self._dtype, allow_lossy, cast, self.problems)
      if len(self.problems) > before:
        continue
      values[label] = value
    return values, cast


def _rebind(
    structure: Any, bound: Mapping[Hashable, pz.AbstractVariable],
    stored: Mapping[Hashable, Any], values: Mapping[Hashable, Any],
) -> Any:
  """The model with new variables holding ``values``; others kept as they were."""
  variables = [var for label, var in bound.items() if label not in values]
  for label, value in values.items():
    if label in bound:  # Keep the model's own variable class and metadata.
      frozen = dataclasses.replace(bound[label].freeze(), value=value)
    else:
      cls = variable_kinds.value_class(stored[label].kind)
      frozen = cls(label=label, value=value, metadata=stored[label].metadata)
    variables.append(frozen.unfreeze_as_copy())
  return pz.bind_variables(structure, variables)


def cast_model(
    model: ModelT, dtype: DTypeRules, *, allow_lossy: bool = False, where: str = "the model"
) -> ModelT:
  """``model`` with its variables' arrays cast as ``dtype=`` asks (checked;
  ``where``: the checkpoint it was loaded from, for messages)."""
  structure, variables = pz.unbind_variables(model)
  _check_selectors(where, {var.label: var for var in variables}, None, dtype)
  cast: list = []
  problems: list[Mismatch] = []
  new = []
  for var in variables:
    value = _cast_value(var.label, var.value, dtype, allow_lossy, cast, problems)
    new.append(dataclasses.replace(var.freeze(), value=value).unfreeze_as_copy())
  if problems:
    raise errors.BindingError("casting the loaded model", LoadReport(mismatched=tuple(problems)))
  return pz.bind_variables(structure, new)


def assign_variables(tree: Any, values: Iterable[pz.AbstractVariableValue]) -> None:
  """Sets the mutable variables of ``tree`` to frozen ``values``, by label, in place.

  For resuming objects that hold on to their variables, such as Penzai's
  ``StatefulTrainer``, where returning a new model would leave them pointing at
  the old ones. Every check runs before any variable changes: each variable
  needs exactly one value, of the same kind (parameter or state variable) and
  the same structure, axis names, shapes and dtypes (axes stored in another
  order are transposed), and no value may be left over. Values are placed
  like the arrays they replace (same devices and sharding).

  Example::

    _, saved = pz.unbind_variables(model, freeze=True)
    ...                                   # training changes the model
    pzp.assign_variables(model, saved)    # back to the saved values

  Raises:
    BindingError: listing every missing, unexpected or mismatched variable;
      nothing was changed.
  """
  _, variables = pz.unbind_variables(tree)
  targets = {variable.label: variable for variable in variables}
  incoming: dict[Hashable, Any] = {}
  problems: list[Mismatch] = []
  for value in values:
    if value.label in incoming:
      problems.append(Mismatch(value.label, "label", "two values", "one"))
    incoming[value.label] = value
  for label, value in incoming.items():
    if label not in targets:
      continue
    if value.get_slot() != targets[label].get_slot():
      kind = type(targets[label]).__name__
      problems.append(Mismatch(label, "kind", type(value).__name__, f"a {kind} value"))
      continue
    mismatch, _ = _misfit(label, value.value, targets[label].value)
    if mismatch:
      problems.append(mismatch)
  report = LoadReport(
      missing=tuple(label for label in targets if label not in incoming),
      unexpected=tuple(label for label in incoming if label not in targets),
      mismatched=tuple(problems),
      matched=tuple(label for label in targets if label in incoming),
  )
  if not report.ok:
    raise errors.BindingError("the values to assign", report)
  for label, variable in targets.items():
    variable.value = _fit(incoming[label].value, variable.value, place=True)
