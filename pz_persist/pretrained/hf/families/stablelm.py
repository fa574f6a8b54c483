"""StableLM 2 and StableLM-3B-4E1T checkpoints (``model_type`` ``stablelm``,
transformers' ``StableLmForCausalLM``).

Llama's grouped-query attention and gated MLP with LayerNorms that have a
shift, RoPE on the first ``partial_rotary_factor`` of each head (a quarter,
by default), optional biases on the query, key and value projections
(``use_qkv_bias``), optional LayerNorms of each query and key head, one per
head and without a shift (``qk_layernorm``, StableLM 2 12B), and optional
parallel blocks on one LayerNorm (``use_parallel_residual``, StableLM 2
12B). Built by `pz_persist.pretrained.hf.building.layernorm_decoder`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.building import layernorm_decoder as layout
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import rope
from pz_persist.pretrained.hf.config_from_model import LLAMALIKE_ACTIVATIONS
from pz_persist.pretrained.hf.config_from_model import activation_field
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

_NAMES = layout.Names(final_norm="model.norm", output="o_proj", mlp=None)
_GATED = {"silu": "swiglu", "gelu_approx": "geglu_approx"}  # Penzai's mlp_variant.


def stablelm_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps a StableLM checkpoint to Penzai (see the module's docstring).

  transformers' StableLM splits ``hidden_size`` evenly into heads and reads
  no ``head_dim``: a ``head_dim`` other than that is refused.
  """
  hidden, heads, kv_heads, head_dim = layout.even_head_sizes(cfg, "StableLM")
  theta, fraction = rope(cfg, FROM_TABLE)
  act = cfg.expect("hidden_act", set(LLAMALIKE_ACTIVATIONS), FROM_TABLE,
                   why="; StableLM's MLP is gated, SwiGLU or tanh-approximate GeGLU in Penzai")
  parallel = cfg.get("use_parallel_residual", FROM_TABLE)
  spec = layout.Layout(
      hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
      layers=cfg.require("num_hidden_layers"), vocab=cfg.require("vocab_size"),
      mlp_width=cfg.require("intermediate_size"),
      activation=_GATED[LLAMALIKE_ACTIVATIONS[act]], gated=True,
      rotary_dims=layout.rotary_dims(cfg, head_dim, fraction), theta=theta,
      eps=float(cfg.get("layer_norm_eps", FROM_TABLE)),
      qkv_bias=cfg.get("use_qkv_bias", FROM_TABLE), output_bias=False, mlp_bias=False,
      head_bias=False,
      query_key_norm="per_head" if cfg.get("qk_layernorm", FROM_TABLE) else None,
      parallel=parallel, window=None, tied=cfg.get("tie_word_embeddings", FROM_TABLE))
  cfg.check_all_used()
  return layout.layernorm_plan(cfg, weights, spec, _NAMES)


def _detect(model: pz.nn.Layer) -> str | None:
  """StableLM: the LayerNorm decoder with Llama's gated MLP."""
  found = layout.blocks_of(model)
  return "stablelm" if found is not None and found[1] else None


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only stablelm.
  found = layout.layout_fields(model)
  return {
      **{k: found[k] for k in layout.SIZES},
      "layer_norm_eps": found["eps"],
      "use_qkv_bias": found["qkv_bias"],
      "qk_layernorm": found["query_key_norm"] == "per_head",
      "use_parallel_residual": found["parallel"],
      **activation_field(model, like),
      **tied_field(model, like),
  }


RECORD = Family(
    title="StableLM 2, StableLM-3B",
    model_types={"stablelm": ModelType(
        stablelm_plan, "StableLmForCausalLM",
        defaults={"hidden_act": "silu", "layer_norm_eps": 1e-5, "tie_word_embeddings": False,
                  "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                  "num_key_value_heads": 32, "use_qkv_bias": False, "qk_layernorm": False,
                  "use_parallel_residual": False})},
    detect=_detect,
    write_config=_write_config,
    adds=("LayerNorm with partial rotary on Llama's gated MLP and grouped-query attention,"
          " query/key/value biases (use_qkv_bias), per-head query/key LayerNorms"
          " (qk_layernorm), parallel blocks on one LayerNorm (use_parallel_residual)"),
    refuses="scaled RoPE, a head_dim other than hidden_size / heads, activations other than"
            " SiLU / tanh GELU",
    rank=20,
    fields={"use_qkv_bias": BOOLEAN, "qk_layernorm": BOOLEAN},
)
