"""Rotary embeddings on adjacent pairs of each head's dimensions
(`pz_persist.nn.llama4_attention.ApplyInterleavedRoPE`) in place of Llama's
halves, for the families whose checkpoints rotate ``(x0, x1), (x2, x3)...``
(ERNIE 4.5, dense and MoE)."""

from __future__ import annotations

from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist.nn.llama4_attention import ApplyChunkedCausalAttentionMask
from pz_persist.nn.llama4_attention import ApplyInterleavedRoPE
from pz_persist.nn.llama4_attention import TemperatureTuning
from pz_persist.nn.scaled_rope import ApplyScaledRoPE
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks


def with_interleaved_rope(model: model_parts.TransformerLM) -> model_parts.TransformerLM:
  """``model`` with each rotary layer (plain or scaled) rotating adjacent
  pairs, with the same frequencies."""
  return (pz.select(model).at_instances_of((pz.nn.ApplyRoPE, ApplyScaledRoPE))
          .apply(lambda rope: ApplyInterleavedRoPE(rope=rope)))


def interleaved_everywhere(model: pz.nn.Layer) -> bool:
  """Whether every block rotates its query and key by adjacent pairs, and
  nothing else (no halves-rotating layer left), with nothing of Llama 4's
  attention (query/key norms, temperature tuning, chunked masks): ERNIE 4.5's
  attention."""
  extras = (pz.nn.RMSStandardize, TemperatureTuning, ApplyChunkedCausalAttentionMask)
  if any(all_layers(part, cls) for a in all_layers(model, pz.nn.Attention)
         for part in (a.input_to_query, a.input_to_key, a.query_key_to_attn) for cls in extras):
    return False
  return all(len(all_layers(block, ApplyInterleavedRoPE)) == 2 for block in blocks(model)) and (
      len(all_layers(model, pz.nn.ApplyRoPE)) + len(all_layers(model, ApplyScaledRoPE))
      == 2 * len(blocks(model)))
