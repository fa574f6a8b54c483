"""Llama and Mistral checkpoints (``model_type`` ``llama``, ``mistral``)."""

from __future__ import annotations

import dataclasses
import math

from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained.hf_config import Config
from pz_persist.pretrained.hf_config import bool_field
from pz_persist.pretrained.hf_config import lm_head_source
from pz_persist.pretrained.hf_config import rope
from pz_persist.pretrained.hf_plan import Plan
from pz_persist.pretrained.hf_plan import TensorSpec
from pz_persist.pretrained.hf_plan import check_layers
from pz_persist.pretrained.hf_weights import Weights


def llama_plan(cfg: Config, weights: Weights, sliding: bool = False) -> Plan:
  """Maps a Llama (or, with ``sliding``, Mistral) checkpoint to Penzai.

  Penzai's llama-like transformer splits attention heads into
  ``head_groups`` (the key/value heads) and ``query_heads`` (query heads per
  group), dropping an axis of size one, so the fused ``q_proj`` /``k_proj``
  /``v_proj``/``o_proj`` matrices are reshaped accordingly; Hugging Face's
  grouped-query attention uses key/value head ``h // group_size`` for query
  head ``h``, which is exactly a (groups, per-group) row-major split.
  """
  hidden, heads, kv_heads, head_dim = attention_sizes(cfg, kv_heads_default=None,
                                                      head_dim_default=None)
  theta = full_rotary_wavelength(cfg)
  cfg.expect("hidden_act", {"silu"}, "silu", why="; Penzai's llama-like MLP is SwiGLU")
  bool_field(cfg, "attention_bias", False, False, "Penzai's llama-like attention has no biases")
  bool_field(cfg, "mlp_bias", False, False, "Penzai's llama-like MLP has no biases")
  tied = cfg.get("tie_word_embeddings", False)
  if sliding:
    # transformers' MistralConfig defaults to a 4096-token window when the
    # field is absent; an explicit null means global attention.
    window = cfg.get("sliding_window") if "sliding_window" in cfg.raw else 4096
    attention = (
        llamalike_common.AttentionTypeGlobalCausal()
        if window is None
        else llamalike_common.AttentionTypeSlidingWindowCausal(window)
    )
  else:
    attention = llamalike_common.AttentionTypeGlobalCausal()
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=kv_heads,
      query_head_multiplier=heads // kv_heads,
      embedding_dim=hidden,
      projection_dim=head_dim,
      mlp_hidden_dim=cfg.require("intermediate_size"),
      num_decoder_blocks=cfg.require("num_hidden_layers"),
      vocab_size=cfg.require("vocab_size"),
      mlp_variant="swiglu",
      tie_embedder_and_logits=False,
      rope_wavelength=theta,
      rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      attention_type=attention,
      parameter_dtype=None,
      activation_dtype=None,
  )
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  check_layers(cfg, weights.names, "model.layers.", config.num_decoder_blocks)
  head_source = lm_head_source(cfg, tied, weights.names, "lm_head.weight",
                                "model.embed_tokens.weight")
  config = dataclasses.replace(config, parameter_dtype=weights.dtype,
                               activation_dtype=weights.dtype)

  vocab = config.vocab_size
  specs = [
      TensorSpec("transformer/embedder.embeddings", "model.embed_tokens.weight",
                  (vocab, hidden), ("vocabulary", "embedding")),
      TensorSpec("transformer/final_norm/scale.weights", "model.norm.weight",
                  (hidden,), ("embedding",)),
      TensorSpec("transformer/lm_head.weights", head_source,
                  (vocab, hidden), ("vocabulary", "embedding")),
  ]
  for i in range(config.num_decoder_blocks):
    p, s = f"transformer/block_{i}/", f"model.layers.{i}."
    specs += [
        TensorSpec(p + "pre_attention_norm/scale.weights", s + "input_layernorm.weight",
                    (hidden,), ("embedding",)),
        TensorSpec(p + "pre_ffw_norm/scale.weights", s + "post_attention_layernorm.weight",
                    (hidden,), ("embedding",)),
        *block_specs(p, s, config),
    ]
  return Plan(
      lambda: llamalike_common.build_llamalike_transformer(config, init_base_rng=None),
      tuple(specs),
  )


def mistral_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Mistral checkpoint: Llama's layout plus sliding-window attention.

  Penzai's ``ApplyCausalSlidingWindowAttentionMask`` masks keys ``window`` or
  more positions back, as Hugging Face does. (Penzai's KV-cache sampling does
  not apply the window; full-sequence calls do.)
  """
  return llama_plan(cfg, weights, sliding=True)


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
  if fraction != 1.0:
    raise cfg.unsupported(
        "partial_rotary_factor", fraction, "Llama-style RoPE covers every dimension"
    )
  return theta


def _head_axes(config: llamalike_common.LlamalikeTransformerConfig) -> tuple[dict[str, int], dict[str, int]]:
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
  q_heads, kv_axes = _head_axes(config)

  def proj(label: str, source: str, head_axes: dict[str, int], output: bool = False) -> TensorSpec:
    """An attention matrix: (heads..., projection, embedding) or its transpose."""
    shape = (*head_axes.values(), head_dim)
    axes = (*head_axes, "projection")
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
