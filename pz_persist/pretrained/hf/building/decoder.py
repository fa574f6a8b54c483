"""The llama-like decoder most families are built on: Llama's layout as a
plan (`llama_plan`, with hooks for what a family adds), its projections'
biases (`Biases`, `model_biases`), its tensors (`block_specs`, `head_axes`)
and scaled RoPE (`with_scaled_rope`).

Llama's and Mistral's own record is `pz_persist.pretrained.hf.families.llama`;
this module names no family's ``model_type``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import TypeAlias

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.scaled_rope import ApplyScaledRoPE
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import TANH_GELU
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import RopeScaling
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config import lm_head_source
from pz_persist.pretrained.hf.config import rope
from pz_persist.pretrained.hf.config import scaled_rope
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import attention as first_attention
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.config_from_model import projection
from pz_persist.pretrained.hf.plan import DECODER_HEAD
from pz_persist.pretrained.hf.plan import DECODER_LAYERS
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import check_layers
from pz_persist.pretrained.hf.weights import Weights

# transformers' defaults for a config.json without max_position_embeddings
# (read only by the rope types that need it).
_MAX_POSITIONS = {False: 2048, True: 4096 * 32}

Attention: TypeAlias = llamalike_common.AttentionType | Sequence[llamalike_common.AttentionType]
"""Penzai's ``attention_type``: one for every layer, or one per layer."""

BlockExtras: TypeAlias = Callable[[str, str, llamalike_common.LlamalikeTransformerConfig],
                                  list[TensorSpec]]
"""The specs of a block's parameters beyond Llama's, given the block's
Penzai prefix (``transformer/block_0/``), its Hugging Face prefix
(``model.layers.0.``) and Penzai's config."""

Edit: TypeAlias = Callable[[model_parts.TransformerLM, llamalike_common.LlamalikeTransformerConfig],
                           model_parts.TransformerLM]
"""A change to the skeleton (layers holding the `BlockExtras` parameters)."""


@dataclasses.dataclass(frozen=True)
class Biases:
  """Which projections of a llama-like block add a bias (``bias=True`` on
  the Hugging Face ``nn.Linear``).

  Each bias is a ``pz.nn.AddBias`` placed right after its projection's
  ``pz.nn.Linear``, named after it with ``_bias``: the bias of
  ``transformer/block_0/attention/query`` (parameter ``query.weights``) is
  ``transformer/block_0/attention/query_bias.bias``, with the projection's
  output axes (``heads``/``head_groups``/``query_heads``, ``projection``).

  Attributes:
    query_key_value: ``q_proj``, ``k_proj`` and ``v_proj`` (Llama's
      ``attention_bias``; always in Qwen2).
    output: ``o_proj`` (Llama's ``attention_bias``; never in Qwen2).
    mlp: ``gate_proj``, ``up_proj`` and ``down_proj`` (Llama's ``mlp_bias``).
  """

  query_key_value: bool = False
  output: bool = False
  mlp: bool = False


# Penzai's Linear names in a llama-like block -> Hugging Face module names.
_ATTENTION_PROJECTIONS = {"query": "q_proj", "key": "k_proj", "value": "v_proj"}
_MLP_PROJECTIONS = {"gating_linear": "gate_proj", "value_linear": "up_proj",
                    "out_linear": "down_proj"}
_BIAS_SUFFIX = "_bias.bias"


def _mlp_variant(cfg: Config) -> str:
  """Penzai's gated MLP for ``hidden_act``: SiLU gates SwiGLU; the tanh GELUs
  (`TANH_GELU`) gate GeGLU with Penzai's approximate GELU, the same formula."""
  act = cfg.expect("hidden_act", {"silu", *TANH_GELU}, "silu",
                   why="; Penzai's llama-like MLP is SwiGLU or tanh-approximate GeGLU")
  return "swiglu" if act == "silu" else "geglu_approx"


