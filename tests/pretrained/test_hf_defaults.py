"""What an absent ``config.json`` field means: one table
(`pz_persist.pretrained.hf.families.DEFAULTS`, collected from each record's
`ModelType.defaults`), checked
against transformers' config classes, and every family loaded from a
``config.json`` of sizes alone against transformers' logits.

A folder without ``rms_norm_eps`` used to load GLM-4.5, gpt-oss and Llama 4
with Llama's 1e-6 where transformers' classes say 1e-5 (logits off by
0.05-0.8); each family's defaults now come from the table, whose every entry
is transformers' own or has its reason written down.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pretrained import hf_family_harness as checks
from pretrained import test_hf_qwen3_5
from pz_persist.pretrained.hf import config as hf_config
from pz_persist.pretrained.hf import families

_ROPE_FIELDS = ("rope_theta", "partial_rotary_factor")
_ABSENT = object()


def _theirs(config, field: str):
  """``field`` of a transformers config instance (``rope_theta`` and
  ``partial_rotary_factor`` from its ``rope_parameters``, the global layers'
  where they are per layer type); `_ABSENT` if it has none."""
  if field in _ROPE_FIELDS:
    params = config.rope_parameters
    params = params.get("full_attention", params)
    return params.get(field, 1.0 if field == "partial_rotary_factor" else None)
  try:
    return getattr(config, field, _ABSENT)
  except Exception:  # pylint: disable=broad-except  # A per-layer field has no one value.
    return _ABSENT


_TEXT_TYPES = sorted(name for name, t in families.MODEL_TYPES.items() if t.exported)


@pytest.mark.parametrize("model_type", _TEXT_TYPES)
def test_the_table_is_transformers_config_class(model_type):
  """Each entry of the ``model_type``'s row equals transformers' config
  class instantiated without arguments, or its record says why not
  (`ModelType.defaults_why`): the class lacks the field, or differs in a way
  that means the same model."""
  config = transformers.CONFIG_MAPPING[model_type]()
  declared = families.MODEL_TYPES[model_type]
  assert declared.defaults, f"{model_type} declares no defaults"
  assert set(declared.defaults_why) <= set(declared.defaults)
  for field, ours in declared.defaults.items():
    theirs = _theirs(config, field)
    same = theirs is not _ABSENT and theirs == ours and (
        type(theirs) is type(ours) or isinstance(theirs, float))
    if field in declared.defaults_why:
      assert not same, f"{model_type}.{field}: now transformers' own; drop its reason"
    else:
      assert same, (model_type, field, ours, None if theirs is _ABSENT else theirs)


def test_multimodal_model_types_read_their_text_models_row():
  """A multimodal row is its text model's, unless the folder's text model has
  a config class of its own (Qwen2-VL's ``Qwen2VLTextConfig``...), whose
  row tests/pretrained/test_hf_vision_language.py checks against it."""
  for name, declared in families.MODEL_TYPES.items():
    if declared.written_as and not declared.defaults:
      text = families.MODEL_TYPES[declared.written_as].defaults
      assert text.items() <= families.DEFAULTS[name].items()


_SIZES = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
          "intermediate_size": 64, "vocab_size": 64, "pad_token_id": 0}
_HEADS = {"num_key_value_heads": 2, "head_dim": 8}
_MOE = {"moe_intermediate_size": 16, "num_experts_per_tok": 2}

MINIMAL = {
    **{name: {**_SIZES, **_HEADS} for name in (
        "llama", "mistral", "qwen2", "granite", "olmo2", "olmo3", "phi3", "smollm3",
        "internlm3", "iquestcoder", "exaone")},
    "gpt_neox": _SIZES,
    "phi": _SIZES,
    "stablelm": {**_SIZES, "num_key_value_heads": 2},
    "starcoder2": {**_SIZES, **_HEADS},
    # Cohere's default logit_scale (0.0625) shrinks the tiny model's logits below a
    # meaningful check: scaled by one instead.
    "cohere2": {**_SIZES, **_HEADS, "logit_scale": 1.0},
    "cohere": {**_SIZES, **_HEADS, "logit_scale": 1.0},
    "falcon": {k: v for k, v in _SIZES.items() if k != "intermediate_size"},
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "pad_token_id": 0},
    "opt": {**{k: v for k, v in _SIZES.items() if k != "intermediate_size"}, "ffn_dim": 64},
    "qwen3": {**_SIZES, **_HEADS},
    "ernie4_5": {**_SIZES, **_HEADS},
    "hunyuan_v1_dense": {**_SIZES, **_HEADS},
    # transformers' default of one expert, chosen for every token.
    "hunyuan_v1_moe": {**_SIZES, **_HEADS},
    "ernie4_5_moe": {**_SIZES, **_HEADS, "moe_intermediate_size": 16, "moe_num_experts": 4,
                     "moe_k": 2},
    "exaone4": {**_SIZES, **_HEADS},
    "lfm2": {**_SIZES, **_HEADS, "layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {**_SIZES, **_HEADS, **_MOE, "num_experts": 4, "num_hidden_layers": 3,
                 "layer_types": ["conv", "full_attention", "conv"]},
    "seed_oss": {**_SIZES, **_HEADS},
    "apertus": {**_SIZES, "num_key_value_heads": 2},
    # Ministral 3 needs its RoPE dict (llama_4_scaling_beta lives there): refused without.
    "ministral3": {**_SIZES, **_HEADS, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
        "original_max_position_embeddings": 4, "llama_4_scaling_beta": 0.1}},
    "mixtral": {**_SIZES, **_HEADS, "num_local_experts": 4},
    "qwen3_moe": {**_SIZES, **_HEADS, **_MOE, "num_experts": 4},
    "olmoe": {**_SIZES, **_HEADS, "num_experts": 4, "num_experts_per_tok": 2},
    "phimoe": {**_SIZES, **_HEADS, "num_local_experts": 4},
    "qwen2_moe": {**_SIZES, **_HEADS, **_MOE, "num_experts": 4,
                  "shared_expert_intermediate_size": 24},
    "gemma": {**_SIZES, **_HEADS}, "gemma2": {**_SIZES, **_HEADS},
    "gemma3_text": {**_SIZES, **_HEADS},
    "gemma4_text": {**_SIZES, **_HEADS, "global_head_dim": 16, "hidden_size_per_layer_input": 4,
                    "vocab_size_per_layer_input": 64},
    # transformers' 15 sharing layers need more than two; the per-layer table is a size.
    "gemma3n_text": {**_SIZES, **_HEADS, "num_kv_shared_layers": 0,
                     "hidden_size_per_layer_input": 4, "vocab_size_per_layer_input": 64},
    "glm4": {**_SIZES, **_HEADS},
    "glm4_moe": {**_SIZES, **_HEADS, **_MOE, "n_routed_experts": 4},
    "glm4_moe_lite": {**_SIZES, **_MOE, "n_routed_experts": 4, "kv_lora_rank": 16,
                      "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                      "v_head_dim": 8},
    "gpt_oss": {**_SIZES, **_HEADS, "num_local_experts": 4},
    "minimax_m2": {**_SIZES, **_HEADS, "num_local_experts": 4, "num_experts_per_tok": 2},
    "llama4_text": {**_SIZES, **_HEADS, "intermediate_size_mlp": 24, "num_local_experts": 3},
    "deepseek_v3": {**_SIZES, **_MOE, "n_routed_experts": 4, "n_group": 2, "topk_group": 1,
                    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4,
                    "qk_nope_head_dim": 4, "v_head_dim": 8},
    "deepseek_v32": {**_SIZES, **_MOE, "n_routed_experts": 4, "n_group": 2, "topk_group": 1,
                     "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4,
                     "qk_nope_head_dim": 4, "v_head_dim": 8, "index_head_dim": 8,
                     "index_n_heads": 4},
    "glm_moe_dsa": {**_SIZES, **_MOE, "n_routed_experts": 4, "kv_lora_rank": 16,
                    "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                    "v_head_dim": 8, "index_head_dim": 8, "index_n_heads": 4},
    "qwen3_5_text": {**_SIZES, **_HEADS, "num_hidden_layers": 4, "linear_key_head_dim": 8,
                     "linear_value_head_dim": 8, "linear_num_key_heads": 2,
                     "linear_num_value_heads": 4},
    "qwen3_next": {**_SIZES, **_HEADS, **_MOE, "num_hidden_layers": 4, "linear_key_head_dim": 8,
                   "linear_value_head_dim": 8, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "num_experts": 4,
                   "shared_expert_intermediate_size": 16},
    "qwen3_5_moe_text": {**{k: v for k, v in _SIZES.items() if k != "intermediate_size"},
                         **_HEADS, **_MOE, "num_hidden_layers": 4, "linear_key_head_dim": 8,
                         "linear_value_head_dim": 8, "linear_num_key_heads": 2,
                         "linear_num_value_heads": 4, "num_experts": 4,
                         "shared_expert_intermediate_size": 16},
    "granitemoehybrid": {**_SIZES, **_HEADS, "layer_types": ["mamba", "attention"],
                         "mamba_n_heads": 4, "mamba_d_state": 8, "shared_intermediate_size": 64},
    "bamba": {**_SIZES, **_HEADS, "attn_layer_indices": [1], "mamba_n_heads": 4,
              "mamba_d_state": 8},
    "nemotron_h": {**_SIZES, **_HEADS, "hybrid_override_pattern": "M*", "mamba_num_heads": 4,
                   "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 8},
    "falcon_h1": {**_SIZES, **_HEADS, "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_d_ssm": 64},
    # Five layers: transformers' default pattern makes layer 4 latent attention.
    "kimi_linear": {**_SIZES, **_MOE, "num_hidden_layers": 5, "num_key_value_heads": 4,
                    "num_experts": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
                    "qk_nope_head_dim": 4, "v_head_dim": 8, "linear_num_heads": 4,
                    "linear_head_dim": 8},
    # Five layers: the default pattern's attention layer (4 of 8), 16 experts on layers 1 and 3.
    "jamba": {**_SIZES, **_HEADS, "num_hidden_layers": 5},
}
"""Each text ``model_type``'s sizes: what its ``config.json`` holds in the
test below (besides ``model_type``), everything else left to the defaults.
The head counts are sizes too (transformers' defaults of 8 or 32 key/value
heads would not divide 4 query heads), as is ``pad_token_id`` (an id within
the tiny vocabulary; it changes no logit)."""


def test_every_text_model_type_is_loaded_from_sizes_alone():
  assert sorted(MINIMAL) == _TEXT_TYPES


@pytest.fixture
def configs(monkeypatch):
  """Every `Config` built while the test runs."""
  made = []
  original = hf_config.Config.__init__

  def record(self, *args, **kwargs):
    original(self, *args, **kwargs)
    made.append(self)

  monkeypatch.setattr(hf_config.Config, "__init__", record)
  return made


@pytest.mark.parametrize("model_type", sorted(MINIMAL))
def test_sizes_alone_load_as_transformers_reads_them(tmp_path, configs, model_type):
  """A ``config.json`` of ``model_type`` and sizes only: transformers builds
  its model with its config class's defaults; `load_hf` matches its float32
  logits, and no mapping took a default of its own (every one came from
  the table)."""
  fields = dict(MINIMAL[model_type])
  torch.manual_seed(0)
  # Qwen3.5's norms multiply by 1 + w: its own draw keeps w near zero (around
  # one, four layers of DeltaNet grow float32's rounding past the tolerance).
  randomized = (test_hf_qwen3_5.randomized if model_type.startswith("qwen3_5")
                else checks.randomized)
  hf_model = randomized(transformers.AutoModelForCausalLM.from_config(
      transformers.AutoConfig.for_model(model_type, **fields)).float())
  hf_model.save_pretrained(tmp_path, safe_serialization=True)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **fields}))
  error = checks.float32_error(tmp_path, checks.reference_logits(hf_model))
  fallbacks = {name: value for cfg in configs for name, value in cfg.fallbacks.items()}
  assert not fallbacks, f"{model_type}: defaults taken outside the table: {fallbacks}"
  print(f"{model_type} from sizes alone: float32 max abs error {error:.2g}")
