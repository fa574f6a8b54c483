"""Hugging Face Gemma / Gemma 2 folders as Penzai's own Gemma builds them.

Penzai's Gemma (``penzai.models.transformer.variants.gemma``, the structure
`pz_persist.pretrained.load_gemma` returns) keeps ``1 + w`` in each RMS
norm's scale where Hugging Face stores ``w``, ties the output head to the
embeddings (``EmbeddingDecode``, with inputs scaled by sqrt(hidden_size)) and
uses the approximate-GELU gated MLP. This plan maps a ``gemma`` / ``gemma2``
``config.json`` to exactly that structure, norms with ``offset=1`` (added in
float32), so `pz_persist.pretrained.hf_export.export_hf` can write such a
model back as a Hugging Face folder by running the plan backwards. It is not
in `pz_persist.pretrained.hf_families.BUILDERS`: ``load_hf`` reads Gemma
folders into its own layout, whose norms hold the raw ``w`` (bit-exact).
"""

from __future__ import annotations

import dataclasses
import math

from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained.hf_config import Config
from pz_persist.pretrained.hf_config import bool_field
from pz_persist.pretrained.hf_config import rope
from pz_persist.pretrained.hf_plan import Plan
from pz_persist.pretrained.hf_plan import TensorSpec
from pz_persist.pretrained.hf_plan import check_layers
from pz_persist.pretrained.hf_weights import Weights

_LAYER_TYPES = {
    "full_attention": lambda window: llamalike_common.AttentionTypeGlobalCausal(),
    "sliding_attention": llamalike_common.AttentionTypeSlidingWindowCausal,
}


def head_axes(heads: int, kv_heads: int) -> tuple[dict[str, int], dict[str, int]]:
  """Penzai's llama-like head axes of the query and of the key/value
  projections (an axis of size one is dropped), as `_head_info` builds them."""
  per_group = heads // kv_heads
  if per_group == 1:
    return {"heads": kv_heads}, {"heads": kv_heads}
  if kv_heads == 1:
    return {"query_heads": per_group}, {}
  return {"head_groups": kv_heads, "query_heads": per_group}, {"head_groups": kv_heads}


def attention_spec(label: str, source: str, axes: dict[str, int], head_dim: int, hidden: int,
                   output: bool = False) -> TensorSpec:
  """An attention matrix: (heads..., projection, embedding) or, for the
  output projection, its transpose; Hugging Face fuses the head axes."""
  shape = (*axes.values(), head_dim)
  names = (*axes, "projection")
  fused = math.prod(shape)
  if output:
    return TensorSpec(label, source, (hidden, *shape), ("embedding", *names), stored=(hidden, fused))
  return TensorSpec(label, source, (*shape, hidden), (*names, "embedding"), stored=(fused, hidden))


def _attention_types(cfg: Config, layers: int, gemma2: bool):
  """Gemma 1 attends globally; Gemma 2 alternates sliding and global layers
  (``layer_types``, or transformers' default: sliding first)."""
  if not gemma2:
    return llamalike_common.AttentionTypeGlobalCausal()
  window = cfg.get("sliding_window", 4096)
  types = cfg.get("layer_types")
  if types is None:
    types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
  if len(types) != layers or any(t not in _LAYER_TYPES for t in types):
    raise cfg.unsupported("layer_types", types,
                          f"one of {sorted(_LAYER_TYPES)} per layer ({layers} layers)")
  return tuple(_LAYER_TYPES[t](window) for t in types)


