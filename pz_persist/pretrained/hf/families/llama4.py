"""Llama 4 text checkpoints: ``llama4_text`` and the text model inside
``llama4`` (multimodal: Scout, Maverick) folders.

Llama 4 is Llama's layout (`pz_persist.pretrained.hf.building.decoder`) with:

- NoPE layers: ``no_rope_layers[i]`` 0 (default: every
  ``no_rope_layer_interval``-th layer, 4) rotates nothing; on those layers,
  with ``attn_temperature_tuning``, the queries are scaled by position
  (`TemperatureTuning`: ``floor_scale``, ``attn_scale``);
- RoPE layers rotate adjacent pairs of dimensions (`ApplyInterleavedRoPE`,
  base 500 000, ``llama3`` scaling on Scout) and, with ``use_qk_norm``,
  RMS-standardise queries and keys after the rotation (no weight);
- chunked attention (``layer_types`` ``chunked_attention``, default: the
  RoPE layers when ``attention_chunk_size`` is set): keys only within the
  query's chunk (`ApplyChunkedCausalAttentionMask`); the NoPE layers attend
  globally;
- a mixture of experts on the layers ``moe_layers`` (default every
  ``interleave_moe_layer_step``-th, 1: all), each the top
  ``num_experts_per_tok`` of a bias-free router's logits, the sigmoid of the
  chosen logit multiplying the expert's *input*, plus a shared expert (a
  SwiGLU MLP of ``intermediate_size``) always added; the other layers a dense
  SwiGLU MLP of ``intermediate_size_mlp``.

A ``llama4`` folder holds the text model under ``language_model.`` (its
config in ``text_config``) beside a vision tower and projector, which are not
read (the load says so, naming how many tensors). Such a model is exported
as ``llama4_text``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from typing import cast

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.llama4_attention import ApplyChunkedCausalAttentionMask
from pz_persist.nn.llama4_attention import ApplyInterleavedRoPE
from pz_persist.nn.llama4_attention import TemperatureTuning
from pz_persist.nn.scaled_rope import ApplyScaledRoPE
from pz_persist.pretrained.hf import multimodal
from pz_persist.pretrained.hf.building import llama4_moe
from pz_persist.pretrained.hf.building.decoder import attention_size_fields
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.defaults import NO_BIASES
from pz_persist.pretrained.hf.building.ignored import OTHER_MODALITIES
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import NON_NEGATIVE_NUMBER
from pz_persist.pretrained.hf.config import OBJECT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config_from_model import activation_field
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.config_from_model import rms_norm_fields
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_TYPES = ("chunked_attention", "full_attention")
_THETA = 500_000.0
_MULTIMODAL = "language_model."

_INDICES = (lambda v: isinstance(v, list) and all(NON_NEGATIVE_INT[0](i) for i in v),
            "a list of non-negative integers")
_FLAGS = (lambda v: isinstance(v, list) and all(i in (0, 1) and not isinstance(i, bool)
                                                 for i in v), "a list of 0s and 1s")


@dataclasses.dataclass(frozen=True)
class _Layers:
  """Each layer's kind, once the layer count is checked against the weights."""

  rope: list[bool]
  chunked: list[bool]
  moe: list[bool]


