"""Kimi-Linear checkpoints (``model_type`` ``kimi_linear``: Kimi-Linear-48B-A3B).

Kimi-Linear mixes two token mixers, chosen per layer by ``layer_types``
(else by ``linear_attn_config``'s 1-indexed ``full_attn_layers`` /
``kda_layers``, else every fourth layer from layer 4 on is full attention):

- **Kimi Delta Attention** (`pz_persist.nn.kimi_delta_attention`): a
  gated delta rule with per-channel decay (low-rank ``f_a_proj`` /
  ``f_b_proj`` plus ``dt_bias``, times ``exp(A_log)`` per head), a
  sigmoid-gated output norm (low-rank ``g_a_proj`` / ``g_b_proj``),
  ``linear_num_heads`` heads of ``linear_head_dim``, separate
  ``q/k/v_conv1d`` short convolutions of ``linear_conv_kernel_dim`` taps;
  its state rides in the sampler (`CachingKimiDeltaAttention`);
- **multi-head latent attention without position embeddings** (NoPE:
  DeepSeek-V3's `pz_persist.nn.latent_attention` with no rotation; the
  shared ``qk_rope_head_dim`` key part is kept, unrotated), the softmax
  scale ``qk_head_dim ** -0.5``, the KV cache holding the latent.

The feed-forward blocks are DeepSeek-V3's
(`pz_persist.pretrained.hf.building.deepseek_moe`): a SwiGLU MLP where
``mlp_layer_types`` says ``"dense"`` (else the first
``first_k_dense_replace``, one by default), elsewhere ``num_experts``
experts with group-limited sigmoid routing, ``e_score_correction_bias``,
``moe_renormalize`` and ``routed_scaling_factor``, plus shared experts.
The checkpoint names them as Moonshot's code does: ``block_sparse_moe.``
(a dense layer's ``mlp.`` too), experts' ``w1`` / ``w3`` / ``w2``.
transformers' ``attribute_map`` spellings (``num_experts``,
``num_experts_per_token``, ``moe_renormalize``, ``num_expert_group``,
``num_shared_experts``, ``model_max_length``) are read as the fields they
name.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist import errors
from pz_persist.nn import latent_attention as mla
from pz_persist.nn import mixture_of_experts as moe
from pz_persist.nn.kimi_delta_attention import KimiDeltaAttention
from pz_persist.pretrained.hf.building import latent_decoder as latent
from pz_persist.pretrained.hf.building.aliases import read_aliases
from pz_persist.pretrained.hf.building.decoder import norm_specs
from pz_persist.pretrained.hf.building.decoder import outer_specs
from pz_persist.pretrained.hf.building.deepseek_moe import MOE_IGNORED
from pz_persist.pretrained.hf.building.deepseek_moe import ROUTER_DEFAULTS_WHY
from pz_persist.pretrained.hf.building.deepseek_moe import check_expert_count
from pz_persist.pretrained.hf.building.deepseek_moe import read_routing
from pz_persist.pretrained.hf.building.deepseek_moe import routing_fields
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import OBJECT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import STRING
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import lm_head_source
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.plan import DECODER_HEAD
from pz_persist.pretrained.hf.plan import DECODER_LAYERS
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import check_layers
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Stacked
from pz_persist.pretrained.hf.weights import View
from pz_persist.pretrained.hf.weights import Weights

_ALIASES = {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
            "num_experts_per_token": "num_experts_per_tok", "moe_renormalize": "norm_topk_prob",
            "num_expert_group": "n_group", "num_shared_experts": "n_shared_experts",
            "model_max_length": "max_position_embeddings"}
"""transformers' ``KimiLinearConfig.attribute_map`` (the spelling its
``config.json`` has -> the field DeepSeek-V3's routing reads)."""

_LINEAR_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
                "short_conv_kernel_size": "linear_conv_kernel_dim"}
