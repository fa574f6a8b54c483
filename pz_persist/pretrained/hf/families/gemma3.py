"""Gemma 3 checkpoints: ``gemma3_text`` (270M, 1B) and the text model inside
``gemma3`` multimodal folders (4B to 27B).

The model is Gemma 2's as `pz_persist.pretrained.hf.families.gemma` builds
it (GeGLU, tied embeddings scaled by sqrt(hidden_size), post-attention and
post-MLP norms, query scaling by ``query_pre_attn_scalar ** -0.5``, every
norm an `OffsetScale` computing ``x * (1 + w)`` in float32), plus:

- an RMS norm on the queries and the keys over each head's ``projection``
  axis, after the projections and before RoPE (the layers of the family
  that introduced them, imported below, with Gemma's offset scale);
- two RoPE bases: local (sliding-window) layers rotate with
  ``rope_local_base_freq`` (default 10 000), global layers with
  ``rope_theta`` (default 1 000 000) and the config's scaling (``linear``,
  factor 8, in the 4B to 27B models: an `ApplyScaledRoPE` on those layers
  only). transformers 5 writes both in ``rope_parameters`` keyed by layer
  type; both spellings are read;
- which layers are local: ``layer_types``, else every layer but each
  ``sliding_window_pattern``-th (default 6);
- the final soft cap off unless the config sets it (Gemma 2's default on);
  an attention soft cap is refused (transformers' Gemma 3 ignores it).

A ``gemma3`` folder holds the text model under ``language_model.model.``
(its config in ``text_config``) next to a SigLIP vision tower and its
projector: those tensors are not read, and the load says so (a warning on
the ``pz_persist.pretrained.hf`` logger, naming how many). Such a model is
exported as ``gemma3_text``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained.hf import multimodal
from pz_persist.pretrained.hf.building.decoder import attention_sizes
from pz_persist.pretrained.hf.building.decoder import block_specs
from pz_persist.pretrained.hf.building.decoder import with_scaled_rope
from pz_persist.pretrained.hf.building.defaults import GEMMA_LIKE
from pz_persist.pretrained.hf.building.defaults import HIDDEN_ACT_WHY
from pz_persist.pretrained.hf.building.gemma_layout import check_activation
from pz_persist.pretrained.hf.building.gemma_layout import query_pre_attn_scalar
from pz_persist.pretrained.hf.building.gemma_layout import soft_cap_fields
from pz_persist.pretrained.hf.building.ignored import OTHER_MODALITIES
from pz_persist.pretrained.hf.building.norms import query_key_norm_specs
from pz_persist.pretrained.hf.building.norms import with_offset_norms
from pz_persist.pretrained.hf.building.norms import with_query_key_norms
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import OBJECT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import RopeScaling
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config import refuse_stored_head
from pz_persist.pretrained.hf.config import rope
from pz_persist.pretrained.hf.config import scaled_rope
from pz_persist.pretrained.hf.config_from_model import activation_field
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import layer_types
from pz_persist.pretrained.hf.config_from_model import rms_norm_fields
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import size_fields
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import DECODER_HEAD
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import check_layers
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_TYPES = ("sliding_attention", "full_attention")
_TEXT = "model."  # gemma3_text's tensors: model.layers.0...
_MULTIMODAL_TEXT = "language_model.model."  # gemma3's text model.


_SIZE_DEFAULTS = {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                  "num_attention_heads": 8, "vocab_size": 262_208}
"""transformers' ``Gemma3TextConfig`` defaults for the sizes, which the Hub's
``gemma3`` folders leave out of ``text_config`` (their ``vocab_size``
always); every size is checked against the weights before anything is built."""


def gemma3_text_plan(cfg: Config, weights: Weights, root: str = _TEXT) -> Plan:
  """Maps a Gemma 3 text model whose tensors are under ``root``."""
  cfg.fill_absent(_SIZE_DEFAULTS)
  hidden, heads, kv_heads, head_dim = attention_sizes(cfg, kv_heads_default=4,
                                                      head_dim_default=256)
  check_activation(cfg)
  _refuse_attention_soft_cap(cfg)
  bool_field(cfg, "attention_bias", False, False, "Gemma 3's attention has no biases")
  bool_field(cfg, "use_bidirectional_attention", False, False,
             "Penzai's Gemma attention is causal (this is EmbeddingGemma's setting)")
  bool_field(cfg, "tie_word_embeddings", True, True,
             "Penzai's Gemma ties the output projection to the embedding table")
  layers = cfg.require("num_hidden_layers")
  (local_theta, global_theta, scaling), window, kinds = _rope(cfg), *_window_and_types(cfg, layers)
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
      rope_wavelength=global_theta,
      rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      use_post_attn_norm=True,
      use_post_ffw_norm=True,
      query_scaling_factor=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
      attn_logits_soft_cap=None,  # `_refuse_attention_soft_cap` made sure.
      final_logit_softcap=cfg.nullable("final_logit_softcapping", None),
      parameter_dtype=weights.dtype,
      activation_dtype=weights.dtype,
  )
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  check_layers(cfg, weights.names, root + "layers.", layers)
  refuse_stored_head(cfg, weights, DECODER_HEAD,
                     "Penzai's Gemma ties the output projection to the embedding table")
  types = kinds(layers)
  config = _with_attention_types(config, types, window)

  def norm(label: str, source: str) -> TensorSpec:
    return TensorSpec(label + "/scale.weights", source, (hidden,), ("embedding",))

  specs = [
      TensorSpec("transformer/embedder.embeddings", root + "embed_tokens.weight",
                 (config.vocab_size, hidden), ("vocabulary", "embedding")),
      norm("transformer/final_norm", root + "norm.weight"),
  ]
  for i in range(layers):
    p, s = f"transformer/block_{i}/", f"{root}layers.{i}."
    specs += [
        norm(p + "pre_attention_norm", s + "input_layernorm.weight"),
        norm(p + "post_attention_norm", s + "post_attention_layernorm.weight"),
        norm(p + "pre_ffw_norm", s + "pre_feedforward_layernorm.weight"),
        norm(p + "post_ffw_norm", s + "post_feedforward_layernorm.weight"),
        *block_specs(p, s, config),
        *query_key_norm_specs(p, s, config),
    ]

  def build() -> model_parts.TransformerLM:
    model = llamalike_common.build_llamalike_transformer(config, init_base_rng=None)
    model = with_offset_norms(with_query_key_norms(model, config))
    return _with_local_rope(model, types, local_theta, scaling)

  return Plan(build, tuple(specs))


def gemma3_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps the text model of a ``gemma3`` (multimodal) folder: the config in
  ``text_config``, the tensors under ``language_model.model.``; the vision
  tower and its projector are left unread, and reported."""
  text = cfg.require("text_config")
  bool_field(cfg, "tie_word_embeddings", True, True,
             "Penzai's Gemma ties the output projection to the embedding table")
  cfg.check_all_used()
  text_cfg = multimodal.text_config(cfg, text, "gemma3", "gemma3_text", RECORD.fields,
                                    RECORD.model_types["gemma3_text"].ignored)
  return multimodal.towers_left_out(
      gemma3_text_plan(text_cfg, weights, root=_MULTIMODAL_TEXT),
      lambda name: name.startswith(_MULTIMODAL_TEXT), "the vision tower and projector",
      "Gemma 3's text model only")


