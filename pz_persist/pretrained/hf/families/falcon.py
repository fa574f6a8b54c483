"""Falcon checkpoints (``model_type`` ``falcon``, transformers' ``FalconForCausalLM``).

Falcon 7B / 40B / 180B and Falcon 2 11B: LayerNorm with a bias, full rotary
embeddings on every head dimension (rotated by halves, as Llama's), biases
on every projection or none (``bias``), a GELU MLP of ``ffn_hidden_size``
neurons, and one fused ``query_key_value`` projection. Three block layouts:

- sequential (``parallel_attn: false``): ``x + attn(ln(x))``, then
  ``+ mlp(ln'(...))``;
- parallel on one LayerNorm (Falcon 7B; Falcon 2 with
  ``num_ln_in_parallel_attn: 1``): ``x + attn(ln(x)) + mlp(ln(x))``;
- parallel on two (``new_decoder_architecture`` with two norms, Falcon
  40B / 180B): ``x + attn(ln_attn(x)) + mlp(ln_mlp(x))``.

The fused projection's rows are ``(group, per-group query heads + 2,
head_dim)`` in every layout: a group's query heads, then its key, then its
value. The new decoder architecture has ``num_kv_heads`` groups; the older
one a single group (``multi_query``: one key/value head shared by all) or
one group per head (``(heads, 3, head_dim)``, multi-head). The queries are
a range of each group's rows and the key and value one row each, read as
Penzai's grouped attention (``head_groups`` x ``query_heads``), so the KV
cache holds one key per group, as transformers' does.

ALiBi (``alibi: true``, Falcon-RW) is refused: Penzai's attention has no
ALiBi bias, and transformers rounds the slopes to bfloat16 and adds them to
the mask, which a new layer would have to match.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.scaled_rope import ApplyScaledRoPE
from pz_persist.pretrained.errors import ExportError
from pz_persist.pretrained.hf.building.decoder import head_axes
from pz_persist.pretrained.hf.building.decoder import with_scaled_rope
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import STRING
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import lm_head_source
from pz_persist.pretrained.hf.config import scaled_rope
from pz_persist.pretrained.hf.config_from_model import activation_field
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.config_from_model import projection
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import DECODER_HEAD
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import check_layers
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

FALCON_LAYERS = "transformer.h."
"""The prefix of layer ``i``'s tensors (``transformer.h.{i}.``)."""

