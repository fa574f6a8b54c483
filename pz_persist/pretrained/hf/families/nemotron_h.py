"""NVIDIA Nemotron-H (``model_type`` ``nemotron_h``): one token mixer per
layer, chosen by the layer's type.

``hybrid_override_pattern`` (or transformers 5's ``layers_block_type``)
gives each layer's mixer: ``M`` a Mamba-2 mixer (`pz_persist.nn.mamba2.Mamba2`,
``linear_attention``), ``*`` grouped-query attention without any position
embedding (``full_attention``), ``-`` a non-gated squared-ReLU MLP
(``up_proj``, ``relu(x)**2``, ``down_proj``; ``mlp``). Each layer is
``x + mixer(rms_norm(x))``, one residual, one norm; ``E`` (``moe``) a
mixture of experts (`pz_persist.pretrained.hf.building.nemotron_moe`:
DeepSeek's sigmoid router with a correction bias and group-limited choice,
non-gated squared-ReLU experts stacked from the Hub's per-expert tensors,
an optional latent projection around them, one shared expert). The model ends with
``norm_f`` and ``lm_head``. Hugging Face keeps the tensors under
``backbone.`` (``backbone.layers.{i}.mixer.*``, ``backbone.embeddings``);
the mixers' fused tensors are read by
`pz_persist.pretrained.hf.building.mamba_hybrid`. transformers never ties
the head to the embeddings (``tie_word_embeddings`` changes nothing): the
head is read from ``lm_head.weight``, and a folder without it is refused
(transformers would draw it at random). transformers' mixers
clip the time step below at ``time_step_min`` (its ``time_step_limit``
field changes nothing), as the `Mamba2` here does. Sampling carries the
mixers' convolution and state-space state: use
`pz_persist.pretrained.kv_caching_lm`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn import mixture_of_experts as moe
from pz_persist.nn.longrope import ApplyLongRoPE
from pz_persist.nn.mamba2 import Mamba2
from pz_persist.nn.proportional_rope import ApplyProportionalRoPE
from pz_persist.nn.scaled_rope import ApplyScaledRoPE
from pz_persist.pretrained.errors import ExportError
from pz_persist.pretrained.hf.building import mamba_hybrid
from pz_persist.pretrained.hf.building import nemotron_moe
from pz_persist.pretrained.hf.building.decoder import block_specs
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import NON_NEGATIVE_NUMBER
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import STRING
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.config_from_model import projection
from pz_persist.pretrained.hf.plan import DECODER_HEAD
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import left_out_matching
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import View
from pz_persist.pretrained.hf.weights import Weights

ROOT = "backbone."
"""Where transformers writes (and the Hub keeps) the decoder's tensors."""

LAYERS = ROOT + "layers."
_EMBEDDINGS = ROOT + "embeddings.weight"

_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
"""``hybrid_override_pattern``'s letters, as transformers reads them."""

_KIND = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
"""Each layer type pz_persist builds -> the kind of its mixer."""

_LAYER_TYPE = {kind: layer_type for layer_type, kind in _KIND.items()}

_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
"""The older names in ``layers_block_type`` that transformers 5 reads as the
new ones (its ``remap_legacy_layer_types``): 4.x wrote them."""


def _current(layer_types: list[str]) -> list[str]:
  return [_LEGACY_LAYER_TYPES.get(t, t) for t in layer_types]


def _pattern(value: Any) -> bool:
  return isinstance(value, str) and bool(value) and all(c in _PATTERN for c in value)


def _layer_types(value: Any) -> bool:
  return (isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)
          and all(v in _PATTERN.values() for v in _current(value)))


