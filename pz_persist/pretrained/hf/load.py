"""Hugging Face checkpoints into Penzai, without torch (every family of
`pz_persist.pretrained.hf.families`: Llama, Mistral, Qwen, Gemma, GPT-NeoX...).

Penzai's own converters (``llama_from_huggingface_model`` and friends) take a
*torch* model: loading a 7B checkpoint that way needs torch, transformers, and
the whole model in torch memory before the first array reaches JAX. `load_hf`
reads the checkpoint folder directly instead: ``config.json`` is mapped to
Penzai's config objects (``LlamalikeTransformerConfig``,
``GPTNeoXTransformerConfig``), the model skeleton comes from Penzai's own
builders, and each safetensors tensor is read on its own, reshaped to its
Penzai layout, cast, placed on its devices and dropped before the next one is
read, so host memory never holds a second copy of the model.

Configuration fields that change the model's math in ways Penzai's builders
cannot express (biases in Mistral attention, an exact-GELU Llama MLP, a rope
type other than the scaled ones below...) are refused with
`errors.UnsupportedConfigError` naming the field and its value; fields that do not
change the math (token ids, dropout, the transformers version...) are
ignored, and any field this module does not know is refused too, rather than
silently producing a different model.

Scaled RoPE (``rope_scaling`` or ``rope_parameters`` of type ``llama3``,
``linear``, ``dynamic`` or ``yarn``, as every Llama 3.x checkpoint has) is
supported for Llama and Mistral: Penzai's ``ApplyRoPE`` layers are replaced by
`pz_persist.nn.scaled_rope.ApplyScaledRoPE`, which computes the
frequencies as transformers does, also in Penzai's KV-cache sampling mode
(its docstring says when ``dynamic`` agrees with transformers' stateful
cache). GPT-NeoX refuses scaling.

A checkpoint folder may come from anyone, so nothing in it is trusted before
it is checked, and the checks come in an order that builds nothing large:
``config.json`` is read with a byte and nesting limit and every field the
builders use is checked against `pz_persist.pretrained.hf.config.SCHEMA` (sizes are positive integers, never
floats or strings); then the safetensors headers are read (their byte ranges
must tile each file, as the reference implementation requires); then
``num_hidden_layers`` must match the layers the weights hold and every tensor
the config calls for must be present with the right size, and every tensor
stored must be one the plan reads or one its family declares knowingly left
out (`pz_persist.pretrained.hf.unread`); then the total
allocation is compared with `pz_persist.safety.limits.allocation_limit`; only then
is the skeleton built and the first tensor read. Only regular files are read,
and a symlink in the folder must stay inside it or, for a ``huggingface_hub``
snapshot, inside its cache entry (`pz_persist.pretrained._files`).
"""

from __future__ import annotations

import collections
import os
import warnings
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from penzai import pz
from penzai.core import variables as penzai_variables
from penzai.models.transformer import model_parts

from pz_persist import extension
from pz_persist import progress as progress_lib
from pz_persist import sharding as sharding_lib
from pz_persist.nn import scaled_rope
from pz_persist.pretrained import _files
from pz_persist.pretrained import errors
from pz_persist.pretrained import safetensors_io
from pz_persist.pretrained.hf import families
from pz_persist.pretrained.hf import unread
from pz_persist.pretrained.hf import unsupported
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import penzai_layout
from pz_persist.pretrained.hf.weights import Weights
from pz_persist.pretrained.hf.weights import check_has_weights

# Documented here too (defined in errors, with every error class).


def _read_config(path: str, seen: list[tuple[str, _files.Identity]] | None = None) -> dict[str, Any]:
  """``config.json``, read with the limits of `_files.read_json` (recorded
  in ``seen``, to be checked unchanged once the load is done)."""
  config_path = _files.check_folder_file(path, "config.json")
  if config_path is None:
    raise errors.CheckpointFolderError(
        f"{path} is not a Hugging Face checkpoint folder: it has no config.json."
    )

  def error(what: str) -> errors.UnsupportedConfigError:
    return errors.UnsupportedConfigError(f"{config_path} {what}.")

  raw_config = _files.read_json(config_path, _files.MAX_CONFIG_BYTES, error, seen)
  if not isinstance(raw_config, dict):
    raise error("is not a JSON object")
  return raw_config


def unsupported_model_type(model_type: object) -> str:
  """Why ``model_type`` is refused, the useful clause first
  (`pz_persist.pretrained.hf.unsupported.message`: its reason and the
  nearest family by architecture, then the families read)."""
  return unsupported.message(model_type)


