"""Llama and Mistral checkpoints (``model_type`` ``llama``, ``mistral``), and the
``model_type`` values transformers itself reads with its Llama classes
(``internlm3``, ``iquestcoder``: their config classes hold Llama's fields
and no others, and ``AutoModelForCausalLM`` builds ``LlamaForCausalLM`` for
them, whose tensor names their folders keep).

Llama's layout is the shared llama-like decoder
(`pz_persist.pretrained.hf.building.decoder.llama_plan`) that most families
build on; this record is what is Llama's and Mistral's own: their defaults,
detection (the default for any llama-like model) and config fields.

A Mistral 3 folder (``mistral3``: Mistral Small 3.1 / 3.2, Magistral,
Devstral, Ministral 3) holds a Pixtral vision tower and its projector around
a text model, whose config is ``text_config`` (``model_type`` ``mistral``, or
``ministral3``, read by that family's plan) and whose tensors are under
``language_model.model.`` with the head ``language_model.lm_head.weight``
(or, transformers 5's names, ``model.language_model.`` and
``lm_head.weight``). Only the text model is built: the vision tower and the
projector are not read, and the load says so (a warning on the
``pz_persist.pretrained.hf`` logger, naming how many); it is exported as its
text ``model_type``. As in transformers 5, the folder's
``tie_word_embeddings`` (default true) decides, and a stored head is used
when there is one (`pz_persist.pretrained.hf.config.lm_head_source`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.building.aliases import read_aliases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.defaults import NO_BIASES
from pz_persist.pretrained.hf.building.ignored import OTHER_MODALITIES
from pz_persist.pretrained.hf.building.vision_language import VL_FIELDS
from pz_persist.pretrained.hf.building.vision_language import renamed_plan
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights


def mistral_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Mistral checkpoint: Llama's layout plus sliding-window attention.

  Penzai's ``ApplyCausalSlidingWindowAttentionMask`` masks keys ``window`` or
  more positions back, as Hugging Face does, in full-sequence calls and in
  Penzai's KV-cache sampling mode (which rebuilds the mask for cached keys).
  """
  return llama_plan(cfg, weights, sliding=True)


_INTERNLM3_ALIASES = {"qkv_bias": "attention_bias", "bias": "mlp_bias"}
"""The other names InternLM3's config class gives Llama's bias fields
(``InternLM3Config.attribute_map``), which the Hub's ``config.json`` holds."""


def internlm3_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps an InternLM3 checkpoint: Llama's layout, transformers'
  ``LlamaForCausalLM``. Its Hub ``config.json`` spells ``attention_bias`` /
  ``mlp_bias`` as ``qkv_bias`` / ``bias``, which transformers reads as the same
  fields; both spellings disagreeing is refused rather than one guessed."""
  read_aliases(cfg, _INTERNLM3_ALIASES)
  return llama_plan(cfg, weights)


_MISTRAL3_LAYOUTS = (
    (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
    (("model.language_model.", "model."), ("lm_head.", "lm_head.")),
)
"""Where a ``mistral3`` folder keeps its text model: the Hub's names (which
transformers 5 still writes), or transformers 5's own."""

_MISTRAL3_FOLDER_FIELDS = ("image_token_index", "multimodal_projector_bias",
                           "projector_hidden_act", "spatial_merge_size", "vision_config",
                           "vision_feature_layer")
"""A ``mistral3`` folder's own fields (the vision tower's and projector's)."""

_MISTRAL3_TIED = True
"""transformers' ``Mistral3Config.tie_word_embeddings`` default (the folder's
field decides, not ``text_config``'s)."""