def _refuse_attention_soft_cap(cfg: Config) -> None:
  """transformers' Gemma 3 keeps ``attn_logit_softcapping`` but never applies
  it (and no Gemma 3 release sets it): a value is refused rather than
  guessed at."""
  cap = cfg.nullable("attn_logit_softcapping", None)
  if cap is not None:
    raise cfg.unsupported("attn_logit_softcapping", cap, "transformers' Gemma 3 does not apply"
                          " it, so what the checkpoint means is unclear; set it to null")


def _rope(cfg: Config) -> tuple[float, float, RopeScaling | None]:
  """``(local base, global base, global scaling)``, from transformers 5's
  ``rope_parameters`` keyed by layer type, or from transformers 4's
  ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` (which
  scales the global layers)."""
  nested = cfg.get("rope_parameters")
  positions = cfg.raw.get("max_position_embeddings")
  extra = {} if positions is None else {"max_position_embeddings": positions}
  if nested is not None:
    if set(nested) - set(_TYPES):
      raise cfg.unsupported("rope_parameters", sorted(nested),
                            f"Gemma 3 keys its RoPE parameters by layer type, {list(_TYPES)}")
    for key in ("rope_theta", "rope_local_base_freq", "rope_scaling"):
      if cfg.get(key) is not None:
        raise cfg.unsupported(key, cfg.raw[key], "rope_parameters says it; keep one of them")
    local = nested.get("sliding_attention") or {}
    full = nested.get("full_attention") or {}
    local_view = {"rope_parameters": {"rope_theta": 10_000.0, **local}}
    full_view = {"rope_parameters": {"rope_theta": 1_000_000.0, **full}, **extra}
  else:
    local_view = {"rope_theta": cfg.get("rope_local_base_freq", FROM_TABLE)}
    full_view = {"rope_theta": cfg.get("rope_theta", FROM_TABLE),
                 "rope_scaling": cfg.get("rope_scaling"), **extra}
  local_cfg = Config(local_view, f"{cfg.where} (sliding_attention RoPE)", defaults=cfg.defaults)
  full_cfg = Config(full_view, f"{cfg.where} (full_attention RoPE)", defaults=cfg.defaults)
  local_theta, local_fraction = rope(local_cfg, 10_000.0)
  theta, fraction, scaling = scaled_rope(full_cfg, 1_000_000.0, 131_072)
  if (local_fraction, fraction) != (1.0, 1.0):
    raise cfg.unsupported("partial_rotary_factor", min(local_fraction, fraction),
                          "Gemma 3's RoPE covers every dimension")
  return local_theta, theta, scaling


