"""Why a ``model_type`` pz_persist does not read is refused, and which
supported family is nearest to it by architecture.

`UNSUPPORTED` is the one table of the ``model_type`` values known and
refused (the families still to build, and the encoders people try), each
with what its architecture has that no family reads and its nearest family
by architecture (or None, and why none is close). A suggestion comes only
from here, never from the spelling of a name: ``gpt2`` is nearest to
GPT-NeoX (LayerNorm with biases, a GELU MLP), not to ``gpt_oss``. A name
neither supported nor known gets a "did you mean" only when it is a likely
typo of a supported one. A family's own next generation
(`pz_persist.pretrained.hf.record.Family.refused_model_types`) keeps its
family's reason.
"""

from __future__ import annotations

import dataclasses
import difflib

from pz_persist.pretrained.hf import families


@dataclasses.dataclass(frozen=True)
class Unsupported:
  """A known ``model_type`` pz_persist refuses.

  Attributes:
    name: The architecture, for people (``"GPT-2"``).
    lacks: What it has that no family reads, as the end of the sentence
      ``"<name> has ..."``.
    nearest: The supported ``model_type`` nearest by architecture, or None.
    nearest_why: What ``nearest`` shares with it and where they differ; or,
      with no ``nearest``, why none is close.
  """

  name: str
  lacks: str
  nearest: str | None
  nearest_why: str


def _row(name: str, lacks: str, nearest: str | None, nearest_why: str) -> Unsupported:
  return Unsupported(name, lacks, nearest, nearest_why)


_MAMBA2 = ("Bamba shares Mamba-2 layers (their state in the KV cache) among attention layers")
_ENCODER = ("pz_persist.pretrained.load_hf reads causal decoder-only language models, and this"
            " is a bidirectional encoder (or an encoder-decoder)")
_ATTENTION_FREE = "every family pz_persist reads is built on attention, and this model has none"
_NEOX = ("GPT-NeoX shares LayerNorm with biases, a fused query-key-value projection and a"
         " non-gated GELU MLP")
_GPT2 = "GPT-2 shares learned absolute positions, LayerNorm with biases and a non-gated MLP"
_BARE = ("no output head (it is transformers' bare text model, not a causal LM); its language"
         " model loads from")

