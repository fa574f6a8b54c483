"""gpt-oss checkpoints (``model_type`` ``gpt_oss``: openai/gpt-oss-20b, -120b).

gpt-oss is Llama's layout (`pz_persist.pretrained.hf.building.decoder`) with:

- biases on all four attention projections (``attention_bias``, true);
- attention *sinks*: one learned logit per query head joining each softmax's
  denominator (``self_attn.sinks``), `SoftmaxWithSinks` in place of Penzai's
  ``pz.nn.Softmax`` (parameter ``transformer/block_{i}/attention/softmax.sinks``
  over the query head axes);
- alternating attention: ``layer_types`` (default: even layers
  ``sliding_attention`` through a ``sliding_window`` of 128, odd layers
  ``full_attention``);
- YaRN RoPE (transformers' default when the config names none: factor 32,
  ``beta_fast`` 32, ``beta_slow`` 1, no truncation, 4096 original positions;
  base 150 000);
- a mixture of experts in place of the MLP on every layer (`gpt_oss_moe`):
  a router with a bias, the top ``num_experts_per_tok`` of its logits softmaxed
  over the chosen, each expert a clamped SwiGLU with biases
  (``swiglu_alpha``, ``swiglu_limit``) whose gate and up projections the
  checkpoint interleaves in one ``gate_up_proj``;
- on the Hub, the experts' matrices stored in MXFP4
  (``quantization_config.quant_method`` ``mxfp4``): ``*_blocks`` and
  ``*_scales`` tensors, dequantised on load (`quantized_mxfp4`), exactly
  as transformers' ``Mxfp4Config(dequantize=True)``; the load logs what it
  dequantised, and the model exports dense (no ``quantization_config``).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.attention_sinks import SoftmaxWithSinks
from pz_persist.pretrained.hf.building import gpt_oss_moe
from pz_persist.pretrained.hf.building.decoder import Attention
from pz_persist.pretrained.hf.building.decoder import Biases
from pz_persist.pretrained.hf.building.decoder import attention_size_fields
from pz_persist.pretrained.hf.building.decoder import head_axes
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import NON_NEGATIVE_NUMBER
from pz_persist.pretrained.hf.config import OBJECT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import rms_norm_fields
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.config_from_model import windows
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_TYPES = ("sliding_attention", "full_attention")
_THETA = 150_000.0
_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "truncate": False, "original_max_position_embeddings": 4096}
"""transformers' ``GptOssConfig`` RoPE when a config names none."""