def _check_tensors(plan: Plan, weights: Weights) -> None:
  """Refuses weights missing a tensor the config calls for, or holding one
  of another size, before the skeleton is built or anything is read; then
  refuses a load larger than `pz_persist.safety.limits.allocation_limit`."""
  where = weights.where
  planned = []
  for spec in plan.tensors:
    file = where.get(spec.source)
    if file is None:
      files = sorted({f.path for f in where.values()})
      raise safetensors_io.SafetensorsFormatError(
          f"tensor {spec.source!r} (for Penzai parameter {spec.label!r}) is in"
          f" none of the checkpoint's files {files}."
      )
    stored_shape = file.entries[spec.source][1]
    expected = spec.file_shape
    if stored_shape != expected:
      raise safetensors_io.SafetensorsFormatError(
          f"safetensors file {file.path}, tensor {spec.source!r}: shape"
          f" {stored_shape} does not fit the config (expected {expected}"
          f" for {spec.label!r})."
      )
    planned.append(_files.PlannedArray(spec.label, weights.dtype, spec.parameter_shape))
  # Dequantising allocates more than its result while it runs, one tensor at
  # a time: the largest such working set is part of the total checked.
  working = max((view.working_bytes for view in weights.decoded()), default=0)
  if working:
    planned.append(_files.PlannedArray(
        "(working memory of dequantising one tensor)", np.dtype(np.uint8), (working,)))
  _files.check_planned_allocation(planned, where=weights.path)


def _placement(sharding: sharding_lib.Target):
  """A function giving the sharding of an array from its axis names."""
  if isinstance(sharding, sharding_lib.AxisRules):
    return lambda axes, shape, label: sharding.sharding(tuple(axes), tuple(shape), what=label)
  target = sharding or sharding_lib.default_sharding()
  return lambda axes, shape, label: target