def _kinds(cfg: Config) -> list[str]:
  """Each layer's mixer kind, from ``layers_block_type`` (transformers 5) or
  ``hybrid_override_pattern`` (the Hub's configs), checked against
  ``num_hidden_layers`` first: the layer count bounds everything built.

  transformers only warns when the pattern's length is not
  ``num_hidden_layers`` (and builds the pattern's); such a config is
  damaged, so it is refused, naming both."""
  listed = cfg.get("layers_block_type")
  listed = None if listed is None else _current(listed)
  pattern = cfg.get("hybrid_override_pattern")
  if listed is None and pattern is None:
    raise cfg.unsupported(
        "hybrid_override_pattern", None,
        "a Nemotron-H config must give each layer's mixer (hybrid_override_pattern or"
        " layers_block_type); transformers' default of four layers, of every kind and"
        " 4096 wide, is not a checkpoint's")
  from_pattern = None if pattern is None else [_PATTERN[c] for c in pattern]
  if listed is not None and from_pattern is not None and listed != from_pattern:
    raise cfg.unsupported("hybrid_override_pattern", pattern,
                          f"it disagrees with layers_block_type={listed!r:.200}")
  types = listed if listed is not None else from_pattern
  assert types is not None
  layers = cfg.get("num_hidden_layers")
  if layers is not None and layers != len(types):
    raise cfg.unsupported(
        "num_hidden_layers", layers,
        f"the layer pattern gives {len(types)} layers"
        f" ({'layers_block_type' if listed is not None else 'hybrid_override_pattern'});"
        " make num_hidden_layers its length")
  return [_KIND[t] for t in types]


def _mamba_sizes(cfg: Config, hidden: int) -> mamba_hybrid.MambaSizes:
  """The mixers' sizes under Nemotron-H's names. Their inner width is
  ``mamba_num_heads * mamba_head_dim`` (transformers' mixer ignores
  ``expand``)."""
  heads, groups = cfg.require("mamba_num_heads"), cfg.require("n_groups")
  if heads % groups:
    raise cfg.unsupported("n_groups", groups,
                          f"each group of B, C and the gated norm serves a whole number of heads:"
                          f" it must divide mamba_num_heads={heads}")
  act = cfg.get("mamba_hidden_act", FROM_TABLE)
  if act != "silu":
    raise cfg.unsupported("mamba_hidden_act", act, "the mixers' convolution is followed by SiLU")
  cache = cfg.get("mamba_ssm_cache_dtype", FROM_TABLE)
  if cache != "float32":
    raise cfg.unsupported("mamba_ssm_cache_dtype", cache,
                          "pz_persist carries the mixers' state in float32")
  bool_field(cfg, "use_bias", False, False,
             "the mixers' in_proj / out_proj have no biases in any published Nemotron-H")
  bool_field(cfg, "mamba_proj_bias", False, False,
             "transformers ignores it; a true value claims biases nothing reads")
  cfg.require("chunk_size")  # Checked; the scan's chunks regroup the same sums.
  return mamba_hybrid.MambaSizes(
      hidden=hidden, heads=heads, head_dim=cfg.require("mamba_head_dim"), groups=groups,
      state=cfg.require("ssm_state_size"), taps=cfg.require("conv_kernel"),
      conv_bias=cfg.get("use_conv_bias", FROM_TABLE),
      time_step_limit=(float(cfg.get("time_step_min", FROM_TABLE)), math.inf))


def _mlp(p: str) -> model_parts.TransformerFeedForward:
  """Nemotron-H's MLP: ``down(relu(up(x)) ** 2)``, no gate (the sizes come
  with the values bound)."""
  return model_parts.TransformerFeedForward(nemotron_moe.relu2_mlp(f"{p}mlp").sublayers)