UNSUPPORTED: dict[str, Unsupported] = {
    # Vision-language folders whose text model is close to one read.
    "qwen2_vl_text": _row("Qwen2-VL's bare text model", f"{_BARE} a qwen2_vl folder", "qwen2",
                          "it is Qwen2's layout"),
    "qwen2_5_vl_text": _row("Qwen2.5-VL's bare text model", f"{_BARE} a qwen2_5_vl folder",
                            "qwen2", "it is Qwen2's layout"),
    "qwen3_vl_text": _row("Qwen3-VL's bare text model", f"{_BARE} a qwen3_vl folder", "qwen3",
                          "it is Qwen3's layout"),
    "qwen3_vl_moe_text": _row("Qwen3-VL-MoE's bare text model",
                              f"{_BARE} a qwen3_vl_moe folder", "qwen3_moe",
                              "it is Qwen3-MoE's layout"),
    "llava": _row("LLaVA", "a vision tower and projector around a text model named by its"
                  " text_config, which pz_persist does not extract yet", "llama",
                  "most LLaVA text models are Llama or Mistral decoders"),
    # Classic decoders.
    "gpt-sw3": _row("GPT-SW3", "its own model_type name, though transformers reads it with"
                    " GPT-2's classes; pz_persist does not take the name as GPT-2's yet", "gpt2",
                    "its config and tensors are GPT-2's"),
    "openai-gpt": _row("GPT-1", "post-LayerNorm blocks and no final LayerNorm",
                       "gpt2", f"{_GPT2}; it normalises before each block instead"),
    "gpt_neo": _row("GPT-Neo", "alternating local and global attention, with attention scores"
                    " left unscaled", "gpt2",
                    f"{_GPT2}; its attention is global in every layer"),
    "gptj": _row("GPT-J", "one LayerNorm shared by parallel attention and MLP, and rotary"
                 " applied to interleaved pairs of the first rotary_dim dimensions", "gpt_neox",
                 "GPT-NeoX shares parallel blocks and partial rotary (rotating halves, with two"
                 " norms)"),
    "codegen": _row("CodeGen", "GPT-J's blocks with a query-key-value projection packed in"
                    " mp_num groups", "gpt_neox", "GPT-NeoX shares parallel blocks and partial"
                    " rotary"),
    "gpt_bigcode": _row("StarCoder 1 / SantaCoder (GPTBigCode)", "multi-query attention in one"
                        " fused projection", "gpt2",
                        f"{_GPT2}; it has multi-head attention instead"),
    "bloom": _row("BLOOM", "ALiBi position biases and a LayerNorm on the embeddings", "gpt_neox",
                  f"{_NEOX}; it has rotary positions instead"),
    "mpt": _row("MPT", "ALiBi position biases and LayerNorms without biases", "gpt_neox",
                f"{_NEOX}; it has rotary positions instead"),
    "persimmon": _row("Persimmon", "query-key LayerNorms, partial rotary and a squared-ReLU MLP",
                      "gpt_neox", "GPT-NeoX shares LayerNorm with biases, a fused"
                      " query-key-value projection and partial rotary"),
    "olmo": _row("OLMo 1", "LayerNorms without learned weights and optional clipping of the"
                 " queries, keys and values (clip_qkv)", "olmo2",
                 "OLMo 2 keeps its projections and MLP; it moved to RMSNorm after each block"
                 " and query-key norms"),
    "nemotron": _row("Nemotron-4 / Minitron", "LayerNorm with 1 + w weights, a non-gated"
                     " squared-ReLU MLP and partial rotary", "llama",
                     "Llama shares separate query, key, value and output projections; its MLP"
                     " is gated"),
    "arcee": _row("Arcee AFM", "a non-gated squared-ReLU MLP", "llama",
                  "it is Llama's layout otherwise"),
    "diffllama": _row("DiffLlama", "differential attention (two softmax maps subtracted with a"
                      " learned lambda)", "llama", "it is Llama's layout otherwise"),
    "bitnet": _row("BitNet b1.58", "ternary weights, quantized activations and sub-layer norms",
                   "llama", "Llama shares its layout before quantization"),
    "ministral": _row("Ministral 8B (2410)", "sliding windows chosen per layer (layer_types)",
                      "mistral", "Mistral shares its layout with one window on every layer"),
    "glm": _row("GLM-4 (ChatGLM 4)", "rotary on interleaved pairs of half the head",
                "phi3", "Phi-3 shares a fused gate_up_proj and fused query-key-value weights"),
    "helium": _row("Helium", "its own configuration fields", "llama",
                   "it is Llama's layout"),
    # Mixtures of experts.
    "granitemoe": _row("Granite 3 MoE", "experts stored fused (input_linear, output_linear)",
                       "granite", "Granite shares its multipliers and attention"),
    "granitemoeshared": _row("Granite 3 MoE with a shared expert", "experts stored fused and a"
                             " shared expert", "granite",
                             "Granite shares its multipliers and attention"),
    "dbrx": _row("DBRX", "a clipped fused Wqkv, LayerNorms without biases and experts stored"
                 " fused (w1, v1, w2)", "mixtral", "Mixtral shares top-k routed SiLU experts"),
    "jetmoe": _row("JetMoE", "a mixture of attention heads beside its MLP experts", "mixtral",
                   "Mixtral shares top-k routed MLP experts"),
    "minicpm3": _row("MiniCPM3", "depth-scaled residuals (scale_depth) around latent attention",
                     "deepseek_v3", "DeepSeek-V3 shares its latent attention"),
    # Linear attention, state-space and recurrent hybrids.
    "minimax": _row("MiniMax-Text-01", "lightning (linear) attention on most layers", "qwen3_5",
                    "Qwen3.5 shares linear attention among full-attention layers"),
    "zamba": _row("Zamba", "Mamba layers with one attention block shared across depths",
                  "jamba", "Jamba shares Mamba layers (their state in the KV cache) among"
                  " attention layers, each layer its own"),
    "zamba2": _row("Zamba2", "Mamba-2 layers with shared attention blocks and LoRA adapters",
                   "bamba", _MAMBA2),
    "recurrent_gemma": _row("RecurrentGemma (Griffin)", "RG-LRU recurrent blocks among"
                            " local-attention layers", "gemma2",
                            "Gemma 2 shares its embeddings, norms and local attention; it has"
                            " no recurrent block"),
    "mamba": _row("Mamba", "selective state-space layers only (under backbone.layers.N.mixer)",
                  "jamba", "Jamba's Mamba mixers are this layer, among attention layers"),
    "mamba2": _row("Mamba-2", "state-space-duality layers only (under backbone.layers.N.mixer)",
                   "bamba", "Bamba's Mamba-2 mixers are this layer, among attention layers"),
    "falcon_mamba": _row("Falcon Mamba", "selective state-space layers only, with unweighted"
                         " RMS norms on their time step, B and C", "jamba",
                         "Jamba's Mamba mixers are this layer, their norms on the same three"
                         " weighted, among attention layers"),
    "rwkv": _row("RWKV", "a time-mixing recurrence in place of attention", None, _ATTENTION_FREE),
    "xlstm": _row("xLSTM", "mLSTM recurrent blocks in place of attention", None, _ATTENTION_FREE),
    # Encoders people try.
    **{name: _row(title, "bidirectional attention", None, _ENCODER) for name, title in (
        ("bert", "BERT"), ("roberta", "RoBERTa"), ("xlm-roberta", "XLM-RoBERTa"),
        ("distilbert", "DistilBERT"), ("deberta-v2", "DeBERTa-v2"),
        ("modernbert", "ModernBERT"), ("t5", "T5"), ("bart", "BART"), ("whisper", "Whisper"))},
}
"""Every known ``model_type`` pz_persist refuses, with why and its nearest
family by architecture: the only source of a refusal's suggestion."""


