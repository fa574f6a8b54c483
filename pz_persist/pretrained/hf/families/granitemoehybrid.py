"""IBM Granite 4 (``model_type`` ``granitemoehybrid``): the dense models
(Granite-4.0-Micro) and the H hybrids (Mamba-2 mixers among attention layers).

Each layer is Granite 3's (`pz_persist.pretrained.hf.building.granite_scales`:
the embedding, residual and attention multipliers and the logits scaling, each a
`ConstantScale`) with one token mixer, as ``layer_types`` says: a
`pz_persist.nn.mamba2.Mamba2` mixer (``mamba`` / ``linear_attention``) or
attention (``attention`` / ``full_attention``). Attention has RoPE only when
``position_embedding_type`` is ``"rope"``; otherwise (the H models' ``"nope"``,
or absent) it has no position encoding at all, the mixers' order doing that
work. The MLP is ``shared_mlp`` (SwiGLU, ``shared_intermediate_size``), its
gate and up projections fused in ``input_linear`` (gate rows first) and read
by rows. With ``num_local_experts`` > 0 a mixture of experts is added to it
(``block_sparse_moe``: softmax over the top k router logits, experts fused as
``input_linear`` / ``output_linear``), the two outputs summed.
Sampling carries the mixers' state: use `pz_persist.pretrained.kv_caching_lm`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn import mixture_of_experts as moe
from pz_persist.nn.mamba2 import Mamba2
from pz_persist.pretrained.hf.building import mamba_hybrid
from pz_persist.pretrained.hf.building.decoder import attention_size_fields
from pz_persist.pretrained.hf.building.decoder import attention_sizes
from pz_persist.pretrained.hf.building.decoder import block_specs
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.granite_scales import MULTIPLIERS
from pz_persist.pretrained.hf.building.granite_scales import scale_fields
from pz_persist.pretrained.hf.building.granite_scales import with_granite_scales
from pz_persist.pretrained.hf.building.moe import TRAINING_ONLY
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config import rope
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import DECODER_LAYERS
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
          "full_attention": "attention"}
_POSITIONS = ("rope", "nope")


def granitemoehybrid_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Granite 4 checkpoint (dense or hybrid, with or without experts)."""
  hidden, heads, kv_heads, head_dim = attention_sizes(cfg, kv_heads_default=None,
                                                      head_dim_default=None)
  act = cfg.get("hidden_act", FROM_TABLE)
  if act != "silu":
    raise cfg.unsupported("hidden_act", act, "Granite 4's MLPs are SwiGLU (silu)")
  bool_field(cfg, "attention_bias", False, False, "Granite 4's attention has no biases")
  positions = cfg.get("position_embedding_type")
  if positions is not None and positions not in _POSITIONS:
    raise cfg.unsupported("position_embedding_type", positions,
                          f"one of {list(_POSITIONS)} or null (no position encoding)")
  theta, fraction = rope(cfg, 10_000.0)
  if fraction != 1.0:
    raise cfg.unsupported("partial_rotary_factor", fraction,
                          "Granite 4's RoPE turns the whole head")
  scales = {name: float(cfg.get(name, FROM_TABLE)) for name in MULTIPLIERS}
  sizes = mamba_hybrid.mamba_sizes(cfg, hidden)
  eps = float(cfg.get("rms_norm_eps", FROM_TABLE))
  layers = cfg.require("num_hidden_layers")
  types = cfg.get("layer_types")
  if types is not None and (len(types) != layers or not set(types) <= set(_KINDS)):
    shown = types if len(types) <= 8 else [*types[:8], "..."]
    raise cfg.unsupported("layer_types", shown, f"one of {sorted(_KINDS)} for each of the"
                          f" num_hidden_layers={layers} layers")
  experts = cfg.get("num_local_experts", FROM_TABLE)
  top_k = cfg.get("num_experts_per_tok", FROM_TABLE)
  expert_neurons = cfg.require("intermediate_size")
  if experts and top_k > experts:
    raise cfg.unsupported("num_experts_per_tok", top_k,
                          f"more experts per token than the num_local_experts={experts}")
  config, head_source = mamba_hybrid.checked_config(
      cfg, weights, heads=heads, kv_heads=kv_heads, hidden=hidden, head_dim=head_dim,
      neurons=cfg.require("shared_intermediate_size"), layers=layers, theta=theta, eps=eps)
  kinds = [_KINDS[t] for t in types] if types is not None else ["mamba"] * layers
  vocab, neurons = config.vocab_size, config.mlp_hidden_dim
  specs = [
      TensorSpec("transformer/embedder.embeddings", "model.embed_tokens.weight",
                 (vocab, hidden), ("vocabulary", "embedding")),
      TensorSpec("transformer/final_norm/scale.weights", "model.norm.weight",
                 (hidden,), ("embedding",)),
      TensorSpec("transformer/lm_head.weights", head_source, (vocab, hidden),
                 ("vocabulary", "embedding")),
  ]
  for i, kind in enumerate(kinds):
    p, s = f"transformer/block_{i}/", f"{DECODER_LAYERS}{i}."
    mlp = p + ("mlp/shared/" if experts else "mlp/")
    specs += [
        TensorSpec(p + "pre_attention_norm/scale.weights", s + "input_layernorm.weight",
                   (hidden,), ("embedding",)),
        TensorSpec(p + "pre_ffw_norm/scale.weights", s + "post_attention_layernorm.weight",
                   (hidden,), ("embedding",)),
        TensorSpec(mlp + "gating_linear.weights", s + "shared_mlp.input_linear.weight",
                   (neurons, hidden), ("neurons", "embedding"), stored=(2 * neurons, hidden),
                   rows=(0, neurons)),
        TensorSpec(mlp + "value_linear.weights", s + "shared_mlp.input_linear.weight",
                   (neurons, hidden), ("neurons", "embedding"), stored=(2 * neurons, hidden),
                   rows=(neurons, 2 * neurons)),
        TensorSpec(mlp + "out_linear.weights", s + "shared_mlp.output_linear.weight",
                   (hidden, neurons), ("embedding", "neurons")),
    ]
    if experts:
      specs += _expert_specs(p + "mlp/", s + "block_sparse_moe.", experts, expert_neurons, hidden)
    if kind == "attention":
      specs += [spec for spec in block_specs(p, s, config) if "/attention/" in spec.label]
    else:
      specs += mamba_hybrid.mamba_specs(p + "mamba", s + "mamba.", sizes)

  def build() -> model_parts.TransformerLM:
    model = llamalike_common.build_llamalike_transformer(config, init_base_rng=None)
    if positions != "rope":
      model = pz.select(model).at_instances_of(pz.nn.ApplyRoPE).remove_from_parent()
    model = with_granite_scales(model, **scales)
    if experts:
      model = _with_experts(model, experts, top_k, expert_neurons, hidden)
    return mamba_hybrid.with_mixers(model, kinds, sizes, eps)

  return Plan(build, tuple(specs))


