"""The LayerNorm decoders of 2023-24 (Phi-1/1.5/2, StableLM 2, StarCoder2):
Llama's grouped-query attention and ``model.layers.{i}.`` names, with
LayerNorms that have a shift, optional biases on any projection (and on the
head), partial rotary, optional query/key LayerNorms (one shared by the
heads, or one per head), a plain or gated MLP, sequential or parallel
blocks and an optional sliding window.

`layernorm_plan` maps a `Layout` (what the family read from its
``config.json``) and its `Names` (its Hugging Face module names) to a
`Plan`; `layout_of` reads the same facts back from a Penzai model for
``export_hf``. The skeleton is Penzai's llama-like transformer with its
blocks rebuilt around the same attention, so sampling, the KV cache and
sliding windows behave as they do for Llama and Mistral.

Families reading this layout: `pz_persist.pretrained.hf.families.phi`,
`~.stablelm`, `~.starcoder2`; this module names no ``model_type``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any
from typing import Literal

import jax
from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.learned_positions import AddLearnedPositions
from pz_persist.pretrained.errors import ExportError
from pz_persist.pretrained.hf.building.decoder import attention_sizes
from pz_persist.pretrained.hf.building.decoder import block_specs
from pz_persist.pretrained.hf.building.decoder import head_axes
from pz_persist.pretrained.hf.building.decoder import with_biases
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import lm_head_source
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.config_from_model import size_fields
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import DECODER_HEAD
from pz_persist.pretrained.hf.plan import DECODER_LAYERS
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import check_layers
from pz_persist.pretrained.hf.weights import Weights
from pz_persist.pretrained.hf.weights import stacked

QueryKeyNorm = Literal["shared", "per_head"] | None
"""The LayerNorm of each query and key head before RoPE: one over
``head_dim`` shared by every head, with a shift (Phi's ``qk_layernorm``);
one per head, without a shift (StableLM's); or none."""

PLAIN_ACTIVATIONS = {
    "gelu": "gelu_exact",
    "gelu_new": "gelu_approx",  # The tanh formula (config.TANH_GELU).
    "gelu_fast": "gelu_approx",
    "gelu_pytorch_tanh": "gelu_approx",
    "relu": "relu",
    "silu": "silu",
}
"""``hidden_act`` of a plain (not gated) MLP -> Penzai's activation."""

_FUNCTIONS = {
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_approx": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


@dataclasses.dataclass(frozen=True)
class Names:
  """A family's Hugging Face names where they differ between families.

  Attributes:
    final_norm: The final LayerNorm (``model.final_layernorm``, ``model.norm``).
    output: The attention's output projection (``dense``, ``o_proj``).
    mlp: The plain MLP's two projections (``("fc1", "fc2")``); None for
      Llama's gated ``gate_proj`` / ``up_proj`` / ``down_proj``.
  """

  final_norm: str
  output: str
  mlp: tuple[str, str] | None


@dataclasses.dataclass(frozen=True)
class Layout:
  """What a checkpoint's ``config.json`` says about its layers.

  Attributes:
    hidden, heads, kv_heads, head_dim, layers, vocab, mlp_width: sizes.
    activation: Penzai's name of the MLP activation (``gelu_approx``...);
      for a gated MLP, Penzai's llama-like ``mlp_variant`` (``swiglu``...).
    gated: Llama's gated MLP instead of a plain one.
    rotary_dims: How many leading dimensions of each head RoPE rotates.
    theta: RoPE's base wavelength.
    eps: Every LayerNorm's epsilon.
    qkv_bias, output_bias, mlp_bias, head_bias: Which projections add a bias.
    query_key_norm: See `QueryKeyNorm`.
    parallel: One LayerNorm feeding attention and MLP, both added to the
      residual (``x + attn(ln(x)) + mlp(ln(x))``); else two sequential
      residual branches with a LayerNorm each.
    window: The sliding window (None: global attention).
    tied: ``tie_word_embeddings``.
  """

  hidden: int
  heads: int
  kv_heads: int
  head_dim: int
  layers: int
  vocab: int
  mlp_width: int
  activation: str
  gated: bool
  rotary_dims: int
  theta: float
  eps: float
  qkv_bias: bool
  output_bias: bool
  mlp_bias: bool
  head_bias: bool
  query_key_norm: QueryKeyNorm
  parallel: bool
  window: int | None
  tied: bool


def even_head_sizes(cfg: Config, family: str) -> tuple[int, int, int, int]:
  """``(hidden_size, heads, key/value heads, head_dim)`` of a family whose
  transformers model splits ``hidden_size`` evenly into heads (Phi,
  StableLM): a ``head_dim`` field that says otherwise, which their
  transformers models do not honour throughout, is refused."""
  hidden, heads, kv_heads, head_dim = attention_sizes(cfg, kv_heads_default=None,
                                                      head_dim_default=None)
  if head_dim * heads != hidden:
    raise cfg.unsupported("head_dim" if "head_dim" in cfg.raw else "num_attention_heads",
                          cfg.raw.get("head_dim", heads),
                          f"{family}'s heads split hidden_size={hidden} evenly")
  return hidden, heads, kv_heads, head_dim


def rotary_dims(cfg: Config, head_dim: int, fraction: float) -> int:
  """transformers' ``int(head_dim * partial_rotary_factor)``, refused when
  it leaves no pair to rotate or an odd dimension (whose half-rotation
  transformers cannot compute either)."""
  dims = int(head_dim * fraction)
  if dims < 2 or dims % 2:
    raise cfg.unsupported("partial_rotary_factor", fraction,
                          f"it rotates {dims} of {head_dim} dimensions; an even number of at"
                          " least 2 is needed")
  return dims


def layernorm_plan(cfg: Config, weights: Weights, layout: Layout, names: Names) -> Plan:
  """The plan of a checkpoint of ``layout``; ``cfg`` is fully read (its
  `Config.check_all_used` passed), so what is left is checked against the
  weights before anything is built."""
  check_layers(cfg, weights.names, DECODER_LAYERS, layout.layers)
  head_source = lm_head_source(cfg, layout.tied, weights, DECODER_HEAD,
                               "model.embed_tokens.weight")
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=layout.kv_heads,
      query_head_multiplier=layout.heads // layout.kv_heads,
      embedding_dim=layout.hidden,
      projection_dim=layout.head_dim,
      mlp_hidden_dim=layout.mlp_width,
      num_decoder_blocks=layout.layers,
      vocab_size=layout.vocab,
      mlp_variant=layout.activation if layout.gated else "swiglu",  # Plain MLPs: replaced.
      tie_embedder_and_logits=False,
      rope_wavelength=layout.theta,
      rms_norm_eps=layout.eps,  # Every RMS norm is replaced by a LayerNorm.
      attention_type=(llamalike_common.AttentionTypeGlobalCausal() if layout.window is None
                      else llamalike_common.AttentionTypeSlidingWindowCausal(layout.window)),
      parameter_dtype=weights.dtype,
      activation_dtype=weights.dtype,
  )
  specs, views = _specs(layout, names, config, head_source)
  bias_specs = tuple(spec for spec in specs if spec.label.endswith("_bias.bias"))

  def build() -> model_parts.TransformerLM:
    return with_biases(_build(layout, config), bias_specs)

  return Plan(build, tuple(specs), tuple(views))


def _specs(layout: Layout, names: Names, config: llamalike_common.LlamalikeTransformerConfig,
           head_source: str) -> tuple[list[TensorSpec], list[Any]]:
  hidden, head_dim, mlp, vocab = layout.hidden, layout.head_dim, layout.mlp_width, layout.vocab
  q_heads, kv_axes = head_axes(config)

  def norm(label: str, source: str, size: int, axis: str = "embedding",
           shift: bool = True) -> list[TensorSpec]:
    out = [TensorSpec(f"{label}/scale.weights", f"{source}.weight", (size,), (axis,))]
    if shift:
      out.append(TensorSpec(f"{label}/shift.bias", f"{source}.bias", (size,), (axis,)))
    return out

  def bias(label: str, source: str, axes: dict[str, int]) -> TensorSpec:
    return TensorSpec(f"{label}_bias.bias", f"{source}.bias", tuple(axes.values()), tuple(axes),
                      stored=(math.prod(axes.values()),))

  specs = [
      TensorSpec("transformer/embedder.embeddings", "model.embed_tokens.weight",
                 (vocab, hidden), ("vocabulary", "embedding")),
      *norm("transformer/final_norm", names.final_norm, hidden),
      TensorSpec("transformer/lm_head.weights", head_source, (vocab, hidden),
                 ("vocabulary", "embedding")),
  ]
  if layout.head_bias:
    specs.append(TensorSpec("transformer/lm_head_bias.bias", "lm_head.bias", (vocab,),
                            ("vocabulary",)))
  views = []
  for i in range(layout.layers):
    p, s = f"transformer/block_{i}/", f"{DECODER_LAYERS}{i}."
    a = s + "self_attn."
    specs += norm(p + "pre_attention_norm", s + "input_layernorm", hidden)
    if not layout.parallel:
      specs += norm(p + "pre_ffw_norm", s + "post_attention_layernorm", hidden)
    # Llama's matrices (its gated MLP's only where the family has it), the
    # output projection under the family's name.
    for spec in block_specs(p, s, config):
      if spec.label.startswith(p + "mlp/") and names.mlp is not None:
        continue
      if spec.label.endswith("attention/output.weights"):
        spec = dataclasses.replace(spec, source=f"{a}{names.output}.weight")
      specs.append(spec)
    if layout.qkv_bias:
      for name, hf, heads in (("query", "q_proj", q_heads), ("key", "k_proj", kv_axes),
                              ("value", "v_proj", kv_axes)):
        specs.append(bias(f"{p}attention/{name}", a + hf, {**heads, "projection": head_dim}))
    if layout.output_bias:
      specs.append(bias(f"{p}attention/output", a + names.output, {"embedding": hidden}))
    if layout.query_key_norm == "shared":
      for name, hf in (("query", "q_layernorm"), ("key", "k_layernorm")):
        specs += norm(f"{p}attention/{name}_norm", a + hf, head_dim, "projection")
    elif layout.query_key_norm == "per_head":
      for name, hf, heads, count in (("query", "q_layernorm", q_heads, layout.heads),
                                     ("key", "k_layernorm", kv_axes, layout.kv_heads)):
        whole = f"{a}{hf}.weight"  # Not a stored name: the stack of the heads' norms.
        views.append(stacked(whole, [f"{a}{hf}.norms.{h}.weight" for h in range(count)]))
        specs.append(TensorSpec(f"{p}attention/{name}_norm/scale.weights", whole,
                                (*heads.values(), head_dim), (*heads, "projection"),
                                stored=(count, head_dim)))
    if names.mlp is not None:
      fc_in, fc_out = names.mlp
      specs += [
          TensorSpec(p + "mlp/in.weights", f"{s}mlp.{fc_in}.weight", (mlp, hidden),
                     ("neurons", "embedding")),
          TensorSpec(p + "mlp/out.weights", f"{s}mlp.{fc_out}.weight", (hidden, mlp),
                     ("embedding", "neurons")),
      ]
      if layout.mlp_bias:
        specs += [bias(p + "mlp/in", f"{s}mlp.{fc_in}", {"neurons": mlp}),
                  bias(p + "mlp/out", f"{s}mlp.{fc_out}", {"embedding": hidden})]
  return specs, views


def _layer_norm(name: str, size: dict[str, int], layout: Layout,
                config: llamalike_common.LlamalikeTransformerConfig,
                scale_axes: dict[str, int] | None = None) -> pz.nn.LayerNorm:
  """A LayerNorm over ``size``'s axes; with ``scale_axes``, one scale per
  entry of those axes and no shift (StableLM's per-head norms)."""
  if scale_axes is None:
    return pz.nn.LayerNorm.from_config(name=name, init_base_rng=None, across_axes=size,
                                       epsilon=layout.eps, dtype=config.parameter_dtype)
  return pz.nn.LayerNorm([
      pz.nn.Standardize(across=tuple(size), epsilon=layout.eps),
      pz.nn.Linear.from_config(name=f"{name}/scale", init_base_rng=None, input_axes={},
                               output_axes={}, parallel_axes=scale_axes,
                               dtype=config.parameter_dtype),
  ])


def _attention(attn: pz.nn.Attention, prefix: str, layout: Layout,
               config: llamalike_common.LlamalikeTransformerConfig) -> pz.nn.Attention:
  """Penzai's llama-like attention with partial rotary and the query/key
  LayerNorms (after the projection, before RoPE); biases come later
  (`with_biases`), right after each projection."""
  if layout.rotary_dims < layout.head_dim:
    attn = pz.select(attn).at_instances_of(pz.nn.ApplyRoPE).apply(
        lambda rope: pz.nn.ApplyRoPEToSubset(
            embedding_axis=rope.embedding_axis, max_wavelength=rope.max_wavelength,
            rope_subset_size=layout.rotary_dims, positions_input_name=rope.positions_input_name))
  if layout.query_key_norm is None:
    return attn
  q_heads, kv_axes = head_axes(config)
  per_head = layout.query_key_norm == "per_head"

  def normed(part: pz.nn.Sequential, name: str, heads: dict[str, int]) -> pz.nn.Sequential:
    first, *rest = part.sublayers
    norm = _layer_norm(f"{prefix}attention/{name}_norm", {"projection": layout.head_dim},
                       layout, config,
                       {**heads, "projection": layout.head_dim} if per_head else None)
    return dataclasses.replace(part, sublayers=[first, norm, *rest])

  return dataclasses.replace(attn, input_to_query=normed(attn.input_to_query, "query", q_heads),
                             input_to_key=normed(attn.input_to_key, "key", kv_axes))


def _plain_mlp(prefix: str, layout: Layout,
               config: llamalike_common.LlamalikeTransformerConfig
               ) -> model_parts.TransformerFeedForward:
  def linear(name: str, inputs: dict[str, int], outputs: dict[str, int]) -> pz.nn.Linear:
    return pz.nn.Linear.from_config(name=f"{prefix}mlp/{name}", init_base_rng=None,
                                    input_axes=inputs, output_axes=outputs,
                                    dtype=config.parameter_dtype)

  hidden, neurons = {"embedding": layout.hidden}, {"neurons": layout.mlp_width}
  return model_parts.TransformerFeedForward([
      linear("in", hidden, neurons), pz.nn.Elementwise(_FUNCTIONS[layout.activation]),
      linear("out", neurons, hidden)])


def _build(layout: Layout, config: llamalike_common.LlamalikeTransformerConfig
           ) -> model_parts.TransformerLM:
  """Penzai's llama-like skeleton with each block rebuilt: LayerNorms, the
  edited attention, the family's MLP, sequential or parallel."""
  llama = llamalike_common.build_llamalike_transformer(config, init_base_rng=None)
  hidden = {"embedding": layout.hidden}
  body = []
  index = 0
  for layer in llama.body.sublayers:
    if isinstance(layer, model_parts.TransformerBlock):
      prefix = f"transformer/block_{index}/"
      index += 1
      attn = _attention(pz.select(layer).at_instances_of(pz.nn.Attention).get(), prefix,
                        layout, config)
      mlp = (pz.select(layer).at_instances_of(model_parts.TransformerFeedForward).get()
             if layout.gated else _plain_mlp(prefix, layout, config))
      pre_attention = _layer_norm(prefix + "pre_attention_norm", hidden, layout, config)
      if layout.parallel:
        layer = model_parts.TransformerBlock(sublayers=[pz.nn.Residual(pz.nn.Sequential([
            pre_attention, pz.nn.BranchAndAddTogether([attn, mlp])]))])
      else:
        pre_ffw = _layer_norm(prefix + "pre_ffw_norm", hidden, layout, config)
        layer = model_parts.TransformerBlock(sublayers=[
            pz.nn.Residual(pz.nn.Sequential([pre_attention, attn])),
            pz.nn.Residual(pz.nn.Sequential([pre_ffw, mlp]))])
    elif isinstance(layer, pz.nn.RMSLayerNorm):
      layer = _layer_norm("transformer/final_norm", hidden, layout, config)
    body.append(layer)
  return dataclasses.replace(llama, body=pz.nn.Sequential(body))


# --- reading a model back (export_hf) -----------------------------------------


def is_layernorm_decoder(model: pz.nn.Layer) -> bool:
  """Whether ``model`` has this module's structure: LayerNorms (with a
  shift) around llama-like attention (``attention/query.weights``, where
  GPT-NeoX's is ``attention/query/Linear.weights``) and no learned positions."""
  if (not all_layers(model, pz.nn.Standardize) or all_layers(model, pz.nn.RMSStandardize)
      or all_layers(model, AddLearnedPositions)):
    return False
  attns = all_layers(model, pz.nn.Attention)
  if not attns:
    return False
  query = all_layers(attns[0].input_to_query, pz.nn.Linear)
  return bool(query) and query[0].weights.label.endswith("/attention/query.weights")


def blocks_of(model: pz.nn.Layer) -> tuple[bool, bool] | None:
  """``(parallel, gated)`` of a model with this module's structure (what
  tells its families apart: Phi's are parallel and plain, StarCoder2's
  sequential and plain, StableLM's gated); None for any other model."""
  if not is_layernorm_decoder(model):
    return None
  return is_parallel(model), is_gated(model)


def is_parallel(model: pz.nn.Layer) -> bool:
  """Whether the first block adds attention and MLP to one residual."""
  return len(blocks(model)[0].sublayers) == 1


def is_gated(model: pz.nn.Layer) -> bool:
  return any(layer.weights.label.endswith("/mlp/gating_linear.weights")
             for layer in all_layers(model, pz.nn.Linear))


def _biased(part: pz.nn.Layer) -> bool:
  return bool(all_layers(part, pz.nn.AddBias))


SIZES = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
         "intermediate_size", "num_hidden_layers", "rope_parameters")
"""The fields of `layout_fields` every family writes under the same name."""


def layout_fields(model: pz.nn.Layer) -> dict[str, Any]:
  """What every family of this layout writes alike: sizes, the epsilon,
  ``rope_parameters`` (with ``partial_rotary_factor`` always: the families'
  defaults differ) and ``tie_word_embeddings``'s inputs; plus the facts the
  family spells its own way (``qkv_bias``, ``output_bias``, ``mlp_bias``,
  ``head_bias``, ``query_key_norm``, ``parallel``, ``window``), under
  those names, for its `Family.write_config` to rename."""
  attn = attention(model)
  sizes = size_fields(model)
  norms = all_layers(attn.input_to_query, pz.nn.LayerNorm)
  query_key_norm: QueryKeyNorm = None
  if norms:
    query_key_norm = "shared" if all_layers(norms[0], pz.nn.AddBias) else "per_head"
  subset = all_layers(model, pz.nn.ApplyRoPEToSubset)
  full = all_layers(model, pz.nn.ApplyRoPE)
  if not subset and not full:
    raise ExportError("the model has no rotary position embedding layer (ApplyRoPE).")
  rope = (subset or full)[0]
  fraction = rope.rope_subset_size / sizes["head_dim"] if subset else 1.0
  found = set(windows(model))
  if len(found) != 1:
    raise ExportError(f"the blocks' attention windows differ ({sorted(map(str, found))});"
                      " these families have one window for every layer.")
  ffw = first_layer(model, model_parts.TransformerFeedForward, "MLP")
  head = all_layers(model, pz.nn.Linear)[-1]
  return {
      **sizes,
      "eps": number(first_layer(model, pz.nn.Standardize, "layer norm").epsilon),
      "rope_parameters": {"rope_type": "default", "rope_theta": float(rope.max_wavelength),
                          "partial_rotary_factor": fraction},
      "qkv_bias": _biased(attn.input_to_query),
      "output_bias": _biased(attn.attn_value_to_output),
      "mlp_bias": _biased(ffw),
      "head_bias": head.weights.label == "transformer/lm_head.weights" and any(
          b.bias.label == "transformer/lm_head_bias.bias" for b in all_layers(model, pz.nn.AddBias)),
      "query_key_norm": query_key_norm,
      "parallel": is_parallel(model),
      "window": found.pop(),
  }
