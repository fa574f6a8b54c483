"""TII's Falcon-H1 (``model_type`` ``falcon_h1``): attention and a Mamba-2
mixer side by side in every layer, with µP constants.

Each layer is Llama's (RMS norms, SwiGLU MLP, RoPE over whole heads) whose
token mixer is two branches added together (`pz.nn.BranchAndAddTogether`):
a `pz_persist.nn.mamba2.FalconH1Mamba2` mixer between ``ssm_in_multiplier``
and ``ssm_out_multiplier``, and Llama's attention between
``attention_in_multiplier`` and ``attention_out_multiplier`` with its keys
scaled by ``key_multiplier`` (before RoPE). The mixer multiplies its five
projected streams by ``ssm_multipliers`` (transformers' ``mup_vector``) and
has a gated RMS norm only with ``mamba_rms_norm`` (then before the gate with
``mamba_norm_before_gate``, after it otherwise). The MLP multiplies its gate
projection by ``mlp_multipliers[0]`` (inside the SiLU) and its output by
``mlp_multipliers[1]``; the embeddings are multiplied by
``embedding_multiplier`` and the logits by ``lm_head_multiplier``. Each
constant is a `pz_persist.nn.constant_scale.ConstantScale` holding the
config's number (kept where it is 1, so that export reads it back).
``mamba_d_ssm`` sets the mixer's width (``mamba_expand * hidden_size``
when null). Hugging Face names the MLP ``feed_forward.*``, its norm
``pre_ff_layernorm`` and the final norm ``final_layernorm``. Sampling
carries the mixers' convolution and state-space state: use
`pz_persist.pretrained.kv_caching_lm`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.constant_scale import ConstantScale
from pz_persist.nn.mamba2 import GATE_THEN_NORM
from pz_persist.nn.mamba2 import NO_NORM
from pz_persist.nn.mamba2 import NORM_THEN_GATE
from pz_persist.nn.mamba2 import FalconH1Mamba2
from pz_persist.pretrained.errors import ExportError
from pz_persist.pretrained.hf.building import mamba_hybrid
from pz_persist.pretrained.hf.building.decoder import attention_size_fields
from pz_persist.pretrained.hf.building.decoder import attention_sizes
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.config import BOOLEAN
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
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import DECODER_LAYERS
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

SCALARS = ("embedding_multiplier", "lm_head_multiplier", "key_multiplier",
           "attention_in_multiplier", "attention_out_multiplier", "ssm_in_multiplier",
           "ssm_out_multiplier")
"""The single constants of ``config.json`` (each 1 by default)."""


@dataclasses.dataclass(frozen=True)
class Multipliers:
  """Every constant of a Falcon-H1 config."""

  embedding_multiplier: float
  lm_head_multiplier: float
  key_multiplier: float
  attention_in_multiplier: float
  attention_out_multiplier: float
  ssm_in_multiplier: float
  ssm_out_multiplier: float
  mlp_multipliers: tuple[float, float]
  ssm_multipliers: tuple[float, float, float, float, float]


def _numbers(count: int) -> tuple[Any, str]:
  return (lambda v: v is None or (isinstance(v, list) and len(v) == count
                                  and all(POSITIVE_NUMBER[0](x) for x in v)),
          f"a list of {count} positive finite numbers, or null")


def _multipliers(cfg: Config) -> Multipliers:
  for key in SCALARS:
    if key in cfg.raw and cfg.raw[key] is None:
      raise cfg.unsupported(key, None, "transformers' Falcon-H1 multiplies by it: give a number"
                            " (1.0 changes nothing) or leave it out")
  mlp = cfg.get("mlp_multipliers", None) or [1.0, 1.0]
  ssm = cfg.get("ssm_multipliers", None) or [1.0] * 5
  return Multipliers(**{k: float(cfg.get(k, FROM_TABLE)) for k in SCALARS},
                     mlp_multipliers=tuple(float(v) for v in mlp),  # type: ignore[arg-type]
                     ssm_multipliers=tuple(float(v) for v in ssm))  # type: ignore[arg-type]


def _norm_order(cfg: Config) -> str:
  if not cfg.get("mamba_rms_norm", FROM_TABLE):
    cfg.get("mamba_norm_before_gate", FROM_TABLE)  # Read (checked), but unused without a norm.
    return NO_NORM
  return NORM_THEN_GATE if cfg.get("mamba_norm_before_gate", FROM_TABLE) else GATE_THEN_NORM


_HUB_ONLY = ("attn_layer_indices", "mamba_use_mlp", "mlp_expansion_factor")
"""Fields the Hub's configs (written by the original code) hold that
transformers' class lacks and its model never reads: every layer has
attention and an MLP, of ``intermediate_size``."""


def _check_hub_settings(cfg: Config) -> None:
  """The original code's layer switches, accepted at the values transformers'
  model (which ignores them) agrees with: attention and an MLP in every layer."""
  indices = cfg.get("attn_layer_indices")
  if indices is not None:
    raise cfg.unsupported("attn_layer_indices", indices,
                          "transformers' Falcon-H1 ignores it and builds attention in every"
                          " layer; only null is read the same by both")
  if cfg.get("mamba_use_mlp") is False:  # Absent: transformers' model, an MLP everywhere.
    raise cfg.unsupported("mamba_use_mlp", False, "transformers' Falcon-H1 ignores it and builds"
                          " an MLP in every layer; only true is read the same by both")
  cfg.get("mlp_expansion_factor")  # intermediate_size gives the MLP's width.


def falcon_h1_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Falcon-H1 checkpoint (the module docstring says how)."""
  hidden, heads, kv_heads, head_dim = attention_sizes(cfg, kv_heads_default=8,
                                                      head_dim_default=None)
  act = cfg.get("hidden_act", FROM_TABLE)
  if act != "silu":
    raise cfg.unsupported("hidden_act", act,
                          "Falcon-H1's MLP is SwiGLU and its mixers' convolution SiLU")
  bool_field(cfg, "attention_bias", False, False, "pz_persist reads no Falcon-H1 attention biases"
             " (no published checkpoint has them)")
  bool_field(cfg, "mlp_bias", False, False, "pz_persist reads no Falcon-H1 MLP biases (no"
             " published checkpoint has them)")
  bool_field(cfg, "projectors_bias", False, False, "the mixers' out_proj bias is not read (no"
             " published checkpoint has one)")
  theta, fraction = rope(cfg, 10_000.0)
  if fraction != 1.0:
    raise cfg.unsupported("partial_rotary_factor", fraction,
                          "transformers' Falcon-H1 rotates every entry of each head")
  d_ssm = cfg.nullable("mamba_d_ssm", FROM_TABLE)  # Null: mamba_expand * hidden_size.
  sizes = dataclasses.replace(mamba_hybrid.mamba_sizes(cfg, hidden, d_ssm),
                              norm=_norm_order(cfg) != NO_NORM)
  norm_order = _norm_order(cfg)
  multipliers = _multipliers(cfg)
  _check_hub_settings(cfg)
  eps = float(cfg.get("rms_norm_eps", FROM_TABLE))
  layers = cfg.require("num_hidden_layers")
  config, head_source = mamba_hybrid.checked_config(
      cfg, weights, heads=heads, kv_heads=kv_heads, hidden=hidden, head_dim=head_dim,
      neurons=cfg.require("intermediate_size"), layers=layers, theta=theta, eps=eps)
  specs = mamba_hybrid.llama_specs(config, head_source, [True] * layers)
  for i in range(layers):
    p, s = f"transformer/block_{i}/", f"{DECODER_LAYERS}{i}."
    specs += mamba_hybrid.mamba_specs(p + "mamba", s + "mamba.", sizes)

  def build():
    model = llamalike_common.build_llamalike_transformer(config, init_base_rng=None)
    return with_falcon_h1_layers(model, sizes, eps, norm_order, multipliers)

  return Plan(build, tuple(specs))


