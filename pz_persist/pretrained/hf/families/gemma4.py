"""Gemma 4 checkpoints: ``gemma4_text`` and the text model inside ``gemma4``
multimodal folders, dense and mixture-of-experts.

What Gemma 4 changes from Gemma 3 (`pz_persist.pretrained.hf.families.
gemma3`), each built from Penzai's layers here:

- every RMS norm multiplies by its weight ``w`` (Gemma 3: ``1 + w``): a
  plain ``RMSLayerNorm``; the values get an RMS norm without a scale
  (``v_norm``: an ``RMSStandardize`` over ``projection``), the queries and
  keys Gemma 3's norms; attention logits are not scaled (factor 1);
- global (``full_attention``) layers have their own head size
  (``global_head_dim``) and, with ``attention_k_eq_v``, their own number of
  key/value heads (``num_global_key_value_heads``) and no value projection:
  the values are the key projection's output (the same ``Linear``,
  ``key.weights``), normed as values;
- their RoPE is ``proportional``
  (`pz_persist.nn.proportional_rope`): only
  ``partial_rotary_factor`` of each head rotates;
- the last ``num_kv_shared_layers`` layers reuse the keys and values of the
  last earlier layer of their type (`pz_persist.nn.
  kv_sharing`), and with ``use_double_wide_mlp`` have twice the MLP width;
- per-layer inputs (``hidden_size_per_layer_input``: E2B, E4B): a second
  embedding of the tokens gated into each layer's residual stream
  (`pz_persist.nn.per_layer_inputs`);
- each layer's output is multiplied by its ``layer_scalar``;
- with ``enable_moe_block`` (26B-A4B) each layer adds a mixture of experts
  beside its dense MLP (`pz_persist.pretrained.hf.building.gemma4_moe`, on the shared
  `pz_persist.nn.mixture_of_experts`).

transformers 5 writes the global layers' sizes as ``per_layer_config``
(keyed by layer index); the Hub's configs as ``global_head_dim`` and
``num_global_key_value_heads``. Both are read. Layers of different head
sizes need `pz_persist.pretrained.kv_caching_lm` for
KV-cache sampling (Penzai sizes every cache from the model's metadata).

A ``gemma4`` folder holds the text model under ``model.language_model.``
next to its vision (and audio) towers, which are not read (the load says
so); its text model is exported as ``gemma4_text``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn import kv_sharing
from pz_persist.nn import mixture_of_experts as mixture
from pz_persist.nn import per_layer_inputs as ple
from pz_persist.nn.proportional_rope import ApplyProportionalRoPE
from pz_persist.pretrained.hf import multimodal
from pz_persist.pretrained.hf.building import gemma4_moe
from pz_persist.pretrained.hf.building.decoder import attention_sizes
from pz_persist.pretrained.hf.building.decoder import block_specs
from pz_persist.pretrained.hf.building.defaults import CAUSAL_WHY
from pz_persist.pretrained.hf.building.defaults import GEMMA_LIKE
from pz_persist.pretrained.hf.building.defaults import HIDDEN_ACT_WHY
from pz_persist.pretrained.hf.building.gemma_attention import FULL
from pz_persist.pretrained.hf.building.gemma_attention import SLIDING
from pz_persist.pretrained.hf.building.gemma_attention import Layer as _Layer
from pz_persist.pretrained.hf.building.gemma_attention import attention_block
from pz_persist.pretrained.hf.building.gemma_attention import common_head_axes as _common_head_axes
from pz_persist.pretrained.hf.building.gemma_attention import layers as _layers
from pz_persist.pretrained.hf.building.gemma_attention import norm as _norm
from pz_persist.pretrained.hf.building.gemma_attention import reused_keys_and_values
from pz_persist.pretrained.hf.building.gemma_attention import with_rope as _with_rope
from pz_persist.pretrained.hf.building.gemma_layout import check_activation
from pz_persist.pretrained.hf.building.ignored import OTHER_MODALITIES
from pz_persist.pretrained.hf.building.norms import query_key_norm_specs
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import OBJECT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import STRING
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config import refuse_stored_head
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import layer_types
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.config_from_model import rms_norm_fields
from pz_persist.pretrained.hf.config_from_model import size_fields
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import DECODER_HEAD
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import check_layers
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_TYPES = (SLIDING, FULL)
_TEXT = "model."
_MULTIMODAL_TEXT = "model.language_model."

_SIZE_DEFAULTS = {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
                  "num_attention_heads": 8, "vocab_size": 262_144}
"""transformers' ``Gemma4TextConfig`` defaults for sizes a ``text_config`` may
leave out; each is checked against the weights before anything is built."""


@dataclasses.dataclass(frozen=True)
class _Moe:
  experts: int
  top_k: int
  width: int


def gemma4_text_plan(cfg: Config, weights: Weights, root: str = _TEXT) -> Plan:
  """Maps a Gemma 4 text model whose tensors are under ``root``."""
  cfg.fill_absent(_SIZE_DEFAULTS)
  hidden, heads, kv_heads, head_dim = attention_sizes(cfg, kv_heads_default=4,
                                                      head_dim_default=256)
  check_activation(cfg)
  bool_field(cfg, "attention_bias", False, False, "Gemma 4's attention has no biases")
  bool_field(cfg, "tie_word_embeddings", True, True,
             "Gemma 4 ties the output projection to the embedding table")
  bidirectional = cfg.get("use_bidirectional_attention")
  if bidirectional not in (None, "vision"):
    raise cfg.unsupported("use_bidirectional_attention", bidirectional,
                          "Penzai's Gemma attention is causal; 'vision' (bidirectional among"
                          " image tokens only) is read, as text has none")
  layers = cfg.require("num_hidden_layers")
  vocab = cfg.require("vocab_size")
  intermediate = cfg.require("intermediate_size")
  eps = float(cfg.get("rms_norm_eps", 1e-6))
  window = cfg.get("sliding_window", 512)
  rope = _rope(cfg)
  keys_are_values = cfg.get("attention_k_eq_v", False)
  double_wide = cfg.get("use_double_wide_mlp", False)
  shared_count = cfg.get("num_kv_shared_layers", 0)
  moe = _moe(cfg)
  ple_width = cfg.get("hidden_size_per_layer_input", 256) or 0
  ple_vocab = cfg.get("vocab_size_per_layer_input", 262_144)  # Read (unused) without PLE.
  softcap = cfg.nullable("final_logit_softcapping", None)
  global_sizes = _global_sizes(cfg, head_dim, kv_heads, keys_are_values)
  types_field = cfg.get("layer_types")
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  check_layers(cfg, weights.names, root + "layers.", layers)
  refuse_stored_head(cfg, weights, DECODER_HEAD,
                     "Gemma 4 ties the output projection to the embedding table")
  kinds = _kinds(cfg, types_field, layers)
  plan_layers = _layers(cfg, kinds, shared_count, head_dim, kv_heads, global_sizes(kinds),
                        keys_are_values, intermediate, double_wide, heads)
  dtype = weights.dtype

  def config_of(layer: _Layer) -> llamalike_common.LlamalikeTransformerConfig:
    return llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=layer.kv_heads, query_head_multiplier=heads // layer.kv_heads,
        embedding_dim=hidden, projection_dim=layer.head_dim, mlp_hidden_dim=layer.mlp,
        num_decoder_blocks=layers, vocab_size=vocab, mlp_variant="geglu_approx",
        tie_embedder_and_logits=True, rms_norm_eps=eps, use_post_attn_norm=True,
        use_post_ffw_norm=True, query_scaling_factor=1.0,
        attention_type=(llamalike_common.AttentionTypeSlidingWindowCausal(window)
                        if layer.kind == SLIDING else llamalike_common.AttentionTypeGlobalCausal()),
        parameter_dtype=dtype, activation_dtype=dtype)

  def norm(label: str, source: str, size: int = hidden, axis: str = "embedding") -> TensorSpec:
    return TensorSpec(label + "/scale.weights", source, (size,), (axis,))

  specs = [TensorSpec("transformer/embedder.embeddings", root + "embed_tokens.weight",
                      (vocab, hidden), ("vocabulary", "embedding")),
           norm("transformer/final_norm", root + "norm.weight")]
  if ple_width:
    specs += [
        TensorSpec("transformer/per_layer_embedder.embeddings",
                   root + "embed_tokens_per_layer.weight", (ple_vocab, layers, ple_width),
                   ("vocabulary", ple.LAYERS_AXIS, ple.EMBEDDING_AXIS),
                   stored=(ple_vocab, layers * ple_width)),
        TensorSpec("transformer/per_layer_inputs/projection.weights",
                   root + "per_layer_model_projection.weight", (layers, ple_width, hidden),
                   (ple.LAYERS_AXIS, ple.EMBEDDING_AXIS, "embedding"),
                   stored=(layers * ple_width, hidden)),
        norm("transformer/per_layer_inputs/norm", root + "per_layer_projection_norm.weight",
             ple_width, ple.EMBEDDING_AXIS),
    ]
  for i, layer in enumerate(plan_layers):
    p, s = f"transformer/block_{i}/", f"{root}layers.{i}."
    config = config_of(layer)
    dropped = set()
    if layer.reuses:
      dropped = {"attention/key.weights", "attention/value.weights"}
    elif layer.keys_are_values:
      dropped = {"attention/value.weights"}
    specs += [spec for spec in block_specs(p, s, config)
              if spec.label.removeprefix(p) not in dropped]
    specs += [spec for spec in query_key_norm_specs(p, s, config)
              if not (layer.reuses and "key_norm" in spec.label)]
    specs += [
        norm(p + "pre_attention_norm", s + "input_layernorm.weight"),
        norm(p + "post_attention_norm", s + "post_attention_layernorm.weight"),
        norm(p + "pre_ffw_norm", s + "pre_feedforward_layernorm.weight"),
        norm(p + "post_ffw_norm", s + "post_feedforward_layernorm.weight"),
        TensorSpec(p + "layer_scalar.weights", s + "layer_scalar", (), (), stored=(1,)),
    ]
    if ple_width:
      specs += [
          TensorSpec(p + "per_layer_input/gate.weights", s + "per_layer_input_gate.weight",
                     (ple_width, hidden), (ple.EMBEDDING_AXIS, "embedding")),
          TensorSpec(p + "per_layer_input/projection.weights",
                     s + "per_layer_projection.weight", (hidden, ple_width),
                     ("embedding", ple.EMBEDDING_AXIS)),
          norm(p + "per_layer_input/norm", s + "post_per_layer_input_norm.weight"),
      ]
    if moe is not None:
      specs += gemma4_moe.specs(p, s, hidden, moe.experts, moe.width)

  def build() -> model_parts.TransformerLM:
    blocks = [_block(i, layer, config_of(layer), moe, ple_width, eps)
              for i, layer in enumerate(plan_layers)]
    return _assemble(blocks, config_of(plan_layers[0]), ple_width, ple_vocab, layers,
                     softcap, rope)

  return Plan(build, tuple(specs), left_out=(reused_keys_and_values(root, plan_layers),))


def _moe(cfg: Config) -> _Moe | None:
  if not cfg.get("enable_moe_block", False):
    return None  # Its sizes are unused without the block, as in transformers.
  experts = cfg.require("num_experts")
  top_k = cfg.require("top_k_experts")
  if top_k > experts:
    raise cfg.unsupported("top_k_experts", top_k, f"at most num_experts={experts}")
  return _Moe(experts, top_k, cfg.require("moe_intermediate_size"))


def _global_sizes(cfg: Config, head_dim: int, kv_heads: int, keys_are_values: bool):
  """A function of the layer kinds giving the global layers' ``(head_dim,
  kv heads)``: from ``per_layer_config`` (transformers 5) or
  ``global_head_dim`` / ``num_global_key_value_heads`` (the Hub's)."""
  per_layer = cfg.get("per_layer_config")
  global_dim = cfg.get("global_head_dim")
  global_kv = cfg.get("num_global_key_value_heads")
  if per_layer is None:
    dim = 512 if global_dim is None else global_dim
    kv = global_kv if (keys_are_values and global_kv is not None) else kv_heads
    return lambda kinds: (dim, kv)
  if global_dim is not None or global_kv is not None:
    raise cfg.unsupported("global_head_dim" if global_dim is not None
                          else "num_global_key_value_heads", global_dim or global_kv,
                          "per_layer_config gives the global layers' sizes; keep one of them")
  found = set()
  for key, value in per_layer.items():
    if not isinstance(value, dict) or set(value) - {"head_dim", "num_key_value_heads"}:
      raise cfg.unsupported(f"per_layer_config.{key}", value,
                            "only head_dim and num_key_value_heads may differ between layers")
    dim, kv = value.get("head_dim", head_dim), value.get("num_key_value_heads", kv_heads)
    for name, v in (("head_dim", dim), ("num_key_value_heads", kv)):
      cfg.checked(f"per_layer_config.{key}.{name}", v)
    found.add((key, dim, kv))

  def sizes(kinds: list[str]) -> tuple[int, int]:
    full = [str(i) for i, kind in enumerate(kinds) if kind == FULL]
    given = {key: (dim, kv) for key, dim, kv in found}
    values = {given.get(key, (head_dim, kv_heads)) for key in full}
    if set(given) - set(full) or len(values) > 1:
      raise cfg.unsupported("per_layer_config", sorted(given),
                            "overrides of full_attention layers only (layers"
                            f" {full}), the same for each, as transformers' Gemma 4 writes it")
    return values.pop() if values else (head_dim, kv_heads)

  return sizes


def _kinds(cfg: Config, types: list[str] | None, layers: int) -> list[str]:
  if types is None:
    kinds = [SLIDING if (i + 1) % 6 else FULL for i in range(layers)]
    kinds[-1] = FULL  # transformers forces the last layer global.
    return kinds
  if len(types) != layers or not set(types) <= set(_TYPES):
    raise cfg.unsupported("layer_types", types if len(types) <= 8 else [*types[:8], "..."],
                          f"one of {list(_TYPES)} for each of the num_hidden_layers={layers}"
                          " layers")
  if types[-1] != FULL:
    raise cfg.unsupported("layer_types", types[-1:], "transformers' Gemma 4 makes the last"
                          " layer 'full_attention' whatever the config says; say so")
  return list(types)


def _rope(cfg: Config) -> dict[str, tuple[str, float, float, float]]:
  """Each layer type's ``(rope_type, theta, partial_rotary_factor, factor)``."""
  params = cfg.get("rope_parameters")
  for key in ("rope_theta", "rope_scaling", "rope_local_base_freq", "partial_rotary_factor"):
    if cfg.get(key) is not None:
      raise cfg.unsupported(key, cfg.raw[key], "Gemma 4 keys rope_parameters by layer type")
  defaults = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
              FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                     "rope_theta": 1_000_000.0}}
  if params is None:
    params = defaults
  if set(params) - set(_TYPES):
    raise cfg.unsupported("rope_parameters", sorted(params),
                          f"Gemma 4 keys its RoPE parameters by layer type, {list(_TYPES)}")
  out = {}
  for kind in _TYPES:
    value = params.get(kind) or defaults[kind]
    where = f"rope_parameters.{kind}"
    if not isinstance(value, dict):
      raise cfg.unsupported(where, value, "a JSON object")
    rope_type = value.get("rope_type", "default")
    allowed = {"default": {"rope_type", "rope_theta"},
               "proportional": {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}}
    if rope_type not in allowed or (kind == SLIDING and rope_type != "default"):
      raise cfg.unsupported(f"{where}.rope_type", rope_type, "Gemma 4 rotates sliding layers"
                            " with 'default' RoPE, global ones with 'default' or 'proportional'")
    extra = set(value) - allowed[rope_type]
    if extra:
      raise cfg.unsupported(f"{where}.{sorted(extra)[0]}", value[sorted(extra)[0]],
                            f"not read for rope_type {rope_type!r}")
    theta = cfg.checked(f"{where}.rope_theta", value.get("rope_theta", defaults[kind]["rope_theta"]))
    fraction = value.get("partial_rotary_factor", 1.0)
    if not (isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
            and 0 < fraction <= 1):
      raise cfg.unsupported(f"{where}.partial_rotary_factor", fraction, "a number in (0, 1]")
    factor = cfg.checked(f"{where}.factor", value.get("factor", 1.0))
    out[kind] = (rope_type, float(theta), float(fraction), float(factor))
  return out


