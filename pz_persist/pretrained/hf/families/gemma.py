"""Gemma and Gemma 2 checkpoints (``model_type`` ``gemma``, ``gemma2``), as
published on the Hugging Face Hub (``google/gemma-2-2b``...).

The model is Penzai's llama-like transformer configured as Penzai's own
Gemma variant configures it (``penzai.models.transformer.variants.gemma``):
GeGLU MLP with the tanh GELU, the embedding table tied to the logits with
inputs scaled by sqrt(hidden_size), and for Gemma 2 post-attention and
post-MLP norms, query scaling by ``query_pre_attn_scalar ** -0.5``, tanh soft
caps on attention and final logits, and attention alternating between a
sliding window and global as ``layer_types`` says. One thing differs from
Penzai's converter: each RMS norm's scale is an `OffsetScale` holding
Hugging Face's weight ``w`` itself and computing ``x * (1 + w)`` in float32,
as transformers does, instead of a ``Linear`` holding ``1 + w`` (see
`pz_persist.nn.offset_scale` for why).

Defaults for absent fields are those of transformers' ``GemmaConfig`` /
``Gemma2Config``; for the soft caps and the window an explicit null means
"off", as in transformers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained.hf.building.decoder import attention_sizes
from pz_persist.pretrained.hf.building.decoder import block_specs
from pz_persist.pretrained.hf.building.decoder import full_rotary_wavelength
from pz_persist.pretrained.hf.building.defaults import CAUSAL_WHY
from pz_persist.pretrained.hf.building.defaults import GEMMA_LIKE
from pz_persist.pretrained.hf.building.defaults import HIDDEN_ACT_WHY
from pz_persist.pretrained.hf.building.gemma_layout import check_activation
from pz_persist.pretrained.hf.building.gemma_layout import query_pre_attn_scalar
from pz_persist.pretrained.hf.building.gemma_layout import soft_cap_fields
from pz_persist.pretrained.hf.building.norms import with_offset_norms
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config import refuse_stored_head
from pz_persist.pretrained.hf.config_from_model import activation_field
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import layer_types
from pz_persist.pretrained.hf.config_from_model import rms_norm_fields
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import size_fields
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import DECODER_HEAD
from pz_persist.pretrained.hf.plan import DECODER_LAYERS
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import check_layers
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_LAYER_TYPES = {"sliding_attention", "full_attention"}


def gemma_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Gemma (1) checkpoint: global attention, no soft caps, no post-norms."""
  return gemma_layout_plan(cfg, weights, gemma2=False)


def gemma2_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Gemma 2 checkpoint: Gemma plus post-norms, soft caps, query
  scaling and alternating sliding-window / global attention."""
  return gemma_layout_plan(cfg, weights, gemma2=True)


def gemma_native_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Gemma folder to Penzai's own Gemma (as `load_gemma` builds it)."""
  return gemma_layout_plan(cfg, weights, gemma2=False, native=True)


def gemma2_native_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Gemma 2 folder to Penzai's own Gemma 2."""
  return gemma_layout_plan(cfg, weights, gemma2=True, native=True)