def _config_biases(cfg: Config, sliding: bool) -> Biases:
  """Llama's ``attention_bias`` / ``mlp_bias``; Mistral has neither (its
  transformers model ignores the fields, so a true value is refused)."""
  if sliding:
    bool_field(cfg, "attention_bias", False, False, "Mistral's attention has no biases")
    bool_field(cfg, "mlp_bias", False, False, "Mistral's MLP has no biases")
    return Biases()
  attention = cfg.get("attention_bias", False)
  return Biases(query_key_value=attention, output=attention, mlp=cfg.get("mlp_bias", False))


def _bias_specs(
    prefix: str,
    source: str,
    biases: Biases,
    config: llamalike_common.LlamalikeTransformerConfig,
) -> list[TensorSpec]:
  """The bias tensors of block ``prefix`` (Hugging Face names under
  ``source``), each shaped like its projection's output."""
  hidden, head_dim, mlp = config.embedding_dim, config.projection_dim, config.mlp_hidden_dim
  q_heads, kv_axes = head_axes(config)

  def bias(name: str, hf_name: str, axes: dict[str, int]) -> TensorSpec:
    return TensorSpec(prefix + name + _BIAS_SUFFIX, source + hf_name + ".bias",
                      tuple(axes.values()), tuple(axes), stored=(math.prod(axes.values()),))

  specs = []
  if biases.query_key_value:
    for name, hf_name in _ATTENTION_PROJECTIONS.items():
      heads = q_heads if name == "query" else kv_axes
      specs.append(bias(f"attention/{name}", f"self_attn.{hf_name}",
                        {**heads, "projection": head_dim}))
  if biases.output:
    specs.append(bias("attention/output", "self_attn.o_proj", {"embedding": hidden}))
  if biases.mlp:
    for name, hf_name in _MLP_PROJECTIONS.items():
      axes = {"embedding": hidden} if name == "out_linear" else {"neurons": mlp}
      specs.append(bias(f"mlp/{name}", f"mlp.{hf_name}", axes))
  return specs


def with_biases(
    model: model_parts.TransformerLM, specs: Sequence[TensorSpec]
) -> model_parts.TransformerLM:
  """The skeleton with a ``pz.nn.AddBias`` slot after each projection that
  ``specs`` gives a bias (`Biases` says how they are named).

  The ``Linear`` and its bias go in one ``Sequential`` which is then inlined
  into the enclosing one (query: ``Linear, AddBias, ApplyRoPE, ...``), so the
  model reads like Penzai's own; only where the projection is not in a
  sequence (the MLP's value branch) does the pair stay a ``Sequential``.
  """
  if not specs:
    return model
  axes_by_linear = {
      spec.label.removesuffix(_BIAS_SUFFIX): dict(zip(spec.axes, spec.shape)) for spec in specs
  }

  def add_bias(linear: pz.nn.Linear) -> pz.nn.Layer:
    name = linear.weights.label.removesuffix(".weights")
    axes = axes_by_linear.get(name)
    if axes is None:
      return linear
    return pz.nn.Sequential([
        linear, pz.nn.AddBias.from_config(name=f"{name}_bias", init_base_rng=None,
                                          biased_axes=axes),
    ])

  def is_bias_pair(layer: pz.nn.Layer) -> bool:
    return (pz.nn.is_anonymous_sequential(layer) and len(layer.sublayers) == 2
            and isinstance(layer.sublayers[1], pz.nn.AddBias))

  model = pz.select(model).at_instances_of(pz.nn.Linear).apply(add_bias)
  return pz.nn.inline_groups(model, parent_filter=pz.nn.is_sequential_or_named,
                             child_filter=is_bias_pair)