def _block(i: int, layer: _Layer, config: llamalike_common.LlamalikeTransformerConfig,
           moe: _Moe | None, ple_width: int, eps: float) -> model_parts.TransformerBlock:
  p = f"transformer/block_{i}"
  block = attention_block(i, layer, config, eps)
  sublayers = list(block.sublayers)
  if moe is not None:
    ffw = sublayers[1].delta
    pre, mlp, post = ffw.sublayers
    experts = gemma4_moe.build(p, config, moe.experts, moe.top_k, moe.width, eps)
    dense = pz.nn.Sequential([pre, mlp, _norm(f"{p}/post_ffw_norm_1", config)])
    sublayers[1] = pz.nn.Residual(pz.nn.Sequential(
        [pz.nn.BranchAndAddTogether([dense, experts]), post]))
  if ple_width:
    sublayers.append(pz.nn.Residual(pz.nn.Sequential([
        pz.nn.Linear.from_config(name=f"{p}/per_layer_input/gate", init_base_rng=None,
                                 input_axes={"embedding": config.embedding_dim},
                                 output_axes={ple.EMBEDDING_AXIS: ple_width},
                                 dtype=config.parameter_dtype),
        pz.nn.Elementwise(jax.nn.gelu),
        ple.MultiplyByPerLayerInput(i),
        pz.nn.Linear.from_config(name=f"{p}/per_layer_input/projection", init_base_rng=None,
                                 input_axes={ple.EMBEDDING_AXIS: ple_width},
                                 output_axes={"embedding": config.embedding_dim},
                                 dtype=config.parameter_dtype),
        _norm(f"{p}/per_layer_input/norm", config),
    ])))
  sublayers.append(ple.ScalarScale(weights=pz.ParameterSlot(f"{p}/layer_scalar.weights")))
  return dataclasses.replace(block, sublayers=sublayers)


