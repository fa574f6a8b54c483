"""Official Gemma Flax checkpoints (Gemma 1 and 2) into Penzai models, and
Gemma 3 and Gemma 4 checkpoints of the ``gemma`` library
(`pz_persist.pretrained.gemma3_flax`, `pz_persist.pretrained.gemma4_flax`).

The conversion itself is Penzai's own
``penzai.models.transformer.variants.gemma.gemma_from_pretrained_checkpoint``,
so a model loaded here is exactly the model Penzai's converter builds. What
this module adds around it:

* the arrays are read with plain Orbax once, cast to ``dtype`` while they are
  read, and each checkpoint array is released as soon as Penzai's converter
  has taken the last thing it needs from it, so a load never holds two full
  copies of the weights;
* ``sharding=`` places every parameter by its axis names (`pz_persist.AxisRules`)
  one array at a time;
* ``preset="auto"`` infers the preset from the checkpoint's shapes (Penzai's
  own "auto" only counts layers), and unknown or Gemma 3 checkpoints fail with
  an error that says what was found and what is supported;
* a custom preset (a mapping) supports models of any size, such as the tiny
  ones the tests write; what the arrays show (sizes, Gemma 2's extra norms,
  the gating layout) is read from them, the rest comes from the ``like``
  preset or the caller, is never guessed, and is logged and reported
  (`GemmaReport`);
* the checks `pz_persist.load` makes before reading: no file leads outside
  the directory or is a FIFO or device, Orbax's metadata is sane, and the
  declared shapes fit the allocation limit (TensorStore allocates a declared
  shape before reading a byte, and aborts the interpreter when it cannot).

Example::

  import jax, jax.numpy as jnp, numpy as np, kagglehub
  import pz_persist as pzp

  path = kagglehub.model_download("google/gemma-2/flax/gemma2-2b")
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  model = pzp.pretrained.load_gemma(
      f"{path}/gemma2-2b", dtype=jnp.bfloat16,
      sharding=pzp.AxisRules(mesh, {"neurons": "model", "query_heads": "model"}),
  )
"""

from __future__ import annotations

import dataclasses
import logging
import math
import types
import typing
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any
from typing import Literal
from typing import overload

import jax
import numpy as np
import numpy.typing as npt
from etils import epath
from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import gemma as pz_gemma
from penzai.models.transformer.variants import llamalike_common

from pz_persist import extension
from pz_persist import penzai_seam
from pz_persist import progress as progress_lib
from pz_persist import sharding as sharding_lib
from pz_persist.pretrained import _files
from pz_persist.pretrained import errors
from pz_persist.pretrained import gemma3_flax
from pz_persist.pretrained import gemma4_flax
from pz_persist.pretrained.errors import GemmaCheckpointError  # Documented here too.

__all__ = ["GemmaCheckpointError", "GemmaReport", "GemmaSetting", "known_presets", "load_gemma"]

_log = logging.getLogger(__name__)


# Settings of a preset that the checkpoint's arrays determine; the others
# (attention windows, soft caps, query scaling) must come from a preset.
_SHAPE_KEYS = (
    "num_decoder_blocks", "vocab_size", "num_kv_heads", "query_head_multiplier",
    "embedding_dim", "projection_dim", "mlp_hidden_dim",
)
# Settings the arrays show by being there (Gemma 2's extra norms).
_NORM_KEYS = ("use_post_attn_norm", "use_post_ffw_norm")
# Settings no array shows: a custom preset takes them from its "like" preset,
# the caller, or Penzai's defaults, and `GemmaReport` says which.
_PRESET_KEYS = ("attention_type", "final_logit_softcap", "attn_logits_soft_cap",
                "query_scaling_factor")
_TRANSPOSE = "needs_gating_transpose"
_LEAF_NAMES = ("w", "scale", "input_embedding")
_GEMMA3_MARKERS = ("query_norm", "key_norm", "q_norm", "k_norm", "siglip",
                   "vision_encoder", "mm_input_projection")
# Layers of Gemma 3n that neither Gemma 3 nor Penzai's Gemma has.
_GEMMA3N_MARKERS = ("altup", "laurel", "per_layer")
# Every block of the gemma library's Gemma 4 has a learned output scale (its
# E2B/E4B also have per-layer inputs, which Gemma 3n's markers would match).
_GEMMA4_MARKERS = ("skip_scale",)


Source = Literal["checkpoint", "preset", "caller", "default"]


@dataclasses.dataclass(frozen=True)
class GemmaSetting:
  """One architecture setting of a `load_gemma` model and where it came from.

  Attributes:
    value: The value, as Penzai's ``LlamalikeTransformerConfig`` takes it
      (``needs_gating_transpose``: a bool).
    source: ``"checkpoint"``: the arrays' shapes, or their presence (Gemma
      2's extra norms), show it; ``"preset"``: the Penzai preset named, or
      the ``like`` preset (what it implies, Penzai's defaults included);
      ``"caller"``: given in ``preset=``; ``"default"``: Penzai's default,
      for a custom preset without ``like``.
  """

  value: Any
  source: Source


