"""Shared code (no record): the one table of what an absent ``config.json``
field means, for every ``model_type`` `load_hf` reads.

Why one table: each family used to carry its own defaults in its mapping
(Llama's 1e-6 epsilon, read by every family built on Llama's layout), and
three of them (GLM-4.5, gpt-oss, Llama 4) silently took 1e-6 where
transformers' config classes say 1e-5. Now `pz_persist.pretrained.hf.load_hf`
hands each ``model_type``'s row to its `pz_persist.pretrained.hf.config.Config`,
whose ``get`` / ``require`` / ``nullable`` answer an absent field from the row
before any default a mapping passes; the values are those of transformers'
config class instantiated without arguments (transformers 5), which a test
checks field by field (tests/pretrained/test_hf_defaults.py), and a second
test loads every family from a ``config.json`` of sizes alone, checks that no
mapping fell back on a default of its own (`Config.fallbacks`), and matches
transformers' logits.

A field may differ from the config class only with its reason in
`DELIBERATE`.
"""

from __future__ import annotations

from typing import Any

_LLAMA_LIKE = {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10_000.0,
               "partial_rotary_factor": 1.0, "rms_norm_eps": 1e-6, "attention_bias": False}

_QWEN_WINDOW = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}

_GEMMA = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
          "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "attention_bias": False,
          "head_dim": 256, "rope_theta": 10_000.0, "partial_rotary_factor": 1.0,
          "use_bidirectional_attention": False}

