"""Penzai models back to Hugging Face folders, by running the load plan backwards.

`export_hf` writes ``config.json``, ``model-0000x-of-0000y.safetensors`` and
``model.safetensors.index.json`` with the family's own tensor names, for
``transformers``, vLLM and the llama.cpp converters to read.

There is no second mapping to keep in step with `load_hf`: the Hugging Face
config is derived from the model's structure (sizes from parameter shapes,
epsilons from the norm layers, the RoPE wavelength and scaling from
``ApplyRoPE`` / `ApplyScaledRoPE`, the attention windows from the mask
layers, biases from ``AddBias`` layers, ...), then the family's own load plan
(its record in `pz_persist.pretrained.hf.families`) is run on that config and its skeleton
is compared with the model, layer by layer and field by field. Only a model
the plan would rebuild exactly is written, each tensor through
`pz_persist.pretrained.hf.plan.stored_layout`, the inverse of what
``load_hf`` reads through. So whatever the config says, ``load_hf`` of the
folder gives this model back, and what transformers computes from it is what
``load_hf``'s tests check against.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist import extension
from pz_persist import progress as progress_lib
from pz_persist.pretrained import errors
from pz_persist.pretrained.hf import families
from pz_persist.pretrained.hf import load as hf
from pz_persist.pretrained.hf import unsupported
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import derive_config
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.folder_writer import check_destination
from pz_persist.pretrained.hf.folder_writer import stored_tensors
from pz_persist.pretrained.hf.folder_writer import write_folder
from pz_persist.pretrained.hf.structure_match import ModelWeights
from pz_persist.pretrained.hf.structure_match import family_plans
from pz_persist.pretrained.hf.structure_match import matching_plan
from pz_persist.pretrained.lora_merge import refuse_lora

DEFAULT_SHARD_BYTES = 5 * 2**30
"""transformers' own default shard size (5 GB) for ``save_pretrained``."""


def _like_config(like: object) -> dict[str, Any]:
  """``like`` as a config dict: a family name, a folder or a dict."""
  if like is None:
    return {}
  if isinstance(like, Mapping):
    return dict(like)
  if isinstance(like, str) and like in family_plans():
    return {"model_type": like}
  if isinstance(like, (str, os.PathLike)) and os.path.isdir(like):
    return hf._read_config(os.fspath(like))  # pylint: disable=protected-access
  known = isinstance(like, str) and (like in unsupported.UNSUPPORTED or like in families.REFUSED)
  raise errors.ArgumentError(
      (f"{unsupported.reason(like)} " if known else "") +
      f"like={like!r} is neither a family ({sorted(family_plans())}), a Hugging Face"
      " folder nor a config dict."
  )


def like_sources(like: object) -> list[str | os.PathLike[str]]:
  """The folder ``like`` names, if it names one (a family name or a dict
  is read from nothing): what an export reads besides the model."""
  if isinstance(like, (str, os.PathLike)) and not (isinstance(like, str) and like in family_plans()):
    local = extension.local_path(like)
    if os.path.isdir(os.fspath(local)):
      return [like]
  return []


def _say_dequantized(like: Mapping[str, Any]) -> None:
  """Warns that ``like``'s ``quantization_config`` is not written: the
  model holds dequantised values (`load_hf` decoded them), written dense."""
  text = like.get("text_config")
  quantized = like.get("quantization_config") or (
      isinstance(text, Mapping) and text.get("quantization_config"))
  if quantized:
    method = quantized.get("quant_method") if isinstance(quantized, Mapping) else None
    warnings.warn(errors.DequantizedWeightsWarning(
        f"like= has a quantization_config (quant_method={method!r:.40}); export_hf writes"
        " the model's dequantised weights dense, and the config without it."), stacklevel=3)