def nemotron_h_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Nemotron-H checkpoint: each layer one residual of an RMS norm
  and the mixer its layer type names."""
  kinds = _kinds(cfg)  # First: the layer count bounds what follows.
  hidden = cfg.require("hidden_size")
  heads = cfg.require("num_attention_heads")
  kv_heads = cfg.get("num_key_value_heads", FROM_TABLE)
  if heads % kv_heads:
    raise cfg.unsupported("num_key_value_heads", kv_heads,
                          f"must divide num_attention_heads={heads}")
  head_dim = cfg.get("head_dim", FROM_TABLE)
  bool_field(cfg, "attention_bias", False, False,
             "transformers' Nemotron-H attention has no biases (it ignores this field)")
  window = cfg.get("sliding_window")
  if window is not None:
    raise cfg.unsupported("sliding_window", window,
                          "transformers' Nemotron-H attends to every past token (it ignores this"
                          " field)")
  act = cfg.get("mlp_hidden_act", FROM_TABLE)
  if act != "relu2":
    raise cfg.unsupported("mlp_hidden_act", act, "Nemotron-H's MLP is squared ReLU ('relu2')")
  bool_field(cfg, "mlp_bias", False, False, "no published Nemotron-H has MLP biases")
  sizes = _mamba_sizes(cfg, hidden)
  experts = nemotron_moe.read_experts(cfg, hidden) if "moe" in kinds else None
  eps = float(cfg.get("layer_norm_epsilon", FROM_TABLE))
  neurons = cfg.get("intermediate_size", FROM_TABLE)
  config, head_source = mamba_hybrid.checked_config(
      cfg, weights, heads=heads, kv_heads=kv_heads, hidden=hidden, head_dim=head_dim,
      neurons=neurons, layers=len(kinds), theta=10_000.0, eps=eps, layer_prefix=LAYERS,
      embeddings=_EMBEDDINGS, ties=False)
  vocab = config.vocab_size
  if experts is not None:  # The layers agree with the weights: count the experts.
    nemotron_moe.check_count(cfg, weights, kinds.index("moe"), LAYERS, experts.routing.experts)
  views: list[View] = []
  specs = [
      TensorSpec("transformer/embedder.embeddings", _EMBEDDINGS, (vocab, hidden),
                 ("vocabulary", "embedding")),
      TensorSpec("transformer/final_norm/scale.weights", ROOT + "norm_f.weight", (hidden,),
                 ("embedding",)),
      TensorSpec("transformer/lm_head.weights", head_source, (vocab, hidden),
                 ("vocabulary", "embedding")),
  ]
  for i, kind in enumerate(kinds):
    p, s = f"transformer/block_{i}/", f"{LAYERS}{i}."
    norm = "pre_ffw_norm" if kind in ("mlp", "moe") else "pre_attention_norm"
    specs.append(TensorSpec(f"{p}{norm}/scale.weights", s + "norm.weight", (hidden,),
                            ("embedding",)))
    if kind == "attention":
      specs += [dataclasses.replace(spec, source=spec.source.replace("self_attn.", "mixer."))
                for spec in block_specs(p, s, config) if "/attention/" in spec.label]
    elif kind == "mlp":
      specs += [
          TensorSpec(p + "mlp/up.weights", s + "mixer.up_proj.weight", (neurons, hidden),
                     ("neurons", "embedding")),
          TensorSpec(p + "mlp/down.weights", s + "mixer.down_proj.weight", (hidden, neurons),
                     ("embedding", "neurons")),
      ]
    elif kind == "moe":
      assert experts is not None
      specs += experts.specs(p, s, views)
    else:
      specs += mamba_hybrid.mamba_specs(p + "mamba", s + "mixer.", sizes)

  def build():
    llama = llamalike_common.build_llamalike_transformer(config, init_base_rng=None)
    llama = mamba_hybrid.with_mixers(llama, kinds, sizes, eps)
    selected = pz.select(llama).at_instances_of(model_parts.TransformerBlock)
    rebuilt = []
    for i, (block, kind) in enumerate(zip(selected.get_sequence(), kinds)):
      mixing, feeding = block.sublayers
      if kind == "mlp":
        sublayer = pz.select(feeding).at_instances_of(model_parts.TransformerFeedForward).set(
            _mlp(f"transformer/block_{i}/"))
      elif kind == "moe":
        assert experts is not None
        sublayer = pz.select(feeding).at_instances_of(model_parts.TransformerFeedForward).set(
            model_parts.TransformerFeedForward([experts.layer(f"transformer/block_{i}/mlp")]))
      else:  # No position embedding: the attention's queries and keys are not rotated.
        sublayer = pz.select(mixing).at_instances_of(pz.nn.ApplyRoPE).remove_from_parent()
      rebuilt.append(dataclasses.replace(block, sublayers=[sublayer]))
    return selected.set_sequence(rebuilt)

  return Plan(build, tuple(specs), tuple(views))


def _mixer_kind(block: model_parts.TransformerBlock) -> str | None:
  """The kind of a one-residual block's mixer, or None (also for a parallel
  block, attention beside an MLP or a mixer in one residual: Falcon's, Phi's,
  Cohere's; Nemotron-H has one mixer per residual)."""
  if len(block.sublayers) != 1:
    return None
  beside_attention = (Mamba2, moe.MixtureOfExperts, model_parts.TransformerFeedForward)
  if all_layers(block, pz.nn.Attention) and any(all_layers(block, kind)
                                                for kind in beside_attention):
    return None
  if all_layers(block, Mamba2):
    return "mamba"
  if all_layers(block, moe.MixtureOfExperts):
    return "moe"
  if all_layers(block, pz.nn.Attention):
    return "attention"
  if all_layers(block, model_parts.TransformerFeedForward):
    return "mlp"
  return None