def llama_plan(
    cfg: Config,
    weights: Weights,
    sliding: bool = False,
    *,
    attention: Callable[[int], Attention] | None = None,
    biases: Biases | None = None,
    head_dim_default: int | None = None,
    max_positions_default: int | None = None,
    block_extras: BlockExtras | None = None,
    edit: Edit | None = None,
) -> Plan:
  """Maps a Llama (or, with ``sliding``, Mistral) checkpoint to Penzai.

  Families built on Llama's layout (Qwen2) pass their own ``attention``
  (per-layer attention types given the layer count, instead of the
  ``sliding`` rule; called only once the count is checked against the
  weights, since a forged config may ask for 10**9 layers) and ``biases``
  (instead of Llama's ``attention_bias`` / ``mlp_bias`` fields), their
  transformers defaults for an absent ``head_dim`` (Llama's is
  ``hidden_size // heads``) and ``max_position_embeddings``, and what they
  add to Llama's layout: ``block_extras`` gives the specs of a block's
  further parameters (query/key norms), ``edit`` puts their layers
  into the skeleton (called once the layer count is checked, on the skeleton
  with its biases and scaled RoPE).

  Scaled RoPE (``rope_scaling`` / ``rope_parameters`` of type ``linear``,
  ``dynamic``, ``llama3`` or ``yarn``, as in Llama 3.x) replaces Penzai's
  ``ApplyRoPE`` layers by `ApplyScaledRoPE` ones carrying the scaling.

  Penzai's llama-like transformer splits attention heads into
  ``head_groups`` (the key/value heads) and ``query_heads`` (query heads per
  group), dropping an axis of size one, so the fused ``q_proj`` /``k_proj``
  /``v_proj``/``o_proj`` matrices are reshaped accordingly; Hugging Face's
  grouped-query attention uses key/value head ``h // group_size`` for query
  head ``h``, which is exactly a (groups, per-group) row-major split.
  """
  hidden, heads, kv_heads, head_dim = attention_sizes(cfg, kv_heads_default=None,
                                                      head_dim_default=head_dim_default)
  theta, fraction, scaling = scaled_rope(cfg, 10_000.0,
                                         max_positions_default or _MAX_POSITIONS[sliding])
  _refuse_partial_rotary(cfg, fraction)
  mlp_variant = _mlp_variant(cfg)
  if biases is None:
    biases = _config_biases(cfg, sliding)
  tied = cfg.get("tie_word_embeddings", False)
  if attention is None:
    shared = _mistral_attention(cfg) if sliding else llamalike_common.AttentionTypeGlobalCausal()
    attention = lambda layers: shared  # noqa: E731
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=kv_heads,
      query_head_multiplier=heads // kv_heads,
      embedding_dim=hidden,
      projection_dim=head_dim,
      mlp_hidden_dim=cfg.require("intermediate_size"),
      num_decoder_blocks=cfg.require("num_hidden_layers"),
      vocab_size=cfg.require("vocab_size"),
      mlp_variant=mlp_variant,
      tie_embedder_and_logits=False,
      rope_wavelength=theta,
      rms_norm_eps=float(cfg.get("rms_norm_eps", FROM_TABLE)),
      attention_type=llamalike_common.AttentionTypeGlobalCausal(),  # Set below.
      parameter_dtype=None,
      activation_dtype=None,
  )
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  check_layers(cfg, weights.names, DECODER_LAYERS, config.num_decoder_blocks)
  head_source = lm_head_source(cfg, tied, weights, DECODER_HEAD,
                                "model.embed_tokens.weight")
  config = dataclasses.replace(config, parameter_dtype=weights.dtype,
                               activation_dtype=weights.dtype,
                               attention_type=attention(config.num_decoder_blocks))

  specs = outer_specs(config.vocab_size, hidden, head_source)
  for i in range(config.num_decoder_blocks):
    p, s = f"transformer/block_{i}/", f"model.layers.{i}."
    specs += [*norm_specs(p, s, hidden), *block_specs(p, s, config)]
    specs += _bias_specs(p, s, biases, config)
    if block_extras is not None:
      specs += block_extras(p, s, config)
  bias_specs = tuple(spec for spec in specs if spec.label.endswith(_BIAS_SUFFIX))

  def build() -> model_parts.TransformerLM:
    skeleton = with_biases(
        llamalike_common.build_llamalike_transformer(config, init_base_rng=None), bias_specs)
    skeleton = skeleton if scaling is None else with_scaled_rope(skeleton, scaling)
    return skeleton if edit is None else edit(skeleton, config)

  return Plan(build, tuple(specs))


