"""Gemma 3n checkpoints: ``gemma3n_text`` and the text model inside
``gemma3n`` multimodal folders (E2B, E4B).

Gemma 3n's text model, each part built from Penzai's layers here:

- AltUp (`pz_persist.nn.altup`): the residual stream is ``altup_num_inputs``
  streams (axis ``altup``), made from the embeddings by ``altup_projections``
  and merged back by ``altup_unembed_projections`` before the final norm;
  each layer (`AltUpLayer`) predicts the streams, runs on the active one
  (``altup_active_idx``) and corrects them all (its ``correct_output_scale``
  applied where ``altup_correct_scale``);
- Laurel (`LaurelResidual`): a rank-``laurel_rank`` map of the normed input
  beside the attention, the sum scaled by ``2 ** -0.5``;
- per-layer inputs (`pz_persist.nn.per_layer_inputs`, as Gemma 4's), added
  to every stream but the first; tokens outside the per-layer table
  (``vocab_size_per_layer_input``: the audio and image tokens) look up row 0;
- the attention of Gemma 4 (`pz_persist.pretrained.hf.building.gemma_attention`):
  query and key norms, values normed without a scale, logits unscaled,
  sliding and full layers with their own RoPE base, and keys and values
  shared across the last ``num_kv_shared_layers`` layers
  (`pz_persist.nn.kv_sharing`);
- activation sparsity (`GaussianTopK`) in the MLPs whose
  ``activation_sparsity_pattern`` entry is not 0, per-layer MLP widths
  (``intermediate_size`` as a list), a final logit soft cap.

A ``gemma3n`` folder holds the text model under ``model.language_model.``
next to its vision tower (MobileNet) and audio tower (a Conformer) and
their embedders, which are not read (the load says so); its text model is
exported as ``gemma3n_text``, without the towers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn import altup
from pz_persist.nn import kv_sharing
from pz_persist.nn import per_layer_inputs as ple
from pz_persist.pretrained.hf import multimodal
from pz_persist.pretrained.hf.building import gemma_attention as attention_parts
from pz_persist.pretrained.hf.building.decoder import attention_sizes
from pz_persist.pretrained.hf.building.decoder import block_specs
from pz_persist.pretrained.hf.building.defaults import CAUSAL_WHY
from pz_persist.pretrained.hf.building.defaults import GEMMA_LIKE
from pz_persist.pretrained.hf.building.defaults import HIDDEN_ACT_WHY
from pz_persist.pretrained.hf.building.gemma_layout import check_activation
from pz_persist.pretrained.hf.building.ignored import OTHER_MODALITIES
from pz_persist.pretrained.hf.building.norms import query_key_norm_specs
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import OBJECT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
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
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import DECODER_HEAD
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import check_layers
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

SLIDING, FULL = attention_parts.SLIDING, attention_parts.FULL
_TYPES = (SLIDING, FULL)
_TEXT = "model."
_MULTIMODAL_TEXT = "model.language_model."
_THETAS = {SLIDING: 10_000.0, FULL: 1_000_000.0}
"""transformers' ``default_theta``: ``rope_local_base_freq`` and ``rope_theta``."""

_SIZE_DEFAULTS = {"hidden_size": 2048, "intermediate_size": 16_384, "num_hidden_layers": 35,
                  "num_attention_heads": 8, "vocab_size": 262_400}
"""transformers' ``Gemma3nTextConfig`` defaults for sizes a ``text_config``
may leave out; each is checked against the weights before anything is built."""

_TIED = "Gemma 3n ties the output projection to the embedding table"


def _widths(value: Any) -> bool:
  ints = value if isinstance(value, list) else [value]
  return bool(ints) and all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                            for v in ints)


def _sparsities(value: Any) -> bool:
  return isinstance(value, list) and all(
      isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1 for v in value)


@dataclasses.dataclass(frozen=True)
class _Sizes:
  """What the whole model's layers share."""
  hidden: int
  vocab: int
  layers: int
  streams: int
  active: int
  correct_scale: bool
  rank: int
  ple_width: int
  ple_vocab: int
  eps: float