_QWEN3_5 = {**_LLAMA_LIKE, "partial_rotary_factor": 0.25, "head_dim": 256,
            "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "attn_output_gate": True}

DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_LLAMA_LIKE, "mlp_bias": False, "max_position_embeddings": 2048},
    "mistral": {**_LLAMA_LIKE, "mlp_bias": False, "sliding_window": 4096,
                "max_position_embeddings": 131_072},
    "mixtral": {**_LLAMA_LIKE, "rope_theta": 1e6, "rms_norm_eps": 1e-5, "intermediate_size": 14336,
                "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2,
                "max_position_embeddings": 131_072},
    "qwen2": {**_LLAMA_LIKE, **_QWEN_WINDOW, "use_mrope": False, "max_position_embeddings": 32768},
    "qwen3": {**_LLAMA_LIKE, **_QWEN_WINDOW, "head_dim": 128, "max_position_embeddings": 32768},
    "qwen3_moe": {**_LLAMA_LIKE, **_QWEN_WINDOW, "intermediate_size": 6144,
                  "decoder_sparse_step": 1, "norm_topk_prob": False, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768, "max_position_embeddings": 32768},
    "granite": {**_LLAMA_LIKE, "mlp_bias": False, "embedding_multiplier": 1.0,
                "logits_scaling": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
                "max_position_embeddings": 2048},
    "olmo2": {**_LLAMA_LIKE, "rms_norm_eps": 1e-5, "mlp_bias": False,
              "max_position_embeddings": 2048},
    "olmo3": {**_LLAMA_LIKE, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0, "mlp_bias": False,
              "sliding_window": 4096, "max_position_embeddings": 2048},
    "phi3": {**_LLAMA_LIKE, "rms_norm_eps": 1e-5, "sliding_window": None, "mlp_bias": False,
             "lm_head_bias": False, "interpolate_factor": 1, "full_attn_mod": 1,
             "partial_rotary_factor": 1.0, "original_max_position_embeddings": 4096,
             "max_position_embeddings": 4096},
    "smollm3": {**_LLAMA_LIKE, "rope_theta": 2_000_000.0, "tie_word_embeddings": True,
                "mlp_bias": False, "use_sliding_window": False, "sliding_window": None,
                "no_rope_layer_interval": 4, "max_position_embeddings": 32768},
    "ministral3": {**_LLAMA_LIKE, "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0,
                   "sliding_window": None, "head_dim": 128, "max_position_embeddings": 262_144},
    "gemma": {**_GEMMA, "num_key_value_heads": 16},
    "gemma2": {**_GEMMA, "num_key_value_heads": 4, "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0},
    "gemma3_text": {**_GEMMA, "num_key_value_heads": 4, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "final_logit_softcapping": None,
                    "attn_logit_softcapping": None, "use_bidirectional_attention": False,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                    "sliding_window_pattern": 6},
    "gemma4_text": {**{k: v for k, v in _GEMMA.items()
                       if k not in ("rope_theta", "partial_rotary_factor")},
                    "num_key_value_heads": 4, "sliding_window": 512,
                    "final_logit_softcapping": None, "attention_k_eq_v": False,
                    "use_double_wide_mlp": False, "num_kv_shared_layers": 0,
                    "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262_144,
                    "enable_moe_block": False},
    "glm4_moe": {**_LLAMA_LIKE, "rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5,
                 "use_qk_norm": False, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
                 "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1,
                 "topk_group": 1, "n_shared_experts": 1, "n_routed_experts": 128,
                 "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
                 "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1},
    "gpt_oss": {**_LLAMA_LIKE, "rms_norm_eps": 1e-5, "attention_bias": True, "rope_theta": 150_000.0,
                "sliding_window": 128, "head_dim": 64, "num_local_experts": 128,
                "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                "max_position_embeddings": 131_072},
    "llama4_text": {**_LLAMA_LIKE, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0,
                    "head_dim": 128, "use_qk_norm": True, "attn_temperature_tuning": True,
                    "floor_scale": 8192, "attn_scale": 0.1, "attention_chunk_size": 8192,
                    "intermediate_size_mlp": 16384, "no_rope_layer_interval": 4,
                    "interleave_moe_layer_step": 1, "num_local_experts": 16,
                    "num_experts_per_tok": 1, "mlp_bias": False},
    "deepseek_v3": {**_LLAMA_LIKE, "first_k_dense_replace": 3, "rope_interleave": True,
                    "num_nextn_predict_layers": 1, "norm_topk_prob": True,
                    "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                    "n_routed_experts": 256, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 2048, "n_shared_experts": 1,
                    "max_position_embeddings": 4096, "scoring_func": "sigmoid",
                    "topk_method": "noaux_tc", "moe_layer_freq": 1},
    "gpt_neox": {"hidden_act": "gelu", "tie_word_embeddings": False, "layer_norm_eps": 1e-5,
                 "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                 "rotary_emb_base": 10_000.0, "rotary_pct": 0.25,
                 "use_parallel_residual": True, "attention_bias": True},
    "qwen3_5_text": dict(_QWEN3_5),
    "qwen3_5_moe_text": {**_QWEN3_5, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                         "shared_expert_intermediate_size": 512},
}
"""For each ``model_type`` pz_persist reads as a text model, what each absent
field means: transformers' config class's value (``rope_theta`` and
``partial_rotary_factor``: those of its ``rope_parameters``). The
multimodal ``model_type`` values read their ``text_config`` with the text
``model_type``'s row."""

DELIBERATE: dict[str, dict[str, str]] = {
    **{name: {"sliding_window": (
        "the config class stores None unless use_sliding_window is true, and 4096 (its"
        " argument's default) when it is; pz_persist reads the window only then")}
       for name in ("qwen2", "qwen3", "qwen3_moe")},
    **{name: {"use_bidirectional_attention": (
        "the config class's None means causal attention, as false does")}
       for name in ("gemma", "gemma2")},
    "gemma4_text": {"use_bidirectional_attention": (
        "the config class's None means causal attention, as false does"), "head_dim": (
        "the config class's per-layer head_dim (its global layers' global_head_dim) has no"
        " one value; 256 is its argument's default, the sliding layers' head size")},
}
"""Entries of `DEFAULTS` that differ from the config class instantiated
without arguments, each with why the two mean the same model."""

_NO_BIASES = ("transformers' class has no such field: its projections have no biases, and"
              " pz_persist refuses true")

NOT_IN_TRANSFORMERS: dict[str, dict[str, str]] = {
    **{name: {"attention_bias": _NO_BIASES}
       for name in ("mistral", "mixtral", "qwen2", "phi3", "ministral3")},
    "qwen2": {"attention_bias": _NO_BIASES, "use_mrope": (
        "Qwen2-VL's field, which transformers' Qwen2 does not have; pz_persist refuses true")},
    "qwen3_moe": {"max_window_layers": (
        "transformers' class has no such field (no layer is windowed by count); pz_persist"
        " reads it with use_sliding_window only")},
    "gemma": {"hidden_activation": (
        "Gemma 1's class reads hidden_act; hidden_activation, the later name, has the"
        " same default")},
    **{name: {"hidden_act": (
        "the class reads hidden_activation; hidden_act, Gemma 1's name, has the same default")}
       for name in ("gemma2", "gemma3_text", "gemma4_text")},
}
for _name in ("llama4_text", "olmo2", "olmo3", "mistral"):
  NOT_IN_TRANSFORMERS.setdefault(_name, {})["mlp_bias"] = _NO_BIASES
NOT_IN_TRANSFORMERS["phi3"].update({
    "mlp_bias": _NO_BIASES,
    **dict.fromkeys(("lm_head_bias", "interpolate_factor", "full_attn_mod"), "a field of Microsoft's remote Phi-4-mini code, which transformers' Phi-3 does" " not read (it computes as with this value); pz_persist refuses any other")})
NOT_IN_TRANSFORMERS["gpt_neox"] = {
    "rotary_emb_base": "transformers 4's name of rope_theta, whose default (10,000) it is",
    "rotary_pct": "transformers 4's name of partial_rotary_factor, whose default (0.25) it is"}
NOT_IN_TRANSFORMERS["deepseek_v3"] = NOT_IN_TRANSFORMERS["glm4_moe"] = {
    field: (f"DeepSeek's router field (GLM-4.5 has DeepSeek's router); transformers 5"
            f" always computes {value}")
    for field, value in (("scoring_func", "sigmoid scores"),
                         ("topk_method", "noaux_tc (a selection-only bias)"),
                         ("moe_layer_freq", "every layer from first_k_dense_replace on as MoE"))}
for _name in ("qwen3_5_text", "qwen3_5_moe_text"):
  NOT_IN_TRANSFORMERS[_name] = {
      "full_attention_interval": (
          "transformers 5 takes it only as an argument (default 4) that builds layer_types"),
      "attn_output_gate": ("the Hub's field; transformers 5's Qwen3.5 always gates the"
                           " attention output, and pz_persist refuses false")}
NOT_IN_TRANSFORMERS["gemma3_text"].update({
    "rope_local_base_freq": ("transformers 4's field, now rope_parameters.sliding_attention."
                             "rope_theta, whose default (10,000) it is"),
    "sliding_window_pattern": ("transformers 4's field, now the class's _sliding_window_pattern"
                               " (6), which builds layer_types"),
})
"""Entries of `DEFAULTS` for fields transformers 5's config class does not
have (older names, or fields pz_persist reads to refuse), each with why its
value is what transformers computes."""
