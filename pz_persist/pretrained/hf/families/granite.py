"""IBM Granite 3 checkpoints (``model_type`` ``granite``).

Granite is Llama's layout (`pz_persist.pretrained.hf.building.decoder`) with
four constants, each a `ConstantScale` layer holding the config's number:
``embedding_multiplier`` after the embedding lookup, ``residual_multiplier``
at the end of each residual branch (attention and MLP), ``attention_multiplier``
instead of Llama's ``1 / sqrt(head_dim)`` query scaling, and the logits
divided by ``logits_scaling``. The layers are there even when a constant is
1, so that the structure says "Granite" to ``export_hf``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.nn.constant_scale import ConstantScale
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.granite_scales import scale_fields
from pz_persist.pretrained.hf.building.granite_scales import with_granite_scales
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                "logits_scaling")


def granite_plan(cfg: Config, weights: Weights) -> Plan:
  """Llama's mapping (biases from ``attention_bias`` / ``mlp_bias``) with
  Granite's four constants (each defaults to 1, as in transformers)."""
  scales = {name: float(cfg.get(name, 1.0)) for name in _MULTIPLIERS}
  plan = llama_plan(cfg, weights)
  return Plan(lambda: with_granite_scales(plan.build(), **scales), plan.tensors)


def _detect(model: pz.nn.Layer) -> str | None:
  """A `ConstantScale` right after the embedding lookup."""
  body = getattr(getattr(model, "body", None), "sublayers", ())
  return "granite" if any(
      isinstance(a, pz.nn.EmbeddingLookup) and isinstance(b, ConstantScale)
      for a, b in zip(body, body[1:])) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only granite.
  biases = model_biases(model)
  return without_default_head_dim({
      **llamalike_fields(model, like),
      "attention_bias": biases.query_key_value or biases.output,
      "mlp_bias": biases.mlp,
      **scale_fields(model),
  })


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "granite": {
        "defaults": {**LLAMA_LIKE, "mlp_bias": False, "embedding_multiplier": 1.0,
                     "logits_scaling": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
                     "max_position_embeddings": 2048},
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Granite 3",
    model_types={"granite": ModelType(granite_plan, "GraniteForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["granite"])},
    detect=_detect,
    write_config=_write_config,
    adds=("Llama's layout with `embedding_multiplier`, `residual_multiplier`,"
          " `attention_multiplier` and `logits_scaling` (`ConstantScale`)"),
    refuses=("what Llama refuses; Granite 4 is `granitemoehybrid`, Granite 3 MoE"
             " (`granitemoe`) is refused"),
    rank=120,
    fields=dict.fromkeys(_MULTIPLIERS, POSITIVE_NUMBER),
)
