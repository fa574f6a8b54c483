"""Qwen3.5 / Qwen3.6 text models (``model_type`` ``qwen3_5_text``, and the
text model inside ``qwen3_5`` multimodal folders).

Qwen3.5 mixes two kinds of layers, as ``layer_types`` says (by default three
``linear_attention`` layers then one ``full_attention``, repeating):

- ``linear_attention``: a gated DeltaNet
  (`pz_persist.nn.gated_delta_net.GatedDeltaNet`) in place of
  Penzai's ``Attention``: a linear-attention recurrence whose state, not a
  growing cache of keys, carries the past. Hugging Face stores the query, key
  and value projections fused (``in_proj_qkv``) and their convolution kernels
  fused (``conv1d.weight``, ``[channels, 1, taps]``); each is read as its
  rows (`TensorSpec.rows`, as Phi-3's fused projections) into the layer's
  named parameters (``key_heads`` / ``value_heads``, ``key_projection`` /
  ``value_projection``, ``conv_taps``), and written back fused.
- ``full_attention``: attention with query/key RMS norms over each head
  with an output gate: ``q_proj`` holds, per head, the query's rows then the
  gate's (read with `TensorSpec.take`), and ``sigmoid(gate)`` multiplies
  the attention's output, per head and dimension, before ``o_proj``. In
  Penzai: ``BranchAndMultiplyTogether`` of the attention (its output
  projection moved after the product) and ``Linear`` -> sigmoid, then the
  output ``Linear``; KV-cache sampling converts the attention as usual.
  RoPE turns only the first ``partial_rotary_factor`` (0.25) of each head
  (``ApplyRoPEToSubset``). The multimodal RoPE's ``mrope_section`` splits the
  frequencies between the temporal, height and width positions of image
  tokens; for text, all three positions are the token's own, so it is plain
  RoPE (the sections are accepted and change nothing).

Every RMS norm but the DeltaNet's output norm multiplies by ``1 + w`` in
float32 (`OffsetScale`, as Gemma's). Sampling needs the DeltaNet layers'
state: use `pz_persist.pretrained.kv_caching_lm`
instead of ``KVCachingTransformerLM.from_uncached`` (which the layers
refuse, rather than forget the past).

A ``qwen3_5`` folder holds the text model under ``model.language_model.``
next to a vision tower (``model.visual.``) and, on the Hub, the
multi-token-prediction head (``mtp.``): neither is read, and the load says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.gated_delta_net import GatedDeltaNet
from pz_persist.pretrained.hf import multimodal
from pz_persist.pretrained.hf.building.decoder import attention_size_fields
from pz_persist.pretrained.hf.building.decoder import block_specs
from pz_persist.pretrained.hf.building.decoder import head_axes
from pz_persist.pretrained.hf.building.ignored import OTHER_MODALITIES
from pz_persist.pretrained.hf.building.norms import query_key_norm_specs
from pz_persist.pretrained.hf.building.norms import with_offset_norms
from pz_persist.pretrained.hf.building.norms import with_query_key_norms
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import OBJECT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import STRING
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config import lm_head_source
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import DECODER_HEAD
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import check_layers
from pz_persist.pretrained.hf.plan import left_out_matching
from pz_persist.pretrained.hf.weights import Weights

_TYPES = ("linear_attention", "full_attention")
TEXT = "model."
MULTIMODAL_TEXT = "model.language_model."
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section",
              "mrope_interleaved"}

# transformers' Qwen3_5TextConfig defaults for the fields a config may leave out.
_DEFAULTS = {"vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
             "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
             "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "linear_num_key_heads": 16,
             "linear_num_value_heads": 32}


_SECTIONS = (lambda v: isinstance(v, list) and len(v) == 3 and all(NON_NEGATIVE_INT[0](x) for x in v),
             "a list of three non-negative integers")


@dataclasses.dataclass(frozen=True)
class Sizes:
  """A Qwen3.5-style hybrid's sizes: attention, and the DeltaNet's heads and taps."""

  hidden: int
  heads: int
  kv_heads: int
  head_dim: int
  key_heads: int
  value_heads: int
  key_dim: int
  value_dim: int
  taps: int


def qwen3_5_text_plan(cfg: Config, weights: Weights, root: str = TEXT,
                      head: str = DECODER_HEAD, tied: bool | None = None,
                      delta_net_specs: Callable[..., list[TensorSpec]] | None = None) -> Plan:
  """Maps a Qwen3.5 text model whose tensors are under ``root``;
  ``delta_net_specs(label, layer prefix, sizes)`` gives the DeltaNet layers'
  tensors when they are not Qwen3.5's (Qwen3-Next fuses them otherwise)."""
  delta_net_specs = delta_net_specs or fused_qkv_delta_specs
  cfg.fill_absent(_DEFAULTS)
  sizes = _sizes(cfg)
  act = cfg.get("hidden_act", "silu")
  if act != "silu":
    raise cfg.unsupported("hidden_act", act, "Qwen3.5's MLP and DeltaNet convolution use SiLU")
  bool_field(cfg, "attention_bias", False, False, "Qwen3.5's attention has no biases")
  bool_field(cfg, "attn_output_gate", True, True,
             "transformers' Qwen3.5 always gates the attention output")
  eps = float(cfg.get("rms_norm_eps", 1e-6))
  theta, rotary = _rope(cfg, sizes.head_dim)
  layers = cfg.require("num_hidden_layers")
  kinds = _layer_types(cfg, layers)
  if tied is None:
    tied = cfg.get("tie_word_embeddings", False)
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=sizes.kv_heads,
      query_head_multiplier=sizes.heads // sizes.kv_heads,
      embedding_dim=sizes.hidden,
      projection_dim=sizes.head_dim,
      mlp_hidden_dim=cfg.require("intermediate_size"),
      num_decoder_blocks=layers,
      vocab_size=cfg.require("vocab_size"),
      mlp_variant="swiglu",
      tie_embedder_and_logits=False,
      rope_wavelength=theta,
      rms_norm_eps=eps,
      parameter_dtype=None,
      activation_dtype=None,
  )
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  check_layers(cfg, weights.names, root + "layers.", layers)
  head_source = lm_head_source(cfg, tied, weights, head, root + "embed_tokens.weight")
  config = dataclasses.replace(config, parameter_dtype=weights.dtype,
                               activation_dtype=weights.dtype)
  types = kinds(layers)
  hidden, vocab = sizes.hidden, config.vocab_size
  specs = [
      TensorSpec("transformer/embedder.embeddings", root + "embed_tokens.weight",
                 (vocab, hidden), ("vocabulary", "embedding")),
      TensorSpec("transformer/final_norm/scale.weights", root + "norm.weight",
                 (hidden,), ("embedding",)),
      TensorSpec("transformer/lm_head.weights", head_source,
                 (vocab, hidden), ("vocabulary", "embedding")),
  ]
  for i, kind in enumerate(types):
    p, s = f"transformer/block_{i}/", f"{root}layers.{i}."
    specs += [
        TensorSpec(p + "pre_attention_norm/scale.weights", s + "input_layernorm.weight",
                   (hidden,), ("embedding",)),
        TensorSpec(p + "pre_ffw_norm/scale.weights", s + "post_attention_layernorm.weight",
                   (hidden,), ("embedding",)),
    ]
    llama = block_specs(p, s, config)
    specs += [spec for spec in llama if "/mlp/" in spec.label]
    if kind == "full_attention":
      specs += _gated_attention_specs(p, s, config, llama)
    else:
      specs += delta_net_specs(p + "linear_attention", s + "linear_attn.", sizes)

  def build() -> model_parts.TransformerLM:
    model = llamalike_common.build_llamalike_transformer(config, init_base_rng=None)
    model = with_offset_norms(with_query_key_norms(model, config))
    if rotary != sizes.head_dim:
      model = pz.select(model).at_instances_of(pz.nn.ApplyRoPE).apply(
          lambda layer: pz.nn.ApplyRoPEToSubset(
              embedding_axis=layer.embedding_axis, max_wavelength=layer.max_wavelength,
              rope_subset_size=rotary, positions_input_name=layer.positions_input_name))
    selected = pz.select(model).at_instances_of(model_parts.TransformerBlock)
    return selected.set_sequence([
        _block(block, kind, f"transformer/block_{i}/", sizes, eps)
        for i, (block, kind) in enumerate(zip(selected.get_sequence(), types))])

  return Plan(build, tuple(specs))