def with_falcon_h1_layers(model: model_parts.TransformerLM, sizes: mamba_hybrid.MambaSizes,
                          eps: float, norm_order: str, m: Multipliers
                          ) -> model_parts.TransformerLM:
  """Penzai's llama-like ``model`` made Falcon-H1's: each attention beside a
  mixer, and every constant in place (the module docstring lists them)."""
  body = model.body.sublayers
  lookup = next(i for i, layer in enumerate(body) if isinstance(layer, pz.nn.EmbeddingLookup))
  body = [*body[:lookup + 1], ConstantScale(m.embedding_multiplier), *body[lookup + 1:],
          ConstantScale(m.lm_head_multiplier)]
  model = dataclasses.replace(model, body=dataclasses.replace(model.body, sublayers=body))
  selected = pz.select(model).at_instances_of(model_parts.TransformerBlock)
  new_blocks = []
  for i, block in enumerate(selected.get_sequence()):
    mixer = FalconH1Mamba2.from_falcon_config(
        f"transformer/block_{i}/mamba", stream_multipliers=m.ssm_multipliers,
        norm_order=norm_order, **mamba_hybrid.mixer_keywords(sizes, eps))

    def parallel(attention: pz.nn.Attention, mixer=mixer) -> pz.nn.Layer:
      key = attention.input_to_key
      assert isinstance(key, pz.nn.Sequential)  # Penzai's llama-like Linear, then ApplyRoPE.
      attention = dataclasses.replace(attention, input_to_key=pz.nn.Sequential(
          [key.sublayers[0], ConstantScale(m.key_multiplier), *key.sublayers[1:]]))
      return pz.nn.BranchAndAddTogether([
          pz.nn.Sequential([ConstantScale(m.ssm_in_multiplier), mixer,
                            ConstantScale(m.ssm_out_multiplier)]),
          pz.nn.Sequential([ConstantScale(m.attention_in_multiplier), attention,
                            ConstantScale(m.attention_out_multiplier)]),
      ])

    block = pz.select(block).at_instances_of(pz.nn.Attention).apply(parallel)
    new_blocks.append(pz.select(block).at_instances_of(model_parts.TransformerFeedForward)
                      .apply(lambda ffw: _scaled_mlp(ffw, m.mlp_multipliers)))
  return selected.set_sequence(new_blocks)


