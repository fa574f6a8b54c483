"""GPT-NeoX / Pythia checkpoints (``model_type`` ``gpt_neox``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import gpt_neox

from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config import lm_head_source
from pz_persist.pretrained.hf.config import rope
from pz_persist.pretrained.hf.config_from_model import activation_field
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import size_fields
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import NEOX_HEAD
from pz_persist.pretrained.hf.plan import NEOX_LAYERS
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import check_layers
from pz_persist.pretrained.hf.plan import left_out_matching
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_NEOX_ACTIVATIONS = {
    "gelu": "gelu_exact",
    "gelu_fast": "gelu_approx",  # The same tanh formula (hf_config.TANH_GELU).
    "gelu_new": "gelu_approx",
    "gelu_pytorch_tanh": "gelu_approx",
    "relu": "relu",
    "silu": "silu",
}


def gpt_neox_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a GPT-NeoX (Pythia) checkpoint to Penzai.

  GPT-NeoX fuses query, key and value into one ``query_key_value`` matrix
  whose rows are ordered (head, q/k/v, projection): it is reshaped that way
  and sliced three times. Penzai's builder uses a default epsilon for the
  final layer norm; it is set to ``layer_norm_eps`` here, as Hugging Face
  does.
  """
  hidden = cfg.require("hidden_size")
  heads = cfg.require("num_attention_heads")
  head_dim = hidden // heads
  if "head_dim" in cfg.raw and cfg.get("head_dim") not in (None, head_dim):
    raise cfg.unsupported(
        "head_dim", cfg.raw["head_dim"],
        f"GPT-NeoX uses hidden_size // num_attention_heads = {head_dim}",
    )
  theta, fraction = rope(cfg, float(cfg.get("rotary_emb_base", 10_000.0)))
  fraction = float(cfg.get("rotary_pct", fraction))
  act = cfg.expect("hidden_act", set(_NEOX_ACTIVATIONS), "gelu")
  bool_field(cfg, "use_parallel_residual", True, True,
              "Penzai's GPT-NeoX block is the parallel-residual formulation")
  bool_field(cfg, "attention_bias", True, True,
              "Penzai's GPT-NeoX attention always has biases")
  eps = float(cfg.get("layer_norm_eps", 1e-5))
  tied = cfg.get("tie_word_embeddings", False)
  config = gpt_neox.GPTNeoXTransformerConfig(
      num_attention_heads=heads,
      embedding_dim=hidden,
      projection_dim=head_dim,
      mlp_hidden_dim=cfg.require("intermediate_size"),
      num_decoder_blocks=cfg.require("num_hidden_layers"),
      vocab_size=cfg.require("vocab_size"),
      activation_fn=_NEOX_ACTIVATIONS[act],
      rope_subset_size=int(fraction * head_dim),
      rope_wavelength=theta,
      layernorm_epsilon=eps,
      parameter_dtype=None,
      activation_dtype=None,
  )
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  check_layers(cfg, weights.names, NEOX_LAYERS, config.num_decoder_blocks)
  head_source = lm_head_source(cfg, tied, weights, NEOX_HEAD,
                                "gpt_neox.embed_in.weight")
  config = dataclasses.replace(config, parameter_dtype=weights.dtype,
                               activation_dtype=weights.dtype)

  def build() -> model_parts.TransformerLM:
    skeleton = gpt_neox.build_gpt_neox_transformer(config, init_base_rng=None)
    return (
        pz.select(skeleton)
        .at_instances_of(pz.nn.Standardize)
        .apply(lambda s: dataclasses.replace(s, epsilon=eps))
    )

  mlp, vocab = config.mlp_hidden_dim, config.vocab_size
  specs = [
      TensorSpec("transformer/embedder.embeddings", "gpt_neox.embed_in.weight",
                  (vocab, hidden), ("vocabulary", "embedding")),
      TensorSpec("transformer/final_norm/scale.weights", "gpt_neox.final_layer_norm.weight",
                  (hidden,), ("embedding",)),
      TensorSpec("transformer/final_norm/shift.bias", "gpt_neox.final_layer_norm.bias",
                  (hidden,), ("embedding",)),
      TensorSpec("transformer/lm_head.weights", head_source,
                  (vocab, hidden), ("vocabulary", "embedding")),
  ]
  for i in range(config.num_decoder_blocks):
    p, s = f"transformer/block_{i}/", f"gpt_neox.layers.{i}."
    specs += [
        TensorSpec(p + "pre_attention_norm/scale.weights", s + "input_layernorm.weight",
                    (hidden,), ("embedding",)),
        TensorSpec(p + "pre_attention_norm/shift.bias", s + "input_layernorm.bias",
                    (hidden,), ("embedding",)),
        TensorSpec(p + "pre_ffw_norm/scale.weights", s + "post_attention_layernorm.weight",
                    (hidden,), ("embedding",)),
        TensorSpec(p + "pre_ffw_norm/shift.bias", s + "post_attention_layernorm.bias",
                    (hidden,), ("embedding",)),
        TensorSpec(p + "mlp/in/Linear.weights", s + "mlp.dense_h_to_4h.weight",
                    (mlp, hidden), ("neurons", "embedding")),
        TensorSpec(p + "mlp/in/AddBias.bias", s + "mlp.dense_h_to_4h.bias",
                    (mlp,), ("neurons",)),
        TensorSpec(p + "mlp/out/Linear.weights", s + "mlp.dense_4h_to_h.weight",
                    (hidden, mlp), ("embedding", "neurons")),
        TensorSpec(p + "mlp/out/AddBias.bias", s + "mlp.dense_4h_to_h.bias",
                    (hidden,), ("embedding",)),
        TensorSpec(p + "attention/output/Linear.weights", s + "attention.dense.weight",
                    (hidden, heads, head_dim), ("embedding", "heads", "projection"),
                    stored=(hidden, heads * head_dim)),
        TensorSpec(p + "attention/output/AddBias.bias", s + "attention.dense.bias",
                    (hidden,), ("embedding",)),
    ]
    for index, which in enumerate(("query", "key", "value")):
      specs += [
          TensorSpec(p + f"attention/{which}/Linear.weights",
                      s + "attention.query_key_value.weight",
                      (heads, 3, head_dim, hidden), ("heads", "projection", "embedding"),
                      take=(1, index), stored=(heads * 3 * head_dim, hidden)),
          TensorSpec(p + f"attention/{which}/AddBias.bias",
                      s + "attention.query_key_value.bias",
                      (heads, 3, head_dim), ("heads", "projection"), take=(1, index),
                      stored=(heads * 3 * head_dim,)),
      ]
  return Plan(build, tuple(specs))