def _expert_specs(m: str, s: str, experts: int, neurons: int, hidden: int) -> list[TensorSpec]:
  """The router and the fused experts (gate rows then up rows per expert)."""
  fused = (experts, 2 * neurons, hidden)
  return [
      TensorSpec(m + "experts/router.weights", s + "router.layer.weight", (experts, hidden),
                 ("experts", "embedding")),
      *(TensorSpec(f"{m}experts/experts/{part}.weights", s + "input_linear.weight",
                   (experts, 2, neurons, hidden), ("experts", "neurons", "embedding"),
                   take=(1, i), stored=fused) for i, part in enumerate(("gate", "up"))),
      TensorSpec(m + "experts/experts/down.weights", s + "output_linear.weight",
                 (experts, hidden, neurons), ("experts", "embedding", "neurons")),
  ]


def _with_experts(model: model_parts.TransformerLM, experts: int, top_k: int, neurons: int,
                  hidden: int) -> model_parts.TransformerLM:
  """Each block's MLP made the sum of its mixture of experts and the shared MLP."""
  def replace(ffw: model_parts.TransformerFeedForward) -> model_parts.TransformerFeedForward:
    slot = pz.select(ffw).at_instances_of(pz.ParameterSlot).get_sequence()[0]
    block = slot.label.split("/mlp/")[0]

    def relabel(s: pz.ParameterSlot) -> pz.ParameterSlot:
      return pz.ParameterSlot(s.label.replace("/mlp/", "/mlp/shared/"))

    shared = pz.select(pz.nn.Sequential(list(ffw.sublayers))).at_instances_of(
        pz.ParameterSlot).apply(relabel)
    name = f"{block}/mlp/experts"
    mixture = moe.MixtureOfExperts(
        router=moe.TopKRouter(logits=moe.router_linear(f"{name}/router", experts, hidden),
                              num_experts=experts, top_k=top_k, score="softmax",
                              normalize=True),
        experts=moe.experts_mlp(f"{name}/experts", experts, hidden, neurons, activation="silu"))
    return model_parts.TransformerFeedForward([pz.nn.BranchAndAddTogether([mixture, shared])])

  return pz.select(model).at_instances_of(model_parts.TransformerFeedForward).apply(replace)


