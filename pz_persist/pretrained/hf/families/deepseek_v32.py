"""DeepSeek-V3.2 checkpoints (``model_type`` ``deepseek_v32``: DeepSeek-V3.2,
V3.2-Exp).

DeepSeek-V3's layout (`pz_persist.pretrained.hf.building.latent_decoder`:
multi-head latent attention, dense layers then group-limited sigmoid-routed
experts with shared experts, FP8 weights dequantised, the multi-token
prediction layer left unread) plus **DeepSeek Sparse Attention**
(`pz_persist.nn.sparse_attention`): each attention layer's lightning indexer
(``self_attn.indexer``: ``wq_b`` from the query latent, ``wk`` and a
LayerNorm ``k_norm`` from the input, RoPE in halves on the first
``qk_rope_head_dim`` numbers, ``weights_proj`` per head) scores every past
token, and attention sees only the ``index_topk`` best for each query. The
KV cache holds each token's indexer key beside its latent, as transformers'
does.

What differs from DeepSeek-V3's config: dense layers are those
``mlp_layer_types`` marks ``"dense"`` (when absent, the first
``first_k_dense_replace``, as transformers derives it); the RoPE is always
interleaved (transformers' class has no ``rope_interleave``, so one saying
``false`` is refused); queries always go through the low-rank latent (the
indexer reads it: a null ``q_lora_rank`` is refused); ``layer_types`` can
only say ``"indexed_attention"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.building import sparse_decoder
from pz_persist.pretrained.hf.building.deepseek_moe import MOE_FOREIGN
from pz_persist.pretrained.hf.building.deepseek_moe import MOE_IGNORED
from pz_persist.pretrained.hf.building.deepseek_moe import ROUTER_DEFAULTS_WHY
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.latent_decoder import IndexerSizes
from pz_persist.pretrained.hf.building.latent_decoder import Sizes
from pz_persist.pretrained.hf.building.latent_decoder import latent_plan
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights


def _read_indexer(cfg: Config, sizes: Sizes) -> IndexerSizes:
  """The indexer of every layer, its RoPE in halves."""
  return sparse_decoder.read_indexer(cfg, sizes, "DeepSeek-V3.2")


def deepseek_v32_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a DeepSeek-V3.2 checkpoint to Penzai (module docstring)."""
  return latent_plan(cfg, weights, dense=sparse_decoder.dense_layers, read_indexer=_read_indexer)


def _detect(model: pz.nn.Layer) -> str | None:
  """Latent attention with a lightning indexer whose RoPE is in halves."""
  return "deepseek_v32" if sparse_decoder.indexer_interleaved(model) is False else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only deepseek_v32.
  return sparse_decoder.sparse_fields(model, like)[0]


_HUB_FIELD = ("the Hub's config.json field, which transformers' class lacks (its model skips the"
              " stored multi-token prediction layer)")

_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v32": {
        "defaults": {**LLAMA_LIKE, "first_k_dense_replace": 3, "rope_interleave": True,
                     "num_nextn_predict_layers": 1, "norm_topk_prob": True,
                     "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                     "n_routed_experts": 256, "num_experts_per_tok": 8,
                     "moe_intermediate_size": 2048, "n_shared_experts": 1,
                     "max_position_embeddings": 163840, "scoring_func": "sigmoid",
                     "topk_method": "noaux_tc", "moe_layer_freq": 1, "q_lora_rank": 1536,
                     "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
                     "mlp_bias": False},
        "defaults_why": {
            **ROUTER_DEFAULTS_WHY, "num_nextn_predict_layers": _HUB_FIELD,
            "rope_interleave": ("DeepSeek-V3's field, which transformers' DeepSeek-V3.2 class"
                                " lacks: its attention always reads the rotary numbers"
                                " interleaved")},
    },
}
"""What each absent field means (``DeepseekV32Config``'s value;
`pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="DeepSeek-V3.2",
    model_types={"deepseek_v32": ModelType(
        deepseek_v32_plan, "DeepseekV32ForCausalLM", **_TRANSFORMERS_DEFAULTS["deepseek_v32"],
        ignored_fields=MOE_IGNORED, foreign_fields=MOE_FOREIGN)},
    detect=_detect,
    write_config=_write_config,
    adds=("DeepSeek-V3's latent attention and experts plus DeepSeek Sparse Attention"
          " (`sparse_attention`: a lightning indexer scores past tokens, attention sees the"
          " `index_topk` best; its keys held in the KV cache beside the latent); dense layers"
          " where `mlp_layer_types` says"),
    refuses=("what DeepSeek-V3 refuses; a null `q_lora_rank`, `rope_interleave` false,"
             " `layer_types` other than indexed attention, `index_head_dim` below"
             " `qk_rope_head_dim`"),
    rank=1,
    fields=sparse_decoder.SPARSE_FIELDS,
)