def llama4_text_plan(cfg: Config, weights: Weights, root: str = "") -> Plan:
  """Maps a Llama 4 text model whose tensors are under ``root`` (``""`` or
  ``language_model.``)."""
  raw = cfg.raw
  if raw.get("rope_parameters") is None and raw.get("rope_theta") is None:
    raw["rope_theta"] = _THETA
  elif isinstance(raw.get("rope_parameters"), dict) and "rope_theta" not in raw["rope_parameters"]:
    raw["rope_parameters"] = {"rope_theta": _THETA, **raw["rope_parameters"]}
  bool_field(cfg, "attention_bias", False, False, "Llama 4's attention has no biases")
  use_qk_norm = cfg.get("use_qk_norm", True)
  # transformers 4.51 wrote the Hub's configs with a number here (Scout: 4),
  # used as a truth value; transformers 5 wants a bool. Both are read.
  tuning = bool(cfg.get("attn_temperature_tuning", True))
  floor_scale = cfg.get("floor_scale", 8192)
  attn_scale = float(cfg.get("attn_scale", 0.1))
  chunk = cfg.nullable("attention_chunk_size", 8192)
  moe = llama4_moe.read_config(cfg)
  layers_of = _layer_kinds(cfg, chunk)
  dense_width = cfg.get("intermediate_size_mlp", 16384)
  moe.width = cfg.require("intermediate_size")
  raw["intermediate_size"] = dense_width  # Llama's plan builds the dense MLPs.
  kinds: list[_Layers] = []
  names = weights.names if not root else {
      n.removeprefix(root) for n in weights.names if n.startswith(root)}

  def attention(count: int) -> llamalike_common.AttentionType:
    kinds.append(layers_of(count))
    return llamalike_common.AttentionTypeGlobalCausal()  # Chunks: set by `edit`.

  def extras(p: str, s: str, config: llamalike_common.LlamalikeTransformerConfig
             ) -> list[TensorSpec]:
    i = int(p.rsplit("_", 1)[-1].rstrip("/"))
    return moe.specs(p, s, config) if kinds[0].moe[i] else []

  def edit(model: model_parts.TransformerLM,
           config: llamalike_common.LlamalikeTransformerConfig) -> model_parts.TransformerLM:
    layers = kinds[0]
    selected = pz.select(model).at_instances_of(model_parts.TransformerBlock)
    new = []
    for i, block in enumerate(selected.get_sequence()):
      block = _attention_block(block, layers.rope[i], layers.chunked[i] and chunk or None,
                               use_qk_norm, config.rms_norm_eps,
                               (floor_scale, attn_scale) if tuning else None)
      if layers.moe[i]:
        block = moe.edit_block(block, i, config)
      new.append(block)
    return selected.set_sequence(new)

  seen = cast(Weights, _Named(weights, names))  # What Llama's plan asks of it.
  plan = llama_plan(cfg, seen, attention=attention, head_dim_default=128,
                    max_positions_default=131_072, block_extras=extras, edit=edit)
  layers = kinds[0]
  tensors = []
  for spec in plan.tensors:
    if spec.label.rsplit("/", 2)[-2] == "mlp":  # Llama's dense MLP: Llama 4's feed_forward.
      if layers.moe[_block(spec.label)]:
        continue  # The experts take its place.
      spec = dataclasses.replace(spec, source=spec.source.replace(".mlp.", ".feed_forward."))
    tensors.append(spec)
  if root:
    tensors = [dataclasses.replace(spec, source=root + spec.source) for spec in tensors]
  return Plan(plan.build, tuple(tensors))


def _block(label: str) -> int:
  head = label.split("/")[1] if label.startswith("transformer/block_") else ""
  return int(head.removeprefix("block_")) if head.startswith("block_") else -1


class _Named:
  """``weights`` seen with the text model's tensor names (a multimodal
  folder's without their ``language_model.`` prefix), for Llama's plan."""

  def __init__(self, weights: Weights, names: set[str]):
    self.names = names
    self.dtype = weights.dtype
    self.path = weights.path


def _layer_kinds(cfg: Config, chunk: int | None) -> Any:
  """Reads the per-layer fields; returns the function giving each layer's
  kinds from the layer count (called once it is checked)."""
  no_rope = cfg.get("no_rope_layers")
  interval = cfg.get("no_rope_layer_interval", 4)
  types = cfg.get("layer_types")
  moe_layers = cfg.get("moe_layers")
  step = cfg.get("interleave_moe_layer_step", 1)

  def kinds(count: int) -> _Layers:
    rope = ([bool(f) for f in no_rope] if no_rope
            else [(i + 1) % interval != 0 for i in range(count)])
    if len(rope) < count:
      raise cfg.unsupported("no_rope_layers", no_rope[:8], f"one flag for each of the {count}"
                            " layers (num_hidden_layers)")
    rope = rope[:count]
    if types is not None:
      if len(types) != count or not set(types) <= set(_TYPES):
        raise cfg.unsupported("layer_types", types[:8], f"one of {list(_TYPES)} for each of the"
                              f" {count} layers")
      chunked = [t == "chunked_attention" for t in types]
    else:
      chunked = [r and chunk is not None for r in rope]
    if any(chunked) and chunk is None:
      raise cfg.unsupported("attention_chunk_size", None, "layers of type 'chunked_attention'"
                            " need a chunk size")
    chosen = moe_layers if moe_layers is not None else list(range(step - 1, count, step))
    if any(i >= count for i in chosen):
      raise cfg.unsupported("moe_layers", chosen[:8], f"layer indices below {count}")
    return _Layers(rope, chunked, [i in chosen for i in range(count)])

  return kinds


