"""ERNIE 4.5 dense checkpoints (``model_type`` ``ernie4_5``).

ERNIE 4.5 is Llama's layout (`pz_persist.pretrained.hf.building.decoder`)
with two changes, read as transformers' ``Ernie4_5ForCausalLM`` computes them:

- its RoPE rotates adjacent pairs of each head's dimensions, ``(x0, x1),
  (x2, x3)...`` (pair ``i`` at Llama's frequency ``i``), in float32
  (`pz_persist.pretrained.hf.building.interleaved_rope`);
- ``use_bias`` puts a bias on every projection: query, key, value, output
  and the three of the MLP (Llama's ``attention_bias`` and ``mlp_bias``
  at once).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist.nn.mixture_of_experts import MixtureOfExperts
from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.interleaved_rope import interleaved_everywhere
from pz_persist.pretrained.hf.building.interleaved_rope import with_interleaved_rope
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights


def ernie4_5_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps an ERNIE 4.5 dense checkpoint: Llama's plan, every projection
  biased under ``use_bias``, RoPE on adjacent pairs."""
  bias = cfg.get("use_bias", False)

  def edit(model: model_parts.TransformerLM, config: Any) -> model_parts.TransformerLM:
    del config
    return with_interleaved_rope(model)

  return llama_plan(cfg, weights, biases=Biases(query_key_value=bias, output=bias, mlp=bias),
                    edit=edit)


def _detect(model: pz.nn.Layer) -> str | None:
  """ERNIE 4.5's attention (adjacent-pair RoPE in every block, nothing of
  Llama 4's) and no experts (ERNIE 4.5's MoE is ``ernie4_5_moe``)."""
  if interleaved_everywhere(model) and not all_layers(model, MixtureOfExperts):
    return "ernie4_5"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only ernie4_5.
  biases = model_biases(model)
  return {**llamalike_fields(model, like), "use_bias": biases.query_key_value}


RECORD = Family(
    title="ERNIE 4.5 (dense)",
    model_types={"ernie4_5": ModelType(
        ernie4_5_plan, "Ernie4_5ForCausalLM",
        defaults={**LLAMA_LIKE, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                  "use_bias": False, "head_dim": 128, "num_key_value_heads": 2,
                  "max_position_embeddings": 131_072, "rope_theta": 500_000.0},
        defaults_why={"attention_bias": "the class has use_bias instead (on every projection);"
                                        " attention_bias is never read"})},
    detect=_detect,
    write_config=_write_config,
    adds=("Llama's layout with RoPE on adjacent pairs (`ApplyInterleavedRoPE`) and `use_bias`"
          " on every projection; tied or untied embeddings, scaled RoPE"),
    refuses="what Llama refuses",
    rank=110,
    fields={"use_bias": BOOLEAN},
)
