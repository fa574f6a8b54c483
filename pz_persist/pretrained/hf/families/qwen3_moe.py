"""Qwen3-MoE checkpoints (``model_type`` ``qwen3_moe``: Qwen3-30B-A3B,
Qwen3-235B-A22B, Qwen3-Coder).

The dense family's attention (query/key RMS norms, its module's
`query_key_norm_specs` / `with_query_key_norms`) with a mixture of experts in place of the MLP in layer ``i`` when ``i`` is
not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (every
layer in the published models), the others keeping a dense MLP of
``intermediate_size``. The router is a softmax over ``num_experts`` experts,
the top ``num_experts_per_tok`` chosen, renormalised over them if
``norm_topk_prob``; each expert a SwiGLU MLP of ``moe_intermediate_size``
(`pz_persist.nn.mixture_of_experts`).

Unlike the dense models' (and Qwen2's), transformers' Qwen3-MoE applies ``sliding_window`` to
every layer when ``use_sliding_window`` is set (``max_window_layers``, which
the Hub's configs carry, is read by nothing and ignored here too).

A Qwen3-VL-MoE folder's (``qwen3_vl_moe``: Qwen3-VL-30B-A3B,
Qwen3-VL-235B-A22B) language model is this decoder, read as Qwen3-VL's is
read from the dense family's: ``text_config``, every layer
global, interleaved multimodal RoPE that is ordinary RoPE at text
positions, DeepStack inactive without images, tensors under
``model.language_model.``. Its router always renormalises the chosen
experts' weights (``Qwen3VLMoeTextTopKRouter``; a ``norm_topk_prob`` of
false is refused), and its experts are fused: ``mlp.experts.gate_up_proj``
and ``mlp.experts.down_proj``, which the Hub's files store transposed
(``[experts, hidden, 2 * moe_intermediate_size]``, ``[experts,
moe_intermediate_size, hidden]``) and ``save_pretrained`` in memory's
layout; each is read in the layout its shape shows, as transformers does
(`pz_persist.pretrained.hf.building.moe.transposed_by_shape`). The vision
tower is not read, and the load says so; the model is exported as
``qwen3_moe`` (per-expert tensors, which ``Qwen3MoeForCausalLM`` reads).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained import errors
from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.defaults import QWEN_WINDOW
from pz_persist.pretrained.hf.building.ignored import OTHER_MODALITIES
from pz_persist.pretrained.hf.building.moe import LAYER_LIST
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY_IGNORED
from pz_persist.pretrained.hf.building.moe import ExpertNames
from pz_persist.pretrained.hf.building.moe import Experts
from pz_persist.pretrained.hf.building.moe import check_experts
from pz_persist.pretrained.hf.building.moe import expert_fields
from pz_persist.pretrained.hf.building.moe import mixtures
from pz_persist.pretrained.hf.building.moe import read_experts
from pz_persist.pretrained.hf.building.moe import routed_layers
from pz_persist.pretrained.hf.building.moe import softmax_routed
from pz_persist.pretrained.hf.building.moe import softmax_router
from pz_persist.pretrained.hf.building.moe import sparse_step_fields
from pz_persist.pretrained.hf.building.moe import transposed_by_shape
from pz_persist.pretrained.hf.building.moe import with_experts
from pz_persist.pretrained.hf.building.norms import query_key_norm_specs
from pz_persist.pretrained.hf.building.norms import with_query_key_norms
from pz_persist.pretrained.hf.building.vision_language import QWEN_VL_FOLDER_FIELDS
from pz_persist.pretrained.hf.building.vision_language import QWEN_VL_LAYOUTS
from pz_persist.pretrained.hf.building.vision_language import VL_FIELDS
from pz_persist.pretrained.hf.building.vision_language import qwen3_vl_global_attention
from pz_persist.pretrained.hf.building.vision_language import qwen_vl_text_config
from pz_persist.pretrained.hf.building.vision_language import renamed_plan
from pz_persist.pretrained.hf.building.vision_language import text_names
from pz_persist.pretrained.hf.building.vision_language import text_positions_rope
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

FIELDS = {
    "num_experts": POSITIVE_INT,
    "num_local_experts": POSITIVE_INT,
    "num_experts_per_tok": POSITIVE_INT,
    "moe_intermediate_size": POSITIVE_INT,
    "norm_topk_prob": BOOLEAN,
    "decoder_sparse_step": POSITIVE_INT,
    "mlp_only_layers": LAYER_LIST,
    "max_window_layers": NON_NEGATIVE_INT,
    **TRAINING_ONLY,
}


def qwen3_moe_plan(cfg: Config, weights: Weights, transposed: frozenset[str] = frozenset()
                   ) -> Plan:
  """Maps a Qwen3-MoE checkpoint (transformers' ``Qwen3MoeConfig`` defaults);
  ``transposed``: the fused expert tensors stored transposed (Qwen3-VL-MoE's,
  `Experts.transposed`)."""
  experts_count, top_k, neurons = read_experts(cfg, "num_experts", "moe_intermediate_size",
                                               aliases=("num_local_experts",))
  normalize = cfg.get("norm_topk_prob", False)
  # One window for every layer, or none.
  use_window = cfg.get("use_sliding_window", False)
  window = cfg.nullable("sliding_window", 4096) if use_window else None
  cfg.used.add("sliding_window")
  kind = (llamalike_common.AttentionTypeGlobalCausal() if window is None
          else llamalike_common.AttentionTypeSlidingWindowCausal(window))
  routed = routed_layers(cfg)
  bias = cfg.get("attention_bias", False)
  plan = llama_plan(cfg, weights, attention=lambda count: kind,
                    biases=Biases(query_key_value=bias, output=bias),
                    max_positions_default=32768, block_extras=query_key_norm_specs,
                    edit=with_query_key_norms)
  # llama_plan checked num_hidden_layers against the weights.
  experts = Experts(experts_count, top_k, neurons, normalize,
                    routed(cfg.require("num_hidden_layers")), ExpertNames(), transposed)
  check_experts(cfg, weights, experts, "num_experts")
  return with_experts(plan, experts, cfg.require("hidden_size"), weights.names,
                      softmax_router())


_FUSED = re.compile(r"model\.layers\.\d{1,9}\.mlp\.experts\.(gate_up_proj|down_proj)")


def qwen3_vl_moe_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps the language model of a ``qwen3_vl_moe`` folder (module docstring);
  the vision tower is left unread, and reported."""
  text_cfg = qwen_vl_text_config(cfg, RECORD.fields)
  qwen3_vl_global_attention(text_cfg, "Qwen3-VL-MoE")
  if text_cfg.get("norm_topk_prob") is False:
    raise text_cfg.unsupported("norm_topk_prob", False, "transformers' Qwen3-VL-MoE router"
                               " always renormalises the chosen experts' weights")
  text_cfg.raw["norm_topk_prob"] = True
  for key in TRAINING_ONLY:
    text_cfg.get(key)  # Read: checked against the schema; training only.
  # transformers' default sections, [24, 20, 20], when the file has none.
  text_positions_rope(text_cfg, interleaved=True, default_section=[24, 20, 20])
  names = text_names(cfg, weights, QWEN_VL_LAYOUTS)
  shapes = {text: weights.where[stored].entries[stored][1] for text, stored in names.items()
            if _FUSED.fullmatch(text)}
  transposed = transposed_by_shape(shapes, text_cfg.require("hidden_size"),
                                   text_cfg.require("moe_intermediate_size"))

  def text_plan(seen: Weights) -> Plan:
    plan = qwen3_moe_plan(text_cfg, seen, transposed)
    if plan.views:  # Per-expert tensors: transformers' Qwen3-VL-MoE reads the fused ones only.
      raise errors.SafetensorsFormatError(
          f"{weights.path}: the experts are stored one per expert"
          f" ({plan.views[0].name.rsplit('.', 2)[0]}.0...); transformers' Qwen3-VL-MoE reads"
          " them fused (mlp.experts.gate_up_proj, mlp.experts.down_proj), so pz_persist"
          " refuses the folder rather than read what transformers would not.")
    return plan

  return renamed_plan(cfg, weights, QWEN_VL_LAYOUTS, text_plan,
                      "Qwen3-VL-MoE's language model only")


def _detect(model: pz.nn.Layer) -> str | None:
  """Query/key norms and softmax-routed mixtures of experts."""
  found = [layer for layer in mixtures(model) if layer is not None]
  if (found and all(softmax_routed(layer) for layer in found)
      and all_layers(attention(model).input_to_query, pz.nn.RMSLayerNorm)):
    return "qwen3_moe"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only qwen3_moe.
  fields = expert_fields(model, like)
  experts, neurons = fields.pop("_experts"), fields.pop("_neurons")
  found_windows = set(windows(model))
  if len(found_windows) > 1:
    raise errors.ExportError(
        "the model's blocks attend through different windows; Qwen3-MoE has one window"
        f" for every layer or none (found {sorted(found_windows, key=str)}).")
  window = found_windows.pop()
  count_key = "num_local_experts" if "num_local_experts" in like else "num_experts"
  fields.update({
      count_key: experts, "moe_intermediate_size": neurons, **sparse_step_fields(model, like),
      "use_sliding_window": window is not None, "sliding_window": window,
      "attention_bias": model_biases(model).output,
  })
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "defaults": {**LLAMA_LIKE, **QWEN_WINDOW, "intermediate_size": 6144,
                     "decoder_sparse_step": 1, "norm_topk_prob": False, "num_experts_per_tok": 8,
                     "moe_intermediate_size": 768, "max_position_embeddings": 32768},
        "defaults_why": {
            "sliding_window": (
                'the config class stores None unless use_sliding_window is true, and 4096'
                " (its argument's default) when it is; pz_persist reads the window only "
                'then'),
            "max_window_layers": (
                "transformers' class has no such field (no layer is windowed by count); "
                'pz_persist reads it with use_sliding_window only'),
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


_VL_DEFAULTS: dict[str, Any] = {
    "defaults": {**LLAMA_LIKE, "rope_theta": 500_000.0, "max_position_embeddings": 128_000,
                 "intermediate_size": 5632, "decoder_sparse_step": 1, "num_experts_per_tok": 4,
                 "moe_intermediate_size": 1408},
}
"""Qwen3-VL-MoE's text model (``Qwen3VLMoeTextConfig``), whose defaults
differ from Qwen3-MoE's; ``tie_word_embeddings`` is the folder class's."""


RECORD = Family(
    title="Qwen3-MoE; Qwen3-VL-MoE's language model",
    model_types={
        "qwen3_moe": ModelType(qwen3_moe_plan, "Qwen3MoeForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["qwen3_moe"],
                     ignored_fields={
                         **TRAINING_ONLY_IGNORED,
                         "transformers' Qwen3-MoE reads it nowhere": ("max_window_layers",),
                     }, foreign_fields=frozenset({"max_window_layers", "router_jitter_noise"})),
        "qwen3_vl_moe": ModelType(qwen3_vl_moe_plan, "Qwen3VLMoeForConditionalGeneration",
                                  exported=False, written_as="qwen3_moe", ignored_fields={
                                      OTHER_MODALITIES: tuple(sorted(QWEN_VL_FOLDER_FIELDS))},
                                  **_VL_DEFAULTS),
    },
    detect=_detect,
    write_config=_write_config,
    adds=("query/key RMS norms with a mixture of experts (`MixtureOfExperts`: softmax router,"
          " top-k, `norm_topk_prob`; experts on an `experts` axis, read from the Hub's"
          " per-expert tensors or transformers 5's fused ones); `decoder_sparse_step`,"
          " `mlp_only_layers` dense layers; one window for every layer; the language model of"
          " `qwen3_vl_moe` folders (experts fused, read as stored or transposed; interleaved"
          " multimodal RoPE at text positions; the vision tower and DeepStack mergers are not"
          " read, and the load says so)"),
    refuses="an MLP bias, other rope types, a window on some layers only",
    rank=330,
    fields={**FIELDS, **VL_FIELDS},
)