def gemma3n_text_plan(cfg: Config, weights: Weights, root: str = _TEXT) -> Plan:
  """Maps a Gemma 3n text model whose tensors are under ``root``."""
  cfg.fill_absent(_SIZE_DEFAULTS)
  hidden, heads, kv_heads, head_dim = attention_sizes(cfg, kv_heads_default=2,
                                                      head_dim_default=256)
  check_activation(cfg)
  bool_field(cfg, "attention_bias", False, False, "Gemma 3n's attention has no biases")
  bool_field(cfg, "tie_word_embeddings", True, True, _TIED)
  layers = cfg.require("num_hidden_layers")
  vocab = cfg.require("vocab_size")
  widths_field = _mlp_widths(cfg, layers)
  sparsity_field = _sparsity(cfg, layers)
  eps = float(cfg.get("rms_norm_eps", 1e-6))
  window = cfg.get("sliding_window", 512)
  rope = _rope(cfg)
  shared_count = cfg.get("num_kv_shared_layers", 15)
  streams = cfg.get("altup_num_inputs", 4)
  active = cfg.get("altup_active_idx", 0)
  if active >= streams:
    raise cfg.unsupported("altup_active_idx", active,
                          f"an index of the altup_num_inputs={streams} streams")
  sizes = _Sizes(hidden, vocab, layers, streams, active,
                 cfg.get("altup_correct_scale", True), cfg.get("laurel_rank", 64),
                 cfg.get("hidden_size_per_layer_input", 256),
                 cfg.get("vocab_size_per_layer_input", 262_144), eps)
  if "final_logit_softcapping" in cfg.raw and cfg.raw["final_logit_softcapping"] is None:
    raise cfg.unsupported("final_logit_softcapping", None, "transformers' Gemma 3n config"
                          " requires a number (its models always soft-cap the logits)")
  softcap = cfg.get("final_logit_softcapping", 30.0)
  types_field = cfg.get("layer_types")
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  check_layers(cfg, weights.names, root + "layers.", layers)
  refuse_stored_head(cfg, weights, DECODER_HEAD, _TIED)
  kinds = _kinds(cfg, types_field, layers)
  widths = widths_field if isinstance(widths_field, list) else [widths_field] * layers
  if sparsity_field is None:  # transformers': the first 10 layers sparse, where there are more.
    sparse = 10 if layers > 10 else 0
    sparsity = [0.95] * sparse + [0.0] * (layers - sparse)
  else:
    sparsity = [float(v) for v in sparsity_field]
  plan_layers = [dataclasses.replace(layer, mlp=width) for layer, width in zip(
      attention_parts.layers(cfg, kinds, shared_count, head_dim, kv_heads,
                     (head_dim, kv_heads), False, 0, False, heads), widths)]
  dtype = weights.dtype

  def config_of(layer: Any) -> llamalike_common.LlamalikeTransformerConfig:
    return llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=layer.kv_heads, query_head_multiplier=heads // layer.kv_heads,
        embedding_dim=hidden, projection_dim=layer.head_dim, mlp_hidden_dim=layer.mlp,
        num_decoder_blocks=layers, vocab_size=vocab, mlp_variant="geglu_approx",
        tie_embedder_and_logits=True, rms_norm_eps=eps, use_post_attn_norm=True,
        use_post_ffw_norm=True, query_scaling_factor=1.0,
        attention_type=(llamalike_common.AttentionTypeSlidingWindowCausal(window)
                        if layer.kind == SLIDING else llamalike_common.AttentionTypeGlobalCausal()),
        parameter_dtype=dtype, activation_dtype=dtype)

  specs = _model_specs(sizes, root)
  for i, layer in enumerate(plan_layers):
    p, s = f"transformer/block_{i}/", f"{root}layers.{i}."
    config = config_of(layer)
    dropped = {"attention/key.weights", "attention/value.weights"} if layer.reuses else set()
    specs += [spec for spec in block_specs(p, s, config)
              if spec.label.removeprefix(p) not in dropped]
    specs += [spec for spec in query_key_norm_specs(p, s, config)
              if not (layer.reuses and "key_norm" in spec.label)]
    specs += _layer_specs(sizes, p, s)

  def build() -> model_parts.TransformerLM:
    found = [_layer(i, layer, config_of(layer), sizes, sparsity[i])
             for i, layer in enumerate(plan_layers)]
    return _assemble(found, config_of(plan_layers[0]), sizes, softcap, rope)

  return Plan(build, tuple(specs),
              left_out=(attention_parts.reused_keys_and_values(root, plan_layers),))


