"""DeepSeek-V3's layout (shared code, no record): multi-head latent
attention (`pz_persist.nn.latent_attention`), dense layers then mixtures of
experts (`pz_persist.pretrained.hf.building.deepseek_moe`), FP8 weights,
multi-token prediction layers left unread. DeepSeek-V3 (``deepseek_v3``,
dense layers first), GLM-4.7-Flash (``glm4_moe_lite``, dense layers
where ``mlp_layer_types`` says), DeepSeek-V3.2 (``deepseek_v32``, with
each layer's lightning indexer: `IndexerSizes`, `pz_persist.nn.sparse_attention`)
and GLM-5 (``glm_moe_dsa``, some layers reusing an earlier indexer's choice)
are built from it; the DeepSeek-V3 family's docstring describes the layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import Literal

from jax.typing import DTypeLike
from penzai import pz
from penzai.models.transformer import model_parts

from pz_persist.nn import kv_sharing
from pz_persist.nn import latent_attention as mla
from pz_persist.nn import scaled_rope as scaled_rope_layer
from pz_persist.nn import sparse_attention as dsa
from pz_persist.nn.constant_scale import ConstantScale
from pz_persist.pretrained.hf import quantized_fp8
from pz_persist.pretrained.hf.building.decoder import norm_specs
from pz_persist.pretrained.hf.building.decoder import outer_specs
from pz_persist.pretrained.hf.building.deepseek_moe import MOE_FIELDS
from pz_persist.pretrained.hf.building.deepseek_moe import Source
from pz_persist.pretrained.hf.building.deepseek_moe import check_expert_count
from pz_persist.pretrained.hf.building.deepseek_moe import main_layers
from pz_persist.pretrained.hf.building.deepseek_moe import mtp_layers
from pz_persist.pretrained.hf.building.deepseek_moe import read_routing
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import OBJECT
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import RopeScaling
from pz_persist.pretrained.hf.config import lm_head_source
from pz_persist.pretrained.hf.config import scaled_rope
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import blocks
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import named_shape
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.config_from_model import rope_fields
from pz_persist.pretrained.hf.config_from_model import tied_field
from pz_persist.pretrained.hf.plan import DECODER_HEAD
from pz_persist.pretrained.hf.plan import DECODER_LAYERS
from pz_persist.pretrained.hf.plan import LeftOut
from pz_persist.pretrained.hf.plan import Plan
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import check_layers
from pz_persist.pretrained.hf.plan import left_out_in_layers
from pz_persist.pretrained.hf.weights import View
from pz_persist.pretrained.hf.weights import Weights

FIELDS = {
    "q_lora_rank": POSITIVE_INT,
    "kv_lora_rank": POSITIVE_INT,
    "qk_rope_head_dim": POSITIVE_INT,
    "qk_nope_head_dim": POSITIVE_INT,
    "qk_head_dim": POSITIVE_INT,
    "v_head_dim": POSITIVE_INT,
    "rope_interleave": BOOLEAN,
    **MOE_FIELDS,
    "quantization_config": OBJECT,
}
"""The ``config.json`` fields DeepSeek-V3's plan reads beyond the shared ones."""

_LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default: q_a / kv_a norms ignore rms_norm_eps.


DenseRule = Callable[[Config, int], Callable[[int], bool]]
"""Given the config and the (checked) layer count: whether layer ``i`` has a
dense MLP (the others a mixture of experts). Never builds a per-layer list
from the count alone (a forged config may ask for 10**9 layers)."""


@dataclasses.dataclass(frozen=True)
class Sizes:
  """A DeepSeek-V3 config's sizes, checked."""

  hidden: int
  heads: int
  q_rank: int | None
  kv_rank: int
  nope: int
  rope: int
  value: int
  intermediate: int
  layers: int
  vocab: int
  dense: Callable[[int], bool]
  eps: float
  interleave: bool


def _every_layer(i: int) -> bool:
  del i
  return True


