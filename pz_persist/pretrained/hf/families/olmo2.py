"""OLMo 2 checkpoints (``model_type`` ``olmo2``), and the pieces OLMo 3
shares (`with_post_norms`, `with_query_key_norms`).

OLMo 2 is Llama's layout (`pz_persist.pretrained.hf.building.decoder`) with
two changes to each block:

- Post-norms: each residual branch normalizes its *output* (``attention ->
  post_attention_norm``, ``mlp -> post_ffw_norm``, Penzai's Gemma 2 names),
  and nothing normalizes its input; the Hugging Face tensors are
  ``post_attention_layernorm`` and ``post_feedforward_layernorm``.
- Query/key norms over the whole projection: an RMS norm of the query
  projection's output across all its heads at once (``q_norm``, one scale of
  ``heads * head_dim`` entries), and likewise for the keys, before RoPE. In
  Penzai, an ``RMSLayerNorm`` across the projection's head axes and
  ``projection`` (``attention/query_norm``, ``attention/key_norm``), its
  scale laid out as the projection's output.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.defaults import NO_BIASES
from pz_persist.pretrained.hf.building.post_norms import is_post_norm
from pz_persist.pretrained.hf.building.post_norms import olmo_blocks
from pz_persist.pretrained.hf.building.post_norms import olmo_fields
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights


def olmo2_plan(cfg: Config, weights: Weights) -> Plan:
  """Llama's mapping (with ``attention_bias``) turned into OLMo 2's blocks."""
  bool_field(cfg, "mlp_bias", False, False, "OLMo's MLP has no biases")
  return olmo_blocks(llama_plan(cfg, weights), float(cfg.get("rms_norm_eps", FROM_TABLE)))


def _detect(model: pz.nn.Layer) -> str | None:
  """Post-norms and no window (OLMo 3's record, of lower rank, claims those with one)."""
  return "olmo2" if is_post_norm(model) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only olmo2.
  return olmo_fields(model, like)


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "olmo2": {
        "defaults": {**LLAMA_LIKE, "rms_norm_eps": 1e-5, "mlp_bias": False,
                     "max_position_embeddings": 2048},
        "defaults_why": {
            "mlp_bias": NO_BIASES,
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="OLMo 2",
    model_types={"olmo2": ModelType(olmo2_plan, "Olmo2ForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["olmo2"])},
    detect=_detect,
    write_config=_write_config,
    adds=("post-norms (`post_attention_norm`, `post_ffw_norm`), query/key RMS norms over the"
          " whole projection (`query_norm`, `key_norm`), `attention_bias`, scaled RoPE"),
    refuses="what Llama refuses",
    rank=300,
)