def _assemble(blocks: list[model_parts.TransformerBlock],
              config: llamalike_common.LlamalikeTransformerConfig, ple_width: int,
              ple_vocab: int, layers: int, softcap: float | None,
              rope: Mapping[str, tuple[str, float, float, float]]) -> model_parts.TransformerLM:
  """The whole model: the embedding (and per-layer inputs), the blocks with
  their RoPE set per layer type, the final norm, tied logits, soft cap."""
  dtype = config.activation_dtype
  table = pz.nn.EmbeddingTable.from_config(
      name="transformer/embedder", init_base_rng=None, vocab_size=config.vocab_size,
      embedding_axes={"embedding": config.embedding_dim}, dtype=config.parameter_dtype)
  blocks = [_with_rope(block, rope) for block in blocks]
  tail: list[pz.nn.Layer] = [
      kv_sharing.SharesKV(pz.nn.Sequential(list(blocks))),
      _norm("transformer/final_norm", config), pz.nn.EmbeddingDecode(table)]
  if softcap is not None:
    tail.append(pz.nn.TanhSoftCap(soft_cap=jnp.array(softcap, dtype=dtype)))
  embed = pz.nn.Sequential([pz.nn.EmbeddingLookup(table), pz.nn.ConstantRescale(
      by=jnp.sqrt(config.embedding_dim).astype(dtype))])
  if ple_width:
    ple_table = pz.nn.EmbeddingTable.from_config(
        name="transformer/per_layer_embedder", init_base_rng=None, vocab_size=ple_vocab,
        embedding_axes={ple.LAYERS_AXIS: layers, ple.EMBEDDING_AXIS: ple_width},
        dtype=config.parameter_dtype)
    body: pz.nn.Layer = ple.WithPerLayerInputs(
        embed=embed,
        per_layer=ple.PerLayerInputs(
            table=pz.nn.EmbeddingLookup(ple_table),
            projection=pz.nn.Linear.from_config(
                name="transformer/per_layer_inputs/projection", init_base_rng=None,
                input_axes={"embedding": config.embedding_dim},
                output_axes={ple.LAYERS_AXIS: layers, ple.EMBEDDING_AXIS: ple_width},
                dtype=config.parameter_dtype),
            norm=_norm("transformer/per_layer_inputs/norm", config, ple.EMBEDDING_AXIS,
                       ple_width),
            table_scale=float(jnp.asarray(ple_width ** 0.5, dtype)),
            projection_scale=config.embedding_dim ** -0.5),
        body=pz.nn.Sequential(tail))
  else:
    body = pz.nn.Sequential([embed, *tail])
  q_multiplier = config.query_head_multiplier
  query_only = {} if q_multiplier == 1 else {"query_heads": q_multiplier}
  return model_parts.TransformerLM(
      metadata=model_parts.TransformerMetadata(
          common_head_axes=_common_head_axes(config), query_only_head_axes=query_only,
          embedding_dim=config.embedding_dim, projection_dim=config.projection_dim,
          mlp_hidden_dim=config.mlp_hidden_dim, vocab_size=config.vocab_size,
          activation_dtype=dtype),
      body=body)


