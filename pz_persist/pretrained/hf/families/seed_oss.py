"""Seed-OSS checkpoints (``model_type`` ``seed_oss``: ByteDance's
Seed-OSS-36B).

Seed-OSS is Llama's layout (`pz_persist.pretrained.hf.building.decoder`)
with its biases set apart: ``attention_bias`` (default true) biases the
query, key and value projections only, ``attention_out_bias`` (default
false) the output projection, ``mlp_bias`` the MLP's three projections.
Each is a ``pz.nn.AddBias`` after its projection, as Llama's are. The
``residual_dropout`` and ``attention_dropout`` fields (0.1 by default) act in
training only, so inference never sees them; a Penzai model is built for
inference, and they are not read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights


def seed_oss_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Seed-OSS checkpoint (transformers' ``SeedOssConfig`` defaults:
  query/key/value biases on, output bias off, ``head_dim`` 128)."""
  biases = Biases(query_key_value=cfg.get("attention_bias", True),
                  output=cfg.get("attention_out_bias", False), mlp=cfg.get("mlp_bias", False))
  return llama_plan(cfg, weights, biases=biases, head_dim_default=128,
                    max_positions_default=524_288)


def _detect(model: pz.nn.Layer) -> str | None:
  """Llama's layout with biases Llama cannot express: on the query, key and
  value projections but not the output one, or the other way round (Qwen2's
  record, of lower rank, claims query/key/value biases alone, the same math)."""
  biases = model_biases(model)
  return "seed_oss" if biases.query_key_value != biases.output else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only seed_oss.
  biases = model_biases(model)
  fields = {**llamalike_fields(model, like), "attention_bias": biases.query_key_value,
            "attention_out_bias": biases.output, "mlp_bias": biases.mlp}
  if "residual_dropout" in like:  # Training only: like's, as the other dropouts are.
    fields["residual_dropout"] = like["residual_dropout"]
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "seed_oss": {
        "defaults": {**LLAMA_LIKE, "attention_bias": True, "attention_out_bias": False,
                     "mlp_bias": False, "head_dim": 128, "max_position_embeddings": 524_288},
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Seed-OSS",
    model_types={"seed_oss": ModelType(
        seed_oss_plan, "SeedOssForCausalLM", **_TRANSFORMERS_DEFAULTS["seed_oss"],
        ignored_fields={"dropout, which acts in training only (a loaded model infers)": (
            "residual_dropout",)})},
    detect=_detect,
    write_config=_write_config,
    adds=("Llama's layout with query/key/value biases (`attention_bias`), an output-projection"
          " bias of its own (`attention_out_bias`) and MLP biases (`mlp_bias`), each an"
          " `AddBias`; `residual_dropout` (training only) is not read"),
    refuses="what Llama refuses",
    rank=870,
    fields={"attention_out_bias": BOOLEAN,
            "residual_dropout": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                                 and 0 <= v <= 1, "a probability between 0 and 1")},
)