def multimodal_plan(cfg: Config, weights: Weights, text_type: str, text_plan: Callable[..., Plan],
                    fields: Mapping[str, Any], text_ignored: frozenset[str]) -> Plan:
  """The plan of the text model (``text_type``, mapped by ``text_plan``,
  leaving ``text_ignored`` unread) of a multimodal Qwen3.5 folder (dense or
  mixture of experts)."""
  text = cfg.require("text_config")
  tied = cfg.get("tie_word_embeddings", False)
  cfg.check_all_used()
  text_cfg = multimodal.text_config(cfg, text, text_type.removesuffix("_text"), text_type, fields,
                                     text_ignored)
  return multimodal.towers_left_out(
      text_plan(text_cfg, weights, root=MULTIMODAL_TEXT, tied=tied),
      lambda name: name.startswith(MULTIMODAL_TEXT) or name == DECODER_HEAD,
      "the vision tower and the multi-token-prediction head",
      "Qwen3.5's text model only (no vision tower, no multi-token-prediction head)")


def _sizes(cfg: Config) -> Sizes:
  heads, kv_heads = cfg.require("num_attention_heads"), cfg.require("num_key_value_heads")
  if heads % kv_heads:
    raise cfg.unsupported("num_key_value_heads", kv_heads,
                          f"must divide num_attention_heads={heads}")
  key_heads = cfg.require("linear_num_key_heads")
  value_heads = cfg.require("linear_num_value_heads")
  if value_heads % key_heads:
    raise cfg.unsupported("linear_num_value_heads", value_heads,
                          f"each key head serves a whole number of value heads; it must be a"
                          f" multiple of linear_num_key_heads={key_heads}")
  return Sizes(hidden=cfg.require("hidden_size"), heads=heads, kv_heads=kv_heads,
                head_dim=cfg.require("head_dim"), key_heads=key_heads, value_heads=value_heads,
                key_dim=cfg.require("linear_key_head_dim"),
                value_dim=cfg.require("linear_value_head_dim"),
                taps=cfg.require("linear_conv_kernel_dim"))


