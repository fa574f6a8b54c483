"""Llama and Mistral checkpoints (``model_type`` ``llama``, ``mistral``)."""

from __future__ import annotations

import dataclasses
import math

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained.hf_config import Config
from pz_persist.pretrained.hf_config import RopeScaling
from pz_persist.pretrained.hf_config import bool_field
from pz_persist.pretrained.hf_config import lm_head_source
from pz_persist.pretrained.hf_config import scaled_rope
from pz_persist.pretrained.hf_plan import Plan
from pz_persist.pretrained.hf_plan import TensorSpec
from pz_persist.pretrained.hf_plan import check_layers
from pz_persist.pretrained.hf_weights import Weights
from pz_persist.pretrained.layers.scaled_rope import ApplyScaledRoPE

# transformers' defaults for a config.json without max_position_embeddings
# (read only by the rope types that need it).
_MAX_POSITIONS = {False: 2048, True: 4096 * 32}


def llama_plan(cfg: Config, weights: Weights, sliding: bool = False) -> Plan:
  """Maps a Llama (or, with ``sliding``, Mistral) checkpoint to Penzai.

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
  hidden = cfg.require("hidden_size")
  heads = cfg.require("num_attention_heads")
  kv_heads = cfg.get("num_key_value_heads", heads)
  if heads % kv_heads:
    raise cfg.unsupported(
        "num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}"
    )
  head_dim = cfg.get("head_dim", hidden // heads)
  theta, fraction, scaling = scaled_rope(cfg, 10_000.0, _MAX_POSITIONS[sliding])
  if fraction != 1.0:
    raise cfg.unsupported(
        "partial_rotary_factor", fraction, "Llama-style RoPE covers every dimension"
    )
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

  groups, per_group = kv_heads, heads // kv_heads
  if per_group == 1:
    q_heads: dict[str, int] = {"heads": kv_heads}
    kv_axes: dict[str, int] = {"heads": kv_heads}
  elif kv_heads == 1:
    q_heads, kv_axes = {"query_heads": per_group}, {}
  else:
    q_heads, kv_axes = {"head_groups": groups, "query_heads": per_group}, {"head_groups": groups}

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

  mlp = config.mlp_hidden_dim
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

  def build() -> model_parts.TransformerLM:
    skeleton = llamalike_common.build_llamalike_transformer(config, init_base_rng=None)
    return skeleton if scaling is None else with_scaled_rope(skeleton, scaling)

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


def mistral_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Mistral checkpoint: Llama's layout plus sliding-window attention.

  Penzai's ``ApplyCausalSlidingWindowAttentionMask`` masks keys ``window`` or
  more positions back, as Hugging Face does. (Penzai's KV-cache sampling does
  not apply the window; full-sequence calls do.)
  """
  return llama_plan(cfg, weights, sliding=True)
