"""OPT checkpoints (``model_type`` ``opt``; transformers' ``OPTForCausalLM``).

OPT is the fairseq decoder: learned absolute positions (looked up two rows
late, `pz_persist.nn.learned_positions.AddLearnedPositions`), LayerNorm with
a bias (epsilon fixed at PyTorch's 1e-5: the config has no field for it),
biased projections (``enable_bias``), a ReLU MLP (``activation_function``),
the query scaled by ``head_dim ** -0.5`` after its bias, and a head tied to
the embeddings. Two layouts: pre-norm with a final LayerNorm (most sizes)
and post-norm without one (``do_layer_norm_before: false``, opt-350m), where
the embeddings are also narrower than the blocks (``word_embed_proj_dim``)
and bias-free ``project_in`` / ``project_out`` map between the two.

Positions: transformers derives them from the attention mask's cumulative
sum; for an unpadded sequence (what Penzai's ``TransformerLM`` and its
KV-cache sampler see) that is ``arange`` over the sequence, the
``token_positions`` side input. Left-padded batches would need the mask's
positions passed as that side input.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist.nn.learned_positions import AddLearnedPositions
from pz_persist.pretrained import errors
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import STRING
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import lm_head_source
from pz_persist.pretrained.hf.config_from_model import activation_field
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.config_from_model import projection
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import DECODER_HEAD
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import check_layers
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

OPT_LAYERS = "model.decoder.layers."
"""Where OPT keeps layer ``i``'s tensors."""

POSITION_OFFSET = 2
"""transformers' ``OPTLearnedPositionalEmbedding.offset``: position ``p`` is row ``p + 2``."""

LAYER_NORM_EPS = 1e-5
"""``torch.nn.LayerNorm``'s default, which every OPT norm uses (no config field sets it)."""

_ACTIVATIONS = {  # transformers' ACT2FN names -> the Penzai function each computes.
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}
"""The very function objects (equal partials) export's
`pz_persist.pretrained.hf.config_from_model.activation` recognises."""

_SPELLINGS = {"relu": "relu", "silu": "silu", "gelu": "gelu_exact", "gelu_new": "gelu_approx",
              "gelu_pytorch_tanh": "gelu_approx"}
"""Each ``activation_function`` by the Penzai activation's name, for export to
keep ``like``'s spelling when it means the same."""


def _layer_norm(name: str, dim: int, affine: bool, dtype: Any) -> pz.nn.Layer:
  """transformers' ``nn.LayerNorm(dim, elementwise_affine=affine)``."""
  if not affine:
    return pz.nn.Standardize(across=("embedding",), epsilon=LAYER_NORM_EPS)
  return pz.nn.LayerNorm.from_config(name=name, init_base_rng=None, across_axes={"embedding": dim},
                                     epsilon=LAYER_NORM_EPS, dtype=dtype)


def _projection(name: str, inputs: dict[str, int], outputs: dict[str, int], bias: bool,
                dtype: Any) -> pz.nn.Layer:
  """A ``nn.Linear`` with or without its bias (``enable_bias``)."""
  cls = pz.nn.Affine if bias else pz.nn.Linear
  return cls.from_config(name=name, init_base_rng=None, input_axes=inputs, output_axes=outputs,
                         dtype=dtype)