def gemma4_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps the text model of a ``gemma4`` (multimodal) folder: the config in
  ``text_config``, the tensors under ``model.language_model.``; the vision
  and audio towers and their embedders are left unread, and reported."""
  text = cfg.require("text_config")
  bool_field(cfg, "tie_word_embeddings", True, True,
             "Gemma 4 ties the output projection to the embedding table")
  cfg.check_all_used()
  text_cfg = multimodal.text_config(cfg, text, "gemma4", "gemma4_text", RECORD.fields,
                                    RECORD.model_types["gemma4_text"].ignored)
  return multimodal.towers_left_out(
      gemma4_text_plan(text_cfg, weights, root=_MULTIMODAL_TEXT),
      lambda name: name.startswith(_MULTIMODAL_TEXT),
      "the vision and audio towers and their embedders", "Gemma 4's text model only")


_MULTIMODAL_FIELDS = ("boi_token_id", "eoi_token_id", "boa_token_id", "eoa_token_id",
                      "eoa_token_index", "image_token_id", "audio_token_id", "video_token_id",
                      "vision_soft_tokens_per_image")


def _detect(model: pz.nn.Layer) -> str | None:
  """Penzai models holding Gemma 4's layer scalars."""
  return "gemma4_text" if all_layers(model, ple.ScalarScale) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # gemma4 (multimodal) is read, never written.
  found = blocks(model)
  kinds = layer_types(windows(model))
  attentions = [first_layer(b, pz.nn.Attention, "attention") for b in found]

  def sizes(kind: str) -> tuple[int, int] | None:
    for kv_kind, attn in zip(kinds, attentions):
      if kv_kind == kind and not isinstance(attn.input_to_key, kv_sharing.SharedKV):
        shape = named_shape(first_layer(attn.input_to_key, pz.nn.Linear, "key projection"))
        return shape["projection"], math.prod(
            size for axis, size in shape.items() if axis in ("heads", "head_groups")) or 1
    return None

  local, global_ = sizes(SLIDING), sizes(FULL)
  shared = sum(isinstance(a.input_to_key, kv_sharing.SharedKV) for a in attentions)
  keys_are_values = any(_values_are_keys(a) for a in attentions)
  fields = size_fields(model, grouped=False)
  if local is not None:
    fields.update(head_dim=local[0], num_key_value_heads=local[1])
  else:
    fields.update(head_dim=like.get("head_dim", 256),
                  num_key_value_heads=like.get("num_key_value_heads", 4))
  if global_ is not None:
    fields["global_head_dim"] = global_[0]
    if keys_are_values:
      fields["num_global_key_value_heads"] = global_[1]
  widths = [named_shape(first_layer(b, pz.nn.Linear, "MLP"))["neurons"]
            for b in (first_layer(x, model_parts.TransformerFeedForward, "MLP") for x in found)]
  double = shared > 0 and widths[-1] == 2 * fields["intermediate_size"]
  per_layer = all_layers(model, ple.PerLayerInputs)
  if per_layer:
    table = named_shape(per_layer[0].table.table)
    fields.update(hidden_size_per_layer_input=table[ple.EMBEDDING_AXIS],
                  vocab_size_per_layer_input=table["vocabulary"])
  else:
    fields.update(hidden_size_per_layer_input=0,
                  vocab_size_per_layer_input=like.get("vocab_size_per_layer_input",
                                                      fields["vocab_size"]))
  experts = all_layers(model, mixture.MixtureOfExperts)
  if experts:
    router = experts[0].router
    gate = named_shape(first_layer(experts[0].experts, pz.nn.Linear, "expert gate"))
    fields.update(enable_moe_block=True, num_experts=gate["experts"],
                  top_k_experts=router.top_k, moe_intermediate_size=gate["neurons"])
  else:
    fields["enable_moe_block"] = False
  caps = all_layers(model, pz.nn.TanhSoftCap)
  window = next((w for w in windows(model) if w is not None), None)
  return {
      **fields, **rms_norm_fields(model),
      "hidden_activation": "gelu_pytorch_tanh",
      "rope_parameters": _rope_parameters(found, kinds, like),
      "layer_types": kinds,
      "sliding_window": like.get("sliding_window", 512) if window is None else window,
      "attention_k_eq_v": keys_are_values,
      "num_kv_shared_layers": shared,
      "use_double_wide_mlp": double or bool(like.get("use_double_wide_mlp", False)
                                            and shared == 0),
      "final_logit_softcapping": number(caps[0].soft_cap) if caps else None,
      "tie_word_embeddings": True, "attention_bias": False,
  }