@dataclasses.dataclass(frozen=True)
class IndexerSizes:
  """DeepSeek Sparse Attention's lightning indexer (`pz_persist.nn.sparse_attention`),
  checked: ``index_n_heads`` heads of ``index_head_dim``, ``index_topk``
  tokens kept; its RoPE interleaved (GLM-5) or in halves (DeepSeek-V3.2);
  ``runs(i)``: whether layer ``i`` has an indexer of its own, or (GLM-5's
  ``"shared"`` layers) reuses the last earlier one's choice of tokens."""

  heads: int
  dim: int
  top_k: int
  interleave: bool = False
  runs: Callable[[int], bool] = _every_layer


def first_k_dense(cfg: Config, layers: int) -> Callable[[int], bool]:
  """DeepSeek-V3's rule: the first ``first_k_dense_replace`` layers are
  dense, the others mixtures of experts."""
  dense = min(cfg.get("first_k_dense_replace", FROM_TABLE), layers)
  return lambda i: i < dense


def read_sizes(cfg: Config, dense: DenseRule = first_k_dense,
               derived: tuple[str, ...] = ("qk_head_dim", "head_dim")) -> Sizes:
  """The attention and MLP sizes, each checked against the others as
  transformers' model would use them; ``dense`` says which layers have a
  dense MLP. ``derived`` are the fields the family's transformers model
  reads although its config class derives them (a file's other value would
  change its math, so it is refused); a family whose model reads neither
  passes fewer (Kimi-Linear: the Hub's config writes ``head_dim`` as
  ``hidden_size / num_attention_heads``, which nothing reads)."""
  heads = cfg.require("num_attention_heads")
  # MLA up-projects keys and values for every head, so transformers never
  # groups them: num_key_value_heads is unused unless smaller than the heads
  # (then its attention repeats each head's keys, which cannot run). Its
  # config writes 128 whatever the heads, so a larger value is accepted.
  kv_heads = cfg.get("num_key_value_heads", heads)
  if kv_heads < heads:
    raise cfg.unsupported("num_key_value_heads", kv_heads,
                          f"multi-head latent attention has keys and values for each of the"
                          f" num_attention_heads={heads} heads; fewer key/value heads would"
                          " make transformers repeat them")
  nope, rope = cfg.require("qk_nope_head_dim"), cfg.require("qk_rope_head_dim")
  for key, value in (("qk_head_dim", nope + rope), ("head_dim", rope)):
    given = cfg.get(key)
    if key in derived and given is not None and given != value:  # Derived fields transformers writes.
      raise cfg.unsupported(key, given, f"DeepSeek-V3 derives it as {value} from"
                            " qk_nope_head_dim and qk_rope_head_dim")
  layers = cfg.require("num_hidden_layers")
  sizes = Sizes(
      hidden=cfg.require("hidden_size"), heads=heads, q_rank=cfg.nullable("q_lora_rank", FROM_TABLE),
      kv_rank=cfg.require("kv_lora_rank"), nope=nope, rope=rope,
      value=cfg.require("v_head_dim"), intermediate=cfg.require("intermediate_size"),
      layers=layers, vocab=cfg.require("vocab_size"),
      dense=dense(cfg, layers),
      eps=float(cfg.get("rms_norm_eps", 1e-6)), interleave=cfg.get("rope_interleave", True))
  if sizes.rope % 2:
    raise cfg.unsupported("qk_rope_head_dim", rope, "RoPE rotates pairs: it must be even")
  cfg.expect("hidden_act", {"silu"}, "silu", why="; DeepSeek-V3's MLPs are SwiGLU")
  if cfg.get("attention_bias", False):
    raise cfg.unsupported("attention_bias", True, "not read yet for DeepSeek-V3 (no published"
                          " checkpoint has attention biases)")
  return sizes


