"""StarCoder2 checkpoints (``model_type`` ``starcoder2``, transformers'
``Starcoder2ForCausalLM``).

Llama's grouped-query attention with LayerNorms that have a shift, a bias on
every projection under ``use_bias`` (query, key, value, output, and the
plain MLP's ``c_fc`` / ``c_proj``), a non-gated GELU MLP, RoPE on every
dimension, sequential blocks and an optional sliding window on every layer
(``sliding_window``; null: global). Built by
`pz_persist.pretrained.hf.building.layernorm_decoder`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.errors import ExportError
from pz_persist.pretrained.hf.building import layernorm_decoder as layout
from pz_persist.pretrained.hf.building.decoder import attention_sizes
from pz_persist.pretrained.hf.building.decoder import full_rotary_wavelength
from pz_persist.pretrained.hf.building.decoder import without_default_head_dim
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import NON_NEGATIVE_NUMBER
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import activation_field
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_NAMES = layout.Names(final_norm="model.norm", output="o_proj", mlp=("c_fc", "c_proj"))


def starcoder2_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a StarCoder2 checkpoint to Penzai (see the module's docstring).

  transformers' StarCoder2 rotates every dimension of each head (a
  ``partial_rotary_factor`` below 1 would not run there): it is refused.
  Its ``head_dim`` field, when present, sizes the heads and RoPE alike.
  """
  hidden, heads, kv_heads, head_dim = attention_sizes(cfg, kv_heads_default=None,
                                                      head_dim_default=None)
  theta = full_rotary_wavelength(cfg)
  act = cfg.expect("hidden_act", set(layout.PLAIN_ACTIVATIONS), FROM_TABLE)
  biased = cfg.get("use_bias", FROM_TABLE)
  for dropout in ("residual_dropout", "embedding_dropout"):
    cfg.get(dropout, FROM_TABLE)  # Inactive at inference.
  spec = layout.Layout(
      hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
      layers=cfg.require("num_hidden_layers"), vocab=cfg.require("vocab_size"),
      mlp_width=cfg.require("intermediate_size"),
      activation=layout.PLAIN_ACTIVATIONS[act], gated=False, rotary_dims=head_dim,
      theta=theta, eps=float(cfg.get("norm_epsilon", FROM_TABLE)),
      qkv_bias=biased, output_bias=biased, mlp_bias=biased, head_bias=False,
      query_key_norm=None, parallel=False, window=cfg.get("sliding_window"),
      tied=cfg.get("tie_word_embeddings", FROM_TABLE))
  cfg.check_all_used()
  return layout.layernorm_plan(cfg, weights, spec, _NAMES)


def _detect(model: pz.nn.Layer) -> str | None:
  """StarCoder2: the LayerNorm decoder with sequential blocks and a plain MLP."""
  return "starcoder2" if layout.blocks_of(model) == (False, False) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only starcoder2.
  found = layout.layout_fields(model)
  biases = {found[k] for k in ("qkv_bias", "output_bias", "mlp_bias")}
  if len(biases) != 1:
    raise ExportError("StarCoder2's use_bias puts a bias on every projection or none; this"
                      f" model has some only ({found}).")
  fields = {
      **without_default_head_dim({k: found[k] for k in (*layout.SIZES, "head_dim")}),
      "norm_epsilon": found["eps"],
      "use_bias": biases.pop(),
      "sliding_window": found["window"],
      **activation_field(model, like, spellings=layout.PLAIN_ACTIVATIONS),
      **tied_field(model, like),
  }
  if fields["rope_parameters"]["partial_rotary_factor"] == 1.0:
    del fields["rope_parameters"]["partial_rotary_factor"]  # Not a StarCoder2 field.
  return fields


RECORD = Family(
    title="StarCoder2",
    model_types={"starcoder2": ModelType(
        starcoder2_plan, "Starcoder2ForCausalLM",
        defaults={"hidden_act": "gelu_pytorch_tanh", "norm_epsilon": 1e-5,
                  "tie_word_embeddings": True, "rope_theta": 10_000.0,
                  "partial_rotary_factor": 1.0, "num_key_value_heads": 2, "use_bias": True,
                  "sliding_window": None, "residual_dropout": 0.0, "embedding_dropout": 0.0},
        ignored_fields={
            "the Hub's folders' fields from before transformers' StarCoder2, which reads none"
            " of them (its norms are LayerNorms of norm_epsilon, its MLP c_fc / c_proj)": (
                "mlp_type", "norm_type", "rms_norm_eps"),
        },
        foreign_fields=frozenset({"mlp_type", "norm_type", "rms_norm_eps"}))},
    detect=_detect,
    write_config=_write_config,
    adds=("LayerNorm with biases, biases on every projection (use_bias), a non-gated GELU MLP"
          " (c_fc, c_proj), grouped-query attention, a sliding window on every layer"),
    refuses="scaled RoPE, partial rotary (transformers' StarCoder2 cannot run it)",
    rank=7,
    fields={"use_bias": BOOLEAN, "norm_epsilon": POSITIVE_NUMBER,
            "residual_dropout": NON_NEGATIVE_NUMBER, "embedding_dropout": NON_NEGATIVE_NUMBER},
)
