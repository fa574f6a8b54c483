"""AI21 Jamba (``model_type`` ``jamba``): Mamba-1 layers among attention
layers, a mixture of experts on every other layer.

Each layer is Llama's (RMS norms ``input_layernorm`` and
``pre_ff_layernorm``, a SwiGLU MLP under ``feed_forward.``) with one token
mixer: Llama's attention without any position encoding on the layers ``i``
with ``i % attn_layer_period == attn_layer_offset``, else a
`pz_persist.nn.mamba.Mamba` mixer (``mamba.``: ``in_proj`` fused ``x`` then
``z``, ``conv1d``, ``x_proj`` fused time step / ``B`` / ``C``, their RMS
norms ``dt_layernorm`` / ``b_layernorm`` / ``c_layernorm``, ``dt_proj``,
``A_log``, ``D``, ``out_proj``). The layers ``i`` with ``i %
expert_layer_period == expert_layer_offset`` (when ``num_experts > 1``)
replace the MLP by a `pz_persist.nn.mixture_of_experts.MixtureOfExperts`: a
softmax router over ``num_experts``, the top ``num_experts_per_tok`` kept
with their softmax weights (not renormalised), read per expert as the Hub
stores them (``feed_forward.experts.{e}.gate_proj.weight``) or fused as
transformers 5 holds them in memory (`pz_persist.pretrained.hf.building.moe`);
export writes the Hub's layout.
Sampling carries the mixers' convolution and state-space state: use
`pz_persist.pretrained.kv_caching_lm`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn import mixture_of_experts as moe
from pz_persist.nn.mamba import Mamba
from pz_persist.pretrained.errors import ExportError
from pz_persist.pretrained.hf.building import mamba_hybrid
from pz_persist.pretrained.hf.building.decoder import attention_size_fields
from pz_persist.pretrained.hf.building.decoder import attention_sizes
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY
from pz_persist.pretrained.hf.building.moe import ExpertNames
from pz_persist.pretrained.hf.building.moe import Experts
from pz_persist.pretrained.hf.building.moe import check_experts
from pz_persist.pretrained.hf.building.moe import mixtures
from pz_persist.pretrained.hf.building.moe import softmax_routed
from pz_persist.pretrained.hf.building.moe import softmax_router
from pz_persist.pretrained.hf.building.moe import with_experts
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import DECODER_LAYERS
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_EXPERTS = ExpertNames(block="feed_forward", router="router")
"""Where Jamba keeps a layer's experts: ``feed_forward.router.weight`` and
``feed_forward.experts.{e}.{gate,up,down}_proj.weight``."""


def _auto_or_positive(value: Any) -> bool:
  return value == "auto" or POSITIVE_INT[0](value)


def _pattern(cfg: Config, period_key: str, offset_key: str) -> tuple[int, int]:
  """``(period, offset)``: the layers ``i`` with ``i % period == offset`` are
  chosen, as transformers' config (which refuses ``offset >= period``)
  chooses them."""
  period, offset = cfg.require(period_key), cfg.require(offset_key)
  if offset >= period:
    raise cfg.unsupported(offset_key, offset,
                          f"must be smaller than {period_key}={period} (transformers' config"
                          " refuses it)")
  return period, offset


def _expert_count(cfg: Config) -> int:
  """``num_experts``, or transformers' alias ``num_local_experts`` (its
  config's ``attribute_map``), which must agree when both are given."""
  given, alias = cfg.get("num_experts"), cfg.get("num_local_experts")
  if given is not None and alias is not None and given != alias:
    raise cfg.unsupported("num_experts, num_local_experts", (given, alias),
                          "the fields name one expert count and must agree")
  if given is None and alias is not None:
    return alias
  return cfg.get("num_experts", FROM_TABLE)