def _rope(cfg: Config, head_dim: int) -> tuple[float, int]:
  """``(rope_theta, rotated entries per head)`` from ``rope_parameters``
  (transformers 5, and the Hub's configs) or the top-level fields older
  configs have; only the default rope type."""
  params = cfg.get("rope_parameters")
  legacy = cfg.get("rope_scaling")
  if legacy:
    raise cfg.unsupported("rope_scaling", legacy, "Qwen3.5's RoPE is the default type,"
                          " given in rope_parameters")
  params = dict(params or {})
  unknown = sorted(set(params) - _ROPE_KEYS)
  if unknown:
    raise cfg.unsupported(f"rope_parameters.{unknown[0]}", params[unknown[0]],
                          f"Qwen3.5 reads only {sorted(_ROPE_KEYS)}")
  kinds = {params.get(k) for k in ("rope_type", "type")} - {None}
  if kinds - {"default"}:
    raise cfg.unsupported("rope_parameters.rope_type", sorted(map(str, kinds - {"default"}))[0],
                          "Qwen3.5's RoPE is of type 'default'")
  if "mrope_section" in params:
    cfg.checked("rope_parameters.mrope_section", params["mrope_section"])
  if "mrope_interleaved" in params:
    cfg.checked("rope_parameters.mrope_interleaved", params["mrope_interleaved"])
  values = {}
  for name, default in (("rope_theta", 10_000.0), ("partial_rotary_factor", 0.25)):
    inner = params.get(name)
    inner = None if inner is None else cfg.checked(f"rope_parameters.{name}", inner)
    outer = cfg.get(name)
    if inner is not None and outer is not None and inner != outer:
      raise cfg.unsupported(name, outer, f"rope_parameters.{name}={inner!r} says otherwise")
    values[name] = next((v for v in (inner, outer) if v is not None), default)
  rotary = int(head_dim * values["partial_rotary_factor"])
  if rotary < 2 or rotary % 2:
    raise cfg.unsupported("partial_rotary_factor", values["partial_rotary_factor"],
                          f"it rotates {rotary} of head_dim={head_dim} entries; RoPE needs an"
                          " even number of at least 2")
  return float(values["rope_theta"]), rotary