def with_scaled_rope(model: model_parts.TransformerLM, scaling: RopeScaling) -> model_parts.TransformerLM:
  """``model`` with each of Penzai's ``ApplyRoPE`` layers replaced by an
  `ApplyScaledRoPE` of the same axis, wavelength and positions input."""

  def scaled(layer: pz.nn.ApplyRoPE) -> ApplyScaledRoPE:
    return ApplyScaledRoPE(
        embedding_axis=layer.embedding_axis,
        max_wavelength=layer.max_wavelength,
        positions_input_name=layer.positions_input_name,
        rope_type=scaling.rope_type,
        **scaling.fields,
    )

  return pz.select(model).at_instances_of(pz.nn.ApplyRoPE).apply(scaled)


def _mistral_attention(cfg: Config) -> llamalike_common.AttentionType:
  # transformers' MistralConfig defaults to a 4096-token window when the
  # field is absent; an explicit null means global attention.
  window = cfg.nullable("sliding_window", 4096)
  if window is None:
    return llamalike_common.AttentionTypeGlobalCausal()
  return llamalike_common.AttentionTypeSlidingWindowCausal(window)


def attention_sizes(
    cfg: Config, kv_heads_default: int | None, head_dim_default: int | None
) -> tuple[int, int, int, int]:
  """``(hidden_size, heads, key/value heads, head_dim)`` of a llama-like config.

  A default of None means the Llama one (as many key/value heads as heads;
  ``hidden_size // heads``); Gemma's transformers configs have fixed defaults.
  """
  hidden = cfg.require("hidden_size")
  heads = cfg.require("num_attention_heads")
  kv_heads = cfg.get("num_key_value_heads", kv_heads_default or heads)
  if heads % kv_heads:
    raise cfg.unsupported(
        "num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}"
    )
  head_dim = cfg.get("head_dim", head_dim_default or hidden // heads)
  return hidden, heads, kv_heads, head_dim


def full_rotary_wavelength(cfg: Config) -> float:
  """The RoPE base wavelength, refusing a partial rotary embedding."""
  theta, fraction = rope(cfg, 10_000.0)
  _refuse_partial_rotary(cfg, fraction)
  return theta


def _refuse_partial_rotary(cfg: Config, fraction: float) -> None:
  if fraction != 1.0:
    raise cfg.unsupported(
        "partial_rotary_factor", fraction, "Llama-style RoPE covers every dimension"
    )


def head_axes(config: llamalike_common.LlamalikeTransformerConfig) -> tuple[dict[str, int], dict[str, int]]:
  """The head axes of the query (and output) and of the key/value projections.

  Penzai's llama-like attention drops a head axis of size one: ``heads``
  without grouping, ``query_heads`` alone with one key/value head (MQA),
  ``head_groups`` x ``query_heads`` otherwise.
  """
  groups, per_group = config.num_kv_heads, config.query_head_multiplier
  if per_group == 1:
    return {"heads": groups}, {"heads": groups}
  if groups == 1:
    return {"query_heads": per_group}, {}
  return {"head_groups": groups, "query_heads": per_group}, {"head_groups": groups}


def block_specs(p: str, s: str, config: llamalike_common.LlamalikeTransformerConfig) -> list[TensorSpec]:
  """The MLP and attention matrices of block ``p`` (Penzai) from layer ``s``
  (Hugging Face), the same for every llama-like family."""
  hidden, head_dim, mlp = config.embedding_dim, config.projection_dim, config.mlp_hidden_dim
  q_heads, kv_axes = head_axes(config)

  def proj(label: str, source: str, heads: dict[str, int], output: bool = False) -> TensorSpec:
    """An attention matrix: (heads..., projection, embedding) or its transpose."""
    shape = (*heads.values(), head_dim)
    axes = (*heads, "projection")
    fused = math.prod(shape)
    if output:
      return TensorSpec(label, source, (hidden, *shape), ("embedding", *axes),
                         stored=(hidden, fused))
    return TensorSpec(label, source, (*shape, hidden), (*axes, "embedding"),
                       stored=(fused, hidden))

  return [
      TensorSpec(p + "mlp/gating_linear.weights", s + "mlp.gate_proj.weight",
                  (mlp, hidden), ("neurons", "embedding")),
      TensorSpec(p + "mlp/value_linear.weights", s + "mlp.up_proj.weight",
                  (mlp, hidden), ("neurons", "embedding")),
      TensorSpec(p + "mlp/out_linear.weights", s + "mlp.down_proj.weight",
                  (hidden, mlp), ("embedding", "neurons")),
      proj(p + "attention/query.weights", s + "self_attn.q_proj.weight", q_heads),
      proj(p + "attention/key.weights", s + "self_attn.k_proj.weight", kv_axes),
      proj(p + "attention/value.weights", s + "self_attn.v_proj.weight", kv_axes),
      proj(p + "attention/output.weights", s + "self_attn.o_proj.weight", q_heads, output=True),
  ]


def model_biases(model: pz.nn.Layer) -> Biases:
  """Which projections of the first block of a Penzai model add a bias
  (``AddBias`` layers, as `Biases` places them); export compares the other
  blocks with the plan built from these."""
  attention = first_attention(model)
  ffw = first_layer(model, model_parts.TransformerFeedForward, "MLP")
  return Biases(query_key_value=bool(all_layers(attention.input_to_query, pz.nn.AddBias)),
                output=bool(all_layers(attention.attn_value_to_output, pz.nn.AddBias)),
                mlp=bool(all_layers(ffw, pz.nn.AddBias)))


def without_default_head_dim(fields: dict[str, Any]) -> dict[str, Any]:
  """transformers' Qwen2 config has no ``head_dim`` field (its attention
  falls back to hidden_size // heads): written only when it is another size."""
  if fields["head_dim"] * fields["num_attention_heads"] == fields["hidden_size"]:
    del fields["head_dim"]
  return fields


def attention_size_fields(model: pz.nn.Layer) -> dict[str, Any]:
  """The sizes of a llama-like model whose MLPs may be mixtures of experts
  (so not read from its first MLP): embedding, vocabulary, heads, key/value
  heads, head width and layer count."""
  embed = named_shape(first_layer(model, pz.nn.EmbeddingTable, "token embeddings"))
  attn = attention(model)
  query, key = projection(attn.input_to_query), projection(attn.input_to_key)

  def heads(shape: dict[str, int]) -> int:
    return math.prod(n for axis, n in shape.items()
                     if axis in ("heads", "head_groups", "query_heads"))

  return {"hidden_size": embed["embedding"], "vocab_size": embed["vocabulary"],
          "num_attention_heads": heads(query), "num_key_value_heads": heads(key),
          "head_dim": query["projection"], "num_hidden_layers": len(blocks(model))}


def outer_specs(vocab: int, hidden: int, head_source: str) -> list[TensorSpec]:
  """A Llama-named decoder's embeddings, final norm and head (``head_source``:
  ``lm_head.weight``, or the embeddings when tied)."""
  return [
      TensorSpec("transformer/embedder.embeddings", "model.embed_tokens.weight",
                 (vocab, hidden), ("vocabulary", "embedding")),
      TensorSpec("transformer/final_norm/scale.weights", "model.norm.weight",
                 (hidden,), ("embedding",)),
      TensorSpec("transformer/lm_head.weights", head_source,
                 (vocab, hidden), ("vocabulary", "embedding")),
  ]


def norm_specs(p: str, s: str, hidden: int) -> list[TensorSpec]:
  """A Llama-named block's two norms: before its attention
  (``input_layernorm``) and before its MLP (``post_attention_layernorm``)."""
  return [
      TensorSpec(p + "pre_attention_norm/scale.weights", s + "input_layernorm.weight",
                 (hidden,), ("embedding",)),
      TensorSpec(p + "pre_ffw_norm/scale.weights", s + "post_attention_layernorm.weight",
                 (hidden,), ("embedding",)),
  ]
