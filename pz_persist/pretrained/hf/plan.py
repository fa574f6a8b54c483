"""How a Hugging Face checkpoint becomes a Penzai model: a skeleton builder
and one `TensorSpec` per parameter (which tensor, reshaped how).

A family's mapping (`pz_persist.pretrained.hf.families`) returns a `Plan`;
`pz_persist.pretrained.hf.load_hf` checks every spec against the safetensors
headers before the skeleton is built or anything is read.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from collections.abc import Sequence

import numpy as np
from penzai.models.transformer import model_parts

from pz_persist import extension
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.weights import View


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """How one Penzai parameter is made from one Hugging Face tensor.

  Attributes:
    label: The Penzai parameter label (``transformer/...``).
    source: The Hugging Face tensor name.
    shape: The shape to reshape the tensor to (Penzai's layout).
    axes: The axis names of the reshaped tensor, in order.
    take: ``(dimension, index)`` to select one slice of the reshaped tensor
      (GPT-NeoX stores query, key and value fused); that dimension is removed
      from ``shape``/``axes`` afterwards, so ``axes`` describes the result.
    stored: The tensor's shape in the checkpoint, when it is not ``shape``
      (Hugging Face keeps attention heads fused into one dimension); checked
      against the safetensors header before anything is read.
    offset: Added to the stored value, in float32, to make the Penzai value
      (Penzai's own Gemma norms hold ``1 + w`` where Hugging Face stores
      ``w``); 0 for an exact copy.
    rows: ``(start, stop)``: only these rows of the stored tensor (its first
      dimension; ``stored`` is the whole tensor's shape) make the parameter,
      before the reshape to ``shape``. Phi-3 stores the query, key and value
      projections in one tensor whose parts differ in size (grouped-query
      attention), which ``take`` cannot split.
    part: ``(dimension, start, stop)``: only this range of one dimension of
      the reshaped tensor makes the parameter (that dimension keeps its
      place, of size ``stop - start``). DeepSeek's ``kv_b_proj`` holds each
      head's key rows then its value rows, of different sizes, so the keys
      and the values of all heads are a range of the dimension after the
      heads, which neither ``rows`` nor ``take`` reach.
    regrouped: The parameter's shape after ``part`` (the same number of
      entries, regrouped), when it is not the part's own. Qwen3-Next's
      ``in_proj_qkvz`` holds, per key head, its query, key, values and gates;
      the values of one key head are several value heads, which only a
      reshape after the part separates.
  """

  label: str
  source: str
  shape: tuple[int, ...]
  axes: tuple[str, ...]
  take: tuple[int, int] | None = None
  stored: tuple[int, ...] | None = None
  offset: float = 0.0
  rows: tuple[int, int] | None = None
  part: tuple[int, int, int] | None = None
  regrouped: tuple[int, ...] | None = None

  @property
  def file_shape(self) -> tuple[int, ...]:
    """The tensor's shape in the safetensors file."""
    return self.stored or self.shape

  @property
  def parameter_shape(self) -> tuple[int, ...]:
    """The Penzai parameter's shape, over ``axes`` (``shape`` without the
    dimension ``take`` removes, ``part``'s range of its dimension, or
    ``regrouped``)."""
    if self.regrouped is not None:
      return self.regrouped
    if self.part is not None:
      dim, start, stop = self.part
      return self.shape[:dim] + (stop - start,) + self.shape[dim + 1:]
    if self.take is None:
      return self.shape
    return self.shape[:self.take[0]] + self.shape[self.take[0] + 1:]


@dataclasses.dataclass(frozen=True)
class LeftOut:
  """Stored tensors a family knowingly leaves unread, and why.

  Every stored tensor of a folder must be read by the plan or covered by one
  of these, or `load_hf` refuses the folder
  (`pz_persist.pretrained.hf.unread.check_all_read`): a tensor nobody reads
  is otherwise a model other than the files describe, loaded without a word
  (a bias the config turns off, a misspelled name...).

  Attributes:
    covers: Whether a stored tensor name is one of them (asked only of
      names the plan does not read).
    what: What they are, for people (``"the vision tower and projector"``).
    why: Why they are not read (``"load_hf builds Gemma 3's text model
      only"``).
    reported: Whether a load says, as a warning on the
      ``pz_persist.pretrained.hf`` logger, how many it left and which
      groups; False for buffers transformers itself ignores silently.
  """

  covers: Callable[[str], bool]
  what: str
  why: str
  reported: bool = True


def left_out_renamed(left_out: LeftOut, planned: Callable[[str], str | None]) -> LeftOut:
  """``left_out``, declared by a plan run on other names, asked of the
  folder's: ``planned`` gives a stored name's name in the plan's spelling
  (None: none, so not covered). For plans run on renamed tensors (EXAONE's
  names as Llama's, a vision-language folder's text model as its family's)."""
  def covers(name: str) -> bool:
    spelled = planned(name)
    return spelled is not None and left_out.covers(spelled)
  return dataclasses.replace(left_out, covers=covers)


def left_out_matching(patterns: Sequence[str], what: str, why: str,
                      reported: bool = False) -> LeftOut:
  """A `LeftOut` of the names any of the regular expressions ``patterns``
  finds (``re.search``, as transformers' ``_keys_to_ignore_on_load_unexpected``)."""
  regex = re.compile("|".join(f"(?:{pattern})" for pattern in patterns))
  return LeftOut(lambda name: regex.search(name) is not None, what, why, reported)


def left_out_layers(prefix: str, first: int, count: int, what: str, why: str) -> LeftOut:
  """A `LeftOut` of layers ``first .. first + count - 1`` under ``prefix``
  (``model.layers.``): the multi-token-prediction layers DeepSeek-V3 and
  GLM-4.5 store after the causal LM's."""
  return left_out_in_layers(prefix, lambda number: first <= number < first + count, what, why)


def left_out_in_layers(prefix: str, which: Callable[[int], bool], what: str, why: str,
                       part: str = "", reported: bool = True) -> LeftOut:
  """A `LeftOut` of what is stored under ``prefix`` + a layer number +
  ``.`` + ``part``, in the layers whose number ``which`` accepts: whole
  layers (``part=""``), or one part of some layers (GLM-5's indexers in the
  layers that reuse another's, ``part="self_attn.indexer."``)."""
  def covers(name: str) -> bool:
    match = _LAYER_NUMBER.match(name, len(prefix)) if name.startswith(prefix) else None
    return (match is not None and name.startswith(part, match.end())
            and which(int(match.group(1))))
  return LeftOut(covers, what, why, reported)


@dataclasses.dataclass(frozen=True)
class Plan:
  """How to build the model skeleton (parameter slots) and fill each slot.

  The skeleton is built only once every tensor of ``tensors`` has been
  checked against the safetensors headers (`pz_persist.pretrained.hf.load_hf`): its size comes
  from ``config.json``, which must not be trusted until the weights agree.

  ``views`` are tensors computed from stored ones (`pz_persist.pretrained.hf.weights.stacked`
  per-expert tensors, `pz_persist.pretrained.hf.weights.decoded` quantised ones), named
  as a spec's ``source`` like a stored tensor.

  ``left_out``: the stored tensors the plan knowingly does not read (the
  other modalities' towers, multi-token-prediction layers), each group with
  why; every other stored tensor must be read (`LeftOut`).
  """

  build: Callable[[], model_parts.TransformerLM]
  tensors: tuple[TensorSpec, ...]
  views: tuple[View, ...] = ()
  left_out: tuple[LeftOut, ...] = ()


_LAYER_NUMBER = re.compile(r"(\d{1,9})\.")

DECODER_LAYERS = "model.layers."
"""The prefix of layer ``i``'s tensors (``model.layers.{i}.``) in llama-like
checkpoints (llama, mistral, qwen2, gemma, gemma2)."""
NEOX_LAYERS = "gpt_neox.layers."
"""GPT-NeoX's."""
DECODER_HEAD = "lm_head.weight"
"""The untied output head of llama-like checkpoints (llama, mistral, qwen2)."""
NEOX_HEAD = "embed_out.weight"
"""GPT-NeoX's."""
def check_layers(cfg: Config, names: set[str], prefix: str, layers: int) -> None:
  """Refuses a ``num_hidden_layers`` other than the layers the weights hold.

  Why: the skeleton and the list of tensors to read grow with it, so a
  forged config (``10**9`` layers in 200 bytes) would take hours before the
  first missing tensor is noticed; the weights' own names bound it.
  """
  held = sorted({
      int(match.group(1)) for name in names if name.startswith(prefix)
      and (match := _LAYER_NUMBER.match(name, len(prefix)))
  })
  if len(held) == layers and held[-1] == layers - 1:  # Sorted and distinct: 0..layers-1.
    return
  if not held:
    found = "no layers"
  elif held[-1] == len(held) - 1:
    found = f"layers 0..{held[-1]}"
  else:
    found = f"layers {held[:10]}{'...' if len(held) > 10 else ''}"
  raise cfg.invalid("num_hidden_layers", layers, "a positive integer matching the weights",
                    f" but the safetensors hold {found}")


# The two directions of a `TensorSpec`, side by side so that they cannot drift:
# `load_hf` reads through `penzai_layout`, `export_hf` writes through
# `stored_layout`, and a round trip is the identity (bit for bit when no spec
# has an ``offset``).


def penzai_layout(spec: TensorSpec, stored: np.ndarray) -> np.ndarray:
  """The stored tensor laid out as the Penzai parameter ``spec`` describes
  (its dtype unchanged unless ``spec.offset`` asks for float32 arithmetic)."""
  if spec.rows is not None:
    stored = stored[spec.rows[0]:spec.rows[1]]
  host = stored.reshape(spec.shape)
  if spec.part is not None:
    dim, start, stop = spec.part
    host = host[(slice(None),) * dim + (slice(start, stop),)]
    if spec.regrouped is not None:
      host = host.reshape(spec.regrouped)
  if spec.take is not None:
    dim, index = spec.take
    host = np.take(host, index, axis=dim)
  if spec.offset:
    host = extension.cast(host.astype(np.float32) + np.float32(spec.offset), stored.dtype,
                      allow_lossy=False, where=f"{spec.source!r} plus {spec.offset}")
  return host


def stored_layout(specs: Sequence[TensorSpec], values: Sequence[np.ndarray]) -> np.ndarray:
  """The stored tensor that ``specs`` (all naming one source) read ``values``
  from: the inverse of `penzai_layout`.

  Slices taken from one fused tensor (GPT-NeoX's query, key and value) are
  stacked back in their ``take`` order; specs reading the same tensor whole
  (an output head tied to the embeddings) must hold the same bits, or there
  is no tensor they all came from.

  Raises:
    ValueError: the specs do not describe one tensor, or whole reads of it
      differ (the message names the labels; callers wrap it).
  """
  first = specs[0]
  if first.rows is not None:
    return _stacked_rows(specs, values)
  if any(spec.part is not None for spec in specs):
    return _joined_parts(specs, values)
  if first.take is None:
    for spec, value in zip(specs[1:], values[1:]):
      if spec.take is not None or value.dtype != values[0].dtype or not np.array_equal(
          value.view(np.uint8), values[0].view(np.uint8)):
        raise ValueError(
            f"{first.label!r} and {spec.label!r} are both written as {first.source!r}"
            " but hold different values"
        )
    host = _unoffset(first, values[0])
  else:
    dim = first.take[0]
    by_index = {spec.take[1]: _unoffset(spec, value) for spec, value in zip(specs, values)
                if spec.take is not None}
    if len(by_index) != len(specs) or sorted(by_index) != list(range(first.shape[dim])):
      raise ValueError(
          f"{first.source!r} is fused from {[s.label for s in specs]}, which do not"
          f" cover its {first.shape[dim]} slices once each"
      )
    host = np.stack([by_index[i] for i in range(first.shape[dim])], axis=dim)
  return host.reshape(first.file_shape)


def _unoffset(spec: TensorSpec, value: np.ndarray) -> np.ndarray:
  if not spec.offset:
    return value
  return extension.cast(value.astype(np.float32) - np.float32(spec.offset), value.dtype,
                    allow_lossy=False, where=f"{spec.label!r} minus {spec.offset}")


def _stacked_rows(specs: Sequence[TensorSpec], values: Sequence[np.ndarray]) -> np.ndarray:
  """The stored tensor whose row ranges ``specs`` read ``values`` from; the
  ranges must tile its first dimension once."""
  first = specs[0]
  shape = first.file_shape
  parts = sorted(((spec.rows or (-1, -1)), spec.label, _unoffset(spec, value))
                 for spec, value in zip(specs, values))
  ends = [0] + [stop for (_, stop), _, _ in parts]
  if any(start != end for ((start, _), _, _), end in zip(parts, ends)) or ends[-1] != shape[0]:
    raise ValueError(
        f"{first.source!r} is fused from {[s.label for s in specs]}, whose rows"
        f" {[rows for rows, _, _ in parts]} do not cover its {shape[0]} rows once each"
    )
  return np.concatenate([value.reshape(stop - start, *shape[1:])
                         for (start, stop), _, value in parts], axis=0)


def _joined_parts(specs: Sequence[TensorSpec], values: Sequence[np.ndarray]) -> np.ndarray:
  """The stored tensor whose ranges (`TensorSpec.part`) ``specs`` read
  ``values`` from; the ranges must tile their dimension once. A spec that
  ``take``s one slice of the same dimension is the range of that slice
  (Falcon's fused projection: a range of query heads, then one key and one
  value slice, per group)."""
  first = specs[0]

  def as_part(spec: TensorSpec, value: np.ndarray) -> tuple[tuple[int, int, int], np.ndarray]:
    value = _unoffset(spec, value)
    if spec.part is None and spec.take is not None:
      dim, index = spec.take
      return (dim, index, index + 1), np.expand_dims(value, dim)
    return spec.part or (-1, -1, -1), value

  dim = next(spec.part[0] for spec in specs if spec.part is not None)
  parts = sorted((part, spec.label, value) for spec, original in zip(specs, values)
                 for part, value in [as_part(spec, original)])
  ends = [0] + [stop for (_, _, stop), _, _ in parts]
  if (any(part[0] != dim or part[1] != end for (part, _, _), end in zip(parts, ends))
      or ends[-1] != first.shape[dim]):
    raise ValueError(
        f"{first.source!r} is fused from {[s.label for s in specs]}, whose ranges"
        f" {[part for part, _, _ in parts]} do not cover dimension {dim} ({first.shape[dim]})"
        " once each"
    )
  def ungrouped(part: tuple[int, int, int], value: np.ndarray) -> np.ndarray:
    """``value`` in the part's own shape (undoing `TensorSpec.regrouped`)."""
    return value.reshape(first.shape[:dim] + (part[2] - part[1],) + first.shape[dim + 1:])

  return np.concatenate([ungrouped(part, value) for part, _, value in parts],
                        axis=dim).reshape(first.file_shape)