def _layer_types(cfg: Config, layers: int):
  """A function giving each layer's type from the layer count (called once
  the count is checked against the weights)."""
  types = cfg.get("layer_types")
  interval = cfg.get("full_attention_interval", 4)
  if types is not None and (len(types) != layers or not set(types) <= set(_TYPES)):
    shown = types if len(types) <= 8 else [*types[:8], "..."]
    raise cfg.unsupported("layer_types", shown, f"one of {list(_TYPES)} for each of the"
                          f" num_hidden_layers={layers} layers")

  def kinds(count: int) -> list[str]:
    if types is not None:
      return list(types)
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(count)]

  return kinds


def _gated_attention_specs(p: str, s: str, config: llamalike_common.LlamalikeTransformerConfig,
                           llama: list[TensorSpec]) -> list[TensorSpec]:
  """The query/key-normed attention's specs, the query and its gate read from ``q_proj``:
  per head, ``head_dim`` query rows then ``head_dim`` gate rows."""
  heads, _ = head_axes(config)
  hidden, head_dim = config.embedding_dim, config.projection_dim
  fused = (config.num_kv_heads * config.query_head_multiplier * 2 * head_dim, hidden)
  shape = (*heads.values(), 2, head_dim, hidden)
  axes = (*heads, "projection", "embedding")
  part = len(heads)
  out = [TensorSpec(p + "attention/query.weights", s + "self_attn.q_proj.weight", shape, axes,
                    take=(part, 0), stored=fused),
         TensorSpec(p + "attention/output_gate.weights", s + "self_attn.q_proj.weight", shape,
                    axes, take=(part, 1), stored=fused)]
  out += [spec for spec in llama if "/attention/" in spec.label
          and not spec.label.endswith("attention/query.weights")]
  return out + query_key_norm_specs(p, s, config)


def fused_qkv_delta_specs(name: str, s: str, sizes: Sizes) -> list[TensorSpec]:
  """The gated DeltaNet's parameters, the fused tensors read by rows."""
  hidden = sizes.hidden
  keys = (sizes.key_heads, sizes.key_dim)
  values = (sizes.value_heads, sizes.value_dim)
  key_rows, value_rows = keys[0] * keys[1], values[0] * values[1]
  channels = 2 * key_rows + value_rows
  bounds = {"query": (0, key_rows), "key": (key_rows, 2 * key_rows),
            "value": (2 * key_rows, channels)}
  out = []
  for stream, rows in bounds.items():
    sized, axes = ((values, ("value_heads", "value_projection")) if stream == "value"
                   else (keys, ("key_heads", "key_projection")))
    out += [
        TensorSpec(f"{name}/{stream}.weights", s + "in_proj_qkv.weight", (*sized, hidden),
                   (*axes, "embedding"), stored=(channels, hidden), rows=rows),
        TensorSpec(f"{name}/{stream}_conv", s + "conv1d.weight", (*sized, sizes.taps),
                   (*axes, "conv_taps"), stored=(channels, 1, sizes.taps), rows=rows),
    ]
  return out + [
      TensorSpec(f"{name}/output_gate.weights", s + "in_proj_z.weight", (*values, hidden),
                 ("value_heads", "value_projection", "embedding"), stored=(value_rows, hidden)),
      TensorSpec(f"{name}/write_strength.weights", s + "in_proj_b.weight",
                 (sizes.value_heads, hidden), ("value_heads", "embedding")),
      TensorSpec(f"{name}/decay_input.weights", s + "in_proj_a.weight",
                 (sizes.value_heads, hidden), ("value_heads", "embedding")),
      TensorSpec(f"{name}/log_decay_rate", s + "A_log", (sizes.value_heads,), ("value_heads",)),
      TensorSpec(f"{name}/decay_bias", s + "dt_bias", (sizes.value_heads,), ("value_heads",)),
      TensorSpec(f"{name}/norm_scale", s + "norm.weight", (sizes.value_dim,),
                 ("value_projection",)),
      TensorSpec(f"{name}/output.weights", s + "out_proj.weight", (hidden, *values),
                 ("embedding", "value_heads", "value_projection"), stored=(hidden, value_rows)),
  ]


