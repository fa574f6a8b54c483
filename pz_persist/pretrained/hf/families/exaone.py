"""EXAONE 3 and 3.5 checkpoints (``model_type`` ``exaone``): Llama's math
under other names.

transformers builds ``LlamaForCausalLM`` for them, renaming the folder's
tensors as it loads (``transformer.h.N.attn.attention.q_proj`` is
``model.layers.N.self_attn.q_proj``; its ``conversion_mapping``) and back as
it saves, and reading the Hub's ``num_layers`` / ``layer_norm_epsilon`` /
``activation_function`` as Llama's fields (``ExaoneConfig.attribute_map``).
This record reads the folder the same way: Llama's plan
(`pz_persist.pretrained.hf.building.decoder.llama_plan`) on the names
renamed (`pz_persist.pretrained.hf.building.renamed`), so `export_hf` writes
EXAONE's own names back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penzai import pz

from pz_persist.pretrained.hf.building.aliases import read_aliases
from pz_persist.pretrained.hf.building.decoder import llama_plan
from pz_persist.pretrained.hf.building.decoder import model_biases
from pz_persist.pretrained.hf.building.defaults import LLAMA_LIKE
from pz_persist.pretrained.hf.building.renamed import Renaming
from pz_persist.pretrained.hf.building.renamed import renamed_plan
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import POSITIVE_NUMBER
from pz_persist.pretrained.hf.config import STRING
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import llamalike_fields
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.record import Family
from pz_persist.pretrained.hf.record import ModelType
from pz_persist.pretrained.hf.weights import Weights

EXAONE_NAMES = Renaming(
    prefixes=(("transformer.wte.", "model.embed_tokens."), ("transformer.h.", "model.layers."),
              ("transformer.ln_f.", "model.norm.")),
    parts=((".attn.attention.", ".self_attn."), (".self_attn.out_proj.", ".self_attn.o_proj."),
           (".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
           (".mlp.c_fc_0.", ".mlp.gate_proj."), (".mlp.c_fc_1.", ".mlp.up_proj."),
           (".mlp.c_proj.", ".mlp.down_proj.")),
)
"""EXAONE's tensor names -> Llama's, as transformers' ``conversion_mapping``
renames them (``lm_head.weight`` is the same in both)."""

_ALIASES = {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
            "activation_function": "hidden_act"}
"""``ExaoneConfig.attribute_map``: the Hub's spelling of Llama's fields."""


def exaone_plan(cfg: Config, weights: Weights) -> Plan:
  """Maps an EXAONE 3 / 3.5 checkpoint: Llama's layout (biases, scaled RoPE
  such as 3.5's ``llama3``, tied heads) read under EXAONE's tensor names,
  its fields under either spelling (both present and disagreeing is
  refused)."""
  read_aliases(cfg, _ALIASES)
  return renamed_plan(llama_plan, EXAONE_NAMES, cfg, weights)


def _write_config(model: pz.nn.Layer, model_type: str, like: Mapping[str, Any]) -> dict[str, Any]:
  del model_type  # Only exaone.
  fields = llamalike_fields(model, like)
  biases = model_biases(model)
  fields.update(attention_bias=biases.query_key_value or biases.output, mlp_bias=biases.mlp)
  return fields


RECORD = Family(
    title="EXAONE 3, 3.5",
    model_types={
        "exaone": ModelType(
            exaone_plan, "LlamaForCausalLM",
            defaults={**LLAMA_LIKE, "mlp_bias": False, "rms_norm_eps": 1e-5,
                      "rope_theta": 500_000.0, "num_key_value_heads": 8,
                      "max_position_embeddings": 4096},
            ignored_fields={
                "the Hub's pointer to its own modeling code, which transformers passes over"
                " for LlamaForCausalLM and pz_persist never runs": ("auto_map",),
                "dropout, inactive at inference": ("embed_dropout",)},
            foreign_fields=frozenset({"auto_map", "embed_dropout"})),
    },
    detect=lambda model: None,  # Llama's structure: written as llama unless like= says exaone.
    write_config=_write_config,
    adds="Llama's layout under EXAONE's tensor names (`transformer.h.N.attn.attention.*`,"
         " `c_fc_0`) and field names (`num_layers`, `layer_norm_epsilon`), both spellings of a"
         " field agreeing; written back under its own names",
    refuses="as Llama",
    rank=890,
    fields={"num_layers": POSITIVE_INT, "layer_norm_epsilon": POSITIVE_NUMBER,
            "activation_function": STRING},
    layer_prefixes=("transformer.h.",),
)