def jamba_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Jamba checkpoint: Llama's layers without RoPE, the attention of
  the Mamba layers replaced by a Mamba-1 mixer, the MLP of the expert layers
  by a mixture of experts."""
  hidden, heads, kv_heads, head_dim = attention_sizes(cfg, kv_heads_default=None,
                                                      head_dim_default=None)
  act = cfg.get("hidden_act", FROM_TABLE)
  if act != "silu":
    raise cfg.unsupported("hidden_act", act, "Jamba's MLPs, experts and Mamba convolutions"
                          " apply SiLU; pz_persist reads no other")
  if cfg.require("mamba_proj_bias"):
    raise cfg.unsupported("mamba_proj_bias", True, "no published Jamba has in_proj / out_proj"
                          " biases, and pz_persist does not read them")
  window = cfg.get("sliding_window")
  if window is not None:
    raise cfg.unsupported("sliding_window", window, "transformers 5's Jamba attends to every"
                          " earlier token whatever it says, and 4.x's flash attention applied it;"
                          " pz_persist cannot tell which is meant (null is accepted)")
  eps = float(cfg.get("rms_norm_eps", FROM_TABLE))
  expand, state = cfg.require("mamba_expand"), cfg.require("mamba_d_state")
  taps, conv_bias = cfg.require("mamba_d_conv"), cfg.require("mamba_conv_bias")
  rank = cfg.require("mamba_dt_rank")
  rank = math.ceil(hidden / 16) if rank == "auto" else rank
  channels = expand * hidden
  layers = cfg.require("num_hidden_layers")
  attention_every = _pattern(cfg, "attn_layer_period", "attn_layer_offset")
  routed_every = _pattern(cfg, "expert_layer_period", "expert_layer_offset")
  count = _expert_count(cfg)
  top_k = cfg.get("num_experts_per_tok", FROM_TABLE)
  if count > 1 and top_k > count:  # (One expert: transformers builds plain MLPs, top k unread.)
    raise cfg.unsupported("num_experts_per_tok", top_k,
                          f"more experts per token than the num_experts={count}")
  neurons = cfg.require("intermediate_size")
  config, head_source = mamba_hybrid.checked_config(
      cfg, weights, heads=heads, kv_heads=kv_heads, hidden=hidden, head_dim=head_dim,
      neurons=neurons, layers=layers, theta=10_000.0, eps=eps)
  # The layer count now agrees with the weights: the per-layer lists are that long.
  attention_at = [i % attention_every[0] == attention_every[1] for i in range(layers)]
  routed_at = [i % routed_every[0] == routed_every[1] for i in range(layers)]
  kinds = ["attention" if a else "mamba" for a in attention_at]
  specs = mamba_hybrid.llama_specs(config, head_source, attention_at)
  for i, kind in enumerate(kinds):
    if kind == "mamba":
      specs += _mamba_specs(f"transformer/block_{i}/mamba", f"{DECODER_LAYERS}{i}.mamba.",
                            hidden=hidden, channels=channels, state=state, rank=rank, taps=taps,
                            conv_bias=conv_bias)

  def build() -> model_parts.TransformerLM:
    model = llamalike_common.build_llamalike_transformer(config, init_base_rng=None)
    model = pz.select(model).at_instances_of(pz.nn.ApplyRoPE).remove_from_parent()
    selected = pz.select(model).at_instances_of(model_parts.TransformerBlock)
    built = []
    for i, (block, kind) in enumerate(zip(selected.get_sequence(), kinds)):
      if kind == "mamba":
        mixer = Mamba.from_config(f"transformer/block_{i}/mamba", embedding=hidden,
                                  channels=channels, state=state, time_step_rank=rank,
                                  conv_taps=taps, norm_epsilon=eps, conv_bias=conv_bias)
        block = pz.select(block).at_instances_of(pz.nn.Attention).set(mixer)
      built.append(block)
    return selected.set_sequence(built)

  plan = Plan(build, tuple(specs))
  if count <= 1 or not any(routed_at):
    return plan
  experts = Experts(count, top_k, neurons, False,
                    tuple(i for i, routed in enumerate(routed_at) if routed), _EXPERTS)
  check_experts(cfg, weights, experts, "num_experts")
  return with_experts(plan, experts, hidden, set(weights.names), softmax_router())


def _mamba_specs(name: str, s: str, *, hidden: int, channels: int, state: int, rank: int,
                 taps: int, conv_bias: bool) -> list[TensorSpec]:
  """The specs of the mixer labelled ``name`` from the tensors under ``s``
  (``model.layers.{i}.mamba.``), the fused ones read by rows: ``in_proj``
  holds ``x`` then ``z``; ``x_proj`` the time step's input, ``B``, ``C``."""
  ch = ((channels,), ("ssm_channels",))
  fused = rank + 2 * state
  return [
      TensorSpec(f"{name}/input.weights", s + "in_proj.weight", (channels, hidden),
                 ("ssm_channels", "embedding"), stored=(2 * channels, hidden),
                 rows=(0, channels)),
      TensorSpec(f"{name}/gate.weights", s + "in_proj.weight", (channels, hidden),
                 ("ssm_channels", "embedding"), stored=(2 * channels, hidden),
                 rows=(channels, 2 * channels)),
      TensorSpec(f"{name}/conv", s + "conv1d.weight", (channels, taps),
                 ("ssm_channels", "conv_taps"), stored=(channels, 1, taps)),
      *([TensorSpec(f"{name}/conv_bias", s + "conv1d.bias", *ch)] if conv_bias else []),
      TensorSpec(f"{name}/time_step_input.weights", s + "x_proj.weight", (rank, channels),
                 ("time_step_rank", "ssm_channels"), stored=(fused, channels), rows=(0, rank)),
      TensorSpec(f"{name}/input_matrix.weights", s + "x_proj.weight", (state, channels),
                 ("ssm_state", "ssm_channels"), stored=(fused, channels),
                 rows=(rank, rank + state)),
      TensorSpec(f"{name}/output_matrix.weights", s + "x_proj.weight", (state, channels),
                 ("ssm_state", "ssm_channels"), stored=(fused, channels),
                 rows=(rank + state, fused)),
      TensorSpec(f"{name}/time_step_norm/scale.weights", s + "dt_layernorm.weight", (rank,),
                 ("time_step_rank",)),
      TensorSpec(f"{name}/input_matrix_norm/scale.weights", s + "b_layernorm.weight", (state,),
                 ("ssm_state",)),
      TensorSpec(f"{name}/output_matrix_norm/scale.weights", s + "c_layernorm.weight", (state,),
                 ("ssm_state",)),
      TensorSpec(f"{name}/time_step.weights", s + "dt_proj.weight", (channels, rank),
                 ("ssm_channels", "time_step_rank")),
      TensorSpec(f"{name}/time_step_bias", s + "dt_proj.bias", *ch),
      TensorSpec(f"{name}/log_decay_rate", s + "A_log", (channels, state),
                 ("ssm_channels", "ssm_state")),
      TensorSpec(f"{name}/skip", s + "D", *ch),
      TensorSpec(f"{name}/output.weights", s + "out_proj.weight", (hidden, channels),
                 ("embedding", "ssm_channels")),
  ]