def _detect(model: pz.nn.Layer) -> str | None:
  """Blocks of one residual each (every other family has two), no RoPE."""
  found = blocks(model)
  if not found or any(_mixer_kind(b) is None for b in found):
    return None
  rotary = [layer for kind in _ROTARY for layer in all_layers(model, kind)]
  return None if rotary else "nemotron_h"


_ROTARY = (pz.nn.ApplyRoPE, pz.nn.ApplyRoPEToSubset, ApplyScaledRoPE, ApplyLongRoPE,
           ApplyProportionalRoPE)
"""Every rotary position layer a family builds: Nemotron-H has none."""


def _heads(shape: Mapping[str, int]) -> int:
  """The heads of an attention projection's weights (1 where it has none)."""
  return math.prod(v for k, v in shape.items() if k not in ("projection", "embedding"))


def _unused_sizes(model: pz.nn.Layer, like: Mapping[str, Any], keys: tuple[str, ...]
                  ) -> dict[str, Any]:
  """Sizes of a mixer kind the model has no layer of: the Llama skeleton's
  record of them (``TransformerLM.metadata``), else ``like``'s, else the
  defaults. They change no computation, but the rebuilt skeleton must agree."""
  meta = getattr(model, "metadata", None)
  if isinstance(meta, model_parts.TransformerMetadata):
    kv_heads = math.prod(meta.common_head_axes.values())
    recorded = {"num_attention_heads": kv_heads * math.prod(meta.query_only_head_axes.values()),
                "num_key_value_heads": kv_heads, "head_dim": meta.projection_dim,
                "intermediate_size": meta.mlp_hidden_dim}
    return {k: recorded[k] for k in keys}
  return {k: like.get(k, _DEFAULTS[k]) for k in keys}


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]
                  ) -> dict[str, Any]:
  del model_type  # Only nemotron_h.
  kinds = [_mixer_kind(b) for b in blocks(model)]
  if any(kind is None for kind in kinds):
    raise ExportError("Nemotron-H's layers each hold one residual: a Mamba2 mixer, an"
                      " attention, an MLP or a mixture of experts")
  embed = named_shape(first_layer(model, pz.nn.EmbeddingTable, "token embeddings"))
  norm = first_layer(model, pz.nn.RMSStandardize, "RMS norm")
  fields: dict[str, Any] = {
      "hidden_size": embed["embedding"], "vocab_size": embed["vocabulary"],
      "layers_block_type": [_LAYER_TYPE[kind] for kind in kinds if kind is not None],
      "layer_norm_epsilon": number(norm.epsilon), "mlp_hidden_act": "relu2",
      "mlp_bias": False, "attention_bias": False, "use_bias": False,
      # transformers never ties Nemotron-H's head (the field changes nothing).
      "tie_word_embeddings": like.get("tie_word_embeddings", False)}
  if "attention" in kinds:
    attn = attention(model)
    query, key = projection(attn.input_to_query), projection(attn.input_to_key)
    fields["num_attention_heads"] = _heads(query)
    fields["num_key_value_heads"] = _heads(key)
    fields["head_dim"] = query["projection"]
  else:  # No attention layer: its sizes change nothing but the skeleton's record of them.
    fields.update(_unused_sizes(model, like, ("num_attention_heads", "num_key_value_heads",
                                              "head_dim")))
  if "mlp" in kinds:
    ffw = first_layer(blocks(model)[kinds.index("mlp")], model_parts.TransformerFeedForward,
                      "MLP")
    fields["intermediate_size"] = named_shape(first_layer(ffw, pz.nn.Linear, "MLP"))["neurons"]
  else:
    fields.update(_unused_sizes(model, like, ("intermediate_size",)))
  mixtures = all_layers(model, moe.MixtureOfExperts)
  fields.update(nemotron_moe.experts_fields(mixtures[0]) if mixtures
                else nemotron_moe.unused_fields(like))
  mixers = all_layers(model, Mamba2)
  if mixers:
    sizes = mamba_hybrid.mixer_sizes(mixers[0])
    low, high = sizes.time_step_limit
    if high != math.inf:
      raise ExportError(f"the Mamba2 mixers clip the time step above at {high}: transformers'"
                        " Nemotron-H clips it only below (time_step_min)")
    fields.update({"mamba_num_heads": sizes.heads, "mamba_head_dim": sizes.head_dim,
                   "n_groups": sizes.groups, "ssm_state_size": sizes.state,
                   "conv_kernel": sizes.taps, "use_conv_bias": sizes.conv_bias,
                   "time_step_min": number(low)})
  else:
    fields.update({k: like.get(k, _DEFAULTS[k]) for k in (
        "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel",
        "use_conv_bias", "time_step_min")})
  fields["chunk_size"] = like.get("chunk_size", _DEFAULTS["chunk_size"])
  return fields


_DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_hidden_act": "relu2",
    "mlp_bias": False, "use_bias": False, "mamba_proj_bias": False, "ssm_state_size": 128,
    "mamba_num_heads": 128, "mamba_head_dim": 64, "mamba_hidden_act": "silu", "n_groups": 8,
    "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": True, "time_step_min": 0.001,
    "mamba_ssm_cache_dtype": "float32", "layer_norm_epsilon": 1e-5,
    **nemotron_moe.DEFAULTS,
}
"""transformers' ``NemotronHConfig``'s value of each field the plan may find
absent."""


RECORD = Family(
    title="Nemotron-H",
    model_types={"nemotron_h": ModelType(
        nemotron_h_plan, "NemotronHForCausalLM", defaults=_DEFAULTS,
        left_out=(left_out_matching(
            (r"(^|\.)mtp\.",), "the multi-token-prediction layers",
            "the causal LM does not run them (transformers drops them too)", reported=True),),
        ignored_fields={
            "initialisation only": ("time_step_max", "time_step_floor", "rescale_prenorm_residual",
                                    "expand"),
            "transformers' mixers clip the time step at (time_step_min, inf) whatever it says":
                ("time_step_limit",),
            "transformers' Nemotron-H never reads it": ("residual_in_fp32", "use_mamba_kernels",
                                                        "time_step_rank", "rms_norm_eps",
                                                        "attention_head_dim"),
            "how many positions' logits transformers computes at generation":
                ("num_logits_to_keep",),
            "multi-token prediction layers, which transformers does not load":
                ("num_nextn_predict_layers", "mtp_layers_block_type",
                 "mtp_hybrid_override_pattern"),
            "the mixture-of-experts layers' settings, read only where a layer is `E` / `moe`":
                ("n_routed_experts", "n_shared_experts", "moe_intermediate_size",
                 "moe_shared_expert_intermediate_size", "moe_latent_size",
                 "num_experts_per_tok", "routed_scaling_factor", "n_group", "topk_group",
                 "norm_topk_prob"),
            "training or parallelism only (the balancing loss; Megatron overlapping the shared"
            " expert with the routed ones' communication)":
                ("output_router_logits", "moe_shared_expert_overlap"),
        },
        foreign_fields=frozenset({"time_step_rank", "rms_norm_eps", "attention_head_dim",
                                  "mtp_hybrid_override_pattern"}))},
    detect=_detect,
    write_config=_write_config,
    adds=("one mixer per layer by `hybrid_override_pattern` / `layers_block_type`: Mamba-2"
          " mixers (`Mamba2`, time step clipped below at `time_step_min`; state carried by"
          " `kv_caching_lm`), attention without position embeddings, non-gated squared-ReLU"
          " MLPs, mixtures of experts (`E` / `moe`: DeepSeek's sigmoid `TopKRouter` with"
          " `e_score_correction_bias`, `n_group` / `topk_group` and `routed_scaling_factor`;"
          " non-gated squared-ReLU experts stacked from the Hub's per-expert tensors;"
          " `moe_latent_size` projections around them, `LatentMixtureOfExperts`; one shared"
          " expert); one RMS norm per layer; tensors under `backbone.`"),
    refuses=("biases (`use_bias`, `mlp_bias`, `attention_bias`), a sliding window, a pattern"
             " whose length is not `num_hidden_layers`, `n_shared_experts` other than 1"
             " (transformers adds one shared expert whatever it says), groups of fewer than two"
             " experts, experts stored fused (transformers 5's in-memory layout)"),
    rank=2,
    fields={
        "hybrid_override_pattern": (_pattern, "a string of the letters M, *, - and E"),
        "layers_block_type": (_layer_types, "a non-empty list of 'linear_attention',"
                              " 'full_attention', 'mlp' and 'moe' (or the older 'mamba' and"
                              " 'attention')"),
        "mtp_hybrid_override_pattern": STRING,
        "mtp_layers_block_type": (lambda v: isinstance(v, list), "a list of layer types"),
        "mamba_num_heads": POSITIVE_INT, "mamba_head_dim": POSITIVE_INT, "n_groups": POSITIVE_INT,
        "ssm_state_size": POSITIVE_INT, "conv_kernel": POSITIVE_INT, "chunk_size": POSITIVE_INT,
        "expand": POSITIVE_INT, "time_step_rank": POSITIVE_INT,
        "use_conv_bias": BOOLEAN, "use_bias": BOOLEAN, "mamba_proj_bias": BOOLEAN,
        "residual_in_fp32": BOOLEAN, "use_mamba_kernels": BOOLEAN,
        "rescale_prenorm_residual": BOOLEAN, "moe_shared_expert_overlap": BOOLEAN,
        "norm_topk_prob": BOOLEAN, "output_router_logits": BOOLEAN,
        "mamba_hidden_act": STRING, "mlp_hidden_act": STRING, "mamba_ssm_cache_dtype": STRING,
        "time_step_min": NON_NEGATIVE_NUMBER, "time_step_max": NON_NEGATIVE_NUMBER,
        "time_step_floor": NON_NEGATIVE_NUMBER,
        "time_step_limit": (lambda v: isinstance(v, (list, tuple)), "a list [low, high]"),
        "layer_norm_epsilon": POSITIVE_NUMBER, "attention_head_dim": POSITIVE_INT,
        "num_logits_to_keep": (lambda v: v is None or NON_NEGATIVE_INT[0](v),
                               "a non-negative integer or null"),
        "num_nextn_predict_layers": NON_NEGATIVE_INT,
        "n_routed_experts": POSITIVE_INT, "n_shared_experts": NON_NEGATIVE_INT,
        "moe_intermediate_size": POSITIVE_INT, "moe_shared_expert_intermediate_size": POSITIVE_INT,
        "moe_latent_size": POSITIVE_INT, "num_experts_per_tok": POSITIVE_INT,
        "routed_scaling_factor": NON_NEGATIVE_NUMBER, "n_group": POSITIVE_INT,
        "topk_group": POSITIVE_INT,
    },
    layer_prefixes=(LAYERS,),
    head_names=(DECODER_HEAD,),
)
