"""GPT-2 checkpoints (``model_type`` ``gpt2``, transformers' ``GPT2LMHeadModel``).

GPT-2 is Penzai's GPT-NeoX parts (LayerNorm with a shift, attention and MLP
with biases) arranged sequentially (``x + attn(ln_1(x))``, then
``x + mlp(ln_2(x))``), without rotary embeddings: a learned table of
absolute positions (`pz_persist.nn.learned_positions.AddLearnedPositions`)
is added to the token embeddings. Its ``Conv1D`` weights are stored
``[in, out]``, the transpose of ``nn.Linear``'s: the named axes say so and
nothing is transposed. The query is scaled by a `ConstantScale` holding
transformers' own factor (``1/sqrt(head_dim)`` under ``scale_attn_weights``,
further divided by the layer number under
``scale_attn_by_inverse_layer_idx``), so export reads both back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import gpt_neox

from pz_persist.nn.constant_scale import ConstantScale
from pz_persist.nn.learned_positions import AddLearnedPositions
from pz_persist.pretrained.errors import ExportError
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import STRING
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import lm_head_source
from pz_persist.pretrained.hf.config_from_model import activation
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.config_from_model import size_fields
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import DECODER_HEAD
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import check_layers
from pz_persist.pretrained.hf.plan import left_out_matching
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

GPT2_LAYERS = "transformer.h."
"""The prefix of layer ``i``'s tensors (``transformer.h.{i}.``)."""

_ACTIVATIONS = {
    "gelu": "gelu_exact",
    "gelu_new": "gelu_approx",  # transformers' NewGELU: the tanh formula (config.TANH_GELU).
    "gelu_fast": "gelu_approx",
    "gelu_pytorch_tanh": "gelu_approx",
    "relu": "relu",
}


def query_scale(head_dim: int, layer: int, scale_attn_weights: bool,
                by_inverse_layer_idx: bool) -> float:
  """transformers' ``GPT2Attention.scaling`` of layer ``layer``, computed as it does."""
  scaling = head_dim**-0.5 if scale_attn_weights else 1.0
  if by_inverse_layer_idx:
    scaling /= float(layer + 1)
  return scaling