@dataclasses.dataclass(frozen=True)
class GemmaReport:
  """Where each setting of a model `load_gemma` built came from.

  Why: a checkpoint's arrays show its sizes but not its attention windows,
  soft caps or query scaling, so ``preset={"like": ...}`` takes those from
  the preset; a checkpoint that differs loads without error and computes
  other logits. `load_gemma` logs those settings as a warning; the report
  keeps them for code.

  Example::

    model, report = pzp.pretrained.load_gemma(
        path, preset={"like": "gemma2_2b"}, report=True)
    print(report)  # One line per setting: value (source).
    report.from_preset["attention_type"]  # (SlidingWindowCausal(4096), GlobalCausal())

  Attributes:
    preset: The preset followed: a Penzai preset name (``"gemma2_2b"``),
      ``"like gemma2_2b"``, or ``"custom"`` (a mapping without ``like``).
    settings: Every setting by name: the sizes, ``use_post_attn_norm``,
      ``use_post_ffw_norm``, ``attention_type``, ``final_logit_softcap``,
      ``attn_logits_soft_cap``, ``query_scaling_factor``,
      ``needs_gating_transpose`` and any other setting given in ``preset=``.
  """

  preset: str
  settings: Mapping[str, GemmaSetting]

  @property
  def from_preset(self) -> dict[str, Any]:
    """``{setting: value}`` for the settings neither the checkpoint nor the
    caller gave (sources ``"preset"`` and ``"default"``): the ones to check
    when the checkpoint is not the preset's own model."""
    return {k: s.value for k, s in self.settings.items() if s.source in ("preset", "default")}

  def __str__(self) -> str:
    width = max(map(len, self.settings), default=0)
    return "\n".join([f"Gemma settings ({self.preset}):", *(
        f"  {name:<{width}} = {s.value!r} ({s.source})" for name, s in self.settings.items())])


def known_presets() -> list[str]:
  """The Gemma presets of the installed Penzai (e.g. ``gemma2_9b``)."""
  return sorted(penzai_seam.gemma_presets())


@overload
def load_gemma(
    path: epath.PathLike,
    *,
    preset: str | Mapping[str, Any] = ...,
    dtype: npt.DTypeLike | None = ...,
    allow_lossy: bool = ...,
    sharding: sharding_lib.Target = ...,
    upcast_activations_to_float32: bool = ...,
    use_layer_stack: bool = ...,
    progress: progress_lib.Progress = ...,
    report: Literal[False] = ...,
) -> model_parts.TransformerLM: ...


@overload
def load_gemma(
    path: epath.PathLike,
    *,
    preset: str | Mapping[str, Any] = ...,
    dtype: npt.DTypeLike | None = ...,
    allow_lossy: bool = ...,
    sharding: sharding_lib.Target = ...,
    upcast_activations_to_float32: bool = ...,
    use_layer_stack: bool = ...,
    progress: progress_lib.Progress = ...,
    report: Literal[True],
) -> tuple[model_parts.TransformerLM, GemmaReport]: ...