"""``linear_attn_config``'s sizes (the Hub's spelling) -> the fields they set."""

_KINDS = ("full_attention", "linear_attention")
_MLP_KINDS = ("dense", "sparse")


def _list_of(kinds: tuple[str, ...]) -> tuple[Callable[[Any], bool], str]:
  return (lambda v: isinstance(v, list) and all(k in kinds for k in v),
          "a list of " + " / ".join(f'"{k}"' for k in kinds))


_FIELDS = {
    **latent.FIELDS,
    "linear_head_dim": POSITIVE_INT, "linear_num_heads": POSITIVE_INT,
    "linear_conv_kernel_dim": POSITIVE_INT, "linear_attn_config": OBJECT,
    "layer_types": _list_of(_KINDS), "mlp_layer_types": _list_of(_MLP_KINDS),
    "num_experts": POSITIVE_INT, "num_local_experts": POSITIVE_INT,
    "num_experts_per_token": POSITIVE_INT, "moe_renormalize": BOOLEAN,
    "num_expert_group": POSITIVE_INT, "num_shared_experts": POSITIVE_INT,
    "model_max_length": POSITIVE_INT, "mla_use_nope": BOOLEAN,
    "moe_router_activation_func": STRING, "use_grouped_topk": BOOLEAN,
    "first_k_dense_replace": NON_NEGATIVE_INT,
}


@dataclasses.dataclass(frozen=True)
class _Linear:
  """The KDA layers' checked sizes."""

  heads: int
  head_dim: int
  taps: int


def _linear_config(cfg: Config) -> tuple[_Linear, dict[str, Any]]:
  """The KDA sizes, with ``linear_attn_config``'s overriding the top-level
  fields as transformers does, and that sub-config's layer lists."""
  sub = cfg.get("linear_attn_config") or {}
  unknown = sorted(set(sub) - set(_LINEAR_KEYS) - {"full_attn_layers", "kda_layers"})
  if unknown:
    raise cfg.unsupported(f"linear_attn_config.{unknown[0]}", sub[unknown[0]],
                          "transformers' Kimi-Linear reads only head_dim, num_heads,"
                          " short_conv_kernel_size, full_attn_layers and kda_layers there")
  sizes = {}
  for key, field in _LINEAR_KEYS.items():
    value = sub.get(key)
    top = cfg.get(field, FROM_TABLE)  # Read (and checked) either way: the sub-config wins.
    sizes[field] = cfg.checked(field, value) if value is not None else top
  return _Linear(sizes["linear_num_heads"], sizes["linear_head_dim"],
                 sizes["linear_conv_kernel_dim"]), sub


def _attention_kinds(cfg: Config, sub: Mapping[str, Any], layers: int) -> Callable[[int], bool]:
  """Whether layer ``i`` is full (latent) attention, as
  ``KimiLinearConfig`` decides; never a list built from the count alone."""
  given = cfg.get("layer_types")
  if given is not None:
    if len(given) != layers:
      raise cfg.unsupported("layer_types", f"a list of {len(given)}",
                            f"needs one entry per layer (num_hidden_layers={layers})")
    full = frozenset(i for i, kind in enumerate(given) if kind == _KINDS[0])
    return lambda i: i in full
  if "full_attn_layers" in sub and "kda_layers" in sub:
    lists = {}
    for key in ("full_attn_layers", "kda_layers"):
      value = sub[key]
      if not (isinstance(value, list) and all(
          type(i) is int and 1 <= i <= layers for i in value)):  # pylint: disable=unidiomatic-typecheck
        raise cfg.invalid(f"linear_attn_config.{key}", value,
                          f"a list of 1-indexed layers (1..{layers})")
      lists[key] = set(value)
    attention, kda = lists["full_attn_layers"], lists["kda_layers"]
    if attention & kda or len(attention) + len(kda) != layers:
      raise cfg.unsupported("linear_attn_config.full_attn_layers", sorted(attention)[:10],
                            f"with kda_layers it must name each of the {layers} layers once")
    zero_based = frozenset(i - 1 for i in attention)
    return lambda i: i in zero_based
  return lambda i: i > 0 and i % 4 == 0


