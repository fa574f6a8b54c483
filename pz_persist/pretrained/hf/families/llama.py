"""Llama and Mistral checkpoints (``model_type`` ``llama``, ``mistral``), and the
``model_type`` values transformers itself reads with its Llama classes
(``internlm3``, ``iquestcoder``: their config classes hold Llama's fields
and no others, and ``AutoModelForCausalLM`` builds ``LlamaForCausalLM`` for
them, whose tensor names their folders keep).

Llama's layout is the shared llama-like decoder
(`pz_persist.pretrained.hf.building.decoder.llama_plan`) that most families
build on; this record is what is Llama's and Mistral's own: their defaults,
detection (the default for any llama-like model) and config fields.
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
    title="Llama 1, 2, 3.x; Mistral; InternLM3, IQuest-Coder",
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
    },
    detect=_detect,
    write_config=_write_config,
    adds=("grouped-query attention, tied or untied embeddings, scaled RoPE (`llama3`, `linear`,"
          " `dynamic`, `yarn`: `ApplyScaledRoPE`), `attention_bias` / `mlp_bias` (`AddBias`);"
          " Mistral's sliding window"),
    refuses="other rope types, partial rotary, activations other than SiLU / tanh GELU",
    rank=90,
    fields=dict.fromkeys(_INTERNLM3_ALIASES, BOOLEAN),
)