def _mlp_widths(cfg: Config, layers: int) -> int | list[int]:
  """``intermediate_size``: one width, or a list of one per layer (checked
  here, expanded only once the weights agree with the layer count)."""
  value = cfg.require("intermediate_size")
  if isinstance(value, list) and len(value) != layers:
    raise cfg.unsupported("intermediate_size", value[:8],
                          f"one width, or one for each of the num_hidden_layers={layers} layers")
  return value


def _sparsity(cfg: Config, layers: int) -> list[float] | None:
  """``activation_sparsity_pattern`` (None: transformers' default)."""
  value = cfg.get("activation_sparsity_pattern")
  if value is not None and len(value) != layers:
    raise cfg.unsupported("activation_sparsity_pattern", value[:8],
                          f"one value for each of the num_hidden_layers={layers} layers")
  return value


def _kinds(cfg: Config, types: list[str] | None, layers: int) -> list[str]:
  if types is None:
    return [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(layers)]
  if len(types) != layers or not set(types) <= set(_TYPES):
    raise cfg.unsupported("layer_types", types if len(types) <= 8 else [*types[:8], "..."],
                          f"one of {list(_TYPES)} for each of the num_hidden_layers={layers}"
                          " layers")
  return list(types)


def _rope(cfg: Config) -> dict[str, tuple[str, float, float, float]]:
  """Each layer type's RoPE, as `gemma_attention.with_rope` takes it: the
  ``rope_parameters`` entry of its type, else the Hub's ``rope_theta``
  (full) / ``rope_local_base_freq`` (sliding), else transformers' default.
  Only the ``default`` rope type is read."""
  scaling = cfg.get("rope_scaling")
  if scaling is not None:
    raise cfg.unsupported("rope_scaling", scaling, "Gemma 3n's RoPE is unscaled here; only"
                          " rope_type 'default' is read")
  params = cfg.get("rope_parameters") or {}
  if set(params) - set(_TYPES):
    raise cfg.unsupported("rope_parameters", sorted(params),
                          f"Gemma 3n keys its RoPE parameters by layer type, {list(_TYPES)}")
  legacy = {FULL: cfg.get("rope_theta"), SLIDING: cfg.get("rope_local_base_freq")}
  out = {}
  for kind in _TYPES:
    value = params.get(kind) or {}
    where = f"rope_parameters.{kind}"
    if not isinstance(value, dict):
      raise cfg.unsupported(where, value, "a JSON object")
    rope_type = value.get("rope_type", "default")
    if rope_type != "default":
      raise cfg.unsupported(f"{where}.rope_type", rope_type, "only 'default' RoPE is read")
    extra = set(value) - {"rope_type", "rope_theta"}
    if extra:
      key = sorted(extra)[0]
      raise cfg.unsupported(f"{where}.{key}", value[key], "not read for rope_type 'default'")
    theta = value.get("rope_theta", legacy[kind] or _THETAS[kind])
    out[kind] = ("default", float(cfg.checked(f"{where}.rope_theta", theta)), 1.0, 1.0)
  return out


def _norm_spec(label: str, source: str, size: int, axis: str = "embedding") -> TensorSpec:
  return TensorSpec(label + "/scale.weights", source, (size,), (axis,))


def _linear_spec(label: str, source: str, out: tuple[str, int], inp: tuple[str, int]
                 ) -> TensorSpec:
  return TensorSpec(label + ".weights", source, (out[1], inp[1]), (out[0], inp[0]))


def _model_specs(sizes: _Sizes, root: str) -> list[TensorSpec]:
  hidden, layers, width = sizes.hidden, sizes.layers, sizes.ple_width
  emb = ("embedding", hidden)
  specs = [
      TensorSpec("transformer/embedder.embeddings", root + "embed_tokens.weight",
                 (sizes.vocab, hidden), ("vocabulary", "embedding")),
      _norm_spec("transformer/final_norm", root + "norm.weight", hidden),
      TensorSpec("transformer/per_layer_embedder.embeddings",
                 root + "embed_tokens_per_layer.weight", (sizes.ple_vocab, layers, width),
                 ("vocabulary", ple.LAYERS_AXIS, ple.EMBEDDING_AXIS),
                 stored=(sizes.ple_vocab, layers * width)),
      TensorSpec("transformer/per_layer_inputs/projection.weights",
                 root + "per_layer_model_projection.weight", (layers, width, hidden),
                 (ple.LAYERS_AXIS, ple.EMBEDDING_AXIS, "embedding"),
                 stored=(layers * width, hidden)),
      _norm_spec("transformer/per_layer_inputs/norm", root + "per_layer_projection_norm.weight",
                 width, ple.EMBEDDING_AXIS),
  ]
  for i in range(sizes.streams - 1):
    specs += [
        _linear_spec(f"transformer/altup_expand/projection_{i}",
                     f"{root}altup_projections.{i}.weight", ("embedding_out", hidden), emb),
        _linear_spec(f"transformer/altup_collapse/projection_{i}",
                     f"{root}altup_unembed_projections.{i}.weight", ("embedding_out", hidden),
                     emb),
    ]
  return specs