def _attention_block(block: model_parts.TransformerBlock, rope: bool, chunk: int | None,
                     qk_norm: bool, eps: float, tuning: tuple[float, float] | None
                     ) -> model_parts.TransformerBlock:
  """One block's attention as Llama 4 has it (module docstring)."""

  def part(sequence: pz.nn.Sequential, query: bool) -> pz.nn.Sequential:
    layers = []
    for layer in sequence.sublayers:
      if isinstance(layer, (pz.nn.ApplyRoPE, ApplyScaledRoPE)):
        if rope:
          layers.append(ApplyInterleavedRoPE(rope=layer))
          if qk_norm:
            layers.append(pz.nn.RMSStandardize(across=("projection",), epsilon=eps))
        elif query and tuning is not None:
          layers.append(TemperatureTuning(floor_scale=tuning[0], attn_scale=tuning[1]))
        continue
      layers.append(layer)
    return dataclasses.replace(sequence, sublayers=layers)

  def attention(attn: pz.nn.Attention) -> pz.nn.Attention:
    attn = dataclasses.replace(attn, input_to_query=part(attn.input_to_query, True),
                               input_to_key=part(attn.input_to_key, False))
    if chunk is None:
      return attn
    return pz.select(attn).at_instances_of(pz.nn.ApplyCausalAttentionMask).apply(
        lambda mask: ApplyChunkedCausalAttentionMask(masked_out_value=mask.masked_out_value,
                                                     chunk_size=chunk))

  return pz.select(block).at_instances_of(pz.nn.Attention).apply(attention)


def llama4_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps the text model of a ``llama4`` (multimodal) folder: the config in
  ``text_config``, the tensors under ``language_model.``; the vision tower
  and its projector are left unread, and reported."""
  text = cfg.require("text_config")
  tied = cfg.get("tie_word_embeddings", False)
  cfg.check_all_used()
  text_cfg = multimodal.text_config(cfg, text, "llama4", "llama4_text", RECORD.fields,
                                    RECORD.model_types["llama4_text"].ignored)
  if tied and text_cfg.raw.get("tie_word_embeddings") is None:
    text_cfg.raw["tie_word_embeddings"] = tied
  return multimodal.towers_left_out(
      llama4_text_plan(text_cfg, weights, root=_MULTIMODAL),
      lambda name: name.startswith(_MULTIMODAL), "the vision tower and projector",
      "Llama 4's text model only")


def _detect(model: pz.nn.Layer) -> str | None:
  """Llama's layout with interleaved RoPE or temperature tuning."""
  if all_layers(model, ApplyInterleavedRoPE) or all_layers(model, TemperatureTuning):
    return "llama4_text"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # llama4 (multimodal) is read, never written.
  per_block = blocks(model)
  rope = [bool(all_layers(b, ApplyInterleavedRoPE)) for b in per_block]
  chunks = [[m.chunk_size for m in all_layers(b, ApplyChunkedCausalAttentionMask)]
            for b in per_block]
  tuning = all_layers(model, TemperatureTuning)
  qk_norms = [n for a in all_layers(model, pz.nn.Attention)
              for n in all_layers(a.input_to_key, pz.nn.RMSStandardize)]
  experts = llama4_moe.moe_layers(model)
  dense = [b for b, layer in zip(per_block, experts) if layer is None]
  fields = {
      **attention_size_fields(model), **rms_norm_fields(model), **tied_field(model, like),
      **llama4_moe.config_fields(model),
      "hidden_act": _activation(model, like),
      "attention_bias": False,
      "no_rope_layers": [int(r) for r in rope],
      "layer_types": ["chunked_attention" if c else "full_attention" for c in chunks],
      "attention_chunk_size": next((c[0] for c in chunks if c),
                                   like.get("attention_chunk_size", 8192)),
      # Fields no layer shows (no layer of their kind): like's, else transformers' default.
      "use_qk_norm": bool(qk_norms) if any(rope) else like.get("use_qk_norm", True),
      "attn_temperature_tuning": bool(tuning) if not all(rope) else like.get(
          "attn_temperature_tuning", True),
      "floor_scale": _whole(tuning[0].floor_scale) if tuning else like.get("floor_scale", 8192),
      "attn_scale": number(tuning[0].attn_scale) if tuning else like.get("attn_scale", 0.1),
  }
  if any(rope):
    fields.update(rope_fields(model))
  else:  # No layer rotates: the RoPE fields change nothing.
    fields["rope_parameters"] = like.get("rope_parameters") or {"rope_theta": _THETA,
                                                                "rope_type": "default"}
  if dense:
    ffw = first_layer(dense[0], model_parts.TransformerFeedForward, "MLP")
    fields["intermediate_size_mlp"] = named_shape(first_layer(ffw, pz.nn.Linear, "MLP"))["neurons"]
  else:  # Every layer has experts: the dense width the skeleton was built with.
    fields["intermediate_size_mlp"] = model.metadata.mlp_hidden_dim
  if "intermediate_size" not in fields:
    fields["intermediate_size"] = like.get("intermediate_size", 8192)
  return fields


