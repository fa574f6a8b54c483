"""GLM-5 checkpoints (``model_type`` ``glm_moe_dsa``).

DeepSeek-V3.2's layout (`pz_persist.pretrained.hf.building.sparse_decoder`:
multi-head latent attention, dense layers where ``mlp_layer_types`` says
then group-limited sigmoid-routed experts with shared experts, the
multi-token prediction layer left unread, DeepSeek Sparse Attention's
lightning indexer, `pz_persist.nn.sparse_attention`) with two differences
transformers' ``GlmMoeDsa`` model makes:

- the indexer's RoPE is interleaved, as the attention's (DeepSeek-V3.2's
  is in halves);
- a layer ``indexer_types`` marks ``"shared"`` has no indexer: it attends to
  the tokens the last earlier ``"full"`` layer's indexer chose
  (`pz_persist.nn.sparse_attention.SharedChoiceLogits`; the choice passed
  down in the forward pass's mailbox, `pz_persist.nn.kv_sharing.SharesKV`),
  and its KV cache holds the latent alone. Without ``indexer_types``,
  transformers derives it from ``index_topk_pattern`` (``"F"`` / ``"S"``
  per layer), else from ``index_topk_freq`` and ``index_skip_topk_offset``
  (layer ``i`` is full when ``max(i - offset + 1, 0) % freq == 0``; every
  layer by default), and so does pz_persist. A first layer marked shared
  (transformers' forward fails on it) is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.nn import sparse_attention as dsa
from pz_persist.pretrained.hf.building import sparse_decoder
from pz_persist.pretrained.hf.building.deepseek_moe import MOE_FOREIGN
from pz_persist.pretrained.hf.building.deepseek_moe import MOE_IGNORED
from pz_persist.pretrained.hf.building.deepseek_moe import ROUTER_DEFAULTS_WHY
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.latent_decoder import IndexerSizes
from pz_persist.pretrained.hf.building.latent_decoder import Sizes
from pz_persist.pretrained.hf.building.latent_decoder import latent_plan
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_FULL, _SHARED = "full", "shared"
_LETTERS = {"F": _FULL, "S": _SHARED}


def _indexer_kinds(value: Any) -> bool:
  return isinstance(value, list) and all(kind in (_FULL, _SHARED) for kind in value)


def _pattern(value: Any) -> bool:
  return (isinstance(value, str) and all(letter in _LETTERS for letter in value)
          ) or _indexer_kinds(value)


def _integer(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _runs_own_indexer(cfg: Config, layers: int) -> Callable[[int], bool]:
  """Whether layer ``i`` runs its own indexer (``"full"``), as
  transformers' config derives ``indexer_types`` (module docstring); a first
  layer that would reuse an earlier one's choice is refused."""
  kinds = sparse_decoder.per_layer(cfg, "indexer_types", layers)
  pattern = cfg.get("index_topk_pattern")  # Read either way; transformers ignores it then.
  freq = max(cfg.get("index_topk_freq", FROM_TABLE), 1)
  offset = cfg.get("index_skip_topk_offset", FROM_TABLE)
  if kinds is not None:
    key = "indexer_types"
  elif pattern is not None:
    key = "index_topk_pattern"
    pattern = sparse_decoder.per_layer(cfg, key, layers)
    kinds = [_LETTERS[letter] for letter in pattern] if isinstance(pattern, str) else pattern
  else:
    key = "index_skip_topk_offset"
  shared = frozenset(i for i, kind in enumerate(kinds or ()) if kind == _SHARED)

  def runs(i: int) -> bool:
    return i not in shared if kinds is not None else max(i - offset + 1, 0) % freq == 0

  if not runs(0):
    raise cfg.unsupported(key, kinds[0] if kinds is not None else offset,
                          "it makes the first layer reuse the top-k of an earlier indexer"
                          " layer, which it does not have (transformers' forward fails)")
  return runs