def softmax_scale(sizes: Sizes, rope_layer: pz.nn.Layer) -> float:
  """transformers' ``qk_head_dim ** -0.5``, times yarn's ``mscale_all_dim``
  factor squared when the RoPE is scaled and sets it."""
  scale = (sizes.nope + sizes.rope) ** -0.5
  mscale_all_dim = getattr(rope_layer, "mscale_all_dim", None)
  factor = getattr(rope_layer, "factor", None)
  if mscale_all_dim and factor is not None:
    mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
    scale = scale * mscale * mscale
  return scale


def indexer_specs(p: str, s: str, sizes: Sizes, indexer: IndexerSizes, src: Source
                  ) -> list[TensorSpec]:
  """The lightning indexer's tensors of block ``p`` from layer ``s``
  (``self_attn.indexer``)."""
  h, q_rank, dim, heads = sizes.hidden, sizes.q_rank, indexer.dim, indexer.heads
  assert q_rank is not None  # DeepSeek-V3.2 refuses a null q_lora_rank.
  p, s = f"{p}attention/indexer/", f"{s}self_attn.indexer."
  return [
      TensorSpec(f"{p}query.weights", src(s + "wq_b.weight", (heads * dim, q_rank)),
                 (heads, dim, q_rank), ("index_heads", "projection", "q_latent"),
                 stored=(heads * dim, q_rank)),
      TensorSpec(f"{p}key.weights", src(s + "wk.weight", (dim, h)), (dim, h),
                 ("projection", "embedding")),
      TensorSpec(f"{p}key_norm/scale.weights", s + "k_norm.weight", (dim,), ("projection",)),
      TensorSpec(f"{p}key_norm/shift.bias", s + "k_norm.bias", (dim,), ("projection",)),
      TensorSpec(f"{p}weights.weights", src(s + "weights_proj.weight", (heads, h)), (heads, h),
                 ("index_heads", "embedding")),
  ]


def mla_specs(p: str, s: str, sizes: Sizes, src: Source) -> list[TensorSpec]:
  """The attention tensors of block ``p`` (Penzai) from layer ``s``; each
  matrix read through ``src`` (FP8 ones dequantised)."""
  h, heads = sizes.hidden, sizes.heads
  qk, attn = sizes.nope + sizes.rope, f"{s}self_attn."
  specs = [
      TensorSpec(f"{p}attention/kv_a.weights", src(attn + "kv_a_proj_with_mqa.weight", (sizes.kv_rank + sizes.rope, h)),
                 (sizes.kv_rank + sizes.rope, h), ("projection", "embedding")),
      TensorSpec(f"{p}attention/kv_a_norm/scale.weights", attn + "kv_a_layernorm.weight",
                 (sizes.kv_rank,), ("kv_latent",)),
      TensorSpec(f"{p}attention/output.weights",
                 src(attn + "o_proj.weight", (h, heads * sizes.value)),
                 (h, heads, sizes.value), ("embedding", "heads", "projection"),
                 stored=(h, heads * sizes.value)),
  ]
  kv_b = (heads, sizes.nope + sizes.value, sizes.kv_rank)
  for name, part in (("key_up", (1, 0, sizes.nope)),
                     ("value_up", (1, sizes.nope, sizes.nope + sizes.value))):
    source = src(attn + "kv_b_proj.weight", (heads * kv_b[1], sizes.kv_rank))
    specs.append(TensorSpec(f"{p}attention/{name}.weights", source, kv_b,
                            ("heads", "projection", "kv_latent"),
                            stored=(heads * kv_b[1], sizes.kv_rank), part=part))
  if sizes.q_rank is None:
    specs.append(TensorSpec(f"{p}attention/query.weights", src(attn + "q_proj.weight", (heads * qk, h)),
                            (heads, qk, h), ("heads", "projection", "embedding"),
                            stored=(heads * qk, h)))
  else:
    specs += [
        TensorSpec(f"{p}attention/q_a.weights", src(attn + "q_a_proj.weight", (sizes.q_rank, h)),
                   (sizes.q_rank, h), ("q_latent", "embedding")),
        TensorSpec(f"{p}attention/q_a_norm/scale.weights", attn + "q_a_layernorm.weight",
                   (sizes.q_rank,), ("q_latent",)),
        TensorSpec(f"{p}attention/query.weights",
                   src(attn + "q_b_proj.weight", (heads * qk, sizes.q_rank)),
                   (heads, qk, sizes.q_rank), ("heads", "projection", "q_latent"),
                   stored=(heads * qk, sizes.q_rank)),
    ]
  return specs


