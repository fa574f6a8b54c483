"""IBM Bamba (``model_type`` ``bamba``): Mamba-2 layers among Llama attention
layers.

Each layer is Llama's (RMS norms, SwiGLU MLP) with one token mixer: a
`pz_persist.nn.mamba2.Mamba2` mixer, or, for the layers ``attn_layer_indices``
lists, Llama's attention with RoPE over the first half of each head
(transformers fixes Bamba's ``partial_rotary_factor`` at 0.5 unless
``rope_parameters`` says otherwise). Hugging Face names the MLP
``feed_forward.*``, its norm ``pre_ff_layernorm`` and the final norm
``final_layernorm``; the mixer's fused tensors are read by
`pz_persist.pretrained.hf.building.mamba_hybrid`. Sampling carries the
mixers' convolution and state-space state: use
`pz_persist.pretrained.kv_caching_lm`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer.variants import llamalike_common

from pz_persist.pretrained.hf.building import mamba_hybrid
from pz_persist.pretrained.hf.building.decoder import attention_sizes
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import NON_NEGATIVE_INT
from pz_persist.pretrained.hf.config import NON_NEGATIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import bool_field
from pz_persist.pretrained.hf.config import rope
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import DECODER_LAYERS
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights


def _indices(value: Any) -> bool:
  return isinstance(value, list) and all(
      isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)


def bamba_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Bamba checkpoint: Llama's layers, the attention of those not in
  ``attn_layer_indices`` replaced by a Mamba-2 mixer."""
  hidden, heads, kv_heads, head_dim = attention_sizes(cfg, kv_heads_default=None,
                                                      head_dim_default=None)
  act = cfg.get("hidden_act", FROM_TABLE)
  if act != "silu":
    raise cfg.unsupported("hidden_act", act, "Bamba's MLP is SwiGLU (silu), as its mixers' SiLU")
  bool_field(cfg, "attention_bias", False, False, "Bamba's attention has no biases")
  bool_field(cfg, "mlp_bias", False, False, "Bamba's MLP has no biases")
  theta, fraction = rope(cfg, 10_000.0)
  rotary = int(head_dim * fraction)
  if rotary < 2 or rotary % 2:
    raise cfg.unsupported("partial_rotary_factor", fraction,
                          f"it rotates {rotary} of head_dim={head_dim} entries; RoPE needs an"
                          " even number of at least 2")
  sizes = mamba_hybrid.mamba_sizes(cfg, hidden)
  eps = float(cfg.get("rms_norm_eps", FROM_TABLE))
  layers = cfg.require("num_hidden_layers")
  attention_at = cfg.get("attn_layer_indices") or []
  if any(i >= layers for i in attention_at):
    raise cfg.unsupported("attn_layer_indices", attention_at,
                          f"each index must name one of the num_hidden_layers={layers} layers")
  config, head_source = mamba_hybrid.checked_config(
      cfg, weights, heads=heads, kv_heads=kv_heads, hidden=hidden, head_dim=head_dim,
      neurons=cfg.require("intermediate_size"), layers=layers, theta=theta, eps=eps)
  kinds = ["attention" if i in attention_at else "mamba" for i in range(layers)]
  specs = mamba_hybrid.llama_specs(config, head_source, [k == "attention" for k in kinds])
  for i, kind in enumerate(kinds):
    p, s = f"transformer/block_{i}/", f"{DECODER_LAYERS}{i}."
    if kind == "mamba":
      specs += mamba_hybrid.mamba_specs(p + "mamba", s + "mamba.", sizes)

  def build():
    model = llamalike_common.build_llamalike_transformer(config, init_base_rng=None)
    if rotary != head_dim:
      model = pz.select(model).at_instances_of(pz.nn.ApplyRoPE).apply(
          lambda layer: pz.nn.ApplyRoPEToSubset(
              embedding_axis=layer.embedding_axis, max_wavelength=layer.max_wavelength,
              rope_subset_size=rotary, positions_input_name=layer.positions_input_name))
    return mamba_hybrid.with_mixers(model, kinds, sizes, eps)

  return Plan(build, tuple(specs))


def _detect(model: pz.nn.Layer) -> str | None:
  """Mamba-2 mixers in Llama's layout (Granite 4's record, of lower rank,
  claims those with Granite's constants)."""
  return "bamba" if mamba_hybrid.has_mixers(model) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only bamba.
  from pz_persist.nn.mamba2 import Mamba2  # pylint: disable=import-outside-toplevel
  indices = [i for i, block in enumerate(blocks(model)) if not all_layers(block, Mamba2)]
  fields: dict[str, Any] = {"attn_layer_indices": indices, "hidden_act": "silu",
                            "attention_bias": False, "mlp_bias": False}
  if indices:
    fields.update(without_default_head_dim(llamalike_fields(model, like)))
    params = fields["rope_parameters"]
    params.setdefault("partial_rotary_factor", 1.0)
  else:  # No attention layer: its sizes change nothing; like's, else the defaults.
    embed = named_shape(first_layer(model, pz.nn.EmbeddingTable, "token embeddings"))
    fields.update({"hidden_size": embed["embedding"], "vocab_size": embed["vocabulary"],
                   "num_hidden_layers": len(blocks(model)),
                   "rope_parameters": dict(like.get("rope_parameters") or {
                       "rope_type": "default", "rope_theta": 10_000.0,
                       "partial_rotary_factor": 0.5}),
                   **{k: like[k] for k in ("num_attention_heads", "num_key_value_heads")
                      if k in like}})
    mixer = all_layers(model, Mamba2)[0]
    fields["rms_norm_eps"] = number(mixer.norm_epsilon)
    fields.update(tied_field(model, like))
  ffw = all_layers(model, pz.nn.Linear)
  fields["intermediate_size"] = next(
      dict(linear.weights.value.named_shape)["neurons"] for linear in ffw
      if "neurons" in dict(linear.weights.value.named_shape))
  fields.update(mamba_hybrid.mamba_fields(model, like))
  return fields


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "bamba": {
        "defaults": {**LLAMA_LIKE, "rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5,
                     "mlp_bias": False, "attn_layer_indices": None, "z_loss_coefficient": 0.0,
                     **mamba_hybrid.DEFAULTS},
        "defaults_why": dict(mamba_hybrid.DEFAULTS_WHY),
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Bamba",
    model_types={"bamba": ModelType(bamba_plan, "BambaForCausalLM",
                                    **_TRANSFORMERS_DEFAULTS["bamba"],
                                    ignored_fields={
                                        "training only": ("z_loss_coefficient",),
                                        "how many positions' logits transformers computes at"
                                        " generation": ("num_logits_to_keep",)})},
    detect=_detect,
    write_config=_write_config,
    adds=("Mamba-2 mixers (`Mamba2`: fused `in_proj` read by rows, causal depthwise conv,"
          " selective scan, `D` skip, gated RMS norm over `n_groups`; state carried by"
          " `kv_caching_lm`) among Llama attention layers (`attn_layer_indices`), RoPE over"
          " half of each head"),
    refuses=("in_proj / out_proj biases (`mamba_proj_bias`), attention or MLP biases, scaled"
             " RoPE, activations other than SiLU"),
    rank=36,
    fields={**mamba_hybrid.FIELDS, "attn_layer_indices": (_indices, "a list of layer indices"),
            "z_loss_coefficient": NON_NEGATIVE_NUMBER,
            "num_logits_to_keep": (lambda v: v is None or NON_NEGATIVE_INT[0](v),
                                   "a non-negative integer or null")},
)