def gemma_layout_plan(cfg: Config, weights: Weights, gemma2: bool, native: bool = False) -> Plan:
  """Maps a Gemma (or, with ``gemma2``, Gemma 2) checkpoint; with
  ``native``, to Penzai's own Gemma structure (as `load_gemma` builds it:
  each norm a scale ``Linear`` holding ``1 + w``, the one added in float32).

  The native plans are not what ``load_hf`` reads (its norms hold the raw
  ``w``, bit-exact); they are the record's further export plans, so
  `pz_persist.pretrained.hf.export.export_hf` can write a model from
  ``load_gemma`` back as a Hugging Face folder by running the plan backwards.
  """
  hidden, heads, kv_heads, head_dim = attention_sizes(
      cfg, kv_heads_default=4 if gemma2 else 16, head_dim_default=256)
  theta = full_rotary_wavelength(cfg)
  check_activation(cfg)
  bool_field(cfg, "attention_bias", False, False, "Penzai's llama-like attention has no biases")
  bool_field(cfg, "use_bidirectional_attention", False, False,
             "Penzai's Gemma attention is causal")
  bool_field(cfg, "tie_word_embeddings", True, True,
             "Penzai's Gemma ties the output projection to the embedding table")
  layers = cfg.require("num_hidden_layers")
  gemma2_settings: dict[str, Any] = {}
  window, types = None, None
  if gemma2:
    window, types = _window_and_layer_types(cfg, layers)
    gemma2_settings = {
        "use_post_attn_norm": True,
        "use_post_ffw_norm": True,
        "query_scaling_factor": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_logits_soft_cap": cfg.nullable("attn_logit_softcapping", 50.0),
        "final_logit_softcap": cfg.nullable("final_logit_softcapping", 30.0),
    }
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=kv_heads,
      query_head_multiplier=heads // kv_heads,
      embedding_dim=hidden,
      projection_dim=head_dim,
      mlp_hidden_dim=cfg.require("intermediate_size"),
      num_decoder_blocks=layers,
      vocab_size=cfg.require("vocab_size"),
      mlp_variant="geglu_approx",
      tie_embedder_and_logits=True,
      rope_wavelength=theta,
      rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      parameter_dtype=None,
      activation_dtype=None,
      **gemma2_settings,
  )
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  check_layers(cfg, weights.names, DECODER_LAYERS, layers)
  refuse_stored_head(cfg, weights, DECODER_HEAD,
                     "Penzai's Gemma ties the output projection to the embedding table")
  config = dataclasses.replace(config, parameter_dtype=weights.dtype,
                               activation_dtype=weights.dtype)
  if gemma2:
    config = dataclasses.replace(config, attention_type=_attention_types(window, types, layers))

  def norm(label: str, source: str) -> TensorSpec:
    return TensorSpec(label + "/scale.weights", source, (hidden,), ("embedding",),
                      offset=1.0 if native else 0.0)

  specs = [
      TensorSpec("transformer/embedder.embeddings", "model.embed_tokens.weight",
                 (config.vocab_size, hidden), ("vocabulary", "embedding")),
      norm("transformer/final_norm", "model.norm.weight"),
  ]
  for i in range(layers):
    p, s = f"transformer/block_{i}/", f"model.layers.{i}."
    specs.append(norm(p + "pre_attention_norm", s + "input_layernorm.weight"))
    if gemma2:
      specs += [
          norm(p + "post_attention_norm", s + "post_attention_layernorm.weight"),
          norm(p + "pre_ffw_norm", s + "pre_feedforward_layernorm.weight"),
          norm(p + "post_ffw_norm", s + "post_feedforward_layernorm.weight"),
      ]
    else:  # Gemma 1 (like Llama) names its pre-MLP norm "post_attention".
      specs.append(norm(p + "pre_ffw_norm", s + "post_attention_layernorm.weight"))
    specs += block_specs(p, s, config)

  def build() -> model_parts.TransformerLM:
    skeleton = llamalike_common.build_llamalike_transformer(config, init_base_rng=None)
    return skeleton if native else with_offset_norms(skeleton)

  return Plan(build, tuple(specs))