def gpt_oss_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a gpt-oss checkpoint (dense or with MXFP4 experts)."""
  _default_rope(cfg)
  moe = gpt_oss_moe.read_config(cfg, weights)
  bias = cfg.get("attention_bias", True)
  sinks: list[str] = []

  def extras(p: str, s: str, config: llamalike_common.LlamalikeTransformerConfig
             ) -> list[TensorSpec]:
    heads, _ = head_axes(config)
    sinks.append(p + "attention/softmax.sinks")
    return [TensorSpec(p + "attention/softmax.sinks", s + "self_attn.sinks",
                       tuple(heads.values()), tuple(heads),
                       stored=(config.num_kv_heads * config.query_head_multiplier,)),
            *moe.specs(p, s, config)]

  def edit(model: model_parts.TransformerLM,
           config: llamalike_common.LlamalikeTransformerConfig) -> model_parts.TransformerLM:
    return moe.edit(with_sinks(model, sinks), config)

  plan = llama_plan(cfg, weights, attention=_attention(cfg), biases=Biases(bias, bias),
                    head_dim_default=64, max_positions_default=131_072,
                    block_extras=extras, edit=edit)
  # Llama's dense MLP is replaced by the experts: its tensors are not read.
  tensors = tuple(spec for spec in plan.tensors if spec.label.rsplit("/", 2)[-2] != "mlp")
  return Plan(plan.build, tensors, views=tuple(moe.views))


def _default_rope(cfg: Config) -> None:
  """transformers' defaults for a config without RoPE fields (YaRN, base
  150 000), spelled as transformers 5 writes them, so that Llama's reader
  reads them; an explicit scaling is read as it is."""
  raw = cfg.raw
  if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
    raw["rope_parameters"] = {**_YARN, "rope_theta": raw.pop("rope_theta", None) or _THETA}
  elif isinstance(raw.get("rope_parameters"), dict) and raw.get("rope_theta") is None:
    raw["rope_parameters"] = {"rope_theta": _THETA, **raw["rope_parameters"]}
  elif raw.get("rope_theta") is None and raw.get("rope_parameters") is None:
    raw["rope_theta"] = _THETA


def _attention(cfg: Config) -> Callable[[int], Attention]:
  """Each layer's attention: ``layer_types`` (default: sliding, full,
  sliding, ...), the sliding ones through ``sliding_window`` (default 128)."""
  window = cfg.nullable("sliding_window", 128)
  types = cfg.get("layer_types")

  def per_layer(layers: int) -> Attention:
    kinds = types if types is not None else [_TYPES[i % 2] for i in range(layers)]
    if len(kinds) != layers or not set(kinds) <= set(_TYPES):
      raise cfg.unsupported("layer_types", kinds if len(kinds) <= 8 else [*kinds[:8], "..."],
                            f"one of {list(_TYPES)} for each of the {layers} layers")
    if window is None and "sliding_attention" in kinds:
      raise cfg.unsupported("sliding_window", None, "the layers of type 'sliding_attention'"
                            " need a window")
    return [llamalike_common.AttentionTypeSlidingWindowCausal(window)
            if kind == "sliding_attention" else llamalike_common.AttentionTypeGlobalCausal()
            for kind in kinds]

  if types is not None and not set(types) <= set(_TYPES):
    raise cfg.unsupported("layer_types", types[:8], f"each one of {list(_TYPES)}")
  return per_layer


def with_sinks(model: model_parts.TransformerLM, labels: list[str]) -> model_parts.TransformerLM:
  """``model`` with each block's attention softmax taking the sinks of
  parameter ``labels[i]`` (block ``i``)."""
  selected = pz.select(model).at_instances_of(model_parts.TransformerBlock)

  def block(layer: model_parts.TransformerBlock, label: str) -> model_parts.TransformerBlock:
    return pz.select(layer).at_instances_of(pz.nn.Softmax).apply(
        lambda softmax: SoftmaxWithSinks(sinks=pz.ParameterSlot(label), axis=softmax.axes))

  return selected.set_sequence([block(b, label)
                                for b, label in zip(selected.get_sequence(), labels)])


def _detect(model: pz.nn.Layer) -> str | None:
  """Llama's layout with attention sinks."""
  return "gpt_oss" if all_layers(model, SoftmaxWithSinks) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only gpt_oss.
  found = windows(model)
  window = next((w for w in found if w is not None), None)
  return {
      **attention_size_fields(model), **rms_norm_fields(model), **rope_fields(model),
      **tied_field(model, like), **gpt_oss_moe.config_fields(model),
      "layer_types": ["full_attention" if w is None else "sliding_attention" for w in found],
      "sliding_window": like.get("sliding_window", 128) if window is None else window,
      "attention_bias": model_biases(model).output,
      "hidden_act": "silu",  # Read (Llama's plan), never used: the experts clamp their own.
  }


_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt_oss": {
        "defaults": {**LLAMA_LIKE, "rms_norm_eps": 1e-5, "attention_bias": True,
                     "rope_theta": 150_000.0,
                     "sliding_window": 128, "head_dim": 64, "num_local_experts": 128,
                     "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                     "max_position_embeddings": 131_072},
    },
}
"""Per ``model_type``: what each absent field means (transformers' config class's
value; `pz_persist.pretrained.hf.record.ModelType.defaults`) and why an entry
differs from the class or is not one of its fields."""


RECORD = Family(
    title="gpt-oss",
    model_types={"gpt_oss": ModelType(gpt_oss_plan, "GptOssForCausalLM",
                     **_TRANSFORMERS_DEFAULTS["gpt_oss"],
                     ignored_fields={
                         "training only: the load-balancing loss": (
                             "router_aux_loss_coef", "output_router_logits"),
                         "the Hub's configs hold it; transformers ignores it": (
                             "initial_context_length",),
                     }, foreign_fields=frozenset({"initial_context_length"}))},
    detect=_detect,
    write_config=_write_config,
    adds=("attention sinks (`SoftmaxWithSinks`), alternating sliding/full layers, YaRN RoPE,"
          " a mixture of experts on every layer (router bias, softmax over the top k, clamped"
          " SwiGLU experts with biases); MXFP4 experts dequantised on load (exported dense)"),
    refuses="other `quantization_config` methods, MXFP4 on modules other than the experts",
    rank=80,
    fields={
        "num_local_experts": POSITIVE_INT,
        "num_experts_per_tok": POSITIVE_INT,
        "swiglu_alpha": POSITIVE_NUMBER,
        "swiglu_limit": POSITIVE_NUMBER,
        "router_aux_loss_coef": NON_NEGATIVE_NUMBER,
        "output_router_logits": BOOLEAN,
        "quantization_config": OBJECT,
        "experts_per_token": POSITIVE_INT,
        "initial_context_length": POSITIVE_INT,
    },
)