def _typo_of(model_type: str) -> str | None:
  """The supported ``model_type`` an unknown one is a likely typo of."""
  close = difflib.get_close_matches(model_type.lower(), list(families.MODEL_TYPES), n=1,
                                    cutoff=0.8)
  return close[0] if close else None


def _family(model_type: str) -> str:
  return f"{families.FAMILY_OF[model_type].title} (model_type {model_type!r})"


def reason(model_type: object) -> str:
  """The useful clause of a refusal of ``model_type``: what its architecture
  has that no family reads and the nearest family by architecture (or why
  none is close); for a name not known, a "did you mean" only when it is a
  likely typo of a supported one."""
  if isinstance(model_type, str) and model_type in families.REFUSED:
    return families.REFUSED[model_type] + "."
  shown = f"{model_type!r:.80}"
  known = UNSUPPORTED.get(model_type) if isinstance(model_type, str) else None
  if known is not None:
    nearest = (f" The nearest supported family by architecture is {_family(known.nearest)}:"
               f" {known.nearest_why}." if known.nearest else
               f" No supported family is close: {known.nearest_why}.")
    return f"model_type={shown} is not supported: {known.name} has {known.lacks}.{nearest}"
  if not isinstance(model_type, str):
    return f"model_type={shown} is not supported: it must be a string naming an architecture."
  typo = _typo_of(model_type)
  return (f"model_type={shown} is not supported: pz_persist knows no architecture of that name"
          + (f"; did you mean {typo!r} ({families.FAMILY_OF[typo].title})?" if typo else "."))


def message(model_type: object) -> str:
  """Why `pz_persist.pretrained.load_hf` refuses ``model_type``: `reason`
  first, then the families it reads (and `load_gemma` for a Gemma)."""
  if isinstance(model_type, str) and model_type in families.REFUSED:
    return reason(model_type)
  gemma = (" For Gemma's official Flax checkpoints, use pz_persist.pretrained.load_gemma."
           if isinstance(model_type, str) and model_type.startswith("gemma") else "")
  return (f"{reason(model_type)}{gemma} pz_persist.pretrained.load_hf reads the families"
          f" {families.names()}.")