def gemma_native_plan(cfg: Config, weights: Weights, gemma2: bool = False) -> Plan:
  """Maps a Gemma (or, with ``gemma2``, Gemma 2) folder to Penzai's Gemma."""
  hidden = cfg.require("hidden_size")
  heads = cfg.require("num_attention_heads")
  kv_heads = cfg.get("num_key_value_heads", heads)
  if heads % kv_heads:
    raise cfg.unsupported("num_key_value_heads", kv_heads,
                          f"must divide num_attention_heads={heads}")
  head_dim = cfg.get("head_dim", hidden // heads)
  theta, fraction = rope(cfg, 10_000.0)
  if fraction != 1.0:
    raise cfg.unsupported("partial_rotary_factor", fraction, "Gemma's RoPE covers every dimension")
  activation = "hidden_activation" if gemma2 else "hidden_act"
  cfg.expect(activation, {"gelu_pytorch_tanh"}, "gelu_pytorch_tanh",
             why="; Penzai's Gemma MLP is the tanh-approximated GeGLU")
  bool_field(cfg, "attention_bias", False, False, "Penzai's Gemma attention has no biases")
  bool_field(cfg, "tie_word_embeddings", True, True,
             "Penzai's Gemma decodes with its embedding table")
  bool_field(cfg, "use_bidirectional_attention", False, False, "Penzai's Gemma is causal")
  layers = cfg.require("num_hidden_layers")
  scaling: float | str = "default"
  if gemma2:
    scaling = float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=kv_heads,
      query_head_multiplier=heads // kv_heads,
      embedding_dim=hidden,
      projection_dim=head_dim,
      mlp_hidden_dim=cfg.require("intermediate_size"),
      num_decoder_blocks=layers,
      vocab_size=cfg.require("vocab_size"),
      mlp_variant="geglu_approx",
      tie_embedder_and_logits=True,
      rope_wavelength=theta,
      rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      attention_type=_attention_types(cfg, layers, gemma2),
      use_post_attn_norm=gemma2,
      use_post_ffw_norm=gemma2,
      final_logit_softcap=cfg.get("final_logit_softcapping") if gemma2 else None,
      attn_logits_soft_cap=cfg.get("attn_logit_softcapping") if gemma2 else None,
      query_scaling_factor=scaling,
      parameter_dtype=None,
      activation_dtype=None,
  )
  cfg.check_all_used()
  check_layers(cfg, weights.names, "model.layers.", layers)
  config = dataclasses.replace(config, parameter_dtype=weights.dtype,
                               activation_dtype=weights.dtype)
  q_axes, kv_axes = head_axes(heads, kv_heads)
  mlp, vocab = config.mlp_hidden_dim, config.vocab_size

  def norm(label: str, source: str) -> TensorSpec:
    return TensorSpec(label, source, (hidden,), ("embedding",), offset=1.0)

  specs = [
      TensorSpec("transformer/embedder.embeddings", "model.embed_tokens.weight",
                 (vocab, hidden), ("vocabulary", "embedding")),
      norm("transformer/final_norm/scale.weights", "model.norm.weight"),
  ]
  # Penzai's norm names -> Hugging Face's (Gemma 1 has no post-norms and
  # calls its pre-feed-forward norm "post_attention_layernorm").
  norms = {"pre_attention_norm": "input_layernorm"}
  if gemma2:
    norms.update(post_attention_norm="post_attention_layernorm",
                 pre_ffw_norm="pre_feedforward_layernorm",
                 post_ffw_norm="post_feedforward_layernorm")
  else:
    norms["pre_ffw_norm"] = "post_attention_layernorm"
  for i in range(layers):
    p, s = f"transformer/block_{i}/", f"model.layers.{i}."
    specs += [norm(f"{p}{ours}/scale.weights", f"{s}{theirs}.weight")
              for ours, theirs in norms.items()]
    specs += [
        TensorSpec(p + "mlp/gating_linear.weights", s + "mlp.gate_proj.weight",
                   (mlp, hidden), ("neurons", "embedding")),
        TensorSpec(p + "mlp/value_linear.weights", s + "mlp.up_proj.weight",
                   (mlp, hidden), ("neurons", "embedding")),
        TensorSpec(p + "mlp/out_linear.weights", s + "mlp.down_proj.weight",
                   (hidden, mlp), ("embedding", "neurons")),
        attention_spec(p + "attention/query.weights", s + "self_attn.q_proj.weight",
                       q_axes, head_dim, hidden),
        attention_spec(p + "attention/key.weights", s + "self_attn.k_proj.weight",
                       kv_axes, head_dim, hidden),
        attention_spec(p + "attention/value.weights", s + "self_attn.v_proj.weight",
                       kv_axes, head_dim, hidden),
        attention_spec(p + "attention/output.weights", s + "self_attn.o_proj.weight",
                       q_axes, head_dim, hidden, output=True),
    ]
  return Plan(
      lambda: llamalike_common.build_llamalike_transformer(config, init_base_rng=None),
      tuple(specs),
  )


def gemma2_native_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Gemma 2 folder: post-norms, soft caps, alternating windows."""
  return gemma_native_plan(cfg, weights, gemma2=True)


NATIVE_BUILDERS = {"gemma": gemma_native_plan, "gemma2": gemma2_native_plan}
"""The Gemma ``model_type`` values as Penzai's own Gemma structure holds them."""