def mistral3_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps the text model of a ``mistral3`` folder (module docstring) with the
  plan of its text ``model_type`` (``mistral``, ``ministral3``) and that
  type's defaults; the vision tower and projector are left unread, and
  reported."""
  from pz_persist.pretrained.hf import families  # pylint: disable=import-outside-toplevel
  text = dict(cfg.require("text_config"))
  tied = cfg.get("tie_word_embeddings")
  cfg.check_all_used()
  text_type = text.get("model_type", "mistral")
  if text_type not in ("mistral", "ministral3"):
    raise cfg.unsupported("text_config.model_type", text_type, "a mistral3 folder's text"
                          " model is 'mistral' or 'ministral3'")
  text["tie_word_embeddings"] = _MISTRAL3_TIED if tied is None else tied
  read = families.MODEL_TYPES[text_type]
  text_cfg = Config(text, f"{cfg.where} (text_config)", {**RECORD.fields,
                    **families.FAMILY_OF[text_type].fields}, families.DEFAULTS[text_type],
                    read.ignored)
  return renamed_plan(cfg, weights, _MISTRAL3_LAYOUTS, lambda seen: read.plan(text_cfg, seen),
                      f"Mistral 3's text model ({text_type}) only")


def _detect(model: pz.nn.Layer) -> str | None:
  """Llama's layout is the default: any llama-like model the records of
  lower rank did not claim; Mistral if it has a window."""
  return "mistral" if all_layers(model, pz.nn.ApplyCausalSlidingWindowAttentionMask) else "llama"


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  fields = llamalike_fields(model, like)
  if model_type == "mistral":  # No bias fields: Mistral's transformers model has none.
    fields["sliding_window"] = windows(model)[0]
  else:
    biases = model_biases(model)
    fields.update(attention_bias=biases.query_key_value or biases.output, mlp_bias=biases.mlp)
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "defaults": {**LLAMA_LIKE, "mlp_bias": False, "max_position_embeddings": 2048},
    },
    "mistral": {
        "defaults": {**LLAMA_LIKE, "mlp_bias": False, "sliding_window": 4096,
                     "max_position_embeddings": 131_072},
        "defaults_why": {
            "attention_bias": NO_BIASES,
            "mlp_bias": NO_BIASES,
        },
    },
    # transformers maps both to LlamaForCausalLM; only the defaults differ.
    "internlm3": {
        "defaults": {**LLAMA_LIKE, "mlp_bias": False, "rms_norm_eps": 1e-5,
                     "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 32_768},
    },
    "iquestcoder": {
        "defaults": {**LLAMA_LIKE, "mlp_bias": False, "rms_norm_eps": 1e-5,
                     "num_key_value_heads": 8, "head_dim": 128,
                     "max_position_embeddings": 131_072},
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


_REMOTE_CODE = {
    "the Hub's pointer to its own modeling code, which transformers passes over for"
    " LlamaForCausalLM and pz_persist never runs": ("auto_map",)}


RECORD = Family(
    title="Llama 1, 2, 3.x; Mistral; Mistral 3's text model; InternLM3, IQuest-Coder",
    model_types={
        "llama": ModelType(llama_plan, "LlamaForCausalLM", **_TRANSFORMERS_DEFAULTS["llama"]),
        "mistral": ModelType(mistral_plan, "MistralForCausalLM",
            **_TRANSFORMERS_DEFAULTS["mistral"]),
        "internlm3": ModelType(internlm3_plan, "LlamaForCausalLM",
            **_TRANSFORMERS_DEFAULTS["internlm3"], ignored_fields=_REMOTE_CODE,
            foreign_fields=frozenset({"auto_map"})),
        "iquestcoder": ModelType(llama_plan, "LlamaForCausalLM",
            **_TRANSFORMERS_DEFAULTS["iquestcoder"], ignored_fields=_REMOTE_CODE,
            foreign_fields=frozenset({"auto_map"})),
        "mistral3": ModelType(mistral3_plan, "Mistral3ForConditionalGeneration",
            exported=False, written_as="mistral",
            ignored_fields={OTHER_MODALITIES: _MISTRAL3_FOLDER_FIELDS}),
    },
    detect=_detect,
    write_config=_write_config,
    adds=("grouped-query attention, tied or untied embeddings, scaled RoPE (`llama3`, `linear`,"
          " `dynamic`, `yarn`: `ApplyScaledRoPE`), `attention_bias` / `mlp_bias` (`AddBias`);"
          " Mistral's sliding window; the text model of `mistral3` folders (Mistral Small 3.1"
          " / 3.2, Magistral, Devstral, Ministral 3: the Pixtral vision tower and projector are"
          " not read, and the load says so)"),
    refuses="other rope types, partial rotary, activations other than SiLU / tanh GELU",
    rank=900,
    fields={**dict.fromkeys(_INTERNLM3_ALIASES, BOOLEAN), **VL_FIELDS},
)