def _read_indexer(cfg: Config, sizes: Sizes) -> IndexerSizes:
  """The indexer's sizes, its RoPE interleaved, and the layers that run it."""
  indexer = sparse_decoder.read_indexer(cfg, sizes, "GLM-5")
  return IndexerSizes(heads=indexer.heads, dim=indexer.dim, top_k=indexer.top_k,
                      interleave=True, runs=_runs_own_indexer(cfg, sizes.layers))


def glm_moe_dsa_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a GLM-5 checkpoint to Penzai (module docstring)."""
  return latent_plan(cfg, weights, dense=sparse_decoder.dense_layers, read_indexer=_read_indexer)


def _detect(model: pz.nn.Layer) -> str | None:
  """Latent attention with a lightning indexer whose RoPE is interleaved."""
  return "glm_moe_dsa" if sparse_decoder.indexer_interleaved(model) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only glm_moe_dsa.
  fields, _ = sparse_decoder.sparse_fields(model, like)
  fields["indexer_types"] = [_SHARED if all_layers(block, dsa.SharedChoiceLogits) else _FULL
                             for block in blocks(model)]
  return fields


_HUB_FIELD = ("the Hub's config.json field, which transformers' class lacks (its model skips the"
              " stored multi-token prediction layer)")
_SCHEDULE = ("not a field of transformers' class: its __post_init__ reads it (when"
             " indexer_types and index_topk_pattern are absent) to derive indexer_types, with"
             " this value when absent")

_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm_moe_dsa": {
        "defaults": {**LLAMA_LIKE, "rms_norm_eps": 1e-5, "first_k_dense_replace": 3,
                     "rope_interleave": True, "num_nextn_predict_layers": 1,
                     "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 1,
                     "topk_group": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
                     "moe_intermediate_size": 2048, "n_shared_experts": 1,
                     "max_position_embeddings": 202752, "scoring_func": "sigmoid",
                     "topk_method": "noaux_tc", "moe_layer_freq": 1, "q_lora_rank": 2048,
                     "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
                     "mlp_bias": False, "index_topk_freq": 1, "index_skip_topk_offset": 2},
        "defaults_why": {
            **ROUTER_DEFAULTS_WHY, "num_nextn_predict_layers": _HUB_FIELD,
            "index_topk_freq": _SCHEDULE, "index_skip_topk_offset": _SCHEDULE,
            "rope_interleave": ("DeepSeek-V3's field, which transformers' GLM-5 class"
                                " lacks: its attention and indexer always read the rotary"
                                " numbers interleaved")},
    },
}
"""What each absent field means (``GlmMoeDsaConfig``'s value;
`pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="GLM-5",
    model_types={"glm_moe_dsa": ModelType(
        glm_moe_dsa_plan, "GlmMoeDsaForCausalLM", **_TRANSFORMERS_DEFAULTS["glm_moe_dsa"],
        ignored_fields=MOE_IGNORED,
        foreign_fields=MOE_FOREIGN)},
    detect=_detect,
    write_config=_write_config,
    adds=("DeepSeek-V3.2's layout (`sparse_attention`) with the indexer's RoPE interleaved;"
          " layers `indexer_types` marks `\"shared\"` reuse the last full layer's top-k"
          " (`SharedChoiceLogits`; no indexer, the latent alone in their KV cache), the list"
          " derived from `index_topk_pattern` or `index_topk_freq` /"
          " `index_skip_topk_offset` as transformers does"),
    refuses=("what DeepSeek-V3.2 refuses; a first layer marked `\"shared\"`"),
    rank=0,
    fields={**sparse_decoder.SPARSE_FIELDS,
            "indexer_types": (_indexer_kinds, 'a list of "full" / "shared"'),
            "index_topk_pattern": (_pattern, 'a string of "F" / "S" or a list of'
                                   ' "full" / "shared"'),
            "index_topk_freq": (_integer, "an integer"),
            "index_skip_topk_offset": (_integer, "an integer")},
)