def _layer_specs(sizes: _Sizes, p: str, s: str) -> list[TensorSpec]:
  hidden, n = sizes.hidden, sizes.streams
  emb = ("embedding", hidden)
  specs = [
      _norm_spec(p + "pre_attention_norm", s + "input_layernorm.weight", hidden),
      _norm_spec(p + "post_attention_norm", s + "post_attention_layernorm.weight", hidden),
      _norm_spec(p + "pre_ffw_norm", s + "pre_feedforward_layernorm.weight", hidden),
      _norm_spec(p + "post_ffw_norm", s + "post_feedforward_layernorm.weight", hidden),
      _linear_spec(p + "laurel/left", s + "laurel.linear_left.weight",
                   ("laurel", sizes.rank), emb),
      _linear_spec(p + "laurel/right", s + "laurel.linear_right.weight", emb,
                   ("laurel", sizes.rank)),
      _norm_spec(p + "laurel/norm", s + "laurel.post_laurel_norm.weight", hidden),
      _norm_spec(p + "altup/router_norm", s + "altup.router_norm.weight", hidden),
      _linear_spec(p + "altup/router", s + "altup.modality_router.weight",
                   (altup.ROUTER_AXIS, n), emb),
      TensorSpec(p + "altup/prediction.weights", s + "altup.prediction_coefs.weight",
                 (n, n, n), (altup.STREAMS_AXIS, altup.SOURCE_AXIS, altup.ROUTER_AXIS),
                 stored=(n * n, n)),
      _linear_spec(p + "altup/correction", s + "altup.correction_coefs.weight",
                   (altup.STREAMS_AXIS, n), (altup.ROUTER_AXIS, n)),
      TensorSpec(p + "altup/output_scale.weights", s + "altup.correct_output_scale",
                 (hidden,), ("embedding",)),
      _linear_spec(p + "per_layer_input/gate", s + "per_layer_input_gate.weight",
                   (ple.EMBEDDING_AXIS, sizes.ple_width), emb),
      _linear_spec(p + "per_layer_input/projection", s + "per_layer_projection.weight", emb,
                   (ple.EMBEDDING_AXIS, sizes.ple_width)),
      _norm_spec(p + "per_layer_input/norm", s + "post_per_layer_input_norm.weight", hidden),
  ]
  return specs


def _linear(name: str, inputs: dict[str, int], outputs: dict[str, int],
            dtype: Any) -> pz.nn.Linear:
  return pz.nn.Linear.from_config(name=name, init_base_rng=None, input_axes=inputs,
                                  output_axes=outputs, dtype=dtype)


def _projection(name: str, hidden: int, dtype: Any) -> pz.nn.Layer:
  """A square ``embedding`` map (transformers' ``nn.Linear(hidden, hidden)``)."""
  return pz.nn.Sequential([
      _linear(name, {"embedding": hidden}, {"embedding_out": hidden}, dtype),
      pz.nn.RenameAxes(old="embedding_out", new="embedding")])


