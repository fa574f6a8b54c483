"""Apertus checkpoints (``model_type`` ``apertus``: the Swiss AI 8B and 70B).

Apertus is Llama's layout (`pz_persist.pretrained.hf.building.decoder`) with
three changes:

- a non-gated MLP: ``down_proj(xielu(up_proj(x)))``, in Penzai a
  ``TransformerFeedForward`` of Llama's ``value_linear`` (``up_proj``), an
  `pz_persist.nn.xielu.XIELU` holding the layer's learned ``alpha_p`` /
  ``alpha_n`` and its ``beta`` / ``eps`` (``mlp.act_fn.*``), and Llama's
  ``out_linear`` (``down_proj``);
- an RMS norm on the queries and the keys over each head's ``projection``
  axis, after the projections and before RoPE (as in Qwen 3: the shared
  `pz_persist.pretrained.hf.building.norms` layers);
- its norms named ``attention_layernorm`` / ``feedforward_layernorm`` (Llama's
  ``input_layernorm`` / ``post_attention_layernorm``, the same places).

transformers' ``ApertusConfig`` defaults to ``llama3``-scaled RoPE (base
12,000,000, factor 8, original context 8192, low/high frequency factors 1
and 4) when the file gives no RoPE fields; that is what such a file loads
with here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.xielu import XIELU
from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.norms import query_key_norm_specs
from pz_persist.pretrained.hf.building.norms import with_query_key_norms
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import rms_norm_fields
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import size_fields
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_ROPE = {"rope_type": "llama3", "rope_theta": 12_000_000.0, "factor": 8.0,
         "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0}
"""``ApertusConfig``'s RoPE when the file gives none (its ``__post_init__``)."""

_XIELU = ("alpha_p", "alpha_n", "beta", "eps")
"""The activation's tensors (``mlp.act_fn.<name>``), each a scalar of the layer."""

_NORMS = {"input_layernorm": "attention_layernorm",
          "post_attention_layernorm": "feedforward_layernorm"}
"""Llama's norm names -> Apertus's."""


def apertus_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps an Apertus checkpoint (transformers' ``ApertusConfig`` defaults:
  xIELU, 65536 positions, epsilon 1e-5, llama3 RoPE as above)."""
  raw = cfg.raw
  if all(raw.get(key) is None for key in ("rope_parameters", "rope_scaling", "rope_theta")):
    raw["rope_parameters"] = dict(_ROPE)
  cfg.expect("hidden_act", {"xielu"}, "xielu", why="; Apertus's MLP is xIELU's")
  raw["hidden_act"] = "silu"  # Llama's plan builds the MLP's matrices; `_edit` swaps the rest.
  bias = cfg.get("attention_bias", False)

  def extras(p: str, s: str, config: llamalike_common.LlamalikeTransformerConfig
             ) -> list[TensorSpec]:
    act = [TensorSpec(f"{p}mlp/act.{name}", f"{s}mlp.act_fn.{name}", (), (),
                      stored=(1,) if name.startswith("alpha") else ())
           for name in _XIELU]
    return [*query_key_norm_specs(p, s, config), *act]

  plan = llama_plan(cfg, weights, biases=Biases(query_key_value=bias, output=bias),
                    max_positions_default=65_536, block_extras=extras, edit=_edit)
  specs = []
  for spec in plan.tensors:
    if spec.label.endswith("/mlp/gating_linear.weights"):
      continue  # Not gated.
    for llama, own in _NORMS.items():
      spec = dataclasses.replace(spec, source=spec.source.replace(f".{llama}.", f".{own}."))
    specs.append(spec)
  return Plan(plan.build, tuple(specs))


def _edit(model: model_parts.TransformerLM,
          config: llamalike_common.LlamalikeTransformerConfig) -> model_parts.TransformerLM:
  """Query/key norms, and each MLP made ``out(xielu(value(x)))``."""
  model = with_query_key_norms(model, config)

  def mlp(ffw: model_parts.TransformerFeedForward) -> model_parts.TransformerFeedForward:
    linears = {layer.weights.label.rsplit("/", 1)[-1]: layer
               for layer in all_layers(ffw, pz.nn.Linear)}
    value, out = linears["value_linear.weights"], linears["out_linear.weights"]
    prefix = value.weights.label.rsplit("/", 1)[0]
    act = XIELU(**{name: pz.ParameterSlot(f"{prefix}/act.{name}") for name in _XIELU})
    return model_parts.TransformerFeedForward([value, act, out])

  return pz.select(model).at_instances_of(model_parts.TransformerFeedForward).apply(mlp)


def _detect(model: pz.nn.Layer) -> str | None:
  """An xIELU MLP."""
  return "apertus" if all_layers(model, XIELU) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only apertus.
  return without_default_head_dim({
      **size_fields(model), **rms_norm_fields(model), **rope_fields(model),
      **tied_field(model, like), "hidden_act": "xielu",
      "attention_bias": model_biases(model).output})


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "apertus": {
        "defaults": {**LLAMA_LIKE, "hidden_act": "xielu", "rms_norm_eps": 1e-5,
                     "rope_theta": 12_000_000.0, "max_position_embeddings": 65_536},
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="Apertus",
    model_types={"apertus": ModelType(apertus_plan, "ApertusForCausalLM",
                                      **_TRANSFORMERS_DEFAULTS["apertus"])},
    detect=_detect,
    write_config=_write_config,
    adds=("a non-gated MLP with the learned xIELU activation (`XIELU`: per-layer `alpha_p`,"
          " `alpha_n`, `beta`, `eps`), per-head query/key RMS norms, `llama3` RoPE by default"),
    refuses="activations other than xIELU, an MLP bias",
    rank=342,
)
