"""Shared code (no record): the layers of LiquidAI's LFM2 (``lfm2``) and
LFM2-MoE (``lfm2_moe``), which differ only in their feed-forward blocks.

LFM2 mixes two kinds of layers, as ``layer_types`` (``"conv"`` /
``"full_attention"``) or, in older configs, ``full_attn_idxs`` (the
attention layers' indices) says:

- ``conv``: a short double-gated causal convolution
  (`pz_persist.nn.short_conv.ShortConv`) in place of attention. Hugging
  Face stores its three input projections fused (``conv.in_proj``: the
  input gate's rows, the output gate's, the value's), read by rows into three
  ``Linear`` layers and written back fused; the depthwise kernel
  ``conv.conv.weight`` is ``[channels, 1, conv_L_cache]``. With ``conv_bias``
  every one of its projections and its kernel adds a bias.
- ``full_attention``: grouped-query attention with an RMS norm over each
  head of the query and the key before RoPE (``q_layernorm`` /
  ``k_layernorm``, weights multiplying as stored), its output projection
  named ``out_proj``; no biases.

Each layer is pre-norm (``operator_norm`` before the mixer, ``ffn_norm``
before the MLP); the final norm is named ``embedding_norm`` but applied
after the last layer, as any final norm. The MLP is SwiGLU (``w1`` gate,
``w3`` up, ``w2`` down). LFM2's width is ``intermediate_size`` (or
``block_ff_dim``) adjusted when ``block_auto_adjust_ff_dim`` (the default):
two thirds of it, times ``block_ffn_dim_multiplier``, rounded up to a
multiple of ``block_multiple_of``, as transformers' ``Lfm2MLP`` computes;
LFM2-MoE's dense layers take ``intermediate_size`` as it is.

Sampling needs the convolution layers' state: use
`pz_persist.pretrained.kv_caching_lm` (``KVCachingTransformerLM.from_uncached``
converts only attention, and `ShortConv` refuses to run there).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.short_conv import CHANNELS
from pz_persist.nn.short_conv import TAPS
from pz_persist.nn.short_conv import ShortConv
from pz_persist.pretrained.hf.building.decoder import attention_size_fields
from pz_persist.pretrained.hf.building.decoder import attention_sizes
from pz_persist.pretrained.hf.building.decoder import block_specs
from pz_persist.pretrained.hf.building.norms import with_query_key_norms
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import lm_head_source
from pz_persist.pretrained.hf.config import rope
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
from pz_persist.pretrained.hf.weights import Weights

_TYPES = ("conv", "full_attention")
_ROOT = "model."
_FF_FIELDS = ("block_auto_adjust_ff_dim", "block_ffn_dim_multiplier", "block_multiple_of")


def _index_list(value: Any) -> bool:
  return isinstance(value, list) and all(NON_NEGATIVE_INT[0](v) for v in value)


FIELDS = {
    "norm_eps": POSITIVE_NUMBER,
    "conv_bias": BOOLEAN,
    "conv_L_cache": POSITIVE_INT,
    "block_multiple_of": POSITIVE_INT,
    "block_ffn_dim_multiplier": POSITIVE_NUMBER,
    "block_auto_adjust_ff_dim": BOOLEAN,
    "full_attn_idxs": (_index_list, "a list of non-negative layer indices"),
    "block_ff_dim": POSITIVE_INT,
    "tie_embedding": BOOLEAN,
    # The Hub's configs (LiquidAI's own code's names), which transformers
    # does not read: each must agree with the field transformers reads.
    "block_dim": POSITIVE_INT,
    "conv_dim": POSITIVE_INT,
    "conv_dim_out": POSITIVE_INT,
    "num_heads": POSITIVE_INT,
    "block_norm_eps": POSITIVE_NUMBER,
    "theta": POSITIVE_NUMBER,
    "use_pos_enc": BOOLEAN,
    "block_use_swiglu": BOOLEAN,
    "block_mlp_init_scale": POSITIVE_NUMBER,
    "block_out_init_scale": POSITIVE_NUMBER,
    "block_use_xavier_init": BOOLEAN,
    "conv_use_xavier_init": BOOLEAN,
}
"""The ``config.json`` fields LFM2 reads beyond the shared ones."""

IGNORED = {
    "initialisation only (LiquidAI's training code; transformers reads none)": (
        "block_mlp_init_scale", "block_out_init_scale", "block_use_xavier_init",
        "conv_use_xavier_init"),
}
FOREIGN = frozenset(IGNORED[next(iter(IGNORED))])


@dataclasses.dataclass(frozen=True)
class _Sizes:
  hidden: int
  heads: int
  kv_heads: int
  head_dim: int
  neurons: int
  taps: int
  bias: bool


def lfm2_plan(cfg: Config, weights: Weights, adjusted: bool = True) -> Plan:
  """Maps an LFM2 checkpoint (module docstring); LFM2-MoE's (its dense
  layers' width not ``adjusted``, and ``layer_types`` required) before its
  family swaps in the experts."""
  sizes = _sizes(cfg, adjusted)
  eps = float(cfg.get("norm_eps", 1e-5))
  theta, fraction = rope(cfg, 1e6)
  if fraction != 1.0:
    raise cfg.unsupported("partial_rotary_factor", fraction,
                          "LFM2's attention rotates every entry of each head")
  _agree(cfg, "theta", theta, "the RoPE base transformers reads (rope_parameters.rope_theta)")
  _agree(cfg, "block_norm_eps", eps, "transformers' norm_eps")
  layers = cfg.require("num_hidden_layers")
  # Read now (for check_all_used); the list is built once the layer count is
  # checked against the weights (10**9 layers must not build 10**9 entries).
  cfg.get("layer_types"), cfg.get("full_attn_idxs")
  tied = cfg.get("tie_embedding")
  tied = cfg.get("tie_word_embeddings", True) if tied is None else tied
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=sizes.kv_heads, query_head_multiplier=sizes.heads // sizes.kv_heads,
      embedding_dim=sizes.hidden, projection_dim=sizes.head_dim, mlp_hidden_dim=sizes.neurons,
      num_decoder_blocks=layers, vocab_size=cfg.require("vocab_size"), mlp_variant="swiglu",
      tie_embedder_and_logits=False, rope_wavelength=theta, rms_norm_eps=eps,
      parameter_dtype=None, activation_dtype=None)
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  check_layers(cfg, weights.names, _ROOT + "layers.", layers)
  types = _layer_types(cfg, layers, derived=adjusted)
  head = lm_head_source(cfg, tied, weights, DECODER_HEAD, _ROOT + "embed_tokens.weight")
  config = dataclasses.replace(config, parameter_dtype=weights.dtype,
                               activation_dtype=weights.dtype)
  hidden, vocab = sizes.hidden, config.vocab_size
  specs = [
      TensorSpec("transformer/embedder.embeddings", _ROOT + "embed_tokens.weight",
                 (vocab, hidden), ("vocabulary", "embedding")),
      TensorSpec("transformer/final_norm/scale.weights", _ROOT + "embedding_norm.weight",
                 (hidden,), ("embedding",)),
      TensorSpec("transformer/lm_head.weights", head, (vocab, hidden), ("vocabulary", "embedding")),
  ]
  renamed = {"mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
             "mlp.down_proj": "feed_forward.w2", "self_attn.o_proj": "self_attn.out_proj"}
  for i, kind in enumerate(types):
    p, s = f"transformer/block_{i}/", f"{_ROOT}layers.{i}."
    specs += [
        TensorSpec(p + "pre_attention_norm/scale.weights", s + "operator_norm.weight",
                   (hidden,), ("embedding",)),
        TensorSpec(p + "pre_ffw_norm/scale.weights", s + "ffn_norm.weight",
                   (hidden,), ("embedding",)),
    ]
    for spec in block_specs(p, s, config):
      if kind == "conv" and "/attention/" in spec.label:
        continue
      source = spec.source
      for ours, theirs in renamed.items():
        source = source.replace(f".{ours}.", f".{theirs}.")
      specs.append(dataclasses.replace(spec, source=source))
    if kind == "full_attention":
      specs += [TensorSpec(f"{p}attention/{name}_norm/scale.weights",
                           f"{s}self_attn.{hf}_layernorm.weight", (sizes.head_dim,),
                           ("projection",)) for name, hf in (("query", "q"), ("key", "k"))]
    else:
      specs += _short_conv_specs(p + "short_conv", s + "conv.", sizes)

  def build() -> model_parts.TransformerLM:
    model = llamalike_common.build_llamalike_transformer(config, init_base_rng=None)
    model = with_query_key_norms(model, config)
    selected = pz.select(model).at_instances_of(model_parts.TransformerBlock)
    return selected.set_sequence([
        block if kind == "full_attention" else pz.select(block).at_instances_of(
            pz.nn.Attention).apply(lambda _, i=i: ShortConv.from_config(
                f"transformer/block_{i}/short_conv", embedding=sizes.hidden,
                conv_taps=sizes.taps, bias=sizes.bias))
        for i, (block, kind) in enumerate(zip(selected.get_sequence(), types))])

  return Plan(build, tuple(specs))


def _sizes(cfg: Config, adjusted: bool) -> _Sizes:
  hidden, heads, kv_heads, head_dim = attention_sizes(cfg, None, None)
  for key in ("block_dim", "conv_dim", "conv_dim_out"):
    _agree(cfg, key, hidden, "transformers' LFM2 makes every block and convolution"
           " hidden_size wide")
  _agree(cfg, "num_heads", heads, "transformers reads num_attention_heads")
  for key in ("use_pos_enc", "block_use_swiglu"):
    _agree(cfg, key, True, "transformers' LFM2 always applies RoPE and a SwiGLU MLP")
  if not adjusted:
    return _Sizes(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                  neurons=cfg.require("intermediate_size"), taps=cfg.get("conv_L_cache", 3),
                  bias=cfg.get("conv_bias", False))
  block_ff_dim = cfg.get("block_ff_dim")
  cfg.get("intermediate_size")  # Read either way: block_ff_dim takes its place when given.
  neurons = block_ff_dim if block_ff_dim is not None else cfg.require("intermediate_size")
  if cfg.get("block_auto_adjust_ff_dim", True):
    neurons = adjusted_ff_dim(neurons, cfg.nullable("block_ffn_dim_multiplier", 1.0),
                              cfg.get("block_multiple_of", 256))
  else:
    cfg.get("block_ffn_dim_multiplier")
    cfg.get("block_multiple_of")
  if neurons < 1:
    raise cfg.unsupported("intermediate_size", cfg.raw.get("intermediate_size"),
                          "block_auto_adjust_ff_dim leaves the MLP without neurons")
  return _Sizes(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                neurons=neurons, taps=cfg.get("conv_L_cache", 3),
                bias=cfg.get("conv_bias", False))


def adjusted_ff_dim(size: int, multiplier: float | None, multiple_of: int) -> int:
  """The MLP width ``Lfm2MLP`` builds from ``intermediate_size`` when
  ``block_auto_adjust_ff_dim``: two thirds, then (unless the multiplier is
  null) times the multiplier, rounded up to a multiple of ``multiple_of``."""
  size = int(2 * size / 3)
  if multiplier is not None:
    size = int(multiplier * size)
    size = multiple_of * ((size + multiple_of - 1) // multiple_of)
  return size


def _agree(cfg: Config, key: str, expected: Any, why: str) -> None:
  """Refuses ``key`` (a Hub field transformers ignores) when present and not
  ``expected``: the file then means a model transformers does not compute."""
  value = cfg.get(key)
  if value is not None and value != expected:
    raise cfg.unsupported(key, value, f"it must equal {expected!r}: {why}")


def _layer_types(cfg: Config, layers: int, derived: bool) -> list[str]:
  """Each layer's type: ``layer_types``, else (if ``derived``: LFM2's
  config derives it; LFM2-MoE's requires it) from ``full_attn_idxs`` (every
  layer attention when neither is given, as transformers)."""
  types = cfg.get("layer_types") if derived else cfg.require("layer_types")
  indices = cfg.get("full_attn_idxs")
  if indices is not None and (len(set(indices)) != len(indices)
                              or any(i >= layers for i in indices)):
    raise cfg.unsupported("full_attn_idxs", indices, f"distinct indices of the"
                          f" num_hidden_layers={layers} layers")
  if types is None:
    chosen = set(range(layers) if indices is None else indices)
    return ["full_attention" if i in chosen else "conv" for i in range(layers)]
  if len(types) != layers or not set(types) <= set(_TYPES):
    shown = types if len(types) <= 8 else [*types[:8], "..."]
    raise cfg.unsupported("layer_types", shown, f"one of {list(_TYPES)} for each of the"
                          f" num_hidden_layers={layers} layers")
  if indices is not None and sorted(indices) != [
      i for i, kind in enumerate(types) if kind == "full_attention"]:
    raise cfg.unsupported("full_attn_idxs", indices, "layer_types, which transformers reads"
                          " instead, puts attention elsewhere")
  return list(types)


def _short_conv_specs(name: str, s: str, sizes: _Sizes) -> list[TensorSpec]:
  """The short convolution's parameters, the fused input projection read by
  rows (input gate, output gate, value)."""
  hidden = sizes.hidden
  fused = (3 * hidden, hidden)
  specs = [TensorSpec(f"{name}/{part}.weights", s + "in_proj.weight", (hidden, hidden),
                      (CHANNELS, "embedding"), stored=fused, rows=(k * hidden, (k + 1) * hidden))
           for k, part in enumerate(("input_gate", "output_gate", "value"))]
  specs += [
      TensorSpec(f"{name}/kernel", s + "conv.weight", (hidden, sizes.taps), (CHANNELS, TAPS),
                 stored=(hidden, 1, sizes.taps)),
      TensorSpec(f"{name}/output.weights", s + "out_proj.weight", (hidden, hidden),
                 ("embedding", CHANNELS)),
  ]
  if sizes.bias:
    specs += [TensorSpec(f"{name}/{part}.bias", s + "in_proj.bias", (hidden,), (CHANNELS,),
                         stored=(3 * hidden,), rows=(k * hidden, (k + 1) * hidden))
              for k, part in enumerate(("input_gate", "output_gate", "value"))]
    specs += [TensorSpec(f"{name}/kernel_bias", s + "conv.bias", (hidden,), (CHANNELS,)),
              TensorSpec(f"{name}/output.bias", s + "out_proj.bias", (hidden,), ("embedding",))]
  return specs


def has_short_conv(model: pz.nn.Layer) -> bool:
  """Whether ``model`` has short convolution layers (LFM2's structure)."""
  return bool(all_layers(model, ShortConv))


def lfm2_fields(model: pz.nn.Layer, like: Mapping[str, Any], adjusted: bool = True
                ) -> dict[str, Any]:
  """The ``config.json`` fields of an LFM2 model (its MLP's width written as
  ``like`` spells it when ``like``'s adjustment gives that width), or, not
  ``adjusted``, of LFM2-MoE's layers (no MLP width: its family's)."""
  convs = all_layers(model, ShortConv)
  types = ["conv" if all_layers(block, ShortConv) else "full_attention"
           for block in blocks(model)]
  if "full_attention" in types:
    fields = attention_size_fields(model)
  else:  # No attention layer: its head sizes are the skeleton's (Penzai's metadata).
    embed = named_shape(first_layer(model, pz.nn.EmbeddingTable, "token embeddings"))
    meta = model.metadata
    kv_heads = math.prod(dict(meta.common_head_axes).values())
    fields = {"hidden_size": embed["embedding"], "vocab_size": embed["vocabulary"],
              "num_hidden_layers": len(types),
              "num_attention_heads": kv_heads * math.prod(dict(meta.query_only_head_axes).values()),
              "num_key_value_heads": kv_heads, "head_dim": meta.projection_dim}
  if fields.get("head_dim") == fields["hidden_size"] // fields["num_attention_heads"]:
    fields.pop("head_dim", None)  # transformers' class has none (hidden_size // heads).
  rope = (all_layers(model, pz.nn.ApplyRoPE) or [None])[0]
  theta = float(rope.max_wavelength) if rope is not None else float(
      (like.get("rope_parameters") or {}).get("rope_theta", 1e6))
  fields["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
  fields["layer_types"] = types
  if like.get("full_attn_idxs") is not None:  # transformers keeps it only as given.
    fields["full_attn_idxs"] = [i for i, kind in enumerate(types) if kind == "full_attention"]
  fields["norm_eps"] = number(first_layer(model, pz.nn.RMSStandardize, "RMS norm").epsilon)
  if convs:
    fields["conv_L_cache"] = convs[0].conv_taps
    fields["conv_bias"] = convs[0].kernel_bias is not None
  else:
    fields.update(conv_L_cache=like.get("conv_L_cache", 3),
                  conv_bias=like.get("conv_bias", False))
  fields.update(tied_field(model, like))
  if not adjusted:
    return fields
  mlp = first_layer(model, model_parts.TransformerFeedForward, "MLP")
  fields.update(_ff_fields(named_shape(first_layer(mlp, pz.nn.Linear, "MLP"))["neurons"], like))
  return fields


def _ff_fields(neurons: int, like: Mapping[str, Any]) -> dict[str, Any]:
  """``intermediate_size`` and the adjustment fields giving ``neurons``:
  ``like``'s when they do, else the width itself, unadjusted."""
  size = like.get("block_ff_dim", like.get("intermediate_size"))
  auto = like.get("block_auto_adjust_ff_dim", True)
  multiplier = like.get("block_ffn_dim_multiplier", 1.0)
  multiple_of = like.get("block_multiple_of", 256)
  if isinstance(size, int) and size > 0 and (
      (not auto and size == neurons) or (auto and isinstance(multiple_of, int) and multiple_of > 0
                                         and adjusted_ff_dim(size, multiplier, multiple_of)
                                         == neurons)):
    return {"intermediate_size": size, "block_auto_adjust_ff_dim": auto,
            "block_ffn_dim_multiplier": multiplier, "block_multiple_of": multiple_of}
  return {"intermediate_size": neurons, "block_auto_adjust_ff_dim": False,
          "block_ffn_dim_multiplier": multiplier if like else 1.0,
          "block_multiple_of": multiple_of if like else 256}
