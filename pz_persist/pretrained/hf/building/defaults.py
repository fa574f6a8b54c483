"""Shared code (no record): the pieces of what an absent ``config.json``
field means that several families' rows share.

Each ``model_type`` declares its row in its family's record
(`pz_persist.pretrained.hf.record.ModelType.defaults`): transformers' config
class's value of each field its mapping may find absent, with the reason
where an entry differs from the class or is not one of its fields
(``defaults_why``). `pz_persist.pretrained.hf.families.DEFAULTS` collects
the rows into the one table `load_hf` and `export_hf` hand to
`pz_persist.pretrained.hf.config.Config`, whose ``get`` / ``require`` /
``nullable`` answer an absent field from it before any default a mapping
passes.

Why: each family used to carry its defaults in its mapping (Llama's 1e-6
epsilon, read by every family built on Llama's layout), and three of them
(GLM-4.5, gpt-oss, Llama 4) silently took 1e-6 where transformers' classes
say 1e-5. A test checks every row field by field against transformers'
config classes instantiated without arguments, and a second loads every
family from a ``config.json`` of sizes alone, checks that no mapping fell
back on a default of its own (`Config.fallbacks`) and matches transformers'
logits (tests/pretrained/test_hf_defaults.py).
"""

from __future__ import annotations

from typing import Any

LLAMA_LIKE: dict[str, Any] = {
    "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10_000.0,
    "partial_rotary_factor": 1.0, "rms_norm_eps": 1e-6, "attention_bias": False}
"""The defaults LlamaConfig has, which most families built on its layout share."""

QWEN_WINDOW: dict[str, Any] = {
    "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
"""The window fields of the Qwen configs."""

QWEN_WINDOW_WHY: dict[str, str] = {
    "sliding_window": (
        "the config class stores None unless use_sliding_window is true, and 4096"
        " (its argument's default) when it is; pz_persist reads the window only then"),
}
"""Why ``sliding_window``'s default differs from what the Qwen config classes store."""

GEMMA_LIKE: dict[str, Any] = {
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "attention_bias": False, "head_dim": 256,
    "rope_theta": 10_000.0, "partial_rotary_factor": 1.0, "use_bidirectional_attention": False}
"""The defaults the Gemma configs share."""

CAUSAL_WHY = "the config class's None means causal attention, as false does"
"""Why a Gemma row's ``use_bidirectional_attention`` is false where the class holds None."""

HIDDEN_ACT_WHY = ("the class reads hidden_activation; hidden_act, Gemma 1's name, has the"
                  " same default")
"""Why a Gemma 2-4 row has ``hidden_act``."""

NO_BIASES = ("transformers' class has no such field: its projections have no biases, and"
             " pz_persist refuses true")
"""Why a row has ``attention_bias`` / ``mlp_bias`` that its class lacks."""


QWEN3_5_DEFAULTS: dict[str, Any] = {
    **LLAMA_LIKE, "partial_rotary_factor": 0.25, "head_dim": 256, "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4, "attn_output_gate": True}
"""Qwen3.5's defaults, which Qwen3.5-MoE's text model shares."""

QWEN3_5_DEFAULTS_WHY: dict[str, str] = {
    "full_attention_interval": (
        "transformers 5 takes it only as an argument (default 4) that builds layer_types"),
    "attn_output_gate": (
        "the Hub's field; transformers 5's Qwen3.5 always gates the attention output, and"
        " pz_persist refuses false"),
}
"""Why the Qwen3.5 text models' (dense and MoE) defaults differ from transformers' classes."""