def load_gemma(
    path: epath.PathLike,
    *,
    preset: str | Mapping[str, Any] = "auto",
    dtype: npt.DTypeLike | None = None,
    allow_lossy: bool = False,
    sharding: sharding_lib.Target = None,
    upcast_activations_to_float32: bool = False,
    use_layer_stack: bool = False,
    progress: progress_lib.Progress = None,
    report: bool = False,
) -> model_parts.TransformerLM | tuple[model_parts.TransformerLM, GemmaReport]:
  """Loads an official Gemma (1 or 2) Flax checkpoint, or a Gemma 3 or Gemma 4
  one of the ``gemma`` library (``gm.ckpts.save_params``), as a Penzai model.

  Gemma 3 and Gemma 4 (which Penzai lacks) are built as `load_hf` builds
  them from the Hugging Face releases (`pz_persist.pretrained.gemma3_flax`,
  `pz_persist.pretrained.gemma4_flax`); their ``preset`` is ``"auto"`` (the
  library's model of those sizes), a name of ``gemma3_flax.PRESETS`` /
  ``gemma4_flax.PRESETS`` or ``{"like": name, <setting>: value}``.

  Example::

    model = pzp.pretrained.load_gemma(path, dtype=jnp.bfloat16)
    tiny, report = pzp.pretrained.load_gemma(
        path, preset={"like": "gemma2_2b"}, report=True)
    print(report.from_preset)  # Settings not read from the checkpoint.

  Args:
    path: The Orbax checkpoint directory (for Kaggle downloads, the folder
      named after the variant, e.g. ``.../gemma2-2b``). Parameters may be
      stored flat (``"transformer/layer_0/attn/q_einsum": {"w": ...}``, as
      published) or nested (``{"transformer": {"layer_0": ...}}``).
    preset: A Penzai preset name (`known_presets`), ``"auto"`` to infer it
      from the arrays' shapes, or a mapping for other sizes: keyword arguments
      of Penzai's ``LlamalikeTransformerConfig``, where sizes missing from it
      are read from the checkpoint, ``"like"`` names a preset whose other
      settings (soft caps, attention windows, query scaling) are used, and
      ``"needs_gating_transpose"`` gives the layout of the MLP gating
      weights (read from their shape, unless the MLP is square: then the
      ``like`` preset's, else it must be given). Whether Gemma 2's extra
      norms are used is read from the checkpoint. The settings taken from
      the ``like`` preset (or Penzai's defaults) are logged as a warning on
      the ``pz_persist.pretrained.gemma`` logger, and reported (``report``).
    dtype: Cast every array to this dtype while it is read (e.g.
      ``jnp.bfloat16``); the model then computes in it too, as Penzai's
      converter does with the checkpoint's own dtype. Floats are rounded to
      a narrower dtype; a cast that would change values beyond that (a
      finite value overflowing to inf, inf into a dtype without one) is
      refused, naming the array.
    allow_lossy: Cast such arrays anyway.
    sharding: A ``jax.sharding.Sharding`` for every array, or
      `pz_persist.AxisRules` mapping the model's axis names (``embedding``,
      ``neurons``, ``query_heads``, ``head_groups``, ``projection``,
      ``vocabulary``...) to mesh axes. Default: the first local device.
    upcast_activations_to_float32: Passed to Penzai's converter.
    use_layer_stack: Passed to Penzai's converter.
    progress: None (default): a bar on stderr if it is a terminal or in a
      notebook; True: always; False: never; or a function called as
      ``progress(done, total)`` in bytes, as checkpoint arrays are converted
      (after Orbax has read them all, in one call), then, with ``sharding``,
      as parameters are placed, when ``total`` grows by their bytes
      (`pz_persist.progress`).
    report: Also return a `GemmaReport` saying where each setting came from
      (the checkpoint, the preset, the caller or Penzai's defaults).

  Returns:
    Penzai's ``TransformerLM``; with ``report=True``, ``(model, report)``.

  Raises:
    GemmaCheckpointError: unknown preset, shapes matching no preset, a
      later Gemma (3n: named as far as its arrays show), a Gemma 3 or 4
      tree with a foreign, missing or misshapen array (named), or stored
      metadata that is not a tree of arrays.
    UnsafeCheckpointError: a file of the checkpoint is a symlink leading out
      of it, a FIFO or a device, or the arrays would allocate more than
      `pz_persist.safety.limits.allocation_limit` (checked on Orbax's metadata,
      before TensorStore allocates anything), or a file of it was replaced,
      rewritten or added while it was read (nothing read is returned).
    IntegrityError: Orbax's metadata or the arrays cannot be read.
    LossyCastError: ``dtype`` would change an array's values beyond rounding
      (naming it and a value) and ``allow_lossy`` is False.
  """
  if isinstance(preset, str) and (preset in gemma3_flax.PRESETS or preset in gemma4_flax.PRESETS):
    preset = {"like": preset}
  if isinstance(preset, str) and preset != "auto" and preset not in penzai_seam.gemma_presets():
    raise GemmaCheckpointError(_unknown_preset_message(preset))
  path = extension.open_path(path)
  tree, snapshot = _stored_tree(path)
  stored = _flatten(tree)  # Shapes and dtypes only: nothing is read yet.
  if gemma4_flax.is_gemma4(stored):
    return _load_library(gemma4_flax, path, tree, stored, preset, dtype, sharding, progress,
                         report)
  if gemma3_flax.is_gemma3(stored) and not _having(stored, _GEMMA3N_MARKERS):
    return _load_library(gemma3_flax, path, tree, stored, preset, dtype, sharding, progress,
                         report)
  _refuse_gemma3(stored, path)
  name, kwargs, transpose, settings = _resolve_preset(stored, preset, path)
  total = _read_bytes(tree, dtype)
  with progress_lib.tracking(progress, f"loading {path}", total) as tracker:
    # Every file still the one whose metadata was read, once all are read:
    # a download replacing files mid-load is refused, never mixed.
    with extension.files_unchanged(path, before=snapshot):
      params = _read(path, tree, dtype, allow_lossy)

    def consumed(array: np.ndarray) -> None:
      tracker.advance(array.nbytes)

    releasing = _releasing_params(params, name, kwargs, transpose, consumed,
                                  upcast_activations_to_float32, use_layer_stack)
    del params  # Only the releasing mappings hold the arrays now.
    model = _converter(name, kwargs, transpose)(
        releasing, upcast_activations_to_float32=upcast_activations_to_float32,
        use_layer_stack=use_layer_stack, preset_name=name,
    )
    del releasing
    if sharding is not None:
      variables = list(pz.unbind_params(model)[1])
      tracker.grow(sum(_nbytes(param.value) for param in variables))
      for param in variables:
        param.value = _place(param.value, sharding, param.label)
        tracker.advance(_nbytes(param.value))
  return (model, settings) if report else model