_ACTIVATIONS = {  # transformers' get_activation names -> the Penzai function each computes.
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_fast": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}
"""Equal partials to those export's `pz_persist.pretrained.hf.config_from_model.activation`
recognises."""

_SPELLINGS = {"gelu": "gelu_exact", "gelu_new": "gelu_approx", "gelu_fast": "gelu_approx",
              "gelu_pytorch_tanh": "gelu_approx", "relu": "relu", "silu": "silu"}
"""Each ``activation`` by the Penzai activation's name (export keeps ``like``'s spelling)."""

SEQUENTIAL, ONE_NORM, TWO_NORMS = "sequential", "parallel on one norm", "parallel on two norms"
"""The three block layouts (the module docstring)."""


def _layout(cfg: Config) -> str:
  """The block layout the config gives, refusing the combinations
  transformers' ``FalconDecoderLayer`` cannot run (it fails on them)."""
  new = cfg.get("new_decoder_architecture", False)
  parallel = cfg.get("parallel_attn", True)
  norms = cfg.get("num_ln_in_parallel_attn")
  if norms is not None and norms not in (1, 2):
    raise cfg.unsupported("num_ln_in_parallel_attn", norms,
                          "Falcon's parallel blocks have one LayerNorm or two")
  if new:
    if not parallel:
      raise cfg.unsupported("parallel_attn", False,
                            "the new decoder architecture is parallel; transformers' Falcon"
                            " layer fails on a sequential one")
    return ONE_NORM if norms == 1 else TWO_NORMS
  if not parallel:
    return SEQUENTIAL
  if norms == 2:
    raise cfg.unsupported("num_ln_in_parallel_attn", 2,
                          "two LayerNorms need new_decoder_architecture: true; transformers'"
                          " Falcon layer fails without it")
  return ONE_NORM


def _groups(cfg: Config, heads: int) -> int:
  """How many key/value heads (groups of the fused projection)."""
  kv = cfg.get("num_kv_heads")
  multi_query = cfg.get("multi_query", True)  # Not read by the new decoder architecture.
  if cfg.get("new_decoder_architecture", False):
    kv = kv or heads  # transformers: None means num_attention_heads.
    if heads % kv:
      raise cfg.invalid("num_kv_heads", kv, f"a divisor of num_attention_heads ({heads})")
    return kv
  if multi_query:
    return 1  # num_kv_heads is not read by the older layout's multi-query attention.
  if kv not in (None, heads):
    raise cfg.unsupported("num_kv_heads", kv,
                          "the older multi-head layout has one key/value head per head;"
                          " grouped heads need new_decoder_architecture: true")
  return heads


def falcon_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Falcon checkpoint to Penzai (the module docstring says how)."""
  hidden = cfg.require("hidden_size")
  heads = cfg.require("num_attention_heads")
  if hidden % heads:
    raise cfg.invalid("num_attention_heads", heads, f"a divisor of hidden_size ({hidden})")
  head_dim = hidden // heads
  layers = cfg.require("num_hidden_layers")
  vocab = cfg.require("vocab_size")
  if cfg.get("alibi", False):
    raise cfg.unsupported("alibi", True,
                          "ALiBi position biases (Falcon-RW) are not built: Penzai's attention"
                          " has no ALiBi layer; rotary Falcon checkpoints load")
  if cfg.get("apply_residual_connection_post_layernorm", False):
    raise cfg.unsupported("apply_residual_connection_post_layernorm", True,
                          "transformers' Falcon adds the block's input, never the normed one")
  layout = _layout(cfg)
  groups = _groups(cfg, heads)
  ffn = cfg.get("ffn_hidden_size") or 4 * hidden  # transformers: None means 4 * hidden_size.
  eps = float(cfg.get("layer_norm_epsilon", 1e-5))
  bias = cfg.get("bias", False)
  act = cfg.expect("activation", set(_ACTIVATIONS), "gelu")
  theta, fraction, scaling = scaled_rope(cfg, 10_000.0, 2048)
  if fraction != 1.0:
    raise cfg.unsupported("partial_rotary_factor", fraction,
                          "transformers' Falcon rotates every dimension of each head")
  tied = cfg.get("tie_word_embeddings", True)
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  check_layers(cfg, weights.names, FALCON_LAYERS, layers)
  head_source = lm_head_source(cfg, tied, weights, DECODER_HEAD,
                               "transformer.word_embeddings.weight")
  dtype = weights.dtype
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=groups, query_head_multiplier=heads // groups, embedding_dim=hidden,
      projection_dim=head_dim, mlp_hidden_dim=ffn, num_decoder_blocks=layers,
      vocab_size=vocab, mlp_variant="swiglu", tie_embedder_and_logits=False,
      rope_wavelength=theta, rms_norm_eps=eps,
      attention_type=llamalike_common.AttentionTypeGlobalCausal(),
      parameter_dtype=dtype, activation_dtype=dtype)

  def build() -> model_parts.TransformerLM:
    model = build_falcon(config, layout, eps, bias, _ACTIVATIONS[act])
    return model if scaling is None else with_scaled_rope(model, scaling)

  specs = [
      TensorSpec("transformer/embedder.embeddings", "transformer.word_embeddings.weight",
                 (vocab, hidden), ("vocabulary", "embedding")),
      *_norm_specs("transformer/final_norm", "transformer.ln_f", hidden),
      TensorSpec("transformer/lm_head.weights", head_source,
                 (vocab, hidden), ("vocabulary", "embedding")),
  ]
  for i in range(layers):
    specs += _block_specs(f"transformer/block_{i}/", f"{FALCON_LAYERS}{i}.", config, layout,
                          bias)
  return Plan(build, tuple(specs))


_NORM_NAMES = {
    SEQUENTIAL: (("input_norm", "input_layernorm"),
                 ("post_attention_norm", "post_attention_layernorm")),
    ONE_NORM: (("input_norm", "input_layernorm"),),
    TWO_NORMS: (("attention_norm", "ln_attn"), ("mlp_norm", "ln_mlp")),
}
"""Each layout's norms: the Penzai name in the block and transformers' module."""


def _norm_specs(label: str, source: str, hidden: int) -> list[TensorSpec]:
  return [TensorSpec(label + "/scale.weights", source + ".weight", (hidden,), ("embedding",)),
          TensorSpec(label + "/shift.bias", source + ".bias", (hidden,), ("embedding",))]


def _block_specs(p: str, s: str, config: llamalike_common.LlamalikeTransformerConfig,
                 layout: str, bias: bool) -> list[TensorSpec]:
  """Block ``p``'s tensors from layer ``s``: norms, the fused projection
  split into query, key and value, the output and the MLP."""
  hidden, head_dim, ffn = config.embedding_dim, config.projection_dim, config.mlp_hidden_dim
  groups, per = config.num_kv_heads, config.query_head_multiplier
  q_heads, kv_axes = head_axes(config)
  specs = [spec for name, module in _NORM_NAMES[layout]
           for spec in _norm_specs(p + name, s + module, hidden)]
  fused = groups * (per + 2) * head_dim
  # The rows (group, per + 2, head_dim); a lone group's axis is dropped, as
  # Penzai's grouped attention drops it (`head_axes`).
  grouped = () if groups == 1 and per > 1 else (groups,)
  dim = len(grouped)

  def fused_specs(suffix: str, tail: tuple[int, ...], tail_axes: tuple[str, ...],
                  label_suffix: str) -> list[TensorSpec]:
    shape = (*grouped, per + 2, head_dim, *tail)
    stored = (fused, *tail)
    if per == 1:  # (heads, 3, head_dim): one slice each.
      return [TensorSpec(p + f"attention/{which}{label_suffix}", s + suffix, shape,
                         ("heads", "projection", *tail_axes), take=(1, index), stored=stored)
              for index, which in enumerate(("query", "key", "value"))]
    return [
        TensorSpec(p + f"attention/query{label_suffix}", s + suffix, shape,
                   (*q_heads, "projection", *tail_axes), part=(dim, 0, per), stored=stored),
        TensorSpec(p + f"attention/key{label_suffix}", s + suffix, shape,
                   (*kv_axes, "projection", *tail_axes), take=(dim, per), stored=stored),
        TensorSpec(p + f"attention/value{label_suffix}", s + suffix, shape,
                   (*kv_axes, "projection", *tail_axes), take=(dim, per + 1), stored=stored),
    ]

  a = s + "self_attention."
  specs += fused_specs("self_attention.query_key_value.weight", (hidden,), ("embedding",),
                       ".weights")
  specs.append(TensorSpec(p + "attention/output.weights", a + "dense.weight",
                          (hidden, *q_heads.values(), head_dim),
                          ("embedding", *q_heads, "projection"), stored=(hidden, hidden)))
  specs += [
      TensorSpec(p + "mlp/in.weights", s + "mlp.dense_h_to_4h.weight", (ffn, hidden),
                 ("neurons", "embedding")),
      TensorSpec(p + "mlp/out.weights", s + "mlp.dense_4h_to_h.weight", (hidden, ffn),
                 ("embedding", "neurons")),
  ]
  if bias:
    specs += fused_specs("self_attention.query_key_value.bias", (), (), "_bias.bias")
    specs += [
        TensorSpec(p + "attention/output_bias.bias", a + "dense.bias", (hidden,), ("embedding",)),
        TensorSpec(p + "mlp/in_bias.bias", s + "mlp.dense_h_to_4h.bias", (ffn,), ("neurons",)),
        TensorSpec(p + "mlp/out_bias.bias", s + "mlp.dense_4h_to_h.bias", (hidden,),
                   ("embedding",)),
    ]
  return specs


def _layer_norm(name: str, hidden: int, eps: float, dtype: Any) -> pz.nn.LayerNorm:
  return pz.nn.LayerNorm.from_config(name=name, init_base_rng=None,
                                     across_axes={"embedding": hidden}, epsilon=eps, dtype=dtype)


def _with_bias(linear: pz.nn.Linear, axes: dict[str, int], dtype: Any) -> list[pz.nn.Layer]:
  """``linear`` and the ``AddBias`` after it (named ``<linear>_bias``)."""
  name = linear.weights.label.removesuffix(".weights")
  return [linear, pz.nn.AddBias.from_config(name=f"{name}_bias", init_base_rng=None,
                                            biased_axes=axes, dtype=dtype)]


def _attention(name: str, config: llamalike_common.LlamalikeTransformerConfig,
               bias: bool) -> pz.nn.Attention:
  """Penzai's grouped llama-like attention, with a bias after each
  projection when ``bias``: the query and key biased before their rotation,
  as transformers' fused projection is."""
  attn = llamalike_common.build_llamalike_attention(name, None, config)
  if not bias:
    return attn
  q_heads, kv_axes = head_axes(config)
  head_dim, dtype = config.projection_dim, config.parameter_dtype

  def biased(part: pz.nn.Sequential, index: int, axes: dict[str, int]) -> pz.nn.Sequential:
    layers = list(part.sublayers)
    layers[index:index + 1] = _with_bias(layers[index], axes, dtype)
    return pz.nn.Sequential(layers)

  return pz.nn.Attention(
      input_to_query=biased(attn.input_to_query, 0, {**q_heads, "projection": head_dim}),
      input_to_key=biased(attn.input_to_key, 0, {**kv_axes, "projection": head_dim}),
      input_to_value=biased(attn.input_to_value, 0, {**kv_axes, "projection": head_dim}),
      query_key_to_attn=attn.query_key_to_attn,
      attn_value_to_output=biased(attn.attn_value_to_output, 1,
                                  {"embedding": config.embedding_dim}),
  )


def _mlp(name: str, hidden: int, ffn: int, bias: bool, fn: Any,
         dtype: Any) -> model_parts.TransformerFeedForward:
  def linear(which: str, inputs: dict[str, int], outputs: dict[str, int]) -> list[pz.nn.Layer]:
    layer = pz.nn.Linear.from_config(name=f"{name}/{which}", init_base_rng=None,
                                     input_axes=inputs, output_axes=outputs, dtype=dtype)
    return _with_bias(layer, outputs, dtype) if bias else [layer]

  return model_parts.TransformerFeedForward([
      *linear("in", {"embedding": hidden}, {"neurons": ffn}),
      pz.nn.Elementwise(fn),
      *linear("out", {"neurons": ffn}, {"embedding": hidden}),
  ])


def build_falcon(config: llamalike_common.LlamalikeTransformerConfig, layout: str, eps: float,
                 bias: bool, fn: Any) -> model_parts.TransformerLM:
  """Falcon's skeleton (parameter slots): blocks of ``layout``, LayerNorms of
  epsilon ``eps``, biases when ``bias``, the MLP's activation ``fn``."""
  hidden, dtype = config.embedding_dim, config.parameter_dtype
  table = pz.nn.EmbeddingTable.from_config(
      name="transformer/embedder", init_base_rng=None, vocab_size=config.vocab_size,
      embedding_axes={"embedding": hidden}, dtype=dtype)
  body: list[pz.nn.Layer] = [pz.nn.EmbeddingLookup(table)]
  for i in range(config.num_decoder_blocks):
    p = f"transformer/block_{i}/"
    attn = _attention(p + "attention", config, bias)
    mlp = _mlp(p + "mlp", hidden, config.mlp_hidden_dim, bias, fn, dtype)
    norms = [_layer_norm(p + name, hidden, eps, dtype) for name, _ in _NORM_NAMES[layout]]
    if layout == SEQUENTIAL:
      sublayers: list[pz.nn.Layer] = [pz.nn.Residual(pz.nn.Sequential([norms[0], attn])),
                                      pz.nn.Residual(pz.nn.Sequential([norms[1], mlp]))]
    elif layout == ONE_NORM:
      sublayers = [pz.nn.Residual(pz.nn.Sequential([
          norms[0], pz.nn.BranchAndAddTogether([attn, mlp])]))]
    else:
      sublayers = [pz.nn.Residual(pz.nn.BranchAndAddTogether([
          pz.nn.Sequential([norms[0], attn]), pz.nn.Sequential([norms[1], mlp])]))]
    body.append(model_parts.TransformerBlock(sublayers))
  body.append(_layer_norm("transformer/final_norm", hidden, eps, dtype))
  body.append(pz.nn.Linear.from_config(
      name="transformer/lm_head", init_base_rng=None, input_axes={"embedding": hidden},
      output_axes={"vocabulary": config.vocab_size}, dtype=dtype))
  return model_parts.TransformerLM(
      metadata=model_parts.TransformerMetadata(
          common_head_axes=({"heads": config.num_kv_heads} if config.query_head_multiplier == 1
                            else {"head_groups": config.num_kv_heads}),
          query_only_head_axes=({} if config.query_head_multiplier == 1
                                else {"query_heads": config.query_head_multiplier}),
          embedding_dim=hidden, projection_dim=config.projection_dim,
          mlp_hidden_dim=config.mlp_hidden_dim, vocab_size=config.vocab_size,
          activation_dtype=dtype),
      body=pz.nn.Sequential(body))


def _block_layout(model: pz.nn.Layer) -> str:
  block = blocks(model)[0]
  if len(block.sublayers) == 2:
    return SEQUENTIAL
  delta = getattr(block.sublayers[0], "delta", None)
  return TWO_NORMS if isinstance(delta, pz.nn.BranchAndAddTogether) else ONE_NORM


def _detect(model: pz.nn.Layer) -> str | None:
  """Falcon: LayerNorms with full rotary embeddings on every head dimension
  (GPT-NeoX's is a subset, GPT-2 and OPT have learned positions)."""
  if (all_layers(model, pz.nn.LayerNorm) and not all_layers(model, pz.nn.ApplyRoPEToSubset)
      and (all_layers(model, pz.nn.ApplyRoPE) or all_layers(model, ApplyScaledRoPE))):
    return "falcon"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only falcon.
  attn = attention(model)
  embed = named_shape(first_layer(model, pz.nn.EmbeddingTable, "token embeddings"))

  def heads_of(shape: dict[str, int]) -> int:
    return math.prod(n for axis, n in shape.items()
                     if axis in ("heads", "head_groups", "query_heads"))

  heads = heads_of(projection(attn.input_to_query))
  groups = heads_of(projection(attn.input_to_key)) or 1
  layout = _block_layout(model)
  ffw = first_layer(model, model_parts.TransformerFeedForward, "MLP")
  # The older layout when it can hold the model and ``like`` does not say otherwise.
  old = (layout != TWO_NORMS and groups in (1, heads)
         and not like.get("new_decoder_architecture", False))
  if layout == SEQUENTIAL and not old:
    raise ExportError(f"Falcon's sequential blocks have one key/value head or one per head;"
                      f" the model has {groups} for {heads} heads.")
  multi_query = like.get("multi_query", True)
  kv_heads: int | None = groups
  norms: int | None = None
  if old:
    if groups != heads or heads == 1:
      multi_query = groups == 1 if heads > 1 else multi_query
    else:
      multi_query = False
    kv_heads = like.get("num_kv_heads") if multi_query else heads
    kv_heads = kv_heads or heads
    norms = like.get("num_ln_in_parallel_attn") if layout == ONE_NORM else None
  else:
    norms = 1 if layout == ONE_NORM else 2
  return {
      "hidden_size": embed["embedding"],
      "vocab_size": embed["vocabulary"],
      "num_attention_heads": heads,
      "num_kv_heads": kv_heads,
      "num_hidden_layers": len(blocks(model)),
      "ffn_hidden_size": named_shape(first_layer(ffw, pz.nn.Linear, "MLP"))["neurons"],
      "new_decoder_architecture": not old,
      "multi_query": multi_query,
      "parallel_attn": layout != SEQUENTIAL,
      "num_ln_in_parallel_attn": norms,
      "bias": bool(all_layers(attn, pz.nn.AddBias)),
      "alibi": False,
      "layer_norm_epsilon": number(first_layer(model, pz.nn.Standardize, "layer norm").epsilon),
      **activation_field(model, like, key="activation", spellings=_SPELLINGS),
      **rope_fields(model),
      **tied_field(model, like),
  }


RECORD = Family(
    title="Falcon",
    model_types={"falcon": ModelType(
        falcon_plan, "FalconForCausalLM",
        defaults={"vocab_size": 65024, "hidden_size": 4544, "num_hidden_layers": 32,
                  "num_attention_heads": 71, "layer_norm_epsilon": 1e-5, "alibi": False,
                  "new_decoder_architecture": False, "multi_query": True,
                  "parallel_attn": True, "bias": False, "activation": "gelu",
                  "tie_word_embeddings": True, "rope_theta": 10_000.0,
                  "partial_rotary_factor": 1.0, "max_position_embeddings": 2048,
                  "apply_residual_connection_post_layernorm": False},
        defaults_why={
            "apply_residual_connection_post_layernorm": (
                "a field of Falcon's original remote code (still in the Hub's falcon-7b"
                " config), which transformers' FalconConfig lacks; false is the layout its"
                " modeling computes"),
        },
        ignored_fields={
            "dropout (inactive at inference)": ("hidden_dropout",),
        })},
    detect=_detect,
    write_config=_write_config,
    adds=("LayerNorm with biases, full rotary, one fused query-key-value projection per key/value"
          " group (multi-query, grouped `num_kv_heads` or multi-head), sequential or parallel"
          " blocks on one or two LayerNorms (`parallel_attn`, `new_decoder_architecture`,"
          " `num_ln_in_parallel_attn`), `bias`, tied or untied head"),
    refuses=("ALiBi (`alibi: true`, Falcon-RW), layouts transformers' Falcon layer fails on"
             " (a sequential new decoder architecture, two norms without it)"),
    rank=8,
    fields={"num_kv_heads": POSITIVE_INT, "ffn_hidden_size": POSITIVE_INT,
            "num_ln_in_parallel_attn": POSITIVE_INT, "layer_norm_epsilon": POSITIVE_NUMBER,
            "alibi": BOOLEAN, "new_decoder_architecture": BOOLEAN, "multi_query": BOOLEAN,
            "parallel_attn": BOOLEAN, "bias": BOOLEAN, "activation": STRING,
            "apply_residual_connection_post_layernorm": BOOLEAN,
            "hidden_dropout": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                               "a number")},
    layer_prefixes=(FALCON_LAYERS,),
    head_names=(DECODER_HEAD,),
)