def dense_mlp_specs(p: str, s: str, hidden: int, neurons: int, src: Source) -> list[TensorSpec]:
  """A SwiGLU MLP's three matrices (``gate_proj``, ``up_proj``, ``down_proj``)."""
  return [
      TensorSpec(f"{p}mlp/gating_linear.weights", src(f"{s}mlp.gate_proj.weight", (neurons, hidden)),
                 (neurons, hidden), ("neurons", "embedding")),
      TensorSpec(f"{p}mlp/value_linear.weights", src(f"{s}mlp.up_proj.weight", (neurons, hidden)),
                 (neurons, hidden), ("neurons", "embedding")),
      TensorSpec(f"{p}mlp/out_linear.weights", src(f"{s}mlp.down_proj.weight", (hidden, neurons)),
                 (hidden, neurons), ("embedding", "neurons")),
  ]


def _linear(name: str, inputs: dict[str, int], outputs: dict[str, int], dtype: DTypeLike) -> pz.nn.Linear:
  return pz.nn.Linear.from_config(name=name, init_base_rng=None, input_axes=inputs,
                                  output_axes=outputs, dtype=dtype)


def _norm(name: str, axes: dict[str, int], eps: float, dtype: DTypeLike) -> pz.nn.RMSLayerNorm:
  return pz.nn.RMSLayerNorm.from_config(name=name, init_base_rng=None, across_axes=axes,
                                        epsilon=eps, dtype=dtype)


def swiglu(name: str, hidden: int, neurons: int, dtype: DTypeLike) -> model_parts.TransformerFeedForward:
  """Penzai's llama-like SwiGLU MLP (``gating_linear``, ``value_linear``,
  ``out_linear``)."""
  import jax  # pylint: disable=import-outside-toplevel
  return model_parts.TransformerFeedForward([
      pz.nn.BranchAndMultiplyTogether(branches=[
          pz.nn.NamedGroup("gate", [
              _linear(f"{name}/gating_linear", {"embedding": hidden}, {"neurons": neurons}, dtype),
              pz.nn.Elementwise(jax.nn.silu),
          ]),
          _linear(f"{name}/value_linear", {"embedding": hidden}, {"neurons": neurons}, dtype),
      ]),
      _linear(f"{name}/out_linear", {"neurons": neurons}, {"embedding": hidden}, dtype),
  ])


def _indexer_layers(name: str, sizes: Sizes, indexer: IndexerSizes, rope_layer: pz.nn.Layer,
                    dtype: DTypeLike) -> tuple[pz.nn.Layer, pz.nn.Layer, pz.nn.Layer]:
  """The lightning indexer's key, query and weights layers
  (`pz_persist.nn.sparse_attention`); its RoPE is on each head's first
  ``qk_rope_head_dim`` numbers, in halves or (``indexer.interleave``)
  interleaved."""
  assert sizes.q_rank is not None
  dim, name = indexer.dim, f"{name}/indexer"
  rotate = [mla.Deinterleave("rotary"), rope_layer] if indexer.interleave else [rope_layer]

  def rotated() -> mla.ApplyToParts:
    return mla.ApplyToParts(parts=[pz.nn.Sequential(list(rotate)), pz.nn.Sequential([])],
                            names=("rotary", "projection"), sizes=(sizes.rope, dim - sizes.rope),
                            axis="projection")

  key = pz.nn.Sequential([
      _linear(f"{name}/key", {"embedding": sizes.hidden}, {"projection": dim}, dtype),
      pz.nn.LayerNorm.from_config(name=f"{name}/key_norm", init_base_rng=None,
                                  across_axes={"projection": dim}, epsilon=_LATENT_NORM_EPS,
                                  dtype=dtype),
      rotated()])
  query = pz.nn.Sequential([
      _linear(f"{name}/query", {"q_latent": sizes.q_rank},
              {"index_heads": indexer.heads, "projection": dim}, dtype), rotated()])
  # transformers computes the weights in float32 (weights_proj kept in float32).
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  weights = pz.nn.Sequential([
      pz.nn.CastToDType(jnp.float32),
      _linear(f"{name}/weights", {"embedding": sizes.hidden}, {"index_heads": indexer.heads},
              dtype),
      ConstantScale(indexer.heads ** -0.5)])
  return key, query, weights


