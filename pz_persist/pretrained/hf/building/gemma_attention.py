"""Gemma 4's decoder attention, shared with Gemma 3n: sliding and full
layers (each type with its own head sizes and RoPE), query and key norms,
values normed without a scale, keys and values published by the last layer
of each type before the last ``num_kv_shared_layers`` layers and reused by
those (`pz_persist.nn.kv_sharing`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from collections.abc import Sequence

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn import kv_sharing
from pz_persist.nn.proportional_rope import ApplyProportionalRoPE
from pz_persist.pretrained.hf.building.norms import with_query_key_norms
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.plan import LeftOut

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Layer:
  """What differs between Gemma 4's layers."""
  kind: str
  head_dim: int
  kv_heads: int
  keys_are_values: bool
  reuses: bool  # Keys and values of an earlier layer (no projections of its own).
  publishes: bool  # The last layer of its kind before the sharing ones.
  mlp: int


def layers(cfg: Config, kinds: list[str], shared: int, head_dim: int, kv_heads: int,
            global_sizes: tuple[int, int], keys_are_values: bool, intermediate: int,
            double_wide: bool, heads: int) -> list[Layer]:
  layers = len(kinds)
  if shared >= layers:
    raise cfg.unsupported("num_kv_shared_layers", shared, f"fewer than num_hidden_layers={layers}:"
                          " some layer must compute the keys and values the others reuse")
  first = layers - shared
  producers = {kind: max((i for i in range(first) if kinds[i] == kind), default=None)
               for kind in set(kinds)}
  if shared and any(index is None for index in producers.values()):
    raise cfg.unsupported("num_kv_shared_layers", shared, "every layer type reusing keys and"
                          " values needs an earlier layer of its type computing them")
  out = []
  for i, kind in enumerate(kinds):
    dim, kv = (head_dim, kv_heads) if kind == SLIDING else global_sizes
    if heads % kv:
      raise cfg.unsupported("num_key_value_heads", kv, f"must divide num_attention_heads={heads}")
    reuses = i >= first
    out.append(Layer(kind, dim, kv, keys_are_values and kind == FULL, reuses,
                      bool(shared) and producers[kind] == i,
                      intermediate * (2 if double_wide and reuses else 1)))
  return out


def reused_keys_and_values(root: str, found: Sequence[Layer]) -> LeftOut:
  """The key and value projections and norms (``k_proj``, ``v_proj``,
  ``k_norm``, ``v_norm``) that transformers' model keeps, and saves, in each
  layer reusing an earlier layer's keys and values, and never reads (its
  ``_keys_to_ignore_on_load_unexpected``): declared left out
  (`pz_persist.pretrained.hf.plan.Plan.left_out`)."""
  prefixes = tuple(f"{root}layers.{i}.self_attn.{name}." for i, layer in enumerate(found)
                   if layer.reuses for name in ("k_proj", "v_proj", "k_norm", "v_norm"))
  return LeftOut(lambda name: name.startswith(prefixes),
                 "the key and value projections and norms of layers reusing an earlier layer's",
                 "those layers reuse the keys and values computed before them; transformers"
                 " does not read them either", reported=False)


def attention_block(i: int, layer: Layer, config: llamalike_common.LlamalikeTransformerConfig,
                    eps: float) -> model_parts.TransformerBlock:
  """Penzai's Gemma block ``i`` with Gemma 4's attention (shared by Gemma
  3n): query/key norms, values normed without a scale, keys and values
  published to (or reused from) the other layers of their kind."""
  block = llamalike_common.build_llamalike_block(f"transformer/block_{i}", None, config, i)
  block = with_query_key_norms(block, config)
  attn_sel = pz.select(block).at_instances_of(pz.nn.Attention)
  attn = attn_sel.get_sequence()[0]
  kv_axes = {**common_head_axes(config), "projection": layer.head_dim}
  if layer.reuses:
    attn = dataclasses.replace(
        attn, input_to_key=kv_sharing.SharedKV(f"{layer.kind}/key", tuple(kv_axes.items())),
        input_to_value=kv_sharing.SharedKV(f"{layer.kind}/value", tuple(kv_axes.items())))
  else:
    value_norm = pz.nn.RMSStandardize(across=("projection",), epsilon=eps)
    values = list(attn.input_to_value.sublayers)
    if layer.keys_are_values:  # The key projection's output, before its norm and RoPE.
      values = [attn.input_to_key.sublayers[0]]
    keys = list(attn.input_to_key.sublayers)
    values.append(value_norm)
    if layer.publishes:
      keys.append(kv_sharing.PublishKV(f"{layer.kind}/key"))
      values.append(kv_sharing.PublishKV(f"{layer.kind}/value"))
    attn = dataclasses.replace(attn, input_to_key=pz.nn.Sequential(keys),
                               input_to_value=pz.nn.Sequential(values))
  return attn_sel.set_sequence([attn])


def norm(name: str, config: llamalike_common.LlamalikeTransformerConfig,
          axis: str = "embedding", size: int | None = None) -> pz.nn.RMSLayerNorm:
  return pz.nn.RMSLayerNorm.from_config(
      name=name, init_base_rng=None, across_axes={axis: size or config.embedding_dim},
      epsilon=config.rms_norm_eps, dtype=config.parameter_dtype)


def common_head_axes(config: llamalike_common.LlamalikeTransformerConfig) -> dict[str, int]:
  if config.query_head_multiplier == 1:
    return {"heads": config.num_kv_heads}
  if config.num_kv_heads == 1:
    return {}
  return {"head_groups": config.num_kv_heads}


def with_rope(block: model_parts.TransformerBlock,
               rope: Mapping[str, tuple[str, float, float, float]]) -> model_parts.TransformerBlock:
  window = pz.select(block).at_instances_of(pz.nn.ApplyCausalSlidingWindowAttentionMask)
  kind = SLIDING if window.count() else FULL
  rope_type, theta, fraction, factor = rope[kind]

  def replace(r: pz.nn.ApplyRoPE) -> pz.nn.Layer:
    if rope_type == "proportional":
      return ApplyProportionalRoPE(embedding_axis=r.embedding_axis, max_wavelength=theta,
                                   rotated_fraction=fraction, factor=factor,
                                   positions_input_name=r.positions_input_name)
    return dataclasses.replace(r, max_wavelength=theta)

  return pz.select(block).at_instances_of(pz.nn.ApplyRoPE).apply(replace)