def load_hf(
    path: str | os.PathLike[str],
    *,
    dtype: npt.DTypeLike | None = None,
    allow_lossy: bool = False,
    allow_unread: bool = False,
    sharding: sharding_lib.Target = None,
    progress: progress_lib.Progress = None,
) -> model_parts.TransformerLM:
  """Loads a Hugging Face checkpoint folder as a Penzai model.

  Its ``model_type`` must be one a family of
  `pz_persist.pretrained.hf.families` reads (the README's table lists them:
  Llama, Mistral, Qwen, Gemma, GPT-NeoX...).

  Needs neither torch nor transformers: ``config.json`` is read as JSON and
  the weights with a safetensors parser. Tensors are read one at a time
  (straight into a new array), reshaped to Penzai's named-axis layout, cast, put on their
  devices and dropped, so the host never holds a second copy of the model.
  The result is the same model Penzai's ``*_from_huggingface_model``
  converters build (labels ``transformer/...``), with mutable parameters.

  Example::

    path = huggingface_hub.snapshot_download("EleutherAI/pythia-70m")
    model = pzp.pretrained.load_hf(path, dtype=jnp.bfloat16)
    tokens = pz.nx.wrap(jnp.array([[1, 2, 3]]), "batch", "seq")
    logits = model(tokens)  # named axes: batch, seq, vocabulary

  Args:
    path: A checkpoint folder: ``config.json`` plus ``model.safetensors``, or
      ``model-0000x-of-0000y.safetensors`` files with
      ``model.safetensors.index.json``.
    dtype: Cast every parameter to this dtype, which is also the activation
      dtype (default: the checkpoint's own floating dtype). Floats are
      rounded to a narrower dtype; a cast that would change values beyond
      that (a finite value overflowing to inf, inf into float8_e4m3fn,
      which has none, an integer tensor a float cannot hold exactly) is
      refused, naming the file and tensor.
    allow_lossy: Cast such tensors anyway.
    allow_unread: Load a folder that stores tensors the model its config
      describes does not read, leaving them out with a warning naming them
      (what transformers does), instead of refusing it.
    sharding: Where each array goes: a ``jax.sharding.Sharding`` for all
      arrays, or `pz_persist.AxisRules` mapping Penzai axis names
      (``embedding``, ``heads``, ``head_groups``, ``query_heads``,
      ``projection``, ``neurons``, ``vocabulary``) to mesh axes. Default: the
      first local device.
    progress: None (default): a bar on stderr if it is a terminal or in a
      notebook; True: always; False: never; or a function called as
      ``progress(done, total)`` with the bytes of the tensors read so far
      (`pz_persist.progress`).

  Returns:
    A ``penzai.models.transformer.model_parts.TransformerLM``.

  Raises:
    errors.UnsupportedConfigError: an unsupported ``model_type`` (the message says
      why, the nearest supported family by architecture, then the families
      read) or a configuration field that would change the
      model's math, naming the field and its value. Raised before any tensor
      is read.
    errors.UnsupportedConfigError: also for a malformed ``config.json`` (not a JSON
      object, too large or too deep, a field of the wrong type or range, or a
      ``num_hidden_layers`` other than the layers the weights hold).
    errors.CheckpointFolderError: ``config.json`` or the weight files are missing.
    SafetensorsFormatError: a weight file is truncated or malformed (byte
      ranges that overlap, leave gaps or leave the file), or lacks a tensor
      the model needs or has one of the wrong shape (naming the file and the
      tensor); all found before any tensor is read.
    UnreadTensorsError: the folder stores tensors the model its config
      describes does not read, which its family does not declare knowingly
      left out (a bias the config turns off, a misspelled name); named,
      before any tensor is read, unless ``allow_unread``.
    UnsafeCheckpointError: a file read is a symlink leading out of the folder
      (and out of its Hugging Face cache entry), a FIFO or a device, or the
      model would allocate more than `pz_persist.safety.limits.allocation_limit`.
    LossyCastError: ``dtype`` would change a tensor's values beyond rounding
      (naming the file, the tensor and a value) and ``allow_lossy`` is False.
    FileChangedError: a file read (``config.json``, the index, a safetensors
      file) was replaced or rewritten during the load (a download or sync
      finishing mid-load), naming it; nothing read is returned.
  """
  path = os.fspath(path)
  seen: list[tuple[str, _files.Identity]] = []
  raw_config = _read_config(path, seen)
  check_has_weights(path)
  model_type = raw_config.get("model_type")
  where = os.path.join(path, "config.json")
  if not isinstance(model_type, str) or model_type not in families.MODEL_TYPES:
    raise errors.UnsupportedConfigError(f"{where}: {unsupported_model_type(model_type)}")
  if dtype is not None:
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise errors.UnsupportedConfigError(f"dtype={dtype} is not a floating dtype.")
  with Weights(path, dtype, seen) as weights:
    cfg = Config(raw_config, where, families.FAMILY_OF[model_type].fields,
                 families.DEFAULTS[model_type], families.MODEL_TYPES[model_type].ignored)
    plan = families.MODEL_TYPES[model_type].plan(cfg, weights)
    weights.add_views(plan.views)
    _check_tensors(plan, weights)
    # Every stored tensor read or knowingly left out, before anything is.
    unread.check_all_read(plan, weights, families.MODEL_TYPES[model_type].left_out, model_type,
                          allow=allow_unread)
    skeleton = plan.build()  # Built once the weights agree with the config.
    scaled_rope.check_computable(skeleton, _axis_sizes(plan), cfg.where)

    place = _placement(sharding)
    params = []
    total = sum(_stored_bytes(source, weights.where) for source in _sources(plan.tensors))
    with progress_lib.tracking(progress, f"loading {path}", total) as tracker:
      reads = _StoredReads(plan.tensors, weights.where, tracker.advance)
      for spec in plan.tensors:
        params.append(pz.Parameter(
            value=_read(spec, reads, weights.dtype, place, allow_lossy), label=spec.label))
    # Every file read, still the one read: a model of one version only.
    weights.check_unchanged()
    _say_decoded(weights, path)
  return _bind(skeleton, params)


def _bind(skeleton: Any, params: Sequence[pz.Parameter]) -> Any:
  """``pz.bind_variables(skeleton, params)`` then
  ``pz.nn.assert_no_parameter_slots``, in one flatten of the skeleton
  instead of three passes over it (each a few thousand Penzai nodes rebuilt
  on a model of 48 layers).

  Raises:
    ValueError: two parameters for one slot, a parameter with no slot, or a
      slot left with no parameter: the plan and its skeleton disagree (a
      bug, never the checkpoint: its tensors were checked against the plan).
  """
  is_slot = lambda leaf: isinstance(leaf, penzai_variables.AbstractVariableSlot)  # noqa: E731
  leaves, treedef = jax.tree_util.tree_flatten(skeleton, is_leaf=is_slot)
  by_slot: dict[Any, pz.Parameter] = {}
  for param in params:
    slot = param.get_slot()
    if slot in by_slot:
      raise ValueError(f"two parameters for the slot {slot} (a bug: please report it)")
    by_slot[slot] = param
  bound = set()
  for i, leaf in enumerate(leaves):
    if is_slot(leaf):
      param = by_slot.get(leaf)
      if param is None:
        if isinstance(leaf, pz.ParameterSlot):
          raise ValueError(f"the model's slot {leaf} got no parameter (a bug: please report it)")
        continue
      leaves[i] = param
      bound.add(leaf)
  if len(bound) != len(by_slot):
    raise ValueError(f"{len(by_slot) - len(bound)} parameters have no slot in the model (a bug:"
                     " please report it)")
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _say_decoded(weights: Weights, path: str) -> None:
  """Says, as a `DequantizedWeightsWarning`, which tensors were stored
  quantised and what they were loaded as: the model holds their decoded
  values, not the stored bits, and `export_hf` writes it dense."""
  decoded = weights.decoded()
  if not decoded:
    return
  kinds = sorted({view.description for view in decoded})
  warnings.warn(errors.DequantizedWeightsWarning(
      f"{path}: {len(decoded)} tensors were stored quantised ({'; '.join(kinds)}) and were"
      f" loaded dequantised as {weights.dtype} (e.g. {decoded[0].name!r}); export_hf writes"
      " them dense, without quantization_config."), stacklevel=3)