def _block(block: model_parts.TransformerBlock, kind: str, p: str, sizes: Sizes,
           eps: float) -> model_parts.TransformerBlock:
  """Penzai's llama-like block with its attention made Qwen3.5's."""
  if kind == "full_attention":
    return pz.select(block).at_instances_of(pz.nn.Attention).apply(
        lambda attn: _gated(attn, p + "attention/output_gate.weights"))
  delta = GatedDeltaNet.from_config(
      p + "linear_attention", embedding=sizes.hidden, key_heads=sizes.key_heads,
      value_heads=sizes.value_heads, key_projection=sizes.key_dim,
      value_projection=sizes.value_dim, conv_taps=sizes.taps, norm_epsilon=eps)
  return pz.select(block).at_instances_of(pz.nn.Attention).apply(lambda attn: delta)


def _gated(attn: pz.nn.Attention, gate_label: str) -> pz.nn.Sequential:
  """``attn`` with its output multiplied by ``sigmoid(gate(x))`` before the
  output projection."""
  *inner, output = attn.attn_value_to_output.sublayers
  assert isinstance(output, pz.nn.Linear), "Penzai's attention ends with its output Linear"
  query = next(layer for layer in attn.input_to_query.sublayers if isinstance(layer, pz.nn.Linear))
  gate = pz.nn.Linear(weights=pz.ParameterSlot(gate_label), in_axis_names=query.in_axis_names,
                      out_axis_names=query.out_axis_names)
  ungated = dataclasses.replace(attn, attn_value_to_output=pz.nn.Sequential(list(inner)))
  return pz.nn.Sequential([
      pz.nn.BranchAndMultiplyTogether(branches=[
          ungated, pz.nn.Sequential([gate, pz.nn.Elementwise(jax.nn.sigmoid)])]),
      output,
  ])


def has_delta_net(model: pz.nn.Layer) -> bool:
  """Whether ``model`` has gated DeltaNet layers (Qwen3.5's structure)."""
  return bool(all_layers(model, GatedDeltaNet))


def hybrid_fields(model: pz.nn.Layer, like: Mapping[str, Any]) -> dict[str, Any]:
  """The ``config.json`` fields of a Qwen3.5 text model (dense or mixture
  of experts: the latter's expert sizes are its family's to write)."""
  deltas = all_layers(model, GatedDeltaNet)
  types = ["linear_attention" if all_layers(block, GatedDeltaNet) else "full_attention"
           for block in blocks(model)]
  fields: dict[str, Any] = {"layer_types": types, "hidden_act": "silu", "attention_bias": False}
  if "full_attention" in types:
    fields.update(attention_size_fields(model))
    rope = (all_layers(model, pz.nn.ApplyRoPEToSubset) + all_layers(model, pz.nn.ApplyRoPE))[0]
    rotary = getattr(rope, "rope_subset_size", fields["head_dim"])
    rope_parameters = {"rope_type": "default", "rope_theta": float(rope.max_wavelength),
                       "partial_rotary_factor": rotary / fields["head_dim"]}
  else:  # No attention layer: its sizes change nothing; like's, else the defaults.
    fields.update(_sizes_without_attention(model, like))
    rope_parameters = dict(like.get("rope_parameters") or {"rope_type": "default",
                                                           "rope_theta": 10_000.0,
                                                           "partial_rotary_factor": 0.25})
  for key in ("mrope_section", "mrope_interleaved"):  # Text positions ignore them.
    if key in (like.get("rope_parameters") or {}):
      rope_parameters[key] = like["rope_parameters"][key]
  fields["rope_parameters"] = rope_parameters
  standardize = all_layers(model, pz.nn.RMSStandardize)
  fields["rms_norm_eps"] = number(standardize[0].epsilon if standardize
                                  else deltas[0].norm_epsilon)
  if deltas:
    first = deltas[0]
    conv_k = dict(first.key_conv.value.named_shape)
    conv_v = dict(first.value_conv.value.named_shape)
    fields.update(linear_num_key_heads=conv_k["key_heads"],
                  linear_key_head_dim=conv_k["key_projection"],
                  linear_num_value_heads=conv_v["value_heads"],
                  linear_value_head_dim=conv_v["value_projection"],
                  linear_conv_kernel_dim=conv_k["conv_taps"])
  else:
    fields.update({k: like.get(k, _DEFAULTS[k]) for k in (
        "linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
        "linear_value_head_dim", "linear_conv_kernel_dim")})
  fields.update(tied_field(model, like))
  dense = [ffw for ffw in all_layers(model, model_parts.TransformerFeedForward)
           if all_layers(ffw, pz.nn.Linear) and "neurons" in dict(
               all_layers(ffw, pz.nn.Linear)[0].weights.value.named_shape)]
  if dense:  # (A mixture of experts' variant has none: its family writes its sizes.)
    fields["intermediate_size"] = dict(
        all_layers(dense[0], pz.nn.Linear)[0].weights.value.named_shape)["neurons"]
  return fields