def _layer(i: int, layer: Any, config: llamalike_common.LlamalikeTransformerConfig,
           sizes: _Sizes, sparsity: float) -> altup.AltUpLayer:
  """Decoder layer ``i``: Gemma 4's attention block, with Laurel beside the
  attention and the sparse gate, inside AltUp's prediction and correction."""
  p, dtype, hidden, n = f"transformer/block_{i}", config.parameter_dtype, sizes.hidden, sizes.streams
  block = attention_parts.attention_block(i, layer, config, sizes.eps)
  attention_half, ffw_half = block.sublayers
  pre, attention, post = attention_half.delta.sublayers
  laurel = pz.nn.Sequential([
      _linear(f"{p}/laurel/left", {"embedding": hidden}, {"laurel": sizes.rank}, dtype),
      _linear(f"{p}/laurel/right", {"laurel": sizes.rank}, {"embedding": hidden}, dtype),
      attention_parts.norm(f"{p}/laurel/norm", config),
  ])
  if sparsity:
    ffw = pz.select(ffw_half).at_instances_of(pz.nn.NamedGroup).where(
        lambda g: g.name == "gate").apply(
            lambda g: dataclasses.replace(g, sublayers=[
                g.sublayers[0], altup.GaussianTopK(sparsity=sparsity), *g.sublayers[1:]]))
  else:
    ffw = ffw_half
  decoder = dataclasses.replace(block, sublayers=[
      altup.LaurelResidual(norm=pre, branch=pz.nn.Sequential([attention, post]), laurel=laurel),
      ffw])
  output_scale = pz.nn.Linear.from_config(
      name=f"{p}/altup/output_scale", init_base_rng=None, input_axes={}, output_axes={},
      parallel_axes={"embedding": hidden}, dtype=dtype)
  per_layer = pz.nn.Sequential([
      _linear(f"{p}/per_layer_input/gate", {"embedding": hidden},
              {ple.EMBEDDING_AXIS: sizes.ple_width}, dtype),
      pz.nn.Elementwise(jax.nn.gelu),
      ple.MultiplyByPerLayerInput(i),
      _linear(f"{p}/per_layer_input/projection", {ple.EMBEDDING_AXIS: sizes.ple_width},
              {"embedding": hidden}, dtype),
      attention_parts.norm(f"{p}/per_layer_input/norm", config),
  ])
  return altup.AltUpLayer(
      router=altup.AltUpRouter(
          norm=attention_parts.norm(f"{p}/altup/router_norm", config),
          router=_linear(f"{p}/altup/router", {"embedding": hidden}, {altup.ROUTER_AXIS: n},
                         dtype)),
      prediction=_linear(f"{p}/altup/prediction", {altup.ROUTER_AXIS: n},
                         {altup.STREAMS_AXIS: n, altup.SOURCE_AXIS: n}, dtype),
      correction=_linear(f"{p}/altup/correction", {altup.ROUTER_AXIS: n},
                         {altup.STREAMS_AXIS: n}, dtype),
      layer=decoder, output_scale=output_scale, per_layer=per_layer, active=sizes.active,
      scale_output=sizes.correct_scale)


def _assemble(layers: list[altup.AltUpLayer],
              config: llamalike_common.LlamalikeTransformerConfig, sizes: _Sizes,
              softcap: float,
              rope: Mapping[str, tuple[str, float, float, float]]) -> model_parts.TransformerLM:
  """The whole model: the embedding, the per-layer inputs, AltUp's streams
  through the layers (RoPE set per layer type), the final norm, tied
  logits, soft cap."""
  dtype, hidden = config.activation_dtype, sizes.hidden
  table = pz.nn.EmbeddingTable.from_config(
      name="transformer/embedder", init_base_rng=None, vocab_size=config.vocab_size,
      embedding_axes={"embedding": hidden}, dtype=config.parameter_dtype)
  layers = [dataclasses.replace(layer, layer=attention_parts.with_rope(layer.layer, rope))
            for layer in layers]
  expand = altup.AltUpExpand(projections=[
      _projection(f"transformer/altup_expand/projection_{i}", hidden, config.parameter_dtype)
      for i in range(sizes.streams - 1)])
  collapse = altup.AltUpCollapse(projections=[
      _projection(f"transformer/altup_collapse/projection_{i}", hidden, config.parameter_dtype)
      for i in range(sizes.streams - 1)])
  tail: list[pz.nn.Layer] = [
      expand, kv_sharing.SharesKV(pz.nn.Sequential(list(layers))), collapse,
      attention_parts.norm("transformer/final_norm", config),
      pz.nn.EmbeddingDecode(table)]
  tail.append(pz.nn.TanhSoftCap(soft_cap=jnp.array(softcap, dtype=dtype)))
  embed = pz.nn.Sequential([pz.nn.EmbeddingLookup(table), pz.nn.ConstantRescale(
      by=jnp.sqrt(hidden).astype(dtype))])
  ple_table = pz.nn.EmbeddingTable.from_config(
      name="transformer/per_layer_embedder", init_base_rng=None, vocab_size=sizes.ple_vocab,
      embedding_axes={ple.LAYERS_AXIS: sizes.layers, ple.EMBEDDING_AXIS: sizes.ple_width},
      dtype=config.parameter_dtype)
  body = ple.WithPerLayerInputs(
      embed=embed,
      per_layer=ple.PerLayerInputsInTable(
          table=pz.nn.EmbeddingLookup(ple_table),
          projection=_linear("transformer/per_layer_inputs/projection", {"embedding": hidden},
                             {ple.LAYERS_AXIS: sizes.layers,
                              ple.EMBEDDING_AXIS: sizes.ple_width}, config.parameter_dtype),
          norm=attention_parts.norm("transformer/per_layer_inputs/norm", config,
                            ple.EMBEDDING_AXIS, sizes.ple_width),
          table_scale=float(jnp.asarray(sizes.ple_width ** 0.5, dtype)),
          projection_scale=hidden ** -0.5),
      body=pz.nn.Sequential(tail))
  q_multiplier = config.query_head_multiplier
  return model_parts.TransformerLM(
      metadata=model_parts.TransformerMetadata(
          common_head_axes=attention_parts.common_head_axes(config),
          query_only_head_axes={} if q_multiplier == 1 else {"query_heads": q_multiplier},
          embedding_dim=hidden, projection_dim=config.projection_dim,
          mlp_hidden_dim=config.mlp_hidden_dim, vocab_size=config.vocab_size,
          activation_dtype=dtype),
      body=body)