def _axis_sizes(plan: Plan) -> dict[str, set[int]]:
  """Each Penzai axis name of the plan's tensors, and the sizes it has."""
  sizes: dict[str, set[int]] = {}
  for spec in plan.tensors:
    for axis, size in zip(spec.axes, spec.parameter_shape):
      sizes.setdefault(axis, set()).add(size)
  return sizes


def _sources(specs: Sequence[TensorSpec]) -> list[str]:
  """The stored tensors ``specs`` read, each once, in order."""
  return list(dict.fromkeys(spec.source for spec in specs))


def _stored_bytes(source: str, where: Mapping[str, safetensors_io.SafetensorsFile]) -> int:
  """Bytes of the stored tensor ``source`` (for progress)."""
  _, _, begin, end = where[source].entries[source]
  return end - begin


def _whole(spec: TensorSpec) -> bool:
  """Whether ``spec`` is its stored tensor as it is (cast while reading);
  otherwise a part is taken or an offset added, after reading the stored
  values as they are."""
  return (spec.take is None and spec.rows is None and spec.part is None
          and spec.regrouped is None and not spec.offset)


class _StoredReads:
  """Each stored tensor read from its file once per load.

  Why: several parameters can be parts of one fused tensor (GPT-NeoX's
  ``query_key_value``, Phi-3's ``qkv_proj`` and ``gate_up_proj``); read per
  parameter, it was read from disk once for each. Here the stored values are
  held only until the last parameter taking a part of them has done so, and
  progress advances by each stored tensor's bytes once, on its first read.
  """

  def __init__(self, specs: Sequence[TensorSpec],
               where: Mapping[str, safetensors_io.SafetensorsFile],
               advance: Callable[[int], None]):
    self.where = where
    self._advance = advance
    self._parts_left = collections.Counter(spec.source for spec in specs if not _whole(spec))
    self._held: dict[str, np.ndarray] = {}
    self._counted: set[str] = set()

  def get(self, spec: TensorSpec, dtype: np.dtype, allow_lossy: bool) -> np.ndarray:
    """The stored tensor ``spec`` reads: cast to ``dtype`` while reading if
    `_whole`, else as stored (shared by the parts of one fused tensor)."""
    source = spec.source
    if _whole(spec):
      host = self.where[source].get(source, dtype=dtype, allow_lossy=allow_lossy)
    else:
      if source not in self._held:
        self._held[source] = self.where[source].get(source)
      host = self._held[source]
      self._parts_left[source] -= 1
      if not self._parts_left[source]:
        del self._held[source]  # Its last part: nothing holds it any more.
    if source not in self._counted:
      self._counted.add(source)
      self._advance(_stored_bytes(source, self.where))
    return host


def _read(
    spec: TensorSpec,
    reads: _StoredReads,
    dtype: np.dtype,
    place: Callable[[tuple[str, ...], tuple[int, ...], str], jax.sharding.Sharding],
    allow_lossy: bool = False,
) -> pz.nx.NamedArray:
  """Reads one tensor, lays it out for Penzai, casts it (checked by
  `pz_persist.extension.cast`) and places it."""
  file = reads.where[spec.source]  # `_check_tensors` made sure it is there, of this size.
  # Cast while reading unless a part is taken or an offset added after (then
  # only the part is cast, and the offset is added to the stored values).
  host = reads.get(spec, dtype, allow_lossy)
  host = extension.cast(penzai_layout(spec, host), dtype, allow_lossy=allow_lossy,
                    where=f"safetensors file {file.path}, tensor {spec.source!r}")
  data = jax.device_put(host, place(spec.axes, host.shape, spec.label))
  del host
  return pz.nx.NamedArray.wrap(data).tag(*spec.axes)