def latent_attention(name: str, sizes: Sizes, rope_layer: pz.nn.Layer, scale: float,
                     dtype: DTypeLike, indexer: IndexerSizes | None = None,
                     choice: Literal["own", "publish", "reuse"] = "own") -> list[pz.nn.Layer]:
  """MLA as `pz_persist.nn.latent_attention` lays it out:
  the `WithLatent` compression, then Penzai's ``Attention``; with
  ``indexer``, DeepSeek Sparse Attention (`pz_persist.nn.sparse_attention`):
  ``choice`` ``"own"``, this layer's lightning indexer chooses the tokens
  it attends to; ``"publish"``, and later layers reuse that choice;
  ``"reuse"``, no indexer, the last publishing layer's choice."""
  h, heads, qk = sizes.hidden, sizes.heads, sizes.nope + sizes.rope
  rotate = [mla.Deinterleave("rotary"), rope_layer] if sizes.interleave else [rope_layer]
  compress = pz.nn.Sequential([
      _linear(f"{name}/kv_a", {"embedding": h}, {"projection": sizes.kv_rank + sizes.rope}, dtype),
      mla.ApplyToParts(parts=[_norm(f"{name}/kv_a_norm", {"kv_latent": sizes.kv_rank},
                                    _LATENT_NORM_EPS, dtype),
                              pz.nn.Sequential(list(rotate))],
                       names=("kv_latent", "rotary"), sizes=(sizes.kv_rank, sizes.rope),
                       axis="projection"),
  ])
  query_axes = {"heads": heads, "projection": qk}
  if sizes.q_rank is None:
    query: list[pz.nn.Layer] = [_linear(f"{name}/query", {"embedding": h}, query_axes, dtype)]
  else:
    query = [_linear(f"{name}/q_a", {"embedding": h}, {"q_latent": sizes.q_rank}, dtype),
             _norm(f"{name}/q_a_norm", {"q_latent": sizes.q_rank}, _LATENT_NORM_EPS, dtype),
             _linear(f"{name}/query", {"q_latent": sizes.q_rank}, query_axes, dtype)]
  query += [mla.ApplyToParts(parts=[pz.nn.Sequential([]), pz.nn.Sequential(list(rotate))],
                             names=("projection", "rotary"), sizes=(sizes.nope, sizes.rope),
                             axis="projection"),
            ConstantScale(scale)]
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  masked = jnp.array(-2.3819763e38, dtype=dtype)
  logits: list[pz.nn.Layer] = [
      mla.LatentAttentionLogits(
          key_up=_linear(f"{name}/key_up", {"kv_latent": sizes.kv_rank},
                         {"heads": heads, "projection": sizes.nope}, dtype),
          latent_size=sizes.kv_rank, nope_size=sizes.nope),
      pz.nn.ApplyCausalAttentionMask(masked_out_value=masked)]
  to_query: pz.nn.Layer = pz.nn.Sequential([mla.Pick(0), *query])
  to_key: pz.nn.Layer = mla.Pick(1)
  if indexer is not None and choice == "reuse":
    logits = [dsa.SharedChoiceLogits(logits=pz.nn.Sequential(logits), masked_out_value=masked)]
    to_key = mla.SizedPick(index=1, axes=(("projection", sizes.kv_rank + sizes.rope),))
  elif indexer is not None:
    index_key, index_query, index_weights = _indexer_layers(name, sizes, indexer, rope_layer,
                                                            dtype)
    compress = dsa.AppendIndexKey(latent=compress, index_key=index_key)
    to_query = pz.nn.Sequential([mla.Pick(0), dsa.IndexedQuery(
        latent=pz.nn.Sequential(query[:2]), query=pz.nn.Sequential(query[2:]),
        index_query=index_query, index_weights=index_weights)])
    sparse = {
        "logits": pz.nn.Sequential(logits),
        "index_scores": pz.nn.Sequential([
            dsa.IndexerScores(scale=indexer.dim ** -0.5),
            pz.nn.ApplyCausalAttentionMask(masked_out_value=jnp.array(-jnp.inf, jnp.float32))]),
        "key_size": sizes.kv_rank + sizes.rope, "top_k": indexer.top_k,
        "masked_out_value": masked}
    logits = [dsa.PublishingSparseAttentionLogits(**sparse) if choice == "publish"
              else dsa.SparseAttentionLogits(**sparse)]
  return [
      mla.WithLatent(compress),
      pz.nn.Attention(
          input_to_query=to_query,
          input_to_key=to_key,
          input_to_value=to_key,
          query_key_to_attn=pz.nn.Sequential([*logits, pz.nn.Softmax("kv_seq")]),
          attn_value_to_output=pz.nn.Sequential([
              mla.LatentAttentionValues(
                  value_up=_linear(f"{name}/value_up", {"kv_latent": sizes.kv_rank},
                                   {"heads": heads, "projection": sizes.value}, dtype),
                  latent_size=sizes.kv_rank),
              _linear(f"{name}/output", {"heads": heads, "projection": sizes.value},
                      {"embedding": h}, dtype),
          ]),
      ),
  ]


