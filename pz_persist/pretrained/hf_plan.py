"""How a Hugging Face checkpoint becomes a Penzai model: a skeleton builder
and one `TensorSpec` per parameter (which tensor, reshaped how).

A family's mapping (`pz_persist.pretrained.hf_families`) returns a `Plan`;
`pz_persist.pretrained.hf.load_hf` checks every spec against the safetensors
headers before the skeleton is built or anything is read.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from penzai.models.transformer import model_parts

from pz_persist.pretrained.hf_config import Config


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
  """

  label: str
  source: str
  shape: tuple[int, ...]
  axes: tuple[str, ...]
  take: tuple[int, int] | None = None
  stored: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
  """How to build the model skeleton (parameter slots) and fill each slot.

  The skeleton is built only once every tensor of ``tensors`` has been
  checked against the safetensors headers (`pz_persist.pretrained.hf.load_hf`): its size comes
  from ``config.json``, which must not be trusted until the weights agree.
  """

  build: Callable[[], model_parts.TransformerLM]
  tensors: tuple[TensorSpec, ...]


_LAYER_NUMBER = re.compile(r"(\d{1,9})\.")


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
