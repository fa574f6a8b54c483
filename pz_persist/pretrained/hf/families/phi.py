"""Phi-1, Phi-1.5 and Phi-2 checkpoints (``model_type`` ``phi``,
transformers' ``PhiForCausalLM``).

Each Phi block feeds one LayerNorm to attention and MLP in parallel and adds
both to the residual (``x + attn(ln(x)) + mlp(ln(x))``); every projection
has a bias, the output head too; RoPE rotates the first
``partial_rotary_factor`` of each head (half, by default); ``qk_layernorm``
adds a LayerNorm over each query and key head (one shared by the heads).
Built by `pz_persist.pretrained.hf.building.layernorm_decoder`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.building import layernorm_decoder as layout
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import NON_NEGATIVE_NUMBER
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import rope
from pz_persist.pretrained.hf.config_from_model import activation_field
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_NAMES = layout.Names(final_norm="model.final_layernorm", output="dense", mlp=("fc1", "fc2"))


def phi_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a Phi checkpoint to Penzai (see the module's docstring).

  transformers' Phi reads ``head_dim`` when the file has one but sizes the
  query/key LayerNorms by ``hidden_size // num_attention_heads``: any other
  ``head_dim`` is refused.
  """
  hidden, heads, kv_heads, head_dim = layout.even_head_sizes(cfg, "Phi")
  theta, fraction = rope(cfg, FROM_TABLE)
  act = cfg.expect("hidden_act", set(layout.PLAIN_ACTIVATIONS), FROM_TABLE)
  cfg.get("resid_pdrop", FROM_TABLE)  # Dropout: inactive at inference.
  spec = layout.Layout(
      hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
      layers=cfg.require("num_hidden_layers"), vocab=cfg.require("vocab_size"),
      mlp_width=cfg.require("intermediate_size"),
      activation=layout.PLAIN_ACTIVATIONS[act], gated=False,
      rotary_dims=layout.rotary_dims(cfg, head_dim, fraction), theta=theta,
      eps=float(cfg.get("layer_norm_eps", FROM_TABLE)),
      qkv_bias=True, output_bias=True, mlp_bias=True, head_bias=True,
      query_key_norm="shared" if cfg.get("qk_layernorm", FROM_TABLE) else None,
      parallel=True, window=None, tied=cfg.get("tie_word_embeddings", FROM_TABLE))
  cfg.check_all_used()
  return layout.layernorm_plan(cfg, weights, spec, _NAMES)


def _detect(model: pz.nn.Layer) -> str | None:
  """Phi: the LayerNorm decoder with parallel blocks and a plain MLP."""
  return "phi" if layout.blocks_of(model) == (True, False) else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only phi.
  found = layout.layout_fields(model)
  act = activation_field(model, like, spellings=layout.PLAIN_ACTIVATIONS)
  if act["hidden_act"] == "gelu_pytorch_tanh" and "hidden_act" not in like:
    act["hidden_act"] = "gelu_new"  # Phi's own spelling of the same tanh formula.
  return {
      **{k: found[k] for k in layout.SIZES},
      "layer_norm_eps": found["eps"],
      "qk_layernorm": found["query_key_norm"] == "shared",
      **act,
      **tied_field(model, like),
  }


RECORD = Family(
    title="Phi-1 / 1.5 / 2",
    model_types={"phi": ModelType(
        phi_plan, "PhiForCausalLM",
        defaults={"hidden_act": "gelu_new", "layer_norm_eps": 1e-5,
                  "tie_word_embeddings": False, "rope_theta": 10_000.0,
                  "partial_rotary_factor": 0.5, "qk_layernorm": False, "resid_pdrop": 0.0})},
    detect=_detect,
    write_config=_write_config,
    adds=("parallel attention and MLP on one LayerNorm, biases on every projection and the"
          " head, partial rotary, query/key LayerNorms (qk_layernorm)"),
    refuses="scaled RoPE, a head_dim other than hidden_size / heads",
    rank=10,
    fields={"qk_layernorm": BOOLEAN, "resid_pdrop": NON_NEGATIVE_NUMBER},
)