def _scaled_mlp(ffw: model_parts.TransformerFeedForward, mlp: tuple[float, float]
                ) -> model_parts.TransformerFeedForward:
  """``ffw`` (gate, SiLU, times up, down) with the gate's projection times
  ``mlp[0]`` (inside the SiLU) and the output times ``mlp[1]``."""
  gate = pz.select(ffw).at_instances_of(pz.nn.NamedGroup).where(lambda g: g.name == "gate")
  ffw = gate.apply(lambda g: dataclasses.replace(
      g, sublayers=[g.sublayers[0], ConstantScale(mlp[0]), *g.sublayers[1:]]))
  return dataclasses.replace(ffw, sublayers=[*ffw.sublayers, ConstantScale(mlp[1])])


def _detect(model: pz.nn.Layer) -> str | None:
  """Falcon-H1's mixers (ahead of Granite 4 and Bamba, which also hold
  Mamba-2 mixers and, for Granite, a `ConstantScale` after the lookup)."""
  return "falcon_h1" if all_layers(model, FalconH1Mamba2) else None


def _scale(layer: Any, where: str) -> float:
  if not isinstance(layer, ConstantScale) or layer.divide:
    raise ExportError(f"the model has no ConstantScale {where} (it has {type(layer).__name__}),"
                      " so it is not Falcon-H1's layout; name the right family with like=, or"
                      " undo the edit that removed it.")
  return layer.by


def _written(multipliers: list[float]) -> list[float]:
  return [number(v) for v in multipliers]


def multiplier_fields(model: pz.nn.Layer, like: Mapping[str, Any]) -> dict[str, Any]:
  """The constants of a model in Falcon-H1's layout (its first block's; a
  model whose blocks differ has no ``config.json`` and is refused)."""
  body = model.body.sublayers
  lookup = next(i for i, layer in enumerate(body) if isinstance(layer, pz.nn.EmbeddingLookup))
  per_block = []
  for block in blocks(model):
    branches = pz.select(block).at_instances_of(pz.nn.BranchAndAddTogether).get_sequence()
    if len(branches) != 1 or len(branches[0].branches) != 2:
      raise ExportError("a Falcon-H1 block adds one mixer branch and one attention branch;"
                        " this model's block has another structure")
    ssm, attn = (branch.sublayers for branch in branches[0].branches)
    key = first_layer(attn[1], pz.nn.Attention, "attention").input_to_key.sublayers
    ffw = first_layer(block, model_parts.TransformerFeedForward, "MLP")
    gate = pz.select(ffw).at_instances_of(pz.nn.NamedGroup).where(
        lambda g: g.name == "gate").get_sequence()
    mixer = first_layer(branches[0].branches[0], FalconH1Mamba2, "Falcon-H1 mixer")
    per_block.append({
        "ssm_in_multiplier": _scale(ssm[0], "before the mixer"),
        "ssm_out_multiplier": _scale(ssm[-1], "after the mixer"),
        "attention_in_multiplier": _scale(attn[0], "before the attention"),
        "attention_out_multiplier": _scale(attn[-1], "after the attention"),
        "key_multiplier": _scale(key[1], "after the key projection"),
        "mlp_multipliers": _written([
            _scale(gate[0].sublayers[1] if gate else None, "after the MLP's gate projection"),
            _scale(ffw.sublayers[-1], "at the end of the MLP")]),
        "ssm_multipliers": _written(list(mixer.stream_multipliers)),
        "norm_order": mixer.norm_order,
    })
  if any(fields != per_block[0] for fields in per_block):
    raise ExportError("the blocks' Falcon-H1 constants (or mixer norms) differ from one block to"
                      " another; config.json holds one of each for every layer")
  fields = dict(per_block[0])
  order = fields.pop("norm_order")
  fields.update({k: number(v) for k, v in fields.items() if isinstance(v, float)})
  fields["embedding_multiplier"] = number(_scale(body[lookup + 1], "after the embedding lookup"))
  fields["lm_head_multiplier"] = number(_scale(body[-1], "after the output head"))
  fields["mamba_rms_norm"] = order != NO_NORM
  # Without a norm the order is unread: like's, else transformers' default.
  fields["mamba_norm_before_gate"] = (order == NORM_THEN_GATE if order != NO_NORM
                                      else like.get("mamba_norm_before_gate", True))
  return fields


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only falcon_h1.
  fields: dict[str, Any] = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                            "projectors_bias": False, **attention_size_fields(model)}
  if fields["head_dim"] * fields["num_attention_heads"] == fields["hidden_size"] and (
      "head_dim" not in like):
    del fields["head_dim"]  # Not a field of transformers' config class: written when needed.
  fields["rms_norm_eps"] = number(first_layer(model, pz.nn.RMSStandardize, "RMS norm").epsilon)
  fields.update(rope_fields(model))
  fields.update(tied_field(model, like))
  fields["intermediate_size"] = next(
      dict(linear.weights.value.named_shape)["neurons"] for linear in all_layers(model, pz.nn.Linear)
      if "neurons" in dict(linear.weights.value.named_shape))
  fields.update(multiplier_fields(model, like))
  fields.update(mamba_hybrid.mamba_fields(model, like, d_ssm=True))
  if "mamba_d_ssm" in like and like["mamba_d_ssm"] is None and (
      fields["mamba_d_ssm"] == fields["mamba_expand"] * fields["hidden_size"]):
    fields["mamba_d_ssm"] = None  # like's spelling of the same width.
  return fields


