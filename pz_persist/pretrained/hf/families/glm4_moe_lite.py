"""GLM-4.7-Flash checkpoints (``model_type`` ``glm4_moe_lite``).

GLM-4.7-Flash is DeepSeek-V3's layout
(`pz_persist.pretrained.hf.building.latent_decoder`): multi-head latent
attention (`pz_persist.nn.latent_attention`: low-rank query and key/value
latents, RoPE on each head's interleaved ``qk_rope_head_dim`` part, yarn's
mscale) with GLM-4.5's mixture of experts, which is DeepSeek's rule
(`pz_persist.pretrained.hf.building.deepseek_moe`: group-limited sigmoid
routing with ``e_score_correction_bias``, shared experts). What differs from
DeepSeek-V3 is which layers are dense: those ``mlp_layer_types`` marks
``"dense"`` (transformers' default: the first one only), not the first
``first_k_dense_replace``; a Hub config that still carries
``first_k_dense_replace`` (which transformers 5 does not read) must agree.
The multi-token prediction layer the Hub's folder stores after the last
layer is left unread, as transformers leaves it.
"""

from __future__ import annotations

from collections.abc import Callable
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

_KINDS = ("dense", "sparse")


def _layer_types(value: Any) -> bool:
  return isinstance(value, list) and all(kind in _KINDS for kind in value)


def mlp_layer_types(cfg: Config, layers: int) -> Callable[[int], bool]:
  """Whether layer ``i`` is dense: ``mlp_layer_types`` (one entry per
  layer), else transformers' default (the first layer only); a
  ``first_k_dense_replace`` given too must say the same."""
  given = cfg.get("mlp_layer_types")
  if given is not None and len(given) != layers:
    raise cfg.unsupported("mlp_layer_types", f"a list of {len(given)}",
                          f"needs one entry per layer (num_hidden_layers={layers})")
  first_k = cfg.get("first_k_dense_replace")
  if first_k is not None:
    dense = given.count("dense") if given is not None else min(1, layers)
    prefix = given is None or given == ["dense"] * dense + ["sparse"] * (layers - dense)
    if not prefix or first_k != dense:
      raise cfg.unsupported("first_k_dense_replace", first_k,
                            "transformers' GLM-4.7-Flash reads mlp_layer_types instead (the"
                            f" first layer only when absent), which makes {dense} layers dense"
                            f"{'' if prefix else ', not all first'}; drop the field or make it"
                            " agree")
  if given is None:
    return lambda i: i == 0
  dense_layers = frozenset(i for i, kind in enumerate(given) if kind == "dense")
  return lambda i: i in dense_layers


def glm4_moe_lite_plan(cfg: Config, weights: Weights) -> Plan:
  """DeepSeek-V3's plan with GLM-4.7-Flash's dense layers (module docstring)."""
  return latent_plan(cfg, weights, dense=mlp_layer_types)


def _detect(model: pz.nn.Layer) -> str | None:
  """Latent attention whose dense layers are not all first (DeepSeek-V3
  cannot say so; with only the first ones dense the two are one model, and
  DeepSeek-V3's record writes it)."""
  if not all_layers(model, mla.LatentAttentionLogits):
    return None
  _, dense = latent_fields(model, {})
  return None if dense == sorted(dense, reverse=True) else "glm4_moe_lite"


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only glm4_moe_lite.
  fields, dense = latent_fields(model, like)
  fields.update(routing_fields(model, like, sum(dense)))
  fields["mlp_layer_types"] = [_KINDS[0] if d else _KINDS[1] for d in dense]
  # The Hub's fields transformers' class lacks: written where like has them.
  for hub_only in ("first_k_dense_replace", "num_nextn_predict_layers"):
    if hub_only not in like:
      del fields[hub_only]
  return fields


_HUB_FIELD = ("the Hub's config.json field, which transformers' class lacks (its model skips the"
              " stored multi-token prediction layer)")

_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm4_moe_lite": {
        "defaults": {**LLAMA_LIKE, "rms_norm_eps": 1e-5, "rope_interleave": True,
                     "q_lora_rank": 768, "num_nextn_predict_layers": 1,
                     "norm_topk_prob": True, "routed_scaling_factor": 1.8, "n_group": 1,
                     "topk_group": 1, "n_routed_experts": 64, "num_experts_per_tok": 4,
                     "moe_intermediate_size": 1536, "n_shared_experts": 1,
                     "max_position_embeddings": 202752, "scoring_func": "sigmoid",
                     "topk_method": "noaux_tc", "moe_layer_freq": 1},
        "defaults_why": {**ROUTER_DEFAULTS_WHY, "num_nextn_predict_layers": _HUB_FIELD},
    },
}
"""What each absent field means (``Glm4MoeLiteConfig``'s value;
`pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="GLM-4.7-Flash",
    model_types={"glm4_moe_lite": ModelType(
        glm4_moe_lite_plan, "Glm4MoeLiteForCausalLM", **_TRANSFORMERS_DEFAULTS["glm4_moe_lite"],
        ignored_fields=MOE_IGNORED,
        foreign_fields=MOE_FOREIGN)},
    detect=_detect,
    write_config=_write_config,
    adds=("DeepSeek-V3's multi-head latent attention (`latent_attention`) and experts"
          " (group-limited sigmoid routing with a correction bias, shared experts), dense"
          " layers where `mlp_layer_types` says"),
    refuses=("what DeepSeek-V3 refuses; a `first_k_dense_replace` that disagrees with"
             " `mlp_layer_types`"),
    rank=24,
    fields={**FIELDS, "mlp_layer_types": (_layer_types, 'a list of "dense" / "sparse"')},
)