def _whole(value: Any) -> int | float:
  """``floor_scale`` as transformers' config takes it: an integer when whole."""
  value = number(value)
  return int(value) if value.is_integer() else value


def _activation(model: pz.nn.Layer, like: Mapping[str, Any]) -> str:
  """``hidden_act``: the dense and shared MLPs' (Llama's plan: SiLU or tanh GELU)."""
  return activation_field(model, like)["hidden_act"]


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama4_text": {
        "defaults": {**LLAMA_LIKE, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0,
                     "head_dim": 128, "use_qk_norm": True, "attn_temperature_tuning": True,
                     "floor_scale": 8192, "attn_scale": 0.1, "attention_chunk_size": 8192,
                     "intermediate_size_mlp": 16384, "no_rope_layer_interval": 4,
                     "interleave_moe_layer_step": 1, "num_local_experts": 16,
                     "num_experts_per_tok": 1, "mlp_bias": False},
        "defaults_why": {
            "mlp_bias": NO_BIASES,
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Llama 4 (text)",
    model_types={
        "llama4_text": ModelType(llama4_text_plan, "Llama4ForCausalLM",
            **_TRANSFORMERS_DEFAULTS["llama4_text"],
            ignored_fields={
                "training only: the balancing loss; transformers' router never adds the noise": (
                    "router_aux_loss_coef", "output_router_logits", "router_jitter_noise"),
                "the Hub's configs hold it; only llm-compressor reads it": ("for_llm_compressor",),
            }, foreign_fields=frozenset({"for_llm_compressor"})),
        "llama4": ModelType(llama4_plan, "Llama4ForConditionalGeneration", exported=False,
                            written_as="llama4_text",
                            ignored_fields={OTHER_MODALITIES: (
                                "vision_config", "boi_token_index", "eoi_token_index",
                                "image_token_index")}),
    },
    detect=_detect,
    write_config=_write_config,
    adds=("`llama4_text` and the text model of `llama4` folders (Scout, Maverick; the vision"
          " tower is not read, and the load says so): chunked attention, NoPE layers with"
          " temperature tuning, interleaved RoPE (`llama3` scaling), L2 query/key norms,"
          " mixture-of-experts layers (sigmoid top-k router scaling the expert input, shared"
          " expert) interleaved with dense ones"),
    refuses="attention biases",
    rank=140,
    fields={
        "intermediate_size_mlp": POSITIVE_INT,
        "moe_layers": _INDICES,
        "interleave_moe_layer_step": POSITIVE_INT,
        "use_qk_norm": BOOLEAN,
        "no_rope_layers": _FLAGS,
        "no_rope_layer_interval": POSITIVE_INT,
        "attention_chunk_size": POSITIVE_INT,
        "attn_temperature_tuning": (lambda v: isinstance(v, bool) or NON_NEGATIVE_INT[0](v),
                                    "true, false or a non-negative integer"),
        "for_llm_compressor": BOOLEAN,
        "floor_scale": POSITIVE_NUMBER,
        "attn_scale": POSITIVE_NUMBER,
        "num_local_experts": POSITIVE_INT,
        "num_experts_per_tok": POSITIVE_INT,
        "router_aux_loss_coef": NON_NEGATIVE_NUMBER,
        "router_jitter_noise": NON_NEGATIVE_NUMBER,
        "output_router_logits": BOOLEAN,
        "text_config": OBJECT,
        "vision_config": OBJECT,
        "boi_token_index": NON_NEGATIVE_INT,
        "eoi_token_index": NON_NEGATIVE_INT,
        "image_token_index": NON_NEGATIVE_INT,
    },
    layer_prefixes=("model.layers.", _MULTIMODAL + "model.layers."),
    head_names=("lm_head.weight", _MULTIMODAL + "lm_head.weight"),
)