def _window_and_types(cfg: Config, layers: int) -> tuple[int | None, Any]:
  """The window, and a function giving each layer's type from the layer
  count (called once the count is checked against the weights)."""
  window = cfg.nullable("sliding_window", 4096)
  pattern = cfg.get("sliding_window_pattern", 6)
  types = cfg.get("layer_types")
  if types is not None and (len(types) != layers or not set(types) <= set(_TYPES)):
    raise cfg.unsupported("layer_types", types if len(types) <= 8 else [*types[:8], "..."],
                          f"one of {list(_TYPES)} for each of the num_hidden_layers={layers} layers")
  if window is None and (types is None or "sliding_attention" in types):
    raise cfg.unsupported("sliding_window", None, "the layers of type 'sliding_attention' need"
                          " a window (transformers' own cache fails without one)")

  def kinds(count: int) -> list[str]:
    if types is not None:
      return list(types)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(count)]

  return window, kinds


def _with_attention_types(config: llamalike_common.LlamalikeTransformerConfig, types: list[str],
                          window: int | None) -> llamalike_common.LlamalikeTransformerConfig:
  attention_types = tuple(
      llamalike_common.AttentionTypeSlidingWindowCausal(window)
      if kind == "sliding_attention" and window is not None
      else llamalike_common.AttentionTypeGlobalCausal() for kind in types)
  return dataclasses.replace(config, attention_type=attention_types)


def _with_local_rope(model: model_parts.TransformerLM, types: list[str], local_theta: float,
                     scaling: RopeScaling | None) -> model_parts.TransformerLM:
  """Local blocks rotate with their own base; global blocks keep the global
  base, scaled if the config says so."""
  def block(layer: model_parts.TransformerBlock, kind: str) -> model_parts.TransformerBlock:
    if kind == "sliding_attention":
      return pz.select(layer).at_instances_of(pz.nn.ApplyRoPE).apply(
          lambda r: dataclasses.replace(r, max_wavelength=local_theta))
    return layer if scaling is None else with_scaled_rope(layer, scaling)

  selected = pz.select(model).at_instances_of(model_parts.TransformerBlock)
  return selected.set_sequence([block(b, k) for b, k in zip(selected.get_sequence(), types)])