def rope_layer(theta: float, scaling: RopeScaling | None) -> pz.nn.Layer:
  """The rotary layer of the ``rotary`` part (Penzai's, or scaled)."""
  if scaling is None:
    return pz.nn.ApplyRoPE(embedding_axis="rotary", max_wavelength=theta,
                           positions_input_name="token_positions")
  return scaled_rope_layer.ApplyScaledRoPE(embedding_axis="rotary", max_wavelength=theta,
                                           positions_input_name="token_positions",
                                           rope_type=scaling.rope_type, **scaling.fields)


def latent_plan(cfg: Config, weights: Weights, dense: DenseRule = first_k_dense,
                mtp_default: Any = FROM_TABLE,
                read_indexer: Callable[[Config, Sizes], IndexerSizes] | None = None) -> Plan:
  """Maps a checkpoint of DeepSeek-V3's layout to Penzai (module
  docstring); ``dense`` says which layers have a dense MLP, ``mtp_default``
  what an absent ``num_nextn_predict_layers`` means, ``read_indexer`` (given
  for DeepSeek-V3.2) the checked sizes of each layer's lightning indexer."""
  sizes = read_sizes(cfg, dense)
  indexer = read_indexer(cfg, sizes) if read_indexer is not None else None
  theta, fraction, scaling = scaled_rope(cfg, 10_000.0,
                                         cfg.default("max_position_embeddings", FROM_TABLE))
  if fraction != 1.0:
    raise cfg.unsupported("partial_rotary_factor", fraction,
                          "the RoPE part of latent attention is qk_rope_head_dim, rotated whole")
  moe = read_routing(cfg, sizes.hidden)
  quantization = quantized_fp8.read_quantization(cfg)
  tied = cfg.get("tie_word_embeddings", False)
  mtp = cfg.get("num_nextn_predict_layers", mtp_default)
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  check_layers(cfg, main_layers(weights.names, sizes.layers, mtp), DECODER_LAYERS, sizes.layers)
  first_moe = next((i for i in range(sizes.layers) if not sizes.dense(i)), None)
  if first_moe is not None and isinstance(weights, Weights):  # Not export's stand-in.
    check_expert_count(cfg, weights.names, first_moe, moe.experts)
  head_source = lm_head_source(cfg, tied, weights, DECODER_HEAD, "model.embed_tokens.weight")
  dtype = weights.dtype
  h = sizes.hidden
  views: list[View] = []
  sources: dict[str, str] = {}

  def src(name: str, shape: tuple[int, int], parts: list[str] | None = None) -> str:
    """The tensor to read for stored matrix ``name`` (a stack of ``parts``
    if given), dequantised if stored FP8; each view declared once."""
    if name not in sources:
      sources[name] = quantized_fp8.source(weights, quantization, parts or [name], shape, views,
                                           stack=name if parts else None)
    return sources[name]

  specs = outer_specs(sizes.vocab, h, head_source)
  for i in range(sizes.layers):
    p, s = f"transformer/block_{i}/", f"model.layers.{i}."
    specs += [
        *norm_specs(p, s, h),
        *mla_specs(p, s, sizes, src),
        *(indexer_specs(p, s, sizes, indexer, src)
          if indexer is not None and indexer.runs(i) else []),
    ]
    if sizes.dense(i):
      specs += dense_mlp_specs(p, s, h, sizes.intermediate, src)
    else:
      specs += moe.specs(p, s, src)
  layer = rope_layer(theta, scaling)
  scale = softmax_scale(sizes, layer)

  def build() -> model_parts.TransformerLM:
    body: list[pz.nn.Layer] = [pz.nn.EmbeddingLookup(pz.nn.EmbeddingTable.from_config(
        name="transformer/embedder", init_base_rng=None, vocab_size=sizes.vocab,
        embedding_axes={"embedding": h}, dtype=dtype))]
    shares = indexer is not None and not all(indexer.runs(i) for i in range(sizes.layers))
    blocks: list[pz.nn.Layer] = []
    for i in range(sizes.layers):
      name = f"transformer/block_{i}"
      ffw = (swiglu(f"{name}/mlp", h, sizes.intermediate, dtype) if sizes.dense(i)
             else moe.layer(f"{name}/mlp", dtype))
      choice: Literal["own", "publish", "reuse"] = (
          ("publish" if indexer.runs(i) else "reuse") if shares and indexer else "own")
      blocks.append(model_parts.TransformerBlock(sublayers=[
          pz.nn.Residual(pz.nn.Sequential([
              _norm(f"{name}/pre_attention_norm", {"embedding": h}, sizes.eps, dtype),
              *latent_attention(f"{name}/attention", sizes, layer, scale, dtype, indexer,
                                choice),
          ])),
          pz.nn.Residual(pz.nn.Sequential([
              _norm(f"{name}/pre_ffw_norm", {"embedding": h}, sizes.eps, dtype), ffw,
          ])),
      ]))
    # GLM-5's shared indexer layers read the choice of an earlier layer from
    # the forward pass's mailbox (`pz_persist.nn.kv_sharing`).
    body += [kv_sharing.SharesKV(pz.nn.Sequential(blocks))] if shares else blocks
    body += [_norm("transformer/final_norm", {"embedding": h}, sizes.eps, dtype),
             _linear("transformer/lm_head", {"embedding": h}, {"vocabulary": sizes.vocab}, dtype)]
    model = model_parts.TransformerLM(
        metadata=model_parts.TransformerMetadata(
            common_head_axes={}, query_only_head_axes={"heads": sizes.heads},
            embedding_dim=h,
            projection_dim=sizes.kv_rank + sizes.rope + (indexer.dim if indexer else 0),
            mlp_hidden_dim=sizes.intermediate, vocab_size=sizes.vocab, activation_dtype=dtype),
        body=pz.nn.Sequential(body))
    # The rotary part is its own axis, which no parameter has: checked here,
    # for its one size, as load_hf checks the others.
    scaled_rope_layer.check_computable(model, {"rotary": {sizes.rope}}, cfg.where)
    return model

  left_out = [mtp_layers(sizes.layers, mtp)]
  if indexer is not None:
    left_out.append(_unused_indexers(indexer))
  return Plan(build, tuple(specs), tuple(views), tuple(left_out))


