"""DeepSeek-V3 checkpoints (``model_type`` ``deepseek_v3``: DeepSeek-V3,
R1, V3.1, Kimi K2, Moonlight...).

What it adds to Llama's layout:

- **Multi-head latent attention** (`pz_persist.nn.latent_attention`):
  queries through a low-rank latent (``q_a_proj``, ``q_a_layernorm``,
  ``q_b_proj``; or one ``q_proj`` when ``q_lora_rank`` is null), keys and
  values up-projected from one compressed latent per token
  (``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``) plus a rotary
  key shared by all heads; RoPE only on each head's last
  ``qk_rope_head_dim`` numbers (held interleaved, ``rope_interleave``), the
  values ``v_head_dim`` wide; the softmax scale ``qk_head_dim ** -0.5``
  times yarn's ``mscale_all_dim`` factor squared. The KV cache holds the
  latent (its docstring says why).
- **Dense first layers, then mixtures of experts**: layers before
  ``first_k_dense_replace`` have a SwiGLU MLP of ``intermediate_size``; the
  others a `pz_persist.nn.mixture_of_experts` layer:
  ``n_routed_experts`` experts of ``moe_intermediate_size`` chosen by
  sigmoid scores with ``e_score_correction_bias`` added for the choice only,
  group-limited (``n_group`` groups ranked by the sum of their two best
  biased scores, the best ``topk_group`` kept), ``num_experts_per_tok``
  chosen, weighted by their unbiased scores (renormalised with
  ``norm_topk_prob``) times ``routed_scaling_factor``; plus
  ``n_shared_experts`` shared experts as one MLP, always added.
- **FP8 block-scaled weights** (`pz_persist.pretrained.hf.quantized_fp8`):
  the Hub's DeepSeek-V3 stores most matrices as float8_e4m3fn with one
  ``weight_scale_inv`` per 128x128 block; they are dequantised on load.
- **Multi-token prediction layers** (``num_nextn_predict_layers``: the Hub's
  ``model.layers.61``) are not part of the causal LM transformers runs; they
  are left unread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.nn import latent_attention as mla
from pz_persist.pretrained.hf.building.deepseek_moe import MOE_FOREIGN
from pz_persist.pretrained.hf.building.deepseek_moe import MOE_IGNORED
from pz_persist.pretrained.hf.building.deepseek_moe import ROUTER_DEFAULTS_WHY
from pz_persist.pretrained.hf.building.deepseek_moe import routing_fields
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.latent_decoder import FIELDS
from pz_persist.pretrained.hf.building.latent_decoder import latent_fields
from pz_persist.pretrained.hf.building.latent_decoder import latent_plan
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights


def deepseek_v3_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a DeepSeek-V3 checkpoint to Penzai (module docstring): its dense
  layers are the first ``first_k_dense_replace``."""
  return latent_plan(cfg, weights)


def _detect(model: pz.nn.Layer) -> str | None:
  """Latent attention."""
  return "deepseek_v3" if all_layers(model, mla.LatentAttentionLogits) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only deepseek_v3.
  fields, dense = latent_fields(model, like)
  fields.update(routing_fields(model, like, sum(dense)))
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "defaults": {**LLAMA_LIKE, "first_k_dense_replace": 3, "rope_interleave": True,
                     "num_nextn_predict_layers": 1, "norm_topk_prob": True,
                     "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                     "n_routed_experts": 256, "num_experts_per_tok": 8,
                     "moe_intermediate_size": 2048, "n_shared_experts": 1,
                     "max_position_embeddings": 4096, "scoring_func": "sigmoid",
                     "topk_method": "noaux_tc", "moe_layer_freq": 1, "q_lora_rank": 1536},
        "defaults_why": dict(ROUTER_DEFAULTS_WHY),
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="DeepSeek-V3",
    model_types={"deepseek_v3": ModelType(deepseek_v3_plan, "DeepseekV3ForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["deepseek_v3"],
                     ignored_fields=MOE_IGNORED, foreign_fields=MOE_FOREIGN)},
    detect=_detect,
    write_config=_write_config,
    adds=("multi-head latent attention (`latent_attention`: low-rank query and key/value"
          " latents, decoupled interleaved RoPE, yarn's mscale; the KV cache holds the latent);"
          " dense first layers then experts with group-limited sigmoid routing and a correction"
          " bias, shared experts; FP8 block-scaled weights dequantised on load"),
    refuses=("`attention_bias`, `num_key_value_heads` other than the heads, routing other than"
             " sigmoid / `noaux_tc`, `moe_layer_freq` other than 1"),
    rank=60,
    fields=FIELDS,
    refused_model_types={
        "deepseek_v2": ("model_type='deepseek_v2' is DeepSeek-V2 / V2.5, whose router (softmax"
                        " scores, greedy or group-limited choice without a correction bias)"
                        " pz_persist does not build yet; pz_persist.pretrained.load_hf reads its"
                        " latent attention in DeepSeek-V3 (model_type 'deepseek_v3')"),
    },
)