def _detect(model: pz.nn.Layer) -> str | None:
  """Gemma's layout (decoding with the embedding table) with query norms."""
  if all_layers(model, pz.nn.EmbeddingDecode) and all_layers(attention(model).input_to_query,
                                                             pz.nn.RMSLayerNorm):
    return "gemma3_text"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # gemma3 (multimodal) is read, never written.
  found = windows(model)
  types = layer_types(found)
  by_type = {kind: blocks(model)[types.index(kind)] for kind in _TYPES if kind in types}
  like_rope = like.get("rope_parameters") or {}
  defaults = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
              "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}
  rope_parameters, extra = {}, {}
  for kind in _TYPES:
    if kind in by_type:
      fields = rope_fields(by_type[kind])
      rope_parameters[kind] = fields.pop("rope_parameters")
      extra.update(fields)
    else:  # No layer of this type: the base changes nothing; like's, else the default.
      rope_parameters[kind] = like_rope.get(kind, defaults[kind])
  window = next((w for w in found if w is not None), None)
  return {
      **size_fields(model), **rms_norm_fields(model), **extra,
      **activation_field(model, like, "hidden_activation"),
      "rope_parameters": rope_parameters,
      "layer_types": types,
      "sliding_window": like.get("sliding_window", 4096) if window is None else window,
      "query_pre_attn_scalar": query_pre_attn_scalar(model),
      **soft_cap_fields(model),
      # Penzai's Gemma decodes with its embedding table, and has no biases.
      "tie_word_embeddings": True, "attention_bias": False,
  }


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "defaults": {**GEMMA_LIKE, "num_key_value_heads": 4, "query_pre_attn_scalar": 256,
                     "sliding_window": 4096, "final_logit_softcapping": None,
                     "attn_logit_softcapping": None, "use_bidirectional_attention": False,
                     "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                     "sliding_window_pattern": 6},
        "defaults_why": {
            "hidden_act": HIDDEN_ACT_WHY,
            "rope_local_base_freq": (
                "transformers 4's field, now "
                'rope_parameters.sliding_attention.rope_theta, whose default (10,000) it '
                'is'),
            "sliding_window_pattern": (
                "transformers 4's field, now the class's _sliding_window_pattern (6), "
                'which builds layer_types'),
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Gemma 3",
    model_types={
        "gemma3_text": ModelType(gemma3_text_plan, "Gemma3ForCausalLM",
            **_TRANSFORMERS_DEFAULTS["gemma3_text"],
            ignored_fields={
                "checked, never needed: Penzai's RoPE has no length limit": (
                    "max_position_embeddings",),
                "transformers 5 writes it and never reads it back": ("_sliding_window_pattern",),
            }),
        "gemma3": ModelType(gemma3_plan, "Gemma3ForConditionalGeneration", exported=False,
                            written_as="gemma3_text",
                            ignored_fields={OTHER_MODALITIES: (
                                "vision_config", "mm_tokens_per_image", "boi_token_index",
                                "eoi_token_index", "image_token_index")}),
    },
    detect=_detect,
    write_config=_write_config,
    adds=("`gemma3_text` (270M, 1B) and the text model of `gemma3` folders (4B-27B; the vision"
          " tower is not read, and the load says so): Gemma 2's layout with query/key norms,"
          " local and global layers with their own RoPE bases, linear scaling on global layers"),
    refuses="bidirectional attention (EmbeddingGemma)",
    rank=150,
    fields={
        "rope_local_base_freq": POSITIVE_NUMBER,
        "sliding_window_pattern": POSITIVE_INT,
        "_sliding_window_pattern": POSITIVE_INT,
        "text_config": OBJECT,
        "vision_config": OBJECT,
        "mm_tokens_per_image": POSITIVE_INT,
        "boi_token_index": NON_NEGATIVE_INT,
        "eoi_token_index": NON_NEGATIVE_INT,
        "image_token_index": NON_NEGATIVE_INT,
    },
    layer_prefixes=(_TEXT + "layers.", _MULTIMODAL_TEXT + "layers."),
)