def _dense_rule(cfg: Config, layers: int) -> Callable[[int], bool]:
  """Whether layer ``i`` has a dense MLP: ``mlp_layer_types``, else the
  first ``first_k_dense_replace`` (transformers' default: one)."""
  given = cfg.get("mlp_layer_types")
  if given is not None:
    if len(given) != layers:
      raise cfg.unsupported("mlp_layer_types", f"a list of {len(given)}",
                            f"needs one entry per layer (num_hidden_layers={layers})")
    dense = frozenset(i for i, kind in enumerate(given) if kind == _MLP_KINDS[0])
    return lambda i: i in dense
  first = cfg.get("first_k_dense_replace", FROM_TABLE)
  return lambda i: i < first


_EXPERT_PART = re.compile(r"(?<!shared_)experts\.((?:\d+\.)?)(gate|up|down)_proj\.")
_HUB_PART = {"gate": "w1", "up": "w3", "down": "w2"}


def _hub_name(name: str) -> str:
  """A DeepSeek-style MoE tensor name as Kimi-Linear stores it."""
  name = name.replace(".mlp.", ".block_sparse_moe.")
  return _EXPERT_PART.sub(lambda m: f"experts.{m.group(1)}{_HUB_PART[m.group(2)]}.", name)


def kda_specs(name: str, s: str, hidden: int, linear: _Linear) -> list[TensorSpec]:
  """Layer ``s``'s KDA tensors (``self_attn.``) as `KimiDeltaAttention`
  ``name``'s parameters."""
  h, d, a = linear.heads, linear.head_dim, s + "self_attn."
  width = h * d
  out = []
  for stream, axes in (("query", ("key_heads", "key_projection")),
                       ("key", ("key_heads", "key_projection")),
                       ("value", ("value_heads", "value_projection"))):
    short = stream[0]
    out += [TensorSpec(f"{name}/{stream}.weights", f"{a}{short}_proj.weight", (h, d, hidden),
                       (*axes, "embedding"), stored=(width, hidden)),
            TensorSpec(f"{name}/{stream}_conv", f"{a}{short}_conv1d.weight", (h, d, linear.taps),
                       (*axes, "conv_taps"), stored=(width, 1, linear.taps))]
  for field, hf, axes in (("output_gate", "g", ("value_heads", "value_projection")),
                          ("decay_input", "f", ("value_heads", "key_projection"))):
    out += [TensorSpec(f"{name}/{field}_a.weights", f"{a}{hf}_a_proj.weight", (d, hidden),
                       ("gate_rank", "embedding")),
            TensorSpec(f"{name}/{field}_b.weights", f"{a}{hf}_b_proj.weight", (h, d, d),
                       (*axes, "gate_rank"), stored=(width, d))]
  return out + [
      TensorSpec(f"{name}/write_strength.weights", a + "b_proj.weight", (h, hidden),
                 ("value_heads", "embedding")),
      TensorSpec(f"{name}/log_decay_rate", a + "A_log", (h,), ("value_heads",),
                 stored=(1, 1, h, 1)),
      TensorSpec(f"{name}/decay_bias", a + "dt_bias", (h, d), ("value_heads", "key_projection"),
                 stored=(width,)),
      TensorSpec(f"{name}/norm_scale", a + "o_norm.weight", (d,), ("value_projection",)),
      TensorSpec(f"{name}/output.weights", a + "o_proj.weight", (hidden, h, d),
                 ("embedding", "value_heads", "value_projection"), stored=(hidden, width)),
  ]