def _values_are_keys(attn: pz.nn.Attention) -> bool:
  """Whether the values come from the key projection (one shared parameter)."""
  if isinstance(attn.input_to_key, kv_sharing.SharedKV):
    return False
  key = first_layer(attn.input_to_key, pz.nn.Linear, "key projection")
  value = first_layer(attn.input_to_value, pz.nn.Linear, "value projection")
  return bool(key.weights.label == value.weights.label)


def _rope_parameters(found: list[Any], kinds: list[str],
                     like: Mapping[str, Any]) -> dict[str, Any]:
  like_rope = like.get("rope_parameters") or {}
  defaults = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
              FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                     "rope_theta": 1_000_000.0}}
  out = {}
  for kind in _TYPES:
    if kind not in kinds:  # No layer of this type: like's, else the default.
      out[kind] = like_rope.get(kind, defaults[kind])
      continue
    block = found[kinds.index(kind)]
    proportional = all_layers(block, ApplyProportionalRoPE)
    if proportional:
      r = proportional[0]
      params = {"rope_type": "proportional", "rope_theta": float(r.max_wavelength),
                "partial_rotary_factor": r.rotated_fraction}
      if r.factor != 1.0:
        params["factor"] = r.factor
    else:
      params = {"rope_type": "default",
                "rope_theta": float(first_layer(block, pz.nn.ApplyRoPE, "RoPE").max_wavelength)}
    out[kind] = params
  return out


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma4_text": {
        "defaults": {**{k: v for k, v in GEMMA_LIKE.items()
                     if k not in ("rope_theta", "partial_rotary_factor")},
                     "num_key_value_heads": 4, "sliding_window": 512,
                     "final_logit_softcapping": None, "attention_k_eq_v": False,
                     "use_double_wide_mlp": False, "num_kv_shared_layers": 0,
                     "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262_144,
                     "enable_moe_block": False},
        "defaults_why": {
            "use_bidirectional_attention": CAUSAL_WHY,
            "head_dim": (
                "the config class's per-layer head_dim (its global layers' "
                "global_head_dim) has no one value; 256 is its argument's default, the "
                "sliding layers' head size"),
            "hidden_act": HIDDEN_ACT_WHY,
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Gemma 4",
    model_types={
        "gemma4_text": ModelType(gemma4_text_plan, "Gemma4ForCausalLM",
            **_TRANSFORMERS_DEFAULTS["gemma4_text"],
            ignored_fields={
                "checked, never needed: Penzai's RoPE has no length limit": (
                    "max_position_embeddings",),
                "the experts' sizes, unused without enable_moe_block, as in transformers": (
                    "num_experts", "top_k_experts", "moe_intermediate_size"),
            }),
        "gemma4": ModelType(gemma4_plan, "Gemma4ForConditionalGeneration", exported=False,
                            written_as="gemma4_text",
                            ignored_fields={OTHER_MODALITIES: (
                                "vision_config", "audio_config", *_MULTIMODAL_FIELDS)},
                            foreign_fields=frozenset({"eoa_token_id",
                                                      "vision_soft_tokens_per_image"})),
    },
    detect=_detect,
    write_config=_write_config,
    adds=("`gemma4_text` and the text model of `gemma4` folders (vision and audio towers not"
          " read, and the load says so), dense and MoE: norms on values, keys as values on"
          " global layers, their own head sizes and proportional (partial) RoPE, keys and"
          " values shared across the last layers, per-layer inputs, layer scalars, experts"
          " beside the dense MLP"),
    refuses="bidirectional attention (`use_bidirectional_attention: all`), a last layer"
            " that is not global",
    rank=130,
    fields={
        "attention_k_eq_v": BOOLEAN, "use_double_wide_mlp": BOOLEAN, "enable_moe_block": BOOLEAN,
        "num_kv_shared_layers": NON_NEGATIVE_INT, "hidden_size_per_layer_input": NON_NEGATIVE_INT,
        "vocab_size_per_layer_input": POSITIVE_INT, "global_head_dim": POSITIVE_INT,
        "num_global_key_value_heads": POSITIVE_INT, "num_experts": POSITIVE_INT,
        "top_k_experts": POSITIVE_INT, "moe_intermediate_size": POSITIVE_INT,
        "per_layer_config": OBJECT, "use_bidirectional_attention": STRING,
        "text_config": OBJECT, "vision_config": OBJECT, "audio_config": OBJECT,
        **dict.fromkeys(_MULTIMODAL_FIELDS, NON_NEGATIVE_INT),
    },
    layer_prefixes=(_TEXT + "layers.", _MULTIMODAL_TEXT + "layers."),
)
