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

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.nn import sparse_attention as dsa
from pz_persist.pretrained.hf.building.deepseek_moe import MOE_FOREIGN
from pz_persist.pretrained.hf.building.deepseek_moe import MOE_IGNORED
from pz_persist.pretrained.hf.building.deepseek_moe import ROUTER_DEFAULTS_WHY
from pz_persist.pretrained.hf.building.deepseek_moe import routing_fields
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.latent_decoder import FIELDS
from pz_persist.pretrained.hf.building.latent_decoder import IndexerSizes
from pz_persist.pretrained.hf.building.latent_decoder import Sizes
from pz_persist.pretrained.hf.building.latent_decoder import first_k_dense
from pz_persist.pretrained.hf.building.latent_decoder import latent_fields
from pz_persist.pretrained.hf.building.latent_decoder import latent_plan
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_KINDS = ("dense", "sparse")
_INDEXED = "indexed_attention"


def _mlp_kinds(value: Any) -> bool:
  return isinstance(value, list) and all(kind in _KINDS for kind in value)


def _attention_kinds(value: Any) -> bool:
  return isinstance(value, list) and all(isinstance(kind, str) for kind in value)


def _per_layer(cfg: Config, key: str, layers: int) -> list[Any] | None:
  given = cfg.get(key)
  if given is not None and len(given) != layers:
    raise cfg.unsupported(key, f"a list of {len(given)}",
                          f"needs one entry per layer (num_hidden_layers={layers})")
  return given


def dense_layers(cfg: Config, layers: int) -> Callable[[int], bool]:
  """Whether layer ``i`` is dense: as ``mlp_layer_types`` says, else (as
  transformers derives that list) the first ``first_k_dense_replace``."""
  given = _per_layer(cfg, "mlp_layer_types", layers)
  first_k = first_k_dense(cfg, layers)  # Read either way: transformers' class holds it.
  if given is None:
    return first_k
  dense = frozenset(i for i, kind in enumerate(given) if kind == "dense")
  return lambda i: i in dense


def read_indexer(cfg: Config, sizes: Sizes) -> IndexerSizes:
  """The lightning indexer's sizes, checked against the attention's; and
  what DeepSeek-V3.2 fixes that DeepSeek-V3 lets a config choose."""
  kinds = _per_layer(cfg, "layer_types", sizes.layers)
  if kinds is not None and any(kind != _INDEXED for kind in kinds):
    other = next(kind for kind in kinds if kind != _INDEXED)
    raise cfg.unsupported("layer_types", other, f"every DeepSeek-V3.2 layer is {_INDEXED!r}"
                          " (the indexer's sparse attention); no other kind is built")
  if not sizes.interleave:
    raise cfg.unsupported("rope_interleave", False, "transformers' DeepSeek-V3.2 always reads"
                          " the rotary numbers interleaved; drop the field")
  if cfg.get("mlp_bias", FROM_TABLE):
    raise cfg.unsupported("mlp_bias", True, "transformers' DeepSeek-V3.2 MLPs have no biases")
  if sizes.q_rank is None:
    raise cfg.unsupported("q_lora_rank", None, "DeepSeek-V3.2's indexer reads its queries"
                          " from the low-rank query latent, which it must have")
  dim = cfg.get("index_head_dim", FROM_TABLE)
  if dim < sizes.rope:
    raise cfg.unsupported("index_head_dim", dim, f"the indexer rotates its first"
                          f" qk_rope_head_dim={sizes.rope} numbers: it must be at least that")
  return IndexerSizes(heads=cfg.get("index_n_heads", FROM_TABLE), dim=dim,
                      top_k=cfg.get("index_topk", FROM_TABLE))


def deepseek_v32_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a DeepSeek-V3.2 checkpoint to Penzai (module docstring)."""
  return latent_plan(cfg, weights, dense=dense_layers, read_indexer=read_indexer)


def _detect(model: pz.nn.Layer) -> str | None:
  """Latent attention with a lightning indexer."""
  return "deepseek_v32" if all_layers(model, dsa.SparseAttentionLogits) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only deepseek_v32.
  fields, dense = latent_fields(model, like)
  fields.update(routing_fields(model, like, sum(dense)))
  sparse = first_layer(model, dsa.SparseAttentionLogits, "sparse attention")
  index_query = first_layer(model, dsa.IndexedQuery, "indexer query").index_query
  query = named_shape(first_layer(index_query, pz.nn.Linear, "indexer query"))
  del fields["rope_interleave"]  # Not a field of transformers' class: always interleaved.
  fields.update({
      "index_topk": sparse.top_k, "index_n_heads": query["index_heads"],
      "index_head_dim": query["projection"],
      "mlp_layer_types": [_KINDS[0] if d else _KINDS[1] for d in dense],
      "layer_types": [_INDEXED] * len(dense), "mlp_bias": False,
  })
  prefix = sum(dense)
  if dense == [True] * prefix + [False] * (len(dense) - prefix):
    fields["first_k_dense_replace"] = prefix
  else:  # transformers reads mlp_layer_types; a first_k that disagrees would mislead.
    fields["first_k_dense_replace"] = like.get("first_k_dense_replace", 0)
  if "num_nextn_predict_layers" not in like:
    del fields["num_nextn_predict_layers"]
  return fields


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
    fields={**FIELDS, "mlp_layer_types": (_mlp_kinds, 'a list of "dense" / "sparse"'),
            "layer_types": (_attention_kinds, 'a list of "indexed_attention"'),
            "index_topk": POSITIVE_INT, "index_head_dim": POSITIVE_INT,
            "index_n_heads": POSITIVE_INT},
)