def kimi_linear_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Kimi-Linear checkpoint to Penzai (module docstring)."""
  read_aliases(cfg, _ALIASES)
  cfg.expect("mla_use_nope", {True}, True,
             why="; transformers' Kimi-Linear attention has no position embedding")
  cfg.expect("moe_router_activation_func", {"sigmoid"}, "sigmoid",
             why="; transformers' Kimi-Linear router scores are sigmoids")
  if cfg.get("quantization_config") is not None:
    raise cfg.unsupported("quantization_config", cfg.raw["quantization_config"],
                          "no quantized Kimi-Linear layout is read yet")
  cfg.expect("hidden_act", {"silu"}, "silu", why="; Kimi-Linear's MLPs and convolutions use SiLU")
  # transformers' Kimi-Linear reads neither head_dim (no RoPE: the Hub's
  # 48B config writes 72, hidden_size / num_attention_heads) nor
  # qk_head_dim (it adds the nope and rope parts itself).
  sizes = dataclasses.replace(latent.read_sizes(cfg, _dense_rule, derived=()), interleave=False)
  kv_heads = cfg.get("num_key_value_heads", sizes.heads)
  if kv_heads != sizes.heads:
    # transformers' Kimi-Linear divides the heads by it to repeat keys that
    # are already per head: more key/value heads than heads leaves none.
    raise cfg.unsupported("num_key_value_heads", kv_heads,
                          f"latent attention has keys and values for each of the"
                          f" num_attention_heads={sizes.heads} heads; transformers' Kimi-Linear"
                          " runs only when the two are equal")
  linear, sub = _linear_config(cfg)
  full = _attention_kinds(cfg, sub, sizes.layers)
  routing = read_routing(cfg, sizes.hidden, defaults=_ROUTING_DEFAULTS)
  # transformers' KimiLinearForCausalLM ties nothing (its _tied_weights_keys
  # is empty): the head is lm_head.weight whatever tie_word_embeddings says.
  cfg.get("tie_word_embeddings", False)
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  check_layers(cfg, weights.names, DECODER_LAYERS, sizes.layers)
  first_moe = next((i for i in range(sizes.layers) if not sizes.dense(i)), None)
  if first_moe is not None and isinstance(weights, Weights):  # Not export's stand-in.
    check_expert_count(cfg, weights.names, first_moe, routing.experts,
                       prefix=f"model.layers.{first_moe}.block_sparse_moe.experts.", part="w1")
  head_source = lm_head_source(cfg, False, weights, DECODER_HEAD, "model.embed_tokens.weight")
  dtype, h = weights.dtype, sizes.hidden
  views: list[View] = []

  def src(name: str, shape: tuple[int, int], parts: list[str] | None = None) -> str:
    del shape  # Checked against the headers with the spec's own shape.
    if parts is None:
      return name
    views.append(Stacked(_hub_name(name), tuple(_hub_name(p) for p in parts)))
    return name

  specs = outer_specs(sizes.vocab, h, head_source)
  for i in range(sizes.layers):
    p, s = f"transformer/block_{i}/", f"model.layers.{i}."
    specs += norm_specs(p, s, h)
    specs += (latent.mla_specs(p, s, sizes, src) if full(i)
              else kda_specs(p + "linear_attention", s, h, linear))
    if sizes.dense(i):
      # Moonshot's checkpoints name a dense MLP ``mlp.``; transformers
      # writes ``block_sparse_moe.`` (its renaming, reversed): either is read.
      module = "mlp." if f"{s}mlp.gate_proj.weight" in weights.names else "block_sparse_moe."
      specs += [dataclasses.replace(spec, source=spec.source.replace(".mlp.", f".{module}"))
                for spec in latent.dense_mlp_specs(p, s, h, sizes.intermediate, src)]
    else:
      specs += [dataclasses.replace(spec, source=_hub_name(spec.source))
                for spec in routing.specs(p, s, src)]
  scale = float((sizes.nope + sizes.rope) ** -0.5)

  def build() -> model_parts.TransformerLM:
    body: list[pz.nn.Layer] = [pz.nn.EmbeddingLookup(pz.nn.EmbeddingTable.from_config(
        name="transformer/embedder", init_base_rng=None, vocab_size=sizes.vocab,
        embedding_axes={"embedding": h}, dtype=dtype))]
    for i in range(sizes.layers):
      name = f"transformer/block_{i}"
      mixer = (latent.latent_attention(f"{name}/attention", sizes, pz.nn.Sequential([]), scale,
                                       dtype) if full(i)
               else [KimiDeltaAttention.from_config(
                   f"{name}/linear_attention", embedding=h, heads=linear.heads,
                   head_dim=linear.head_dim, conv_taps=linear.taps, norm_epsilon=sizes.eps)])
      ffw = (latent.swiglu(f"{name}/mlp", h, sizes.intermediate, dtype) if sizes.dense(i)
             else routing.layer(f"{name}/mlp", dtype))
      body.append(model_parts.TransformerBlock(sublayers=[
          pz.nn.Residual(pz.nn.Sequential([
              _norm(f"{name}/pre_attention_norm", {"embedding": h}, sizes.eps, dtype),
              *mixer])),
          pz.nn.Residual(pz.nn.Sequential([
              _norm(f"{name}/pre_ffw_norm", {"embedding": h}, sizes.eps, dtype), ffw])),
      ]))
    body += [_norm("transformer/final_norm", {"embedding": h}, sizes.eps, dtype),
             pz.nn.Linear.from_config(name="transformer/lm_head", init_base_rng=None,
                                      input_axes={"embedding": h},
                                      output_axes={"vocabulary": sizes.vocab}, dtype=dtype)]
    return model_parts.TransformerLM(
        metadata=model_parts.TransformerMetadata(
            common_head_axes={}, query_only_head_axes={"heads": sizes.heads},
            embedding_dim=h, projection_dim=sizes.kv_rank + sizes.rope,
            mlp_hidden_dim=sizes.intermediate, vocab_size=sizes.vocab, activation_dtype=dtype),
        body=pz.nn.Sequential(body))

  return Plan(build, tuple(specs), tuple(views))


def _norm(name: str, axes: dict[str, int], eps: float, dtype: Any) -> pz.nn.RMSLayerNorm:
  return pz.nn.RMSLayerNorm.from_config(name=name, init_base_rng=None, across_axes=axes,
                                        epsilon=eps, dtype=dtype)


def _detect(model: pz.nn.Layer) -> str | None:
  """Kimi Delta Attention layers."""
  return "kimi_linear" if all_layers(model, KimiDeltaAttention) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only kimi_linear.
  all_blocks = blocks(model)
  full = [bool(all_layers(b, mla.LatentAttentionLogits)) for b in all_blocks]
  if not any(full):
    raise errors.ExportError(
        "this Kimi-Linear model has no latent attention layer: the sizes config.json must"
        " give for one are not held by any of its layers, and export_hf does not guess them.")
  fields, dense = latent.latent_fields(model, like, rotary=False)
  fields["tie_word_embeddings"] = like.get("tie_word_embeddings", False)  # Never tied (above).
  for unread in ("rope_interleave", "num_nextn_predict_layers"):
    fields.pop(unread, None)
  kda = all_layers(model, KimiDeltaAttention)[0]
  conv = dict(kda.key_conv.value.named_shape)
  fields.update(linear_num_heads=conv["key_heads"], linear_head_dim=conv["key_projection"],
                linear_conv_kernel_dim=conv["conv_taps"],
                layer_types=[_KINDS[0] if f else _KINDS[1] for f in full],
                mlp_layer_types=[_MLP_KINDS[0] if d else _MLP_KINDS[1] for d in dense])
  routed = routing_fields(model, like, sum(dense))
  routed.pop("first_k_dense_replace")
  if not all_layers(model, moe.MixtureOfExperts):
    routed = {k: like.get(v, like.get(k, _DEFAULTS[k])) for k, v in _WRITTEN.items()}
  fields.update({_WRITTEN.get(k, k): v for k, v in routed.items()})
  return fields


_WRITTEN = {"n_routed_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
            "norm_topk_prob": "moe_renormalize", "n_group": "num_expert_group",
            "n_shared_experts": "num_shared_experts"}
"""DeepSeek-V3's routing fields -> the spelling transformers writes for Kimi-Linear."""