def _detect(model: pz.nn.Layer) -> str | None:
  """Granite's constants (a `ConstantScale` after the embedding lookup) with
  Mamba-2 mixers, experts beside a shared MLP, or attention without RoPE
  (Granite 3's layout, with RoPE and none of these, is ``granite``'s)."""
  body = getattr(getattr(model, "body", None), "sublayers", ())
  from pz_persist.nn.constant_scale import ConstantScale  # pylint: disable=import-outside-toplevel
  if not any(isinstance(a, pz.nn.EmbeddingLookup) and isinstance(b, ConstantScale)
             for a, b in zip(body, body[1:])):
    return None
  rope_layers = all_layers(model, pz.nn.ApplyRoPE)
  if all_layers(model, Mamba2) or all_layers(model, moe.MixtureOfExperts) or not rope_layers:
    return "granitemoehybrid"
  return None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only granitemoehybrid.
  mixers = [bool(all_layers(block, Mamba2)) for block in blocks(model)]
  spelling = ("mamba", "attention") if set(like.get("layer_types") or ()) & {
      "mamba", "attention"} else ("linear_attention", "full_attention")
  fields: dict[str, Any] = {
      "layer_types": [spelling[0] if m else spelling[1] for m in mixers], "hidden_act": "silu",
      "attention_bias": False, **scale_fields(model)}
  embed = named_shape(first_layer(model, pz.nn.EmbeddingTable, "token embeddings"))
  if all_layers(model, pz.nn.Attention):
    fields.update(without_default_head_dim(attention_size_fields(model)))
    fields["rms_norm_eps"] = number(first_layer(model, pz.nn.RMSStandardize, "RMS norm").epsilon)
  else:  # No attention layer: its sizes change nothing; like's, else the defaults.
    fields.update({"hidden_size": embed["embedding"], "vocab_size": embed["vocabulary"],
                   "num_hidden_layers": len(mixers),
                   **{k: like[k] for k in ("num_attention_heads", "num_key_value_heads")
                      if k in like}})
    fields["rms_norm_eps"] = number(all_layers(model, Mamba2)[0].norm_epsilon)
  if all_layers(model, pz.nn.ApplyRoPE):
    fields["position_embedding_type"] = "rope"
    fields.update(rope_fields(model))
  else:
    # None (absent) and "nope" mean the same: like's spelling, else the Hub's.
    if "position_embedding_type" in like or not like:
      fields["position_embedding_type"] = like.get("position_embedding_type", "nope")
    if "rope_parameters" in like:
      fields["rope_parameters"] = like["rope_parameters"]
  fields.update(tied_field(model, like))
  mixtures = all_layers(model, moe.MixtureOfExperts)
  shared = [linear for linear in all_layers(model, pz.nn.Linear)
            if "neurons" in (axes := dict(linear.weights.value.named_shape))
            and "experts" not in axes]
  fields["shared_intermediate_size"] = dict(shared[0].weights.value.named_shape)["neurons"]
  if mixtures:
    router = mixtures[0].router
    fields.update(num_local_experts=router.num_experts, num_experts_per_tok=router.top_k,
                  intermediate_size=dict(mixtures[0].experts.sublayers[-1].weights.value
                                         .named_shape)["neurons"])
  else:
    fields["num_local_experts"] = 0
    if "intermediate_size" in like:
      fields["intermediate_size"] = like["intermediate_size"]
  fields.update(mamba_hybrid.mamba_fields(model, like))
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "granitemoehybrid": {
        "defaults": {**LLAMA_LIKE, "embedding_multiplier": 1.0, "logits_scaling": 1.0,
                     "residual_multiplier": 1.0, "attention_multiplier": 1.0,
                     "num_local_experts": 8, "num_experts_per_tok": 2,
                     "intermediate_size": 11008, "shared_intermediate_size": 1024,
                     "position_embedding_type": None, "layer_types": None,
                     **mamba_hybrid.DEFAULTS},
        "defaults_why": {
            **mamba_hybrid.DEFAULTS_WHY,
            "layer_types": ("the config class fills None with linear_attention for every layer,"
                            " as pz_persist reads an absent field"),
        },
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


_HUB_ONLY = {
    "not read by transformers (the Hub's remote code's settings)": (
        "init_method", "normalization_function"),
}
"""Fields the Hub's Granite 4 configs hold that transformers' class lacks:
its initialisation scheme, and the norm's name (always RMS norm in
transformers' model, whatever it says: read as transformers reads it)."""


RECORD = Family(
    title="Granite 4",
    model_types={"granitemoehybrid": ModelType(
        granitemoehybrid_plan, "GraniteMoeHybridForCausalLM",
        **_TRANSFORMERS_DEFAULTS["granitemoehybrid"],
        ignored_fields={"training only: the load-balancing loss": (
                            "output_router_logits", "router_aux_loss_coef"), **_HUB_ONLY},
        foreign_fields=frozenset(_HUB_ONLY["not read by transformers (the Hub's remote code's"
                                           " settings)"]))},
    detect=_detect,
    write_config=_write_config,
    adds=("Granite 3's multipliers (`ConstantScale`) with Mamba-2 mixers (`Mamba2`, as Bamba's)"
          " among attention layers (`layer_types`), attention with RoPE or none"
          " (`position_embedding_type`), a fused SwiGLU `shared_mlp`, and optionally a mixture"
          " of experts beside it (`MixtureOfExperts`, softmax over the top k); dense Micro and"
          " the H hybrids"),
    refuses=("in_proj / out_proj biases (`mamba_proj_bias`), attention biases, scaled or partial"
             " RoPE, activations other than SiLU"),
    rank=26,
    fields={**mamba_hybrid.FIELDS, **dict.fromkeys(MULTIPLIERS, POSITIVE_NUMBER),
            **TRAINING_ONLY, "shared_intermediate_size": POSITIVE_INT,
            "num_local_experts": NON_NEGATIVE_INT, "num_experts_per_tok": POSITIVE_INT,
            "position_embedding_type": (lambda v: isinstance(v, str), "a string"),
            "init_method": (lambda v: isinstance(v, str), "a string"),
            "normalization_function": (lambda v: isinstance(v, str), "a string")},
)