def gemma3n_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps the text model of a ``gemma3n`` (multimodal) folder: the config in
  ``text_config``, the tensors under ``model.language_model.``; the vision
  and audio towers and their embedders are left unread, and reported."""
  text = cfg.require("text_config")
  bool_field(cfg, "tie_word_embeddings", True, True, _TIED)
  cfg.check_all_used()
  text_cfg = multimodal.text_config(cfg, text, "gemma3n", "gemma3n_text", RECORD.fields,
                                    RECORD.model_types["gemma3n_text"].ignored)
  return multimodal.towers_left_out(
      gemma3n_text_plan(text_cfg, weights, root=_MULTIMODAL_TEXT),
      lambda name: name.startswith(_MULTIMODAL_TEXT),
      "the vision and audio towers and their embedders", "Gemma 3n's text model only")


_MULTIMODAL_FIELDS = ("boi_token_id", "eoi_token_id", "boa_token_id", "eoa_token_id",
                      "image_token_id", "audio_token_id", "vision_soft_tokens_per_image",
                      "audio_soft_tokens_per_image")


def _detect(model: pz.nn.Layer) -> str | None:
  """Penzai models made of AltUp layers."""
  return "gemma3n_text" if all_layers(model, altup.AltUpLayer) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # gemma3n (multimodal) is read, never written.
  layers = all_layers(model, altup.AltUpLayer)
  found = blocks(model)
  kinds = layer_types(windows(model))
  attentions = [first_layer(b, pz.nn.Attention, "attention") for b in found]
  producer = next(a for a in attentions if not isinstance(a.input_to_key, kv_sharing.SharedKV))
  key = named_shape(first_layer(producer.input_to_key, pz.nn.Linear, "key projection"))
  query = named_shape(first_layer(attentions[0].input_to_query, pz.nn.Linear, "query"))
  embed = named_shape(first_layer(model, pz.nn.EmbeddingTable, "token embeddings"))
  kv_heads = key.get("heads", key.get("head_groups", 1))
  heads = kv_heads * query.get("query_heads", 1)
  widths = [named_shape(first_layer(first_layer(b, model_parts.TransformerFeedForward, "MLP"),
                                    pz.nn.Linear, "MLP"))["neurons"] for b in found]
  sparsity = [next((t.sparsity for t in all_layers(b, altup.GaussianTopK)), 0.0) for b in found]
  per_layer = first_layer(model, ple.PerLayerInputs, "per-layer inputs")
  table = named_shape(per_layer.table.table)
  laurel = named_shape(first_layer(layers[0].layer, altup.LaurelResidual, "Laurel").laurel
                       .sublayers[0])
  cap = first_layer(model, pz.nn.TanhSoftCap, "final logit soft cap, which Gemma 3n requires")
  window = next((w for w in windows(model) if w is not None), None)
  rope = {}
  for kind in _TYPES:
    if kind in kinds:
      rope_layer = first_layer(found[kinds.index(kind)], pz.nn.ApplyRoPE, "RoPE")
      rope[kind] = {"rope_type": "default", "rope_theta": float(rope_layer.max_wavelength)}
    else:
      rope[kind] = (like.get("rope_parameters") or {}).get(
          kind, {"rope_type": "default", "rope_theta": _THETAS[kind]})
  return {
      **rms_norm_fields(model),
      "hidden_size": embed["embedding"], "vocab_size": embed["vocabulary"],
      "num_hidden_layers": len(found), "num_attention_heads": heads,
      "num_key_value_heads": kv_heads, "head_dim": key["projection"],
      "intermediate_size": widths if len(set(widths)) > 1 else widths[0],
      "activation_sparsity_pattern": sparsity,
      "hidden_activation": "gelu_pytorch_tanh",
      "rope_parameters": rope,
      "layer_types": kinds,
      "sliding_window": like.get("sliding_window", 512) if window is None else window,
      "num_kv_shared_layers": sum(isinstance(a.input_to_key, kv_sharing.SharedKV)
                                  for a in attentions),
      "hidden_size_per_layer_input": table[ple.EMBEDDING_AXIS],
      "vocab_size_per_layer_input": table["vocabulary"],
      "altup_num_inputs": len(all_layers(model, altup.AltUpExpand)[0].projections) + 1,
      "altup_active_idx": layers[0].active,
      "altup_correct_scale": layers[0].scale_output,
      "laurel_rank": laurel["laurel"],
      "final_logit_softcapping": number(cap.soft_cap),
      "tie_word_embeddings": True, "attention_bias": False,
  }


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3n_text": {
        "defaults": {**{k: v for k, v in GEMMA_LIKE.items()
                     if k not in ("rope_theta", "partial_rotary_factor")},
                     "num_key_value_heads": 2, "sliding_window": 512,
                     "final_logit_softcapping": 30.0, "num_kv_shared_layers": 15,
                     "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262_144,
                     "altup_active_idx": 0, "altup_correct_scale": True, "altup_num_inputs": 4,
                     "laurel_rank": 64},
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
    title="Gemma 3n",
    model_types={
        "gemma3n_text": ModelType(
            gemma3n_text_plan, "Gemma3nForCausalLM", **_TRANSFORMERS_DEFAULTS["gemma3n_text"],
            ignored_fields={
                "checked, never needed: Penzai's RoPE has no length limit": (
                    "max_position_embeddings",),
                "training only: clips AltUp's coefficients while training": (
                    "altup_coef_clip", "altup_lr_multiplier"),
                "not read by transformers' Gemma 3n, whose attention logits are unscaled": (
                    "query_pre_attn_scalar",),
            },
            foreign_fields=frozenset({"altup_lr_multiplier", "query_pre_attn_scalar"})),
        "gemma3n": ModelType(gemma3n_plan, "Gemma3nForConditionalGeneration", exported=False,
                             written_as="gemma3n_text",
                             ignored_fields={OTHER_MODALITIES: (
                                 "vision_config", "audio_config", *_MULTIMODAL_FIELDS)}),
    },
    detect=_detect,
    write_config=_write_config,
    adds=("`gemma3n_text` and the text model of `gemma3n` folders (vision and audio towers not"
          " read, and the load says so): AltUp's streams, Laurel beside the attention,"
          " per-layer inputs, keys and values shared across the last layers, activation"
          " sparsity in the first MLPs, per-layer MLP widths, sliding and full layers, a final"
          " soft cap"),
    refuses="RoPE other than `default` (`rope_scaling`), per-layer lists of the wrong length",
    rank=125,
    fields={
        "intermediate_size": (_widths, "a positive integer or a list of them"),
        "activation_sparsity_pattern": (_sparsities, "a list of numbers in [0, 1)"),
        "rope_local_base_freq": POSITIVE_NUMBER, "altup_coef_clip": POSITIVE_NUMBER,
        "altup_lr_multiplier": POSITIVE_NUMBER,
        "altup_num_inputs": POSITIVE_INT, "altup_active_idx": NON_NEGATIVE_INT,
        "altup_correct_scale": BOOLEAN, "laurel_rank": POSITIVE_INT,
        "num_kv_shared_layers": NON_NEGATIVE_INT, "hidden_size_per_layer_input": POSITIVE_INT,
        "vocab_size_per_layer_input": POSITIVE_INT,
        "text_config": OBJECT, "vision_config": OBJECT, "audio_config": OBJECT,
        **dict.fromkeys(_MULTIMODAL_FIELDS, NON_NEGATIVE_INT),
    },
    layer_prefixes=(_TEXT + "layers.", _MULTIMODAL_TEXT + "layers."),
)