_LATENT_SIZES = ("num_attention_heads", "num_key_value_heads", "kv_lora_rank", "q_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

_ROUTING_DEFAULTS = {"n_routed_experts": 256, "n_group": 1, "topk_group": 1,
                     "num_experts_per_tok": 8, "moe_intermediate_size": 1024,
                     "n_shared_experts": 1, "routed_scaling_factor": 2.446}
"""``KimiLinearConfig``'s routing defaults, under DeepSeek-V3's names."""

_DEFAULTS = {
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "attention_bias": False, "max_position_embeddings": 1048576,
    "linear_head_dim": 128, "linear_num_heads": 32, "linear_conv_kernel_dim": 4,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "mla_use_nope": True,
    "moe_router_activation_func": "sigmoid", "rope_interleave": False,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
    **_ROUTING_DEFAULTS,
    "num_experts": 256, "num_experts_per_token": 8, "moe_renormalize": True,
    "num_expert_group": 1, "num_shared_experts": 1,
}
"""What each absent field means: ``KimiLinearConfig``'s value."""

_DEFAULTS_WHY = {
    **ROUTER_DEFAULTS_WHY,
    "rope_interleave": "not a KimiLinearConfig field: its latent attention rotates nothing",
    "n_routed_experts": "DeepSeek-V3's name of num_experts (KimiLinearConfig's num_local_experts)",
    "first_k_dense_replace": ("read by KimiLinearConfig from the Hub's config.json when"
                              " mlp_layer_types is absent (default 1)"),
    "mla_use_nope": "the Hub's field: its attention has no position embedding",
    "moe_router_activation_func": "the Hub's field: its router scores are sigmoids",
}

_HUB_ONLY = ("the Hub's config.json fields for Moonshot's remote code, which transformers'"
             " class does not read")

RECORD = Family(
    title="Kimi-Linear",
    model_types={"kimi_linear": ModelType(
        kimi_linear_plan, "KimiLinearForCausalLM", defaults=_DEFAULTS, defaults_why=_DEFAULTS_WHY,
        ignored_fields={
            **MOE_IGNORED,
            "the attention has no position embedding (NoPE): transformers reads no rotary"
            " field": ("rope_theta", "rope_scaling", "rope_parameters"),
            _HUB_ONLY: ("use_grouped_topk", "num_nextn_predict_layers", "moe_layer_freq"),
        },
        foreign_fields=frozenset({"rope_theta", "rope_scaling", "rope_parameters",
                                  "use_grouped_topk",
                                  "num_nextn_predict_layers", "moe_layer_freq",
                                  "aux_loss_alpha", "seq_aux", "ep_size",
                                  "router_aux_loss_coef", "auto_map"}))},
    detect=_detect,
    write_config=_write_config,
    adds=("Kimi Delta Attention (`kimi_delta_attention`: a gated delta rule with per-channel"
          " low-rank decay and a sigmoid-gated output norm, its state carried by the sampler)"
          " beside NoPE multi-head latent attention (`latent_attention`, the cache holding the"
          " latent), per `layer_types` / `linear_attn_config`; DeepSeek-V3's experts"
          " (`block_sparse_moe`), dense where `mlp_layer_types` says"),
    refuses=("`attention_bias`, `num_key_value_heads` other than the heads, `mla_use_nope`"
             " false, routers other than sigmoid, quantized checkpoints"),
    rank=5,
    fields=_FIELDS,
)