def _load_library(
    module: types.ModuleType, path: epath.Path, tree: Mapping[str, Any],
    stored: Mapping[str, Mapping[str, np.ndarray]], preset: str | Mapping[str, Any],
    dtype: npt.DTypeLike | None, sharding: sharding_lib.Target, progress: progress_lib.Progress, report: bool,
) -> model_parts.TransformerLM | tuple[model_parts.TransformerLM, GemmaReport]:
  """A Gemma 3 or Gemma 4 checkpoint of the ``gemma`` library (``module``:
  `gemma3_flax` or `gemma4_flax`): the settings are resolved and every
  array checked before anything is read."""
  config, media, name, sources = module.config_of(stored, preset, path)
  with progress_lib.tracking(progress, f"loading {path}", _read_bytes(tree, dtype)) as tracker:
    params = _read(path, tree, dtype)
    model = module.load(path, params, config, media, sharding, tracker)
  settings = {key: GemmaSetting(value, typing.cast(Source, source))
              for key, (value, source) in sources.items()}
  return (model, GemmaReport(f"like {name}", settings)) if report else model


def _read_bytes(tree: Mapping[str, Any], dtype: npt.DTypeLike | None) -> int:
  """Bytes of the arrays `_read` returns (the stored ones cast to ``dtype``)."""
  total = 0
  for arrays in _flatten(tree).values():
    for meta in arrays.values():
      shape, stored = _checked_layout(meta)
      total += math.prod(shape) * np.dtype(stored if dtype is None else dtype).itemsize
  return total


def _nbytes(value: pz.nx.NamedArrayBase | jax.Array | np.ndarray) -> int:
  """Bytes of a parameter's value (a NamedArray or an array)."""
  data = value.data_array if isinstance(value, pz.nx.NamedArrayBase) else value
  return data.nbytes


def _stored_tree(path: epath.Path) -> tuple[Mapping[str, Any], extension.FolderSnapshot | None]:
  """Orbax's metadata of the stored arrays (a nested dict of ``ArrayMetadata``),
  and the `extension.FolderSnapshot` of the files it was read from.

  The same checks as `pz_persist.load` make first: no file leads outside the
  directory or is a FIFO or device (`extension.check_orbax_folder`), the Orbax
  metadata files are of sane size and parse, and the tree is a tree of arrays
  with valid shapes and dtypes, so that nothing downstream meets a surprise.

  Raises:
    NotACheckpointError: no such directory, or not an Orbax checkpoint.
    UnsafeCheckpointError: a symlink out, a special file, an oversized file.
    IntegrityError: Orbax's metadata cannot be read (damaged files).
    GemmaCheckpointError: the metadata is not a tree of arrays.
  """
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  if not path.exists():
    raise errors.NotACheckpointError(f"{path}: no such Gemma checkpoint directory.")
  snapshot = extension.check_orbax_folder(path)
  try:
    metadata = ocp.PyTreeCheckpointer().metadata(path)
  except (FileNotFoundError, ValueError) as e:
    raise errors.NotACheckpointError(
        f"{path} is not an Orbax checkpoint (the Gemma Flax checkpoint folder is"
        f" the one holding _METADATA or checkpoint): {str(e)[:400]}"
    ) from e
  except (KeyboardInterrupt, MemoryError):
    raise
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise extension.unreadable_orbax_metadata(path, e) from None
  tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)
  _check_tree(tree, path)
  return tree, snapshot


def _check_tree(tree: object, path: epath.Path) -> None:
  """Refuses stored metadata that is not a nested dict (string keys, at most
  `_files.MAX_JSON_DEPTH` deep) of arrays with valid shapes and dtypes."""
  if not isinstance(tree, Mapping):
    raise GemmaCheckpointError(
        f"{path / '_METADATA'}: the stored tree is a {type(tree).__name__}, not"
        " a dict of arrays as in Gemma's Flax checkpoints."
    )
  stack: list[tuple[str, object, int]] = [("", tree, 1)]
  while stack:
    where, node, depth = stack.pop()
    if isinstance(node, Mapping):
      if depth > _files.MAX_JSON_DEPTH:
        raise GemmaCheckpointError(
            f"{path / '_METADATA'}: the stored tree nests deeper than"
            f" {_files.MAX_JSON_DEPTH} levels at {where!r}."
        )
      for key, value in node.items():
        if not isinstance(key, str):
          raise GemmaCheckpointError(
              f"{path / '_METADATA'}: key {key!r:.80} under {where!r} is not a string."
          )
        stack.append((f"{where}/{key}" if where else key, value, depth + 1))
    elif _array_layout(node) is None:
      raise GemmaCheckpointError(
          f"{path / '_METADATA'}: {where!r} is not an array with a valid shape"
          f" and dtype ({node!r:.120})."
      )


def _array_layout(node: object) -> tuple[tuple[int, ...], np.dtype] | None:
  """``(shape, dtype)`` of an array's metadata, or None if either is invalid."""
  shape, dtype = getattr(node, "shape", None), getattr(node, "dtype", None)
  if not isinstance(shape, (tuple, list)) or dtype is None or not all(
      isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in shape
  ):
    return None
  try:
    return tuple(int(n) for n in shape), np.dtype(dtype)
  except TypeError:
    return None


def _checked_layout(meta: object) -> tuple[tuple[int, ...], np.dtype]:
  """`_array_layout` of metadata `_stored_tree` has already checked."""
  layout = _array_layout(meta)
  assert layout is not None, "_stored_tree refuses invalid array metadata"
  return layout