def _detect(model: pz.nn.Layer) -> str | None:
  """Penzai's GPT-NeoX: layer norms with a shift, or a partial rotary
  embedding without RMS norms (which later families with partial rotary
  have)."""
  if all_layers(model, pz.nn.Standardize) or (
      all_layers(model, pz.nn.ApplyRoPEToSubset) and not all_layers(model, pz.nn.RMSStandardize)):
    return "gpt_neox"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only gpt_neox.
  return {
      **size_fields(model, grouped=False),
      "layer_norm_eps": number(first_layer(model, pz.nn.Standardize, "layer norm").epsilon),
      **rope_fields(model),
      **activation_field(model, like, spellings=_NEOX_ACTIVATIONS),
      **tied_field(model, like),
      # Fixed by Penzai's GPT-NeoX structure.
      "attention_bias": True,
      "use_parallel_residual": True,
  }


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt_neox": {
        "defaults": {"hidden_act": "gelu", "tie_word_embeddings": False, "layer_norm_eps": 1e-5,
                     "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                     "rotary_emb_base": 10_000.0, "rotary_pct": 0.25,
                     "use_parallel_residual": True, "attention_bias": True},
        "defaults_why": {
            "rotary_emb_base": (
                "transformers 4's name of rope_theta, whose default (10,000) it is"),
            "rotary_pct": (
                "transformers 4's name of partial_rotary_factor, whose default (0.25) it "
                'is'),
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="GPT-NeoX, Pythia",
    model_types={"gpt_neox": ModelType(
        gpt_neox_plan, "GPTNeoXForCausalLM", **_TRANSFORMERS_DEFAULTS["gpt_neox"],
        left_out=(left_out_matching(
            (r"(^|\.)attention\.(masked_)?bias$",),
            "the causal-mask buffers (attention.bias, attention.masked_bias)",
            "older transformers saved them (Pythia's folders hold them); GPTNeoXForCausalLM"
            " ignores them (_keys_to_ignore_on_load_unexpected)"),))},
    detect=_detect,
    write_config=_write_config,
    adds="fused query/key/value, partial rotary, parallel residual",
    refuses="scaled RoPE, a sequential residual, attention without biases",
    rank=100,
    layer_prefixes=(NEOX_LAYERS,),
    head_names=(NEOX_HEAD,),
)