def _sizes_without_attention(model: pz.nn.Layer, like: Mapping[str, Any]) -> dict[str, Any]:
  embed = named_shape(first_layer(model, pz.nn.EmbeddingTable, "token embeddings"))
  return {"hidden_size": embed["embedding"], "vocab_size": embed["vocabulary"],
          "num_hidden_layers": len(blocks(model)),
          **{k: like.get(k, _DEFAULTS[k])
             for k in ("num_attention_heads", "num_key_value_heads", "head_dim")}}


TEXT_IGNORED = {
    "the multi-token-prediction head, which is not built (nor read)": (
        "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"),
    "not read by transformers: the recurrent state is float32": ("mamba_ssm_dtype",),
    "top-level spellings of older configs: text positions ignore them": (
        "mrope_section", "mrope_interleaved"),
    "in a multimodal folder the folder's own tie_word_embeddings counts": (
        "tie_word_embeddings",),
}
"""The fields a Qwen3.5 text model's config (dense or mixture of experts)
holds that its plan leaves unread."""

MTP_HEAD = left_out_matching(
    (r"^mtp\.",), "the multi-token-prediction head",
    "the causal LM does not run it (transformers drops it too)", reported=True)
"""The ``mtp.*`` tensors of Qwen3-Next and Qwen3.5 folders, which
transformers' classes ignore (``_keys_to_ignore_on_load_unexpected``)."""

TEXT_FOREIGN = frozenset({"mamba_ssm_dtype", "mrope_interleaved", "mrope_section",
                          "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"})
"""Those of `TEXT_IGNORED` that only the Hub's configs hold (transformers'
Qwen3.5 classes lack them)."""

MULTIMODAL_IGNORED = {
    OTHER_MODALITIES: (
        "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
        "vision_end_token_id"),
}
"""The fields of a multimodal Qwen3.5 folder's own config left unread."""

FIELDS = {
        "linear_conv_kernel_dim": POSITIVE_INT,
        "linear_key_head_dim": POSITIVE_INT,
        "linear_value_head_dim": POSITIVE_INT,
        "linear_num_key_heads": POSITIVE_INT,
        "linear_num_value_heads": POSITIVE_INT,
        "full_attention_interval": POSITIVE_INT,
        "attn_output_gate": BOOLEAN,
        "mtp_num_hidden_layers": NON_NEGATIVE_INT,
        "mtp_use_dedicated_embeddings": BOOLEAN,
        "mamba_ssm_dtype": STRING,
        "mrope_section": _SECTIONS,
        "mrope_interleaved": BOOLEAN,
        "text_config": OBJECT,
        "vision_config": OBJECT,
        "image_token_id": NON_NEGATIVE_INT,
        "video_token_id": NON_NEGATIVE_INT,
        "vision_start_token_id": NON_NEGATIVE_INT,
        "vision_end_token_id": NON_NEGATIVE_INT,
}
"""The ``config.json`` fields Qwen3.5's text models (dense and mixture of
experts) and their multimodal folders read beyond the shared ones."""