def _planned(name: str, meta: object, dtype: np.dtype | None,
             path: epath.Path) -> _files.PlannedArray:
  """What reading one array allocates: the array (in ``dtype``, default the
  stored one), or, if larger, one storage chunk, which TensorStore decodes
  whole (a tiny array declaring ``[2**20, 2**20]`` chunks aborts it too)."""
  shape, stored = _checked_layout(meta)
  array = _files.PlannedArray(name, dtype or stored, shape)
  storage = getattr(meta, "storage", None)
  chunk = getattr(storage, "chunk_shape", None)
  if chunk is None:
    return array
  if not isinstance(chunk, (tuple, list)) or not all(
      isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n > 0 for n in chunk):
    raise GemmaCheckpointError(
        f"{path}: the storage chunks of {name!r} have an invalid shape {chunk!r:.80}."
    )
  chunk_array = _files.PlannedArray(f"{name} (one storage chunk)", stored,
                                    tuple(int(n) for n in chunk))
  return max(array, chunk_array, key=lambda a: a.nbytes)


def _read(path: epath.Path, tree: Mapping[str, Any], dtype: npt.DTypeLike | None,
          allow_lossy: bool = False) -> dict[str, dict[str, np.ndarray]]:
  """Reads every array once, as NumPy, cast to ``dtype``, after checking
  that they all fit the allocation limit (TensorStore allocates each
  declared shape before reading a byte).

  Orbax casts on read where no value can change (`extension.always_exact`) or
  ``allow_lossy``; the other arrays are read as stored, then checked and
  cast one by one (`extension.cast`), so a lossy cast is refused, naming the
  array.
  """
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  np_dtype = None if dtype is None else np.dtype(dtype)

  def on_read(meta: object) -> np.dtype | None:
    if np_dtype is None or allow_lossy or extension.always_exact(_checked_layout(meta)[1], np_dtype):
      return np_dtype
    return None

  planned = []
  for key, arrays in _flatten(tree).items():
    for leaf, meta in arrays.items():
      planned.append(_planned(f"{key}/{leaf}", meta, on_read(meta), path))
  _files.check_planned_allocation(planned, where=str(path))
  restore_args = jax.tree.map(
      lambda meta: ocp.RestoreArgs(restore_type=np.ndarray, dtype=on_read(meta)), tree
  )
  try:
    restored = ocp.PyTreeCheckpointer().restore(
        path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
  except (KeyboardInterrupt, MemoryError):
    raise
  except Exception as e:  # pylint: disable=broad-exception-caught
    detail = (str(e).strip().splitlines() or [""])[0][:400]
    raise errors.IntegrityError(
        f"{path}: the arrays cannot be read; the checkpoint's files are"
        f" damaged or incomplete ({type(e).__name__}: {detail})",
        damaged=(f"{path}: arrays cannot be read",),
    ) from None
  flat = _flatten(restored)
  del restored  # Each stored array is dropped as its cast replaces it.
  if np_dtype is not None:
    for key, arrays in flat.items():
      for leaf in arrays:
        arrays[leaf] = extension.cast(np.asarray(arrays[leaf]), np_dtype, allow_lossy=allow_lossy,
                                      where=f"{path}: array {key}/{leaf}")
  return flat


def _flatten(tree: Mapping[str, Any]) -> dict[str, dict[str, np.ndarray]]:
  """``{"transformer/layer_0/attn/q_einsum": {"w": array}}``, Penzai's layout.

  Accepts the published flat layout, fully nested trees, and the nested
  layout of the Gemma library (``mlp: {"gating_einsum": array}``, no "w").
  """
  flat: dict[str, dict[str, np.ndarray]] = {}

  def walk(prefix: str, node: Any) -> None:
    for key, value in node.items():
      full = f"{prefix}/{key}" if prefix else str(key)
      if isinstance(value, Mapping):
        walk(full, value)
      elif key in _LEAF_NAMES and prefix:
        flat.setdefault(prefix, {})[key] = value
      else:
        flat.setdefault(full, {})["w"] = value

  walk("", tree)
  if flat and not any(k.startswith("transformer/") for k in flat):
    flat = {f"transformer/{k}": v for k, v in flat.items()}
  return flat


def _having(params: Mapping[str, object], markers: tuple[str, ...]) -> list[str]:
  """The keys of ``params`` naming one of ``markers``."""
  return [k for k in params if any(m in k.rsplit("/", 1)[-1] or f"/{m}" in k for m in markers)]


def _refuse_gemma3(params: Mapping[str, object], path: epath.Path) -> None:
  """Refuses a checkpoint of a later Gemma, naming the generation only as
  far as its arrays show it: an incomplete Gemma 4 by its blocks'
  ``skip_scale``, Gemma 3n by its own layers, otherwise "Gemma 3 or later"."""
  gemma4 = _having(params, _GEMMA4_MARKERS)
  if gemma4:  # Complete ones have 'transformer/layer_0/skip_scale' (`gemma4_flax`).
    raise GemmaCheckpointError(
        f"{path} looks like a Gemma 4 checkpoint of the gemma library (it has"
        f" {gemma4[0]!r}) but has no 'transformer/layer_0/skip_scale': it is not a complete"
        " Gemma 4 checkpoint (load_gemma reads the library's Gemma 4 trees, and load_hf the"
        " Hugging Face folders on the Hub, google/gemma-4-*).")
  later, found = _having(params, _GEMMA3N_MARKERS), _having(params, _GEMMA3_MARKERS)
  if later:
    raise GemmaCheckpointError(
        f"{path} looks like a Gemma 3n checkpoint (it has {later[0]!r}), an architecture"
        f" pz_persist does not build; {no_gemma3_architecture()}.")
  if found:
    raise GemmaCheckpointError(
        f"{path} looks like a Gemma 3 or later checkpoint (it has {found[0]!r}), but not"
        f" in the gemma library's Gemma 3 layout: {no_gemma3_architecture()}."
    )


def no_gemma3_architecture() -> str:
  """Why Gemma 3 is refused, in the words of every loader (`load_gemma`,
  `pz_persist.pretrained.load_hf`)."""
  return (f"the installed Penzai ({_penzai_version()}) has no Gemma 3 architecture;"
          f" its Gemma presets are {known_presets()}")


def _penzai_version() -> str:
  import penzai  # pylint: disable=import-outside-toplevel

  return f"penzai {getattr(penzai, '__version__', '?')}"


def _unknown_preset_message(preset: str) -> str:
  if preset.startswith("gemma3"):
    return (f"preset {preset!r}: the installed Penzai ({_penzai_version()}) has"
            f" no Gemma 3 presets; it knows {known_presets()}.")
  return f"unknown Gemma preset {preset!r}; known presets: {known_presets()} (or 'auto')."


def _shapes(params: Mapping[str, Mapping[str, np.ndarray]],
            path: epath.Path) -> tuple[dict[str, int], bool | None]:
  """The preset sizes the arrays determine, and the gating layout if known."""
  p = {k.removeprefix("transformer/"): v for k, v in params.items()}
  try:
    layers = 0
    while f"layer_{layers}/mlp/linear" in p:
      layers += 1
    vocab, embed = p["embedder"]["input_embedding"].shape
    hidden = p["layer_0/mlp/linear"]["w"].shape[0]
    if "layer_0/attn/qkv_einsum" in p:
      _, heads, _, proj = p["layer_0/attn/qkv_einsum"]["w"].shape
      kv_heads = heads
    else:
      heads, _, proj = p["layer_0/attn/q_einsum"]["w"].shape
      kv_heads = p["layer_0/attn/kv_einsum"]["w"].shape[1]
    gating = tuple(p["layer_0/mlp/gating_einsum"]["w"].shape)
    kv_heads_ok = kv_heads > 0
  except (KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
    raise GemmaCheckpointError(
        f"{path} does not have the arrays of a Gemma Flax checkpoint (missing or"
        f" misshapen {e}); found {sorted(params)[:8]}..."
    ) from e
  sizes = {
      "num_decoder_blocks": layers, "vocab_size": vocab, "num_kv_heads": kv_heads,
      "query_head_multiplier": heads // kv_heads if kv_heads_ok else 0,
      "embedding_dim": embed, "projection_dim": proj, "mlp_hidden_dim": hidden,
  }
  empty = sorted(k for k, v in sizes.items() if v <= 0)
  if empty:
    raise GemmaCheckpointError(
        f"{path}: the arrays' shapes give zero for {empty} ({sizes}); a Gemma"
        " checkpoint's sizes are all positive, so it is damaged."
    )
  transpose = None if embed == hidden else gating[1:] == (hidden, embed)
  sizes["use_post_attn_norm"] = "layer_0/post_attention_norm" in p
  sizes["use_post_ffw_norm"] = "layer_0/post_ffw_norm" in p
  return sizes, transpose


def _resolve_preset(
    params: Mapping[str, Mapping[str, np.ndarray]], preset: str | Mapping[str, Any], path: epath.Path
) -> tuple[str, dict[str, Any] | None, bool | None, GemmaReport]:
  """(preset name, custom preset kwargs or None, gating transpose, report)."""
  presets = penzai_seam.gemma_presets()
  sizes, transpose = _shapes(params, path)
  if isinstance(preset, str):
    if preset == "auto":
      for name, kwargs in presets.items():
        if all(kwargs[k] == sizes[k] for k in _SHAPE_KEYS) and (
            bool(kwargs.get("use_post_attn_norm")) == sizes["use_post_attn_norm"]):
          return name, None, None, _named_report(name, "checkpoint")
      shown = {k: v for k, v in sizes.items() if k in _SHAPE_KEYS}
      raise GemmaCheckpointError(
          f"{path}: no Gemma preset of the installed Penzai has these shapes"
          f" ({'Gemma 2' if sizes['use_post_attn_norm'] else 'Gemma 1'}-style,"
          f" {shown}); known presets: {known_presets()}. For another size pass"
          f" preset={{'like': 'gemma2_2b'}} (sizes are read from the checkpoint)."
      )
    return preset, None, None, _named_report(preset, "preset")
  custom = dict(preset)
  like = custom.pop("like", None)
  given_transpose = custom.pop(_TRANSPOSE, None)
  if like is not None:
    if like not in presets:
      raise GemmaCheckpointError(_unknown_preset_message(like))
    base = {k: v for k, v in presets[like].items() if k not in _SHAPE_KEYS + _NORM_KEYS}
    if "query_scaling_factor" in base:  # 27b's rule: 1/sqrt(embedding/heads).
      heads = sizes["num_kv_heads"] * sizes["query_head_multiplier"]
      base["query_scaling_factor"] = (sizes["embedding_dim"] // heads) ** -0.5
  else:
    base = {}
  shown = {k: sizes[k] for k in _SHAPE_KEYS + _NORM_KEYS}
  kwargs = {**shown, **base, **custom}
  mismatched = {k: (kwargs[k], v) for k, v in shown.items() if kwargs[k] != v}
  if mismatched:
    raise GemmaCheckpointError(
        f"{path}: the preset's sizes differ from the checkpoint's arrays"
        f" ({{setting: (preset, checkpoint)}}): {mismatched}; leave them out of"
        " preset= to read them from the checkpoint."
    )
  gating = _gating_transpose(given_transpose, transpose, like, sizes, path)
  report = _custom_report(like, kwargs, base, custom, gating)
  _log_preset_settings(report, path)
  return "pz_persist_custom", kwargs, gating.value, report


def _gating_transpose(given: object, shown: bool | None, like: str | None,
                      sizes: Mapping[str, int], path: epath.Path) -> GemmaSetting:
  """Whether the MLP gating array is stored transposed, and who says so.

  The array's shape shows it unless the MLP is square (``embedding_dim ==
  mlp_hidden_dim``); then the ``like`` preset's layout is used (gemma2_9b
  and gemma2_27b store it transposed), and without one the caller must say:
  a wrong guess loads without error and computes wrong logits.
  """
  if given is not None:
    if not isinstance(given, bool):
      raise GemmaCheckpointError(
          f"preset {_TRANSPOSE} must be True or False, got {given!r:.80}.")
    if shown is not None and given != shown:
      raise GemmaCheckpointError(
          f"{path}: preset {_TRANSPOSE}={given} contradicts the checkpoint: the"
          f" shape of its MLP gating array shows it is stored"
          f" {'transposed' if shown else 'not transposed'}; leave {_TRANSPOSE} out.")
    return GemmaSetting(given, "caller")
  if shown is not None:
    return GemmaSetting(shown, "checkpoint")
  needs = penzai_seam.gemma_gating_transposed()
  if like is not None and isinstance(needs.get(like), bool):
    return GemmaSetting(needs[like], "preset")
  raise GemmaCheckpointError(
      f"{path}: the MLP is square (embedding_dim == mlp_hidden_dim =="
      f" {sizes['embedding_dim']}), so the shape of its gating array does not"
      f" show whether it is stored transposed (gemma2_9b and gemma2_27b store it"
      f" so, the others do not); pass preset={{..., '{_TRANSPOSE}': True}} or"
      f" False, or 'like' a preset stored the same way."
  )


def _config_defaults() -> dict[str, Any]:
  """Penzai's defaults for the settings a custom preset may leave out."""
  fields = dataclasses.fields(llamalike_common.LlamalikeTransformerConfig)
  return {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}


def _named_report(name: str, sizes_source: Source) -> GemmaReport:
  """A Penzai preset's settings: its sizes matched the checkpoint (``auto``)
  or were named by the caller, the rest is the preset's."""
  kwargs = {**_config_defaults(), **penzai_seam.gemma_presets()[name]}
  settings = {k: GemmaSetting(kwargs[k], sizes_source) for k in _SHAPE_KEYS}
  settings |= {k: GemmaSetting(bool(kwargs[k]), sizes_source) for k in _NORM_KEYS}
  settings |= {k: GemmaSetting(kwargs[k], "preset") for k in _PRESET_KEYS}
  settings[_TRANSPOSE] = GemmaSetting(
      penzai_seam.gemma_gating_transposed()[name], "preset")
  return GemmaReport(name, settings)


def _custom_report(like: str | None, kwargs: Mapping[str, Any], base: Mapping[str, Any],
                   custom: Mapping[str, Any], gating: GemmaSetting) -> GemmaReport:
  """Where each setting of a custom preset came from."""
  defaults = _config_defaults()
  settings = {k: GemmaSetting(kwargs[k], "checkpoint") for k in _SHAPE_KEYS + _NORM_KEYS}
  for key in (*_PRESET_KEYS, *(k for k in kwargs if k not in settings and k not in _PRESET_KEYS)):
    if key in custom:
      settings[key] = GemmaSetting(custom[key], "caller")
    elif key in base or like is not None:
      settings[key] = GemmaSetting(base.get(key, defaults.get(key)), "preset")
    else:
      settings[key] = GemmaSetting(defaults.get(key), "default")
  settings[_TRANSPOSE] = gating
  return GemmaReport("custom" if like is None else f"like {like}", settings)


def _log_preset_settings(report: GemmaReport, path: epath.Path) -> None:
  """Logs, as a warning, each setting a custom preset took from the ``like``
  preset or Penzai's defaults rather than the checkpoint or the caller."""
  borrowed = {k: s for k, s in report.settings.items() if s.source in ("preset", "default")}
  if not borrowed:
    return
  origin = {"preset": f"preset {report.preset.removeprefix('like ')!r}",
            "default": "Penzai's default"}
  lines = "".join(f"\n  {k}={s.value!r} (from {origin[s.source]})" for k, s in borrowed.items())
  _log.warning(
      "load_gemma(%s): %d settings are not shown by the checkpoint's arrays and"
      " were not given in preset=; if this checkpoint differs, pass them in"
      " preset=:%s", path, len(borrowed), lines)


def _converter(name: str, kwargs: dict[str, Any] | None,
               transpose: bool | None) -> Callable[..., model_parts.TransformerLM]:
  """Penzai's ``gemma_from_pretrained_checkpoint``, knowing preset ``name``
  (a custom one: `penzai_seam.gemma_converter_with_preset`, which writes
  nothing of Penzai's)."""
  if kwargs is None:
    return pz_gemma.gemma_from_pretrained_checkpoint
  return penzai_seam.gemma_converter_with_preset(name, kwargs, bool(transpose))


class _Releasing(Mapping):
  """One checkpoint entry (``{"w": array}``) that forgets each array after the
  converter's last read of it, so converted parameters replace checkpoint
  arrays instead of accumulating next to them."""

  def __init__(self, arrays: dict[str, np.ndarray], reads: Mapping[str, int],
               on_release: Callable[[np.ndarray], None]):
    self._arrays = arrays
    self._left = dict(reads)
    self._on_release = on_release

  def __getitem__(self, key: str) -> np.ndarray:
    value = self._arrays[key]
    self._left[key] = self._left.get(key, 1) - 1
    if self._left[key] <= 0:
      del self._arrays[key]
      self._on_release(value)
    return value

  def __iter__(self) -> Iterator[str]:
    return iter(self._arrays)

  def __len__(self) -> int:
    return len(self._arrays)


class _Counting(Mapping):
  """Counts the converter's reads of each array (on abstract values)."""

  def __init__(self, arrays: Mapping[str, jax.ShapeDtypeStruct], counts: dict[str, int]):
    self._arrays, self._counts = arrays, counts

  def __getitem__(self, key: str) -> jax.ShapeDtypeStruct:
    self._counts[key] = self._counts.get(key, 0) + 1
    return self._arrays[key]

  def __iter__(self) -> Iterator[str]:
    return iter(self._arrays)

  def __len__(self) -> int:
    return len(self._arrays)


def _releasing_params(
    params: dict[str, dict[str, np.ndarray]],
    name: str,
    kwargs: dict[str, Any] | None,
    transpose: bool | None,
    on_release: Callable[[np.ndarray], None],
    upcast: bool,
    layer_stack: bool,
) -> dict[str, _Releasing]:
  """Wraps each entry in a `_Releasing`, after counting the converter's reads
  in a dry run on shapes only (``jax.eval_shape``: nothing is computed)."""
  counts: dict[str, dict[str, int]] = {k: {} for k in params}

  def dry_run(abstract):
    counting = {k: _Counting(v, counts[k]) for k, v in abstract.items()}
    _converter(name, kwargs, transpose)(
        counting, upcast_activations_to_float32=upcast,
        use_layer_stack=layer_stack, preset_name=name,
    )

  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
  try:
    jax.eval_shape(dry_run, abstract)
  except (ValueError, TypeError, KeyError, IndexError, AttributeError,
          ZeroDivisionError) as e:  # Raised before any array is used.
    raise GemmaCheckpointError(
        f"Penzai's Gemma converter cannot build preset {name!r}"
        f"{'' if kwargs is None else f' ({kwargs})'} from this checkpoint: {e!r}"
    ) from e
  result = {}
  for key in list(params):
    arrays = params.pop(key)
    reads = counts[key]
    unread = [leaf for leaf in arrays if leaf not in reads]
    for leaf in unread:  # Never used by the converter: drop it now.
      on_release(arrays.pop(leaf))
    result[key] = _Releasing(arrays, reads, on_release)
  return result


def _place(value: pz.nx.NamedArrayBase | jax.Array, target: sharding_lib.Target,
           label: str) -> pz.nx.NamedArrayBase | jax.Array:
  """``value`` (a NamedArray) put where ``target`` says, by its axis names."""
  if isinstance(target, sharding_lib.AxisRules):
    if isinstance(value, pz.nx.NamedArray):
      dims = (None,) * len(value.positional_shape) + tuple(value.named_axes)
    elif isinstance(value, pz.nx.NamedArrayView):
      by_axis: list[str | None] = [None] * value.data_array.ndim
      for axis_name, axis in value.data_axis_for_name.items():
        by_axis[axis] = axis_name
      dims = tuple(by_axis)
    else:
      dims = (None,) * np.ndim(value)
    data = value.data_array if isinstance(value, pz.nx.NamedArrayBase) else value
    placed = jax.device_put(data, target.sharding(dims, data.shape, what=f"label {label!r}"))
  else:
    data = value.data_array if isinstance(value, pz.nx.NamedArrayBase) else value
    placed = jax.device_put(data, target)
  if isinstance(value, pz.nx.NamedArrayBase):
    return dataclasses.replace(value, data_array=placed)
  return placed