def _unused_indexers(indexer: IndexerSizes) -> LeftOut:
  """An indexer stored in a layer its config marks ``"shared"`` (GLM-5): the
  layer reuses an earlier layer's choice and runs none of its own, so
  transformers builds no indexer there and leaves the stored one unread;
  so does load_hf, saying so."""
  return left_out_in_layers(
      DECODER_LAYERS, lambda number: not indexer.runs(number),
      "the indexers of layers marked shared in indexer_types",
      "those layers reuse the top-k of the last earlier full layer, as transformers'"
      " do (it leaves these tensors unread too)", part="self_attn.indexer.")


def latent_fields(model: pz.nn.Layer, like: Mapping[str, Any], rotary: bool = True
                  ) -> tuple[dict[str, Any], list[bool]]:
  """The fields of a model of DeepSeek-V3's layout but its routing's, and
  which of its blocks are dense; ``rotary=False`` for a model without
  position embeddings (Kimi-Linear's NoPE latent attention)."""
  embed = named_shape(first_layer(model, pz.nn.EmbeddingTable, "token embeddings"))
  logits = first_layer(model, mla.LatentAttentionLogits, "latent attention")
  key_up = named_shape(logits.key_up)
  values = named_shape(first_layer(model, mla.LatentAttentionValues, "latent attention").value_up)
  compress = first_layer(model, mla.WithLatent, "latent attention").compress
  if isinstance(compress, dsa.AppendIndexKey):  # DeepSeek-V3.2: the latent, then the index key.
    compress = compress.latent
  kv_a = named_shape(compress.sublayers[0])
  attention = first_layer(model, pz.nn.Attention, "attention")
  q_a = [layer for layer in all_layers(attention.input_to_query, pz.nn.Linear)
         if "q_latent" in named_shape(layer) and "embedding" in named_shape(layer)]
  all_blocks = blocks(model)
  dense = [b for b in all_blocks if all_layers(b, model_parts.TransformerFeedForward)]
  first_dense = dense[0] if dense else None
  fields: dict[str, Any] = {
      "hidden_size": embed["embedding"], "vocab_size": embed["vocabulary"],
      "num_hidden_layers": len(all_blocks),
      "num_attention_heads": key_up["heads"],
      "num_key_value_heads": like.get("num_key_value_heads", key_up["heads"]),
      "kv_lora_rank": logits.latent_size, "qk_nope_head_dim": logits.nope_size,
      "qk_rope_head_dim": kv_a["projection"] - logits.latent_size,
      "v_head_dim": values["projection"],
      "q_lora_rank": named_shape(q_a[0])["q_latent"] if q_a else None,
      "rope_interleave": bool(all_layers(model, mla.Deinterleave)),
      "rms_norm_eps": number(first_layer(model, pz.nn.RMSStandardize, "RMS norm").epsilon),
      "hidden_act": "silu", "attention_bias": False,
      "num_nextn_predict_layers": like.get("num_nextn_predict_layers", 0),
      **(rope_fields(model) if rotary else {}), **tied_field(model, like),
  }
  fields["qk_head_dim"] = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
  fields["head_dim"] = fields["qk_rope_head_dim"]
  if first_dense is not None:
    ffw = first_layer(first_dense, model_parts.TransformerFeedForward, "MLP")
    fields["intermediate_size"] = named_shape(first_layer(ffw, pz.nn.Linear, "MLP"))["neurons"]
  else:
    fields["intermediate_size"] = like.get("intermediate_size", 1)
  return fields, [bool(all_layers(b, model_parts.TransformerFeedForward)) for b in all_blocks]