def _detect(model: pz.nn.Layer) -> str | None:
  """Mamba-1 mixers (no other family pz_persist loads has them)."""
  return "jamba" if all_layers(model, Mamba) else None


def _period(chosen: list[bool], like: Mapping[str, Any], keys: tuple[str, str]
            ) -> tuple[int, int]:
  """A ``(period, offset)`` choosing exactly ``chosen`` by ``i % period ==
  offset``: ``like``'s when it does (a field it leaves out meaning
  JambaConfig's default, so that the written config reads back as ``like``
  does), else the smallest period that does."""
  layers = len(chosen)
  defaults = _TRANSFORMERS_DEFAULTS["jamba"]["defaults"]

  def fits(period: Any, offset: Any) -> bool:
    return (isinstance(period, int) and isinstance(offset, int) and 0 <= offset < period
            and [i % period == offset for i in range(layers)] == chosen)

  given = like.get(keys[0], defaults[keys[0]]), like.get(keys[1], defaults[keys[1]])
  if fits(*given):
    return given
  for period in range(1, layers + 2):
    for offset in range(period):
      if fits(period, offset):
        return period, offset
  shown = [i for i, c in enumerate(chosen) if c]
  raise ExportError(f"the model's layers {shown} ({keys[0]}) are not every p-th layer from an"
                    f" offset: transformers' Jamba config ({keys[0]}, {keys[1]}) cannot say so")


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only jamba.
  found = blocks(model)
  mixers = [all_layers(block, Mamba) for block in found]
  attention_at = [not m for m in mixers]
  fields: dict[str, Any] = {"hidden_act": "silu", "mamba_proj_bias": False}
  fields["attn_layer_period"], fields["attn_layer_offset"] = _period(
      attention_at, like, ("attn_layer_period", "attn_layer_offset"))
  embed = named_shape(first_layer(model, pz.nn.EmbeddingTable, "token embeddings"))
  if any(attention_at):
    fields.update(without_default_head_dim(attention_size_fields(model)))
  else:  # No attention layer: its sizes change nothing; like's, else the defaults.
    fields.update({"hidden_size": embed["embedding"], "vocab_size": embed["vocabulary"],
                   "num_hidden_layers": len(found),
                   **{k: like[k] for k in ("num_attention_heads", "num_key_value_heads")
                      if k in like}})
  fields["rms_norm_eps"] = number(first_layer(model, pz.nn.RMSStandardize, "RMS norm").epsilon)
  fields.update(tied_field(model, like))
  routed = mixtures(model)
  chosen = [layer is not None for layer in routed]
  dense = [ffw for ffw, layer in zip(all_layers(model, model_parts.TransformerFeedForward),
                                     routed) if layer is None]
  if any(chosen):
    first = next(layer for layer in routed if layer is not None)
    router = first.router
    if not (softmax_routed(first) and isinstance(router, moe.TopKRouter)
            and not router.normalize):
      raise ExportError("the model's MixtureOfExperts is not Jamba's (a softmax over every"
                        " expert, the top k kept unnormalised, no shared expert)")
    gate = named_shape(first_layer(first.experts, pz.nn.Linear, "experts"))
    fields.update(num_experts=gate["experts"], num_experts_per_tok=router.top_k,
                  intermediate_size=gate["neurons"])
    fields["expert_layer_period"], fields["expert_layer_offset"] = _period(
        chosen, like, ("expert_layer_period", "expert_layer_offset"))
  else:  # One expert: every layer a plain MLP.
    fields.update(num_experts=1, **{k: like[k] for k in (
        "num_experts_per_tok", "expert_layer_period", "expert_layer_offset") if k in like})
  if dense:
    size = named_shape(first_layer(dense[0], pz.nn.Linear, "MLP"))["neurons"]
    if any(chosen) and size != fields["intermediate_size"]:
      raise ExportError(f"the model's MLPs have {size} neurons and its experts"
                        f" {fields['intermediate_size']}: Jamba's config gives both as one"
                        " intermediate_size")
    fields["intermediate_size"] = size
  fields.update(_mamba_fields(model, like, embed["embedding"]))
  return fields