def _attention(name: str, hidden: int, heads: int, bias: bool, dtype: Any) -> pz.nn.Attention:
  head_dim = hidden // heads
  split = {"heads": heads, "projection": head_dim}
  embed = {"embedding": hidden}
  return pz.nn.Attention(
      input_to_query=pz.nn.Sequential([
          _projection(f"{name}/query", embed, split, bias, dtype),
          # transformers scales q_proj's output, bias included.
          pz.nn.ConstantRescale(by=jnp.array(head_dim**-0.5, dtype=dtype)),
      ]),
      input_to_key=pz.nn.Sequential([_projection(f"{name}/key", embed, split, bias, dtype)]),
      input_to_value=pz.nn.Sequential([_projection(f"{name}/value", embed, split, bias, dtype)]),
      query_key_to_attn=pz.nn.Sequential([
          pz.nn.NamedEinsum(({"seq": "tq", "heads": "h", "projection": "p"},
                             {"seq": "tkv", "heads": "h", "projection": "p"}),
                            {"seq": "tq", "heads": "h", "kv_seq": "tkv"}),
          pz.nn.ApplyCausalAttentionMask(masked_out_value=jnp.array(-2.3819763e38, dtype=dtype)),
          pz.nn.Softmax("kv_seq"),
      ]),
      attn_value_to_output=pz.nn.Sequential([
          pz.nn.NamedEinsum(({"seq": "tq", "heads": "h", "kv_seq": "tkv"},
                             {"seq": "tkv", "heads": "h", "projection": "p"}),
                            {"seq": "tq", "heads": "h", "projection": "p"}),
          _projection(f"{name}/output", split, embed, bias, dtype),
      ]),
  )