def gpt2_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a GPT-2 checkpoint to Penzai.

  ``reorder_and_upcast_attn`` is read and accepted either way: it computes
  the same scores (scaled before rather than after the product, in float32
  under half precision), so a float32 load is the same model; a bfloat16
  load computes the scores in bfloat16 as with it off.
  """
  hidden = cfg.require("n_embd")
  heads = cfg.require("n_head")
  if hidden % heads:
    raise cfg.invalid("n_head", heads, f"a divisor of n_embd ({hidden})")
  head_dim = hidden // heads
  layers = cfg.require("n_layer")
  vocab = cfg.require("vocab_size")
  positions = cfg.require("n_positions")
  inner = cfg.get("n_inner") or 4 * hidden  # transformers: None means 4 * n_embd.
  act = cfg.expect("activation_function", set(_ACTIVATIONS), "gelu_new")
  eps = float(cfg.get("layer_norm_epsilon", 1e-5))
  scale_weights = cfg.get("scale_attn_weights", True)
  by_layer = cfg.get("scale_attn_by_inverse_layer_idx", False)
  cfg.get("reorder_and_upcast_attn", False)
  if cfg.get("add_cross_attention", False):
    raise cfg.unsupported("add_cross_attention", True,
                          "a decoder-only language model has no encoder to attend to")
  tied = cfg.get("tie_word_embeddings", True)
  config = gpt_neox.GPTNeoXTransformerConfig(
      num_attention_heads=heads, embedding_dim=hidden, projection_dim=head_dim,
      mlp_hidden_dim=inner, num_decoder_blocks=layers, vocab_size=vocab,
      activation_fn=_ACTIVATIONS[act],
      rope_subset_size=0, rope_wavelength=10_000.0, layernorm_epsilon=eps,
      parameter_dtype=None, activation_dtype=None,
  )
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  # The Hub's own GPT-2 folders (openai-community/gpt2...) hold GPT2Model's
  # names, without the ``transformer.`` of GPT2LMHeadModel's (transformers
  # reads both); export writes GPT2LMHeadModel's.
  bare = "wte.weight" in weights.names and "transformer.wte.weight" not in weights.names
  t = "" if bare else "transformer."
  check_layers(cfg, weights.names, t + "h.", layers)
  head_source = lm_head_source(cfg, tied, weights, DECODER_HEAD, t + "wte.weight")
  config = dataclasses.replace(config, parameter_dtype=weights.dtype,
                               activation_dtype=weights.dtype)
  scales = [query_scale(head_dim, i, scale_weights, by_layer) for i in range(layers)]

  def build() -> model_parts.TransformerLM:
    return build_gpt2(config, scales)

  specs = [
      TensorSpec("transformer/embedder.embeddings", t + "wte.weight",
                 (vocab, hidden), ("vocabulary", "embedding")),
      TensorSpec("transformer/position_embedder.embeddings", t + "wpe.weight",
                 (positions, hidden), ("positions", "embedding")),
      TensorSpec("transformer/final_norm/scale.weights", t + "ln_f.weight",
                 (hidden,), ("embedding",)),
      TensorSpec("transformer/final_norm/shift.bias", t + "ln_f.bias",
                 (hidden,), ("embedding",)),
      TensorSpec("transformer/lm_head.weights", head_source,
                 (vocab, hidden), ("vocabulary", "embedding")),
  ]
  for i in range(layers):
    p, s = f"transformer/block_{i}/", f"{t}h.{i}."
    specs += [
        TensorSpec(p + "pre_attention_norm/scale.weights", s + "ln_1.weight",
                   (hidden,), ("embedding",)),
        TensorSpec(p + "pre_attention_norm/shift.bias", s + "ln_1.bias",
                   (hidden,), ("embedding",)),
        TensorSpec(p + "pre_ffw_norm/scale.weights", s + "ln_2.weight",
                   (hidden,), ("embedding",)),
        TensorSpec(p + "pre_ffw_norm/shift.bias", s + "ln_2.bias", (hidden,), ("embedding",)),
        # Conv1D: [in, out].
        TensorSpec(p + "mlp/in/Linear.weights", s + "mlp.c_fc.weight",
                   (hidden, inner), ("embedding", "neurons")),
        TensorSpec(p + "mlp/in/AddBias.bias", s + "mlp.c_fc.bias", (inner,), ("neurons",)),
        TensorSpec(p + "mlp/out/Linear.weights", s + "mlp.c_proj.weight",
                   (inner, hidden), ("neurons", "embedding")),
        TensorSpec(p + "mlp/out/AddBias.bias", s + "mlp.c_proj.bias", (hidden,), ("embedding",)),
        TensorSpec(p + "attention/output/Linear.weights", s + "attn.c_proj.weight",
                   (heads, head_dim, hidden), ("heads", "projection", "embedding"),
                   stored=(hidden, hidden)),
        TensorSpec(p + "attention/output/AddBias.bias", s + "attn.c_proj.bias",
                   (hidden,), ("embedding",)),
    ]
    # c_attn: [in, (q|k|v, head, projection)].
    for index, which in enumerate(("query", "key", "value")):
      specs += [
          TensorSpec(p + f"attention/{which}/Linear.weights", s + "attn.c_attn.weight",
                     (hidden, 3, heads, head_dim), ("embedding", "heads", "projection"),
                     take=(1, index), stored=(hidden, 3 * hidden)),
          TensorSpec(p + f"attention/{which}/AddBias.bias", s + "attn.c_attn.bias",
                     (3, heads, head_dim), ("heads", "projection"), take=(0, index),
                     stored=(3 * hidden,)),
      ]
  return Plan(build, tuple(specs))


def build_gpt2(config: gpt_neox.GPTNeoXTransformerConfig,
               scales: list[float]) -> model_parts.TransformerLM:
  """GPT-2's skeleton (parameter slots) from Penzai's GPT-NeoX parts:
  sequential residual blocks, no rotary embedding, the query scaled by
  ``scales[i]`` in block ``i``, learned positions after the lookup."""
  neox = gpt_neox.build_gpt_neox_transformer(config, init_base_rng=None)
  lookup, *rest = neox.body.sublayers
  neox_blocks = [layer for layer in rest if isinstance(layer, model_parts.TransformerBlock)]
  final_norm, head = rest[-2:]
  blocks = []
  for block, scale in zip(neox_blocks, scales):
    _, attention_branch, ffw_branch = block.sublayers[0].branches
    attention_branch = (
        pz.select(attention_branch).at_instances_of(pz.nn.ApplyRoPEToSubset).remove_from_parent())
    attention_branch = (pz.select(attention_branch).at_instances_of(pz.nn.ConstantRescale)
                        .apply(lambda _, s=scale: ConstantScale(s)))
    blocks.append(model_parts.TransformerBlock(sublayers=[
        pz.nn.Residual(attention_branch), pz.nn.Residual(ffw_branch)]))
  final_norm = (pz.select(final_norm).at_instances_of(pz.nn.Standardize)
                .apply(lambda s: dataclasses.replace(s, epsilon=config.layernorm_epsilon)))
  learned = AddLearnedPositions(
      embeddings=pz.ParameterSlot("transformer/position_embedder.embeddings"))
  body = pz.nn.Sequential([lookup, learned, *blocks, final_norm, head])
  return dataclasses.replace(neox, body=body)


def _detect(model: pz.nn.Layer) -> str | None:
  """GPT-2: learned positions (no rotary embedding) and layer norms."""
  positions = all_layers(model, AddLearnedPositions)
  if (positions and all(p.offset == 0 for p in positions)
      and all_layers(model, pz.nn.Standardize) and not all_layers(model, pz.nn.ApplyRoPE)
      and not all_layers(model, pz.nn.ApplyRoPEToSubset)):
    return "gpt2"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only gpt2.
  sizes = size_fields(model, grouped=False)
  hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
  table = first_layer(model, AddLearnedPositions, "learned positions")
  scales = [layer.by for layer in all_layers(model, ConstantScale)]
  head_dim = hidden // heads
  fields = None
  for scale_weights in (True, False):
    for by_layer in (False, True):
      if scales == [query_scale(head_dim, i, scale_weights, by_layer)
                    for i in range(len(scales))]:
        fields = fields or (scale_weights, by_layer)
  if fields is None:
    raise ExportError(f"the query scales {scales} are none GPT-2's scale_attn_weights and"
                      " scale_attn_by_inverse_layer_idx give; the model was edited.")
  inner = sizes["intermediate_size"]
  if inner == 4 * hidden and like.get("n_inner") is None:
    inner = None  # transformers' own spelling of 4 * n_embd.
  found = activation(model)
  name = like.get("activation_function")
  if _ACTIVATIONS.get(name or "") != found:  # ``like``'s spelling when it means the same.
    name = {"gelu_approx": "gelu_new", "gelu_exact": "gelu"}.get(found, found)
  return {
      "n_embd": hidden, "n_head": heads, "n_layer": sizes["num_hidden_layers"],
      "vocab_size": sizes["vocab_size"], "n_inner": inner,
      "n_positions": dict(table.embeddings.value.named_shape)["positions"],
      "layer_norm_epsilon": number(first_layer(model, pz.nn.Standardize, "layer norm").epsilon),
      "activation_function": name,
      **tied_field(model, like),
      "scale_attn_weights": fields[0],
      "scale_attn_by_inverse_layer_idx": fields[1],
      "reorder_and_upcast_attn": bool(like.get("reorder_and_upcast_attn", False)),
  }


RECORD = Family(
    title="GPT-2",
    model_types={"gpt2": ModelType(
        gpt2_plan, "GPT2LMHeadModel",
        left_out=(left_out_matching(
            (r"(^|\.)(cross)?attn\.(masked_)?bias$", r"(^|\.)crossattention\.(masked_)?bias$"),
            "the causal-mask buffers (attn.bias, attn.masked_bias)",
            "older transformers saved them; GPT2LMHeadModel ignores them"
            " (_keys_to_ignore_on_load_unexpected)"),),
        defaults={"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
                  "n_head": 12, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                  "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                  "reorder_and_upcast_attn": False, "tie_word_embeddings": True,
                  "add_cross_attention": False},
        ignored_fields={
            "dropout (inactive at inference)": ("resid_pdrop", "attn_pdrop"),
            "GPT2DoubleHeadsModel's multiple-choice head, which a language model lacks": (
                "summary_type", "summary_use_proj", "summary_activation",
                "summary_proj_to_labels", "summary_first_dropout"),
            "the context length of transformers 2, which n_positions now gives": ("n_ctx",),
        },
        foreign_fields=frozenset({"n_ctx"}))},
    detect=_detect,
    write_config=_write_config,
    adds=("learned absolute positions, LayerNorm and biases, Conv1D weights, query scaling"
          " by the inverse layer number"),
    refuses="cross-attention (add_cross_attention), quick_gelu and other activations",
    rank=40,
    fields={"n_embd": POSITIVE_INT, "n_head": POSITIVE_INT, "n_layer": POSITIVE_INT,
            "n_positions": POSITIVE_INT, "n_inner": POSITIVE_INT, "n_ctx": POSITIVE_INT,
            "activation_function": STRING, "layer_norm_epsilon": POSITIVE_NUMBER,
            "scale_attn_weights": BOOLEAN, "scale_attn_by_inverse_layer_idx": BOOLEAN,
            "reorder_and_upcast_attn": BOOLEAN, "add_cross_attention": BOOLEAN,
            "resid_pdrop": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                            "a number"),
            "attn_pdrop": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                           "a number")},
    layer_prefixes=(GPT2_LAYERS,),
    head_names=(DECODER_HEAD,),
)