_MAMBA_KEYS = ("mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_dt_rank",
               "mamba_conv_bias")


def _mamba_fields(model: pz.nn.Layer, like: Mapping[str, Any], hidden: int) -> dict[str, Any]:
  """The ``mamba_*`` fields of the model's first `Mamba` mixer (``like``'s
  when it has none: they then change nothing)."""
  mixers = all_layers(model, Mamba)
  if not mixers:
    return {k: like[k] for k in _MAMBA_KEYS if k in like}
  mixer = mixers[0]
  if not all(isinstance(norm, pz.nn.RMSLayerNorm) for norm in (
      mixer.time_step_norm, mixer.input_matrix_norm, mixer.output_matrix_norm)):
    raise ExportError("the model's Mamba mixers lack Jamba's RMS norms on the time step, B and C"
                      " (dt_layernorm, b_layernorm, c_layernorm)")
  shape = dict(mixer.log_decay_rate.value.named_shape)
  channels = shape["ssm_channels"]
  if channels % hidden:
    raise ExportError(f"the Mamba mixers' {channels} channels are not a multiple of the"
                      f" embedding size ({hidden}): Jamba's config gives them as mamba_expand *"
                      " hidden_size")
  rank = named_shape(first_layer(mixer.time_step_input, pz.nn.Linear,
                                 "the mixer's time-step projection"))["time_step_rank"]
  return {"mamba_d_state": shape["ssm_state"],
          "mamba_d_conv": dict(mixer.conv.value.named_shape)["conv_taps"],
          "mamba_expand": channels // hidden,
          "mamba_dt_rank": rank, "mamba_conv_bias": mixer.conv_bias is not None}


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "jamba": {
        "defaults": {
            "hidden_act": "silu", "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
            "num_experts": 16, "num_experts_per_tok": 2, "expert_layer_period": 2,
            "expert_layer_offset": 1, "attn_layer_period": 8, "attn_layer_offset": 4,
            "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": "auto",
            "mamba_conv_bias": True, "mamba_proj_bias": False},
        "defaults_why": {
            "mamba_dt_rank": ("the config class replaces 'auto' by ceil(hidden_size / 16),"
                              " which pz_persist computes the same way"),
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


_KERNEL_CHOICES = ("use_mamba_kernels", "use_mambapy", "use_associative_scan")


RECORD = Family(
    title="Jamba",
    model_types={"jamba": ModelType(
        jamba_plan, "JambaForCausalLM", **_TRANSFORMERS_DEFAULTS["jamba"],
        ignored_fields={
            "training only: the load-balancing loss": ("output_router_logits",
                                                       "router_aux_loss_coef"),
            "which implementation of the same scan transformers runs": _KERNEL_CHOICES,
            "how many positions' logits transformers 4.x computed at generation": (
                "num_logits_to_keep",),
            "Jamba-v0.1's first config.json, for AI21's remote code: its context length and"
            " its name of num_logits_to_keep": ("n_ctx", "calc_logits_for_entire_prompt")},
        foreign_fields=frozenset({"num_logits_to_keep", "n_ctx",
                                  "calc_logits_for_entire_prompt"}))},
    detect=_detect,
    write_config=_write_config,
    adds=("Mamba-1 mixers (`Mamba`: selective scan with a per-channel `A`, low-rank time step,"
          " RMS norms on dt / B / C; state carried by `kv_caching_lm`) among attention layers"
          " without position encoding (`attn_layer_period` / `attn_layer_offset`), and a"
          " mixture of experts (`MixtureOfExperts`, softmax top k unnormalised) on every"
          " `expert_layer_period`-th layer"),
    refuses=("in_proj / out_proj biases (`mamba_proj_bias`), a non-null `sliding_window`,"
             " activations other than SiLU"),
    rank=9,
    fields={**TRAINING_ONLY, "attn_layer_period": POSITIVE_INT,
            "attn_layer_offset": NON_NEGATIVE_INT, "expert_layer_period": POSITIVE_INT,
            "expert_layer_offset": NON_NEGATIVE_INT, "num_experts": POSITIVE_INT,
            "num_local_experts": POSITIVE_INT, "num_experts_per_tok": POSITIVE_INT,
            "mamba_d_state": POSITIVE_INT, "mamba_d_conv": POSITIVE_INT,
            "mamba_expand": POSITIVE_INT,
            "mamba_dt_rank": (_auto_or_positive, "a positive integer or 'auto'"),
            "mamba_conv_bias": BOOLEAN, "mamba_proj_bias": BOOLEAN,
            **dict.fromkeys(_KERNEL_CHOICES, BOOLEAN),
            "sliding_window": (lambda v: v is None or POSITIVE_INT[0](v),
                               "a positive integer or null"),
            "num_logits_to_keep": (lambda v: v is None or NON_NEGATIVE_INT[0](v),
                                   "a non-negative integer or null")},
)