def opt_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps an OPT checkpoint to Penzai (the module docstring says how)."""
  hidden = cfg.require("hidden_size")
  heads = cfg.require("num_attention_heads")
  if hidden % heads:
    raise cfg.unsupported("num_attention_heads", heads,
                          f"OPT splits hidden_size={hidden} evenly between the heads")
  ffn = cfg.require("ffn_dim")
  layers = cfg.require("num_hidden_layers")
  vocab = cfg.require("vocab_size")
  positions = cfg.require("max_position_embeddings") + POSITION_OFFSET
  word_dim = cfg.get("word_embed_proj_dim") or hidden  # transformers: None means hidden_size.
  pre_norm = cfg.get("do_layer_norm_before", True)
  remove_final = cfg.get("_remove_final_layer_norm", False)
  final_norm = pre_norm and not remove_final
  bias = cfg.get("enable_bias", True)
  affine = cfg.get("layer_norm_elementwise_affine", True)
  act = cfg.expect("activation_function", set(_ACTIVATIONS), "relu")
  tied = cfg.get("tie_word_embeddings", True)
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  check_layers(cfg, weights.names, OPT_LAYERS, layers)
  d = "model.decoder."
  head_source = lm_head_source(cfg, tied, weights, DECODER_HEAD, d + "embed_tokens.weight")
  dtype = weights.dtype
  projected = word_dim != hidden

  def build() -> model_parts.TransformerLM:
    table = pz.nn.EmbeddingTable.from_config(
        name="transformer/embedder", init_base_rng=None, vocab_size=vocab,
        embedding_axes={"embedding": word_dim}, dtype=dtype)
    body: list[pz.nn.Layer] = [pz.nn.EmbeddingLookup(table)]
    if projected:
      body.append(pz.nn.Linear.from_config(
          name="transformer/project_in", init_base_rng=None,
          input_axes={"embedding": word_dim}, output_axes={"embedding": hidden}, dtype=dtype))
    body.append(AddLearnedPositions(
        embeddings=pz.ParameterSlot("transformer/positions.embeddings"),
        offset=POSITION_OFFSET))
    for i in range(layers):
      p = f"transformer/block_{i}/"
      attn = _attention(p + "attention", hidden, heads, bias, dtype)
      mlp = model_parts.TransformerFeedForward([
          _projection(p + "mlp/in", {"embedding": hidden}, {"neurons": ffn}, bias, dtype),
          pz.nn.Elementwise(_ACTIVATIONS[act]),
          _projection(p + "mlp/out", {"neurons": ffn}, {"embedding": hidden}, bias, dtype),
      ])
      if pre_norm:
        sublayers = [
            pz.nn.Residual(pz.nn.Sequential([
                _layer_norm(p + "pre_attention_norm", hidden, affine, dtype), attn])),
            pz.nn.Residual(pz.nn.Sequential([
                _layer_norm(p + "pre_ffw_norm", hidden, affine, dtype), mlp])),
        ]
      else:
        sublayers = [
            pz.nn.Residual(pz.nn.Sequential([attn])),
            _layer_norm(p + "post_attention_norm", hidden, affine, dtype),
            pz.nn.Residual(pz.nn.Sequential([mlp])),
            _layer_norm(p + "post_ffw_norm", hidden, affine, dtype),
        ]
      body.append(model_parts.TransformerBlock(sublayers))
    if final_norm:
      body.append(_layer_norm("transformer/final_norm", hidden, affine, dtype))
    if projected:
      body.append(pz.nn.Linear.from_config(
          name="transformer/project_out", init_base_rng=None,
          input_axes={"embedding": hidden}, output_axes={"embedding": word_dim}, dtype=dtype))
    body.append(pz.nn.Linear.from_config(
        name="transformer/lm_head", init_base_rng=None, input_axes={"embedding": word_dim},
        output_axes={"vocabulary": vocab}, dtype=dtype))
    return model_parts.TransformerLM(
        metadata=model_parts.TransformerMetadata(
            common_head_axes={"heads": heads}, query_only_head_axes={}, embedding_dim=hidden,
            projection_dim=hidden // heads, mlp_hidden_dim=ffn, vocab_size=vocab,
            activation_dtype=dtype),
        body=pz.nn.Sequential(body))

  head_dim = hidden // heads
  embed = ("embedding",)
  specs = [
      TensorSpec("transformer/embedder.embeddings", d + "embed_tokens.weight",
                 (vocab, word_dim), ("vocabulary", "embedding")),
      TensorSpec("transformer/positions.embeddings", d + "embed_positions.weight",
                 (positions, hidden), ("positions", "embedding")),
      TensorSpec("transformer/lm_head.weights", head_source,
                 (vocab, word_dim), ("vocabulary", "embedding")),
  ]
  if projected:
    specs += [
        TensorSpec("transformer/project_in.weights", d + "project_in.weight",
                   (hidden, word_dim), ("embedding_out", "embedding")),
        TensorSpec("transformer/project_out.weights", d + "project_out.weight",
                   (word_dim, hidden), ("embedding_out", "embedding")),
    ]

  def norm(label: str, source: str) -> list[TensorSpec]:
    if not affine:
      return []
    return [TensorSpec(label + "/scale.weights", source + ".weight", (hidden,), embed),
            TensorSpec(label + "/shift.bias", source + ".bias", (hidden,), embed)]

  def linear(label: str, source: str, shape: tuple[int, ...], axes: tuple[str, ...],
             stored: tuple[int, int], bias_shape: tuple[int, ...],
             bias_axes: tuple[str, ...]) -> list[TensorSpec]:
    if not bias:
      return [TensorSpec(label + ".weights", source + ".weight", shape, axes, stored=stored)]
    return [TensorSpec(label + "/Linear.weights", source + ".weight", shape, axes, stored=stored),
            TensorSpec(label + "/AddBias.bias", source + ".bias", bias_shape, bias_axes,
                       stored=(bias_shape[0] * (bias_shape[1] if len(bias_shape) > 1 else 1),))]

  if final_norm:
    specs += norm("transformer/final_norm", d + "final_layer_norm")
  for i in range(layers):
    p, s = f"transformer/block_{i}/", f"{OPT_LAYERS}{i}."
    first, second = (("pre_attention_norm", "pre_ffw_norm") if pre_norm
                     else ("post_attention_norm", "post_ffw_norm"))
    specs += norm(p + first, s + "self_attn_layer_norm")
    specs += norm(p + second, s + "final_layer_norm")
    for which, name in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
      specs += linear(p + f"attention/{which}", s + f"self_attn.{name}",
                      (heads, head_dim, hidden), ("heads", "projection", "embedding"),
                      (hidden, hidden), (heads, head_dim), ("heads", "projection"))
    specs += linear(p + "attention/output", s + "self_attn.out_proj",
                    (hidden, heads, head_dim), ("embedding", "heads", "projection"),
                    (hidden, hidden), (hidden,), embed)
    specs += linear(p + "mlp/in", s + "fc1", (ffn, hidden), ("neurons", "embedding"),
                    (ffn, hidden), (ffn,), ("neurons",))
    specs += linear(p + "mlp/out", s + "fc2", (hidden, ffn), ("embedding", "neurons"),
                    (hidden, ffn), (hidden,), embed)
  return Plan(build, tuple(specs))


def _detect(model: pz.nn.Layer) -> str | None:
  """OPT: learned positions read two rows late."""
  found = all_layers(model, AddLearnedPositions)
  return "opt" if found and found[0].offset == POSITION_OFFSET else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only opt.
  positions = first_layer(model, AddLearnedPositions, "learned positions")
  if positions.offset != POSITION_OFFSET:
    raise errors.ExportError(f"OPT reads learned positions {POSITION_OFFSET} rows late; the"
                             f" model's offset is {positions.offset}.")
  table = named_shape(positions)
  words = named_shape(first_layer(model, pz.nn.EmbeddingTable, "token embeddings"))
  query = projection(attention(model).input_to_query)
  ffw = first_layer(model, model_parts.TransformerFeedForward, "MLP")
  block = blocks(model)[0]
  pre_norm = all(isinstance(layer, pz.nn.Residual) for layer in block.sublayers)
  top = getattr(getattr(model, "body", None), "sublayers", [])  # The final norm's level.
  final = [layer for layer in top if isinstance(layer, (pz.nn.LayerNorm, pz.nn.Standardize))]
  return {
      "hidden_size": table["embedding"],
      "word_embed_proj_dim": words["embedding"],
      "vocab_size": words["vocabulary"],
      "num_attention_heads": query["heads"],
      "ffn_dim": named_shape(first_layer(ffw, pz.nn.Linear, "MLP"))["neurons"],
      "num_hidden_layers": len(blocks(model)),
      "max_position_embeddings": table["positions"] - POSITION_OFFSET,
      "do_layer_norm_before": pre_norm,
      "_remove_final_layer_norm": pre_norm and not final,
      "enable_bias": bool(all_layers(attention(model), pz.nn.AddBias)),
      "layer_norm_elementwise_affine": bool(all_layers(model, pz.nn.LayerNorm)),
      **activation_field(model, like, key="activation_function", spellings=_SPELLINGS),
      **tied_field(model, like),
  }


RECORD = Family(
    title="OPT",
    model_types={"opt": ModelType(
        opt_plan, "OPTForCausalLM",
        defaults={"do_layer_norm_before": True, "_remove_final_layer_norm": False,
                  "enable_bias": True, "layer_norm_elementwise_affine": True,
                  "activation_function": "relu", "tie_word_embeddings": True,
                  "max_position_embeddings": 2048},
        ignored_fields={
            "training only: dropout and layer drop are off at inference": (
                "dropout", "layerdrop", "activation_dropout"),
            "training only: the initialisation's scale": ("init_std",),
        },
        foreign_fields=frozenset({"activation_dropout"}))},
    detect=_detect,
    write_config=_write_config,
    adds=("learned positions read two rows late (`AddLearnedPositions`), LayerNorm with biases"
          " or without weights (`layer_norm_elementwise_affine`), pre-norm with a final norm or"
          " post-norm (`do_layer_norm_before`: opt-350m), `word_embed_proj_dim`'s `project_in` /"
          " `project_out`, `enable_bias`, tied or untied head"),
    refuses=("activations other than ReLU / GELU / SiLU; left-padded batches need their"
             " positions as `token_positions`"),
    rank=90,
    fields={"ffn_dim": POSITIVE_INT, "word_embed_proj_dim": POSITIVE_INT,
            "do_layer_norm_before": BOOLEAN, "_remove_final_layer_norm": BOOLEAN,
            "enable_bias": BOOLEAN, "layer_norm_elementwise_affine": BOOLEAN,
            "activation_function": STRING},
    layer_prefixes=(OPT_LAYERS,),
    head_names=(DECODER_HEAD,),
)