def export_hf(
    model: Any,
    folder: str | os.PathLike[str],
    *,
    like: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    shard_size: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    progress: progress_lib.Progress = None,
) -> str:
  """Writes a Penzai transformer as a Hugging Face folder.

  Example::

    model = pzp.pretrained.load_hf("Llama-3.2-1B")
    ...  # fine-tune, merge LoRA, cut layers
    pzp.export_hf(model, "my-llama", like="Llama-3.2-1B")
    # transformers.AutoModelForCausalLM.from_pretrained("my-llama")

  Args:
    model: A ``TransformerLM`` with the structure of a family `load_hf`
      reads (any exported ``model_type`` of
      `pz_persist.pretrained.hf.families`, with RoPE scaling and biases as
      `load_hf` builds them),
      or of Penzai's Gemma as `load_gemma` builds it (also written as
      ``gemma`` / ``gemma2``; its norms hold ``1 + w``, so ``w`` is written
      as ``value - 1`` computed in float32, which is not bit-exact in
      bfloat16). Layers may have been cut: ``num_hidden_layers`` follows
      the model.
    folder: The folder to write (created; its parent too).
    like: The ``model_type`` (``"llama"``, ``"qwen2"``, ``"gemma2"``...), or
      a Hugging Face folder or config dict whose ``model_type`` is used and whose fields that do not change the math
      (token ids, ``architectures``, ``max_position_embeddings``...) are
      copied. Default: the ``model_type`` the structure shows (each family's
      record recognises its own, `pz_persist.pretrained.hf.families.detect`).
    shard_size: Most bytes per safetensors file (a larger tensor gets a file
      of its own).
    overwrite: Replace ``folder`` if it exists and is not empty.
    progress: As for `load_hf`, in bytes written.

  Returns:
    ``folder``.

  Raises:
    errors.ExportError: the model's structure is not one the family can express
      (naming the first difference, e.g. an unmerged LoRA adapter), before
      anything is written.
    CheckpointExistsError: ``folder`` exists, is not empty and
      ``overwrite`` is False.
  """
  if not isinstance(shard_size, int) or shard_size <= 0:
    raise errors.ArgumentError(f"shard_size={shard_size!r} must be a positive number of bytes.")
  # The destination rule: never over, inside or around the like= folder read
  # (nor inside any checkpoint); then only an earlier export is replaced.
  given = os.fspath(folder)
  target = os.fspath(extension.check_output(folder, like_sources(like)))
  check_destination(target, overwrite)
  if not isinstance(model, model_parts.TransformerLM):
    raise errors.ExportError(f"export_hf writes Penzai TransformerLM models, not {type(model).__name__}.")
  refuse_lora(model)
  pz.nn.assert_no_parameter_slots(model)
  model = pz.freeze_params(model)  # Parameter values, mutable or not, in place.
  like_config = _like_config(like)
  _say_dequantized(like_config)
  read_only = families.MODEL_TYPES.get(like_config.get("model_type"))  # type: ignore[arg-type]
  if read_only is not None and read_only.written_as:  # A multimodal folder: its text model.
    text = like_config.get("text_config")
    text = text if isinstance(text, dict) else {}
    # A text model_type export writes (mistral3's ministral3) wins over the folder's default.
    named = families.MODEL_TYPES.get(text.get("model_type"))  # type: ignore[arg-type]
    written = text["model_type"] if named is not None and named.exported else read_only.written_as
    like_config = {**text, "model_type": written}
  family = like_config.get("model_type") or families.detect(model)
  plans = family_plans()
  if family not in plans:
    why = (unsupported.reason(family) + " " if isinstance(family, str)
           and family not in families.MODEL_TYPES else "")
    raise errors.ExportError(f"family {family!r} cannot be exported: {why}export_hf writes the"
                             f" model_types {sorted(plans)}.")
  config = derive_config(model, family, families.FAMILY_OF[family], like_config)
  embeddings = first_layer(model, pz.nn.EmbeddingTable, "token embeddings").embeddings.value
  # GPT-2 names the count n_layer; a family without the field has a block per layer.
  layers = config.get("num_hidden_layers", len(blocks(model)))
  weights = ModelWeights(layers, np.dtype(embeddings.dtype))
  plan, slots = matching_plan(plans[family], config, weights, model, family, target)
  values = {p.label: p.value for p in all_layers(model, pz.ParameterValue)}
  write_folder(target, config, stored_tensors(plan, slots, values), shard_size, overwrite, progress)
  return given