_DEFAULTS: dict[str, Any] = {
    **LLAMA_LIKE, "rms_norm_eps": 1e-5, "num_key_value_heads": 8, "mlp_bias": False,
    "projectors_bias": False, "mamba_d_ssm": 1024, "mamba_norm_before_gate": True,
    "mamba_rms_norm": False, **dict.fromkeys(SCALARS, 1.0), "mlp_multipliers": None,
    "ssm_multipliers": None, **mamba_hybrid.DEFAULTS}

RECORD = Family(
    title="Falcon-H1",
    model_types={"falcon_h1": ModelType(
        falcon_h1_plan, "FalconH1ForCausalLM", defaults=_DEFAULTS,
        defaults_why={
            **mamba_hybrid.DEFAULTS_WHY,
            "mamba_d_head": ("the config class replaces 'auto' by mamba_d_ssm (or mamba_expand *"
                             " hidden_size) // mamba_n_heads, which pz_persist computes the same"
                             " way"),
            "mlp_multipliers": "the config class fills None with [1.0, 1.0], as pz_persist does",
            "ssm_multipliers": "the config class fills None with five 1.0s, as pz_persist does",
        },
        ignored_fields={"how many positions' logits transformers computes at generation": (
            "num_logits_to_keep",),
            "the original code's settings, not read by transformers (checked where they would"
            " disagree with it)": _HUB_ONLY},
        foreign_fields=frozenset(_HUB_ONLY))},
    detect=_detect,
    write_config=_write_config,
    adds=("attention and a Mamba-2 mixer (`FalconH1Mamba2`: `ssm_multipliers` on its five"
          " projected streams, gated RMS norm optional and before or after the gate,"
          " `mamba_d_ssm` width) side by side in every layer (`BranchAndAddTogether`), and every"
          " µP constant (`ConstantScale`: embedding, lm_head, key, attention and SSM in/out, MLP"
          " gate/down)"),
    refuses=("in_proj / out_proj biases (`mamba_proj_bias`, `projectors_bias`), attention or MLP"
             " biases, scaled or partial RoPE, activations other than SiLU"),
    rank=22,
    fields={**mamba_hybrid.FIELDS, **dict.fromkeys(SCALARS, POSITIVE_NUMBER),
            "mlp_multipliers": _numbers(2), "ssm_multipliers": _numbers(5),
            "mamba_d_ssm": (lambda v: v is None or POSITIVE_INT[0](v),
                            "a positive integer or null"),
            "mamba_rms_norm": BOOLEAN, "mamba_norm_before_gate": BOOLEAN,
            "projectors_bias": BOOLEAN, "mamba_use_mlp": BOOLEAN,
            "mlp_expansion_factor": POSITIVE_INT,
            "attn_layer_indices": (lambda v: v is None or isinstance(v, list), "a list or null"),
            "num_logits_to_keep": (lambda v: v is None or NON_NEGATIVE_INT[0](v),
                                   "a non-negative integer or null")},
)