def _window_and_layer_types(cfg: Config, layers: int) -> tuple[int | None, list[str] | None]:
  """``sliding_window`` and ``layer_types`` (None: transformers' default),
  checked.

  ``sliding_window_size`` (written by early Gemma 2 releases, read by no
  transformers version) must agree with ``sliding_window`` if present.
  Nothing here grows with ``layers``: it is not yet checked against the
  weights (`check_layers`), and a forged config may ask for 10**9 layers.
  """
  window = cfg.nullable("sliding_window", 4096)
  legacy = cfg.get("sliding_window_size")
  if legacy is not None and legacy != window:
    raise cfg.unsupported("sliding_window_size", legacy,
                          f"it differs from sliding_window={window}")
  types = cfg.get("layer_types")
  if types is not None and (len(types) != layers or not set(types) <= _LAYER_TYPES):
    raise cfg.unsupported(
        "layer_types", types,
        f"one of {sorted(_LAYER_TYPES)} for each of the num_hidden_layers={layers} layers")
  if window is None and (types is None or "sliding_attention" in types):
    raise cfg.unsupported("sliding_window", None,
                          "the layers of type 'sliding_attention' need a window"
                          " (transformers' own cache fails without one)")
  return window, types


def _attention_types(
    window: int | None, types: list[str] | None, layers: int
) -> tuple[llamalike_common.AttentionType, ...]:
  """Each block's attention. Without ``layer_types``, transformers' Gemma 2
  alternates sliding-window (even blocks) and global attention (odd blocks)."""
  if types is None:
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
  return tuple(
      llamalike_common.AttentionTypeSlidingWindowCausal(window)
      if kind == "sliding_attention" and window is not None
      else llamalike_common.AttentionTypeGlobalCausal()
      for kind in types
  )


def _detect(model: pz.nn.Layer) -> str | None:
  """Penzai's Gemma decodes with its embedding table; Gemma 2 adds norms
  after attention and MLP."""
  if not all_layers(model, pz.nn.EmbeddingDecode):
    return None
  return "gemma2" if len(all_layers(blocks(model)[0], pz.nn.RMSLayerNorm)) > 2 else "gemma"


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  gemma2 = model_type == "gemma2"
  fields = {
      **size_fields(model), **rms_norm_fields(model), **rope_fields(model),
      **activation_field(model, like, "hidden_activation" if gemma2 else "hidden_act"),
      # Penzai's Gemma decodes with its embedding table, and has no biases.
      "tie_word_embeddings": True, "attention_bias": False,
  }
  if gemma2:
    found = windows(model)
    window = next((w for w in found if w is not None), None)
    fields.update({
        "sliding_window": like.get("sliding_window", 4096) if window is None else window,
        "layer_types": layer_types(found),
        "query_pre_attn_scalar": query_pre_attn_scalar(model),
        **soft_cap_fields(model),
    })
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": {
        "defaults": {**GEMMA_LIKE, "num_key_value_heads": 16},
        "defaults_why": {
            "use_bidirectional_attention": CAUSAL_WHY,
            "hidden_activation": (
                "Gemma 1's class reads hidden_act; hidden_activation, the later name, has"
                ' the same default'),
        },
    },
    "gemma2": {
        "defaults": {**GEMMA_LIKE, "num_key_value_heads": 4, "query_pre_attn_scalar": 256,
                     "sliding_window": 4096, "final_logit_softcapping": 30.0,
                     "attn_logit_softcapping": 50.0},
        "defaults_why": {
            "use_bidirectional_attention": CAUSAL_WHY,
            "hidden_act": HIDDEN_ACT_WHY,
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Gemma, Gemma 2",
    model_types={
        "gemma": ModelType(gemma_plan, "GemmaForCausalLM", export_plans=(gemma_native_plan,),
            **_TRANSFORMERS_DEFAULTS["gemma"]),
        "gemma2": ModelType(gemma2_plan, "Gemma2ForCausalLM", export_plans=(gemma2_native_plan,),
            **_TRANSFORMERS_DEFAULTS["gemma2"]),
    },
    detect=_detect,
    write_config=_write_config,
    adds=("the Hub's folders (`google/gemma-2-2b`...): GeGLU, tied and scaled embeddings, Gemma 2's"
          " post-norms, `query_pre_attn_scalar`, soft caps, sliding / global attention per layer;"
          " norms keep Hugging Face's `w` (`OffsetScale`)"),
    refuses="bidirectional attention, untied embeddings, attention biases",
    rank=200,
)
