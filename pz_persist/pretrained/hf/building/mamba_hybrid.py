"""Shared code (no record): the Mamba-2 layers of the state-space hybrids
(Bamba, Granite 4, Nemotron-H), read from and written back to Hugging Face's layout.

transformers stores a Mamba-2 mixer (``mamba.``) fused: ``in_proj`` holds, by
rows, the gate ``z`` (``intermediate = mamba_n_heads * mamba_d_head`` rows),
the input ``x`` (as many), ``B`` and ``C`` (``mamba_n_groups *
mamba_d_state`` each) and the time step ``dt`` (``mamba_n_heads``);
``conv1d.weight`` (``[channels, 1, taps]``) and ``conv1d.bias`` hold ``x``,
``B`` and ``C``'s kernels and biases in that order. Each is read by its rows
(`TensorSpec.rows`) into `pz_persist.nn.mamba2.Mamba2`'s named parameters and
written back fused. The ``mamba_*`` fields are the same in every family.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn.mamba2 import Mamba2
from pz_persist.pretrained.errors import ExportError
from pz_persist.pretrained.hf.building.decoder import block_specs
from pz_persist.pretrained.hf.config import BOOLEAN
from pz_persist.pretrained.hf.config import FROM_TABLE
from pz_persist.pretrained.hf.config import POSITIVE_INT
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config import lm_head_source
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.plan import DECODER_HEAD
from pz_persist.pretrained.hf.plan import DECODER_LAYERS
from pz_persist.pretrained.hf.plan import TensorSpec
from pz_persist.pretrained.hf.plan import check_layers
from pz_persist.pretrained.hf.weights import Weights

_INF = float("inf")


def _auto_or_positive(value: Any) -> bool:
  return value == "auto" or POSITIVE_INT[0](value)


_INFINITY = {"__float__": "Infinity"}
"""How transformers 5 writes an infinite float in ``config.json`` (older
versions wrote JSON's ``Infinity``, which Python's reader turns into the float)."""


def _float(value: Any) -> float | None:
  """A config number, or transformers' tagged infinity; None otherwise."""
  if value == _INFINITY:
    return _INF
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return float(value)
  return None


def _limit(value: Any) -> bool:
  if not isinstance(value, (list, tuple)) or len(value) != 2:
    return False
  low, high = (_float(v) for v in value)
  return low is not None and high is not None and 0 <= low < _INF and low <= high


FIELDS = {
    "mamba_n_heads": POSITIVE_INT,
    "mamba_d_head": (_auto_or_positive, "a positive integer or 'auto'"),
    "mamba_n_groups": POSITIVE_INT,
    "mamba_d_state": POSITIVE_INT,
    "mamba_d_conv": POSITIVE_INT,
    "mamba_expand": POSITIVE_INT,
    "mamba_chunk_size": POSITIVE_INT,
    "mamba_conv_bias": BOOLEAN,
    "mamba_proj_bias": BOOLEAN,
    "time_step_limit": (_limit, "[low, high] with 0 <= low <= high, low finite"),
}
"""The ``mamba_*`` fields the hybrids' configs share, with their checks."""

DEFAULTS: dict[str, Any] = {
    "mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True,
    "mamba_proj_bias": False, "time_step_limit": (0.0, _INF)}
"""Their defaults, the same in BambaConfig and GraniteMoeHybridConfig."""

DEFAULTS_WHY = {
    "mamba_d_head": ("the config class replaces 'auto' by mamba_expand * hidden_size //"
                     " mamba_n_heads, which pz_persist computes the same way"),
}
"""Why an entry of `DEFAULTS` differs from what the config classes store."""


@dataclasses.dataclass(frozen=True)
class MambaSizes:
  """A Mamba-2 mixer's sizes, as its config gives them."""

  hidden: int
  heads: int
  head_dim: int
  groups: int
  state: int
  taps: int
  conv_bias: bool
  time_step_limit: tuple[float, float]
  norm: bool = True
  """Whether the mixer has its gated norm (``norm.weight``); Falcon-H1's may not."""

  @property
  def intermediate(self) -> int:
    return self.heads * self.head_dim


def mamba_sizes(cfg: Config, hidden: int, intermediate: int | None = None) -> MambaSizes:
  """The ``mamba_*`` fields, checked against each other as transformers'
  config classes check them (and refused where pz_persist reads less).
  ``intermediate``: the heads' total size when the config gives it (Falcon-H1's
  ``mamba_d_ssm``), else ``mamba_expand * hidden_size``."""
  heads, expand = cfg.require("mamba_n_heads"), cfg.require("mamba_expand")
  groups = cfg.require("mamba_n_groups")
  given = "mamba_d_ssm" if intermediate is not None else "mamba_expand * hidden_size"
  intermediate = expand * hidden if intermediate is None else intermediate
  head_dim = cfg.require("mamba_d_head")
  if head_dim == "auto":
    if intermediate % heads:
      raise cfg.unsupported("mamba_n_heads", heads, f"must divide {given} = {intermediate}")
    head_dim = intermediate // heads
  if head_dim * heads != intermediate:
    raise cfg.unsupported("mamba_d_head", head_dim,
                          f"mamba_d_head * mamba_n_heads must be {given} = {intermediate}")
  if heads % groups:
    raise cfg.unsupported("mamba_n_groups", groups,
                          f"each group of B, C and the gated norm serves a whole number of heads:"
                          f" it must divide mamba_n_heads={heads}")
  if cfg.require("mamba_proj_bias"):
    raise cfg.unsupported("mamba_proj_bias", True,
                          "no published Mamba-2 hybrid has in_proj / out_proj biases, and"
                          " pz_persist does not read them")
  cfg.require("mamba_chunk_size")  # Checked; the scan's chunks regroup the same sums.
  if "time_step_limit" in cfg.raw and cfg.raw["time_step_limit"] is None:
    # transformers' mixers index it (a TypeError on null); absent means no limit.
    raise cfg.unsupported("time_step_limit", None, "transformers' Mamba-2 mixers clamp the time"
                          " step by it and cannot run a null one; leave it out for no limit")
  limit = cfg.get("time_step_limit")
  low, high = (0.0, _INF) if limit is None else (_float(limit[0]), _float(limit[1]))
  assert low is not None and high is not None  # The schema checked both.
  return MambaSizes(hidden=hidden, heads=heads, head_dim=head_dim, groups=groups,
                    state=cfg.require("mamba_d_state"), taps=cfg.require("mamba_d_conv"),
                    conv_bias=cfg.require("mamba_conv_bias"), time_step_limit=(low, high))


def mamba_specs(name: str, s: str, sizes: MambaSizes) -> list[TensorSpec]:
  """The specs of the mixer labelled ``name`` from the tensors under ``s``
  (``model.layers.{i}.mamba.``), the fused ones read by rows."""
  hidden, inner = sizes.hidden, sizes.intermediate
  heads = (sizes.heads, sizes.head_dim)
  matrix = (sizes.groups, sizes.state)
  head_axes, matrix_axes = ("ssm_heads", "ssm_head_dim"), ("ssm_groups", "ssm_state")
  channels = inner + 2 * math.prod(matrix)
  projected = inner + channels + sizes.heads
  parts = [("gate", heads, head_axes), ("input", heads, head_axes),
           ("input_matrix", matrix, matrix_axes), ("output_matrix", matrix, matrix_axes),
           ("time_step", (sizes.heads,), ("ssm_heads",))]
  out, start = [], 0
  for field, shape, axes in parts:
    stop = start + math.prod(shape)
    out.append(TensorSpec(f"{name}/{field}.weights", s + "in_proj.weight", (*shape, hidden),
                          (*axes, "embedding"), stored=(projected, hidden), rows=(start, stop)))
    if field in ("input", "input_matrix", "output_matrix"):
      rows = (start - inner, stop - inner)  # The convolution's channels skip z.
      out.append(TensorSpec(f"{name}/{field}_conv", s + "conv1d.weight", (*shape, sizes.taps),
                            (*axes, "conv_taps"), stored=(channels, 1, sizes.taps), rows=rows))
      if sizes.conv_bias:
        out.append(TensorSpec(f"{name}/{field}_conv_bias", s + "conv1d.bias", shape, axes,
                              stored=(channels,), rows=rows))
    start = stop
  per_head = (sizes.heads,), ("ssm_heads",)
  return out + [
      TensorSpec(f"{name}/log_decay_rate", s + "A_log", *per_head),
      TensorSpec(f"{name}/time_step_bias", s + "dt_bias", *per_head),
      TensorSpec(f"{name}/skip", s + "D", *per_head),
      *([TensorSpec(f"{name}/norm_scale", s + "norm.weight", heads, head_axes, stored=(inner,))]
        if sizes.norm else []),
      TensorSpec(f"{name}/output.weights", s + "out_proj.weight", (hidden, *heads),
                 ("embedding", *head_axes), stored=(hidden, inner)),
  ]


def mixer_keywords(sizes: MambaSizes, eps: float) -> dict[str, Any]:
  """`Mamba2.from_config`'s keywords for ``sizes``."""
  return {"embedding": sizes.hidden, "heads": sizes.heads, "head_dim": sizes.head_dim,
          "groups": sizes.groups, "state": sizes.state, "conv_taps": sizes.taps,
          "norm_epsilon": eps, "conv_bias": sizes.conv_bias,
          "time_step_limit": sizes.time_step_limit}


def mamba_mixer(name: str, sizes: MambaSizes, eps: float) -> Mamba2:
  """The mixer whose parameters `mamba_specs` reads."""
  return Mamba2.from_config(name, **mixer_keywords(sizes, eps))


def with_mixers(model: Any, kinds: list[str], sizes: MambaSizes, eps: float) -> Any:
  """``model`` (Penzai's llama-like skeleton) with the attention of each
  ``"mamba"`` block of ``kinds`` replaced by a `Mamba2` mixer labelled
  ``transformer/block_{i}/mamba``."""
  selected = pz.select(model).at_instances_of(model_parts.TransformerBlock)
  blocks = []
  for i, (block, kind) in enumerate(zip(selected.get_sequence(), kinds)):
    if kind == "mamba":
      mixer = mamba_mixer(f"transformer/block_{i}/mamba", sizes, eps)
      block = pz.select(block).at_instances_of(pz.nn.Attention).set(mixer)
    blocks.append(block)
  return selected.set_sequence(blocks)


def has_mixers(model: pz.nn.Layer) -> bool:
  return bool(all_layers(model, Mamba2))


def mixer_sizes(mixer: Mamba2) -> MambaSizes:
  """The sizes of a built `Mamba2` mixer, read from its parameters' shapes
  (what `mamba_sizes` reads from a config, for writing one back)."""
  heads = dict(mixer.input_conv.value.named_shape)
  matrix = dict(mixer.input_matrix_conv.value.named_shape)
  low, high = mixer.time_step_limit
  return MambaSizes(hidden=dict(mixer.output.weights.value.named_shape)["embedding"],
                    heads=heads["ssm_heads"], head_dim=heads["ssm_head_dim"],
                    groups=matrix["ssm_groups"], state=matrix["ssm_state"],
                    taps=heads["conv_taps"], conv_bias=mixer.input_conv_bias is not None,
                    time_step_limit=(float(low), float(high)),
                    norm=mixer.norm_scale is not None)


def mamba_fields(model: pz.nn.Layer, like: Mapping[str, Any], d_ssm: bool = False
                 ) -> dict[str, Any]:
  """The ``mamba_*`` fields of a model with `Mamba2` mixers (``like``'s, or
  the defaults, when it has none: they then change nothing). With ``d_ssm``
  (Falcon-H1), the heads' total size is ``mamba_d_ssm`` and ``mamba_expand``
  (then unread) is ``like``'s or the default."""
  mixers = all_layers(model, Mamba2)
  if not mixers:
    return {k: like.get(k, v) for k, v in DEFAULTS.items() if k != "time_step_limit"}
  sizes = mixer_sizes(mixers[0])
  fields: dict[str, Any] = {
      "mamba_n_heads": sizes.heads, "mamba_d_head": sizes.head_dim,
      "mamba_n_groups": sizes.groups, "mamba_d_state": sizes.state,
      "mamba_d_conv": sizes.taps, "mamba_conv_bias": sizes.conv_bias,
      "mamba_proj_bias": False, "mamba_chunk_size": like.get("mamba_chunk_size", 256)}
  if sizes.intermediate % sizes.hidden and not d_ssm:
    raise ExportError(
        f"the Mamba2 mixers' heads x head size ({sizes.intermediate}) is not a multiple of the"
        f" embedding size ({sizes.hidden}): transformers' configs give it as mamba_expand *"
        " hidden_size, so no config.json describes this model")
  if d_ssm:
    fields.update(mamba_d_ssm=sizes.intermediate,
                  mamba_expand=like.get("mamba_expand", DEFAULTS["mamba_expand"]))
  else:
    fields["mamba_expand"] = sizes.intermediate // sizes.hidden
  low, high = sizes.time_step_limit
  if (low, high) != (0.0, _INF) or "time_step_limit" in like:
    fields["time_step_limit"] = [low, _INFINITY if high == _INF else high]
  return fields


def checked_config(cfg: Config, weights: Weights, *, heads: int, kv_heads: int, hidden: int,
                   head_dim: int, neurons: int, layers: int, theta: float, eps: float,
                   layer_prefix: str = DECODER_LAYERS,
                   embeddings: str = "model.embed_tokens.weight", ties: bool = True,
                   ) -> tuple[llamalike_common.LlamalikeTransformerConfig, str]:
  """The hybrids' Llama skeleton config and their output head's tensor, once
  ``config.json`` is read whole (`Config.check_all_used`) and its layer
  count agrees with the weights: the order every family keeps, so that a
  config is refused on its own before the weights are asked. ``layer_prefix``
  and ``embeddings`` name where the family keeps its layers and embeddings
  (Nemotron-H: under ``backbone.``). ``ties`` false: transformers' model
  never ties its head (Nemotron-H), which must then be stored."""
  tied = cfg.get("tie_word_embeddings", FROM_TABLE) and ties
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=kv_heads, query_head_multiplier=heads // kv_heads, embedding_dim=hidden,
      projection_dim=head_dim, mlp_hidden_dim=neurons, num_decoder_blocks=layers,
      vocab_size=cfg.require("vocab_size"), mlp_variant="swiglu", tie_embedder_and_logits=False,
      rope_wavelength=theta, rms_norm_eps=eps, parameter_dtype=None, activation_dtype=None)
  cfg.check_all_used()
  # config.json is valid on its own; from here on it must agree with the weights.
  check_layers(cfg, weights.names, layer_prefix, layers)
  head_source = lm_head_source(cfg, tied, weights, DECODER_HEAD, embeddings)
  return dataclasses.replace(config, parameter_dtype=weights.dtype,
                             activation_dtype=weights.dtype), head_source


_MLP_NAMES = {"mlp.gate_proj.": "feed_forward.gate_proj.", "mlp.up_proj.": "feed_forward.up_proj.",
              "mlp.down_proj.": "feed_forward.down_proj."}


def llama_specs(config: llamalike_common.LlamalikeTransformerConfig, head_source: str,
                attention: list[bool]) -> list[TensorSpec]:
  """The Llama parts of the hybrids' checkpoints (Bamba, Falcon-H1): the
  embeddings, final norm (``final_layernorm``) and head, and per layer its
  two norms (``input_layernorm``, ``pre_ff_layernorm``), its MLP (under
  ``feed_forward.``) and, where ``attention[i]``, its attention. The mixers'
  specs are `mamba_specs`'."""
  vocab, hidden = config.vocab_size, config.embedding_dim
  specs = [
      TensorSpec("transformer/embedder.embeddings", "model.embed_tokens.weight",
                 (vocab, hidden), ("vocabulary", "embedding")),
      TensorSpec("transformer/final_norm/scale.weights", "model.final_layernorm.weight",
                 (hidden,), ("embedding",)),
      TensorSpec("transformer/lm_head.weights", head_source, (vocab, hidden),
                 ("vocabulary", "embedding")),
  ]
  for i, with_attention in enumerate(attention):
    p, s = f"transformer/block_{i}/", f"{DECODER_LAYERS}{i}."
    specs += [
        TensorSpec(p + "pre_attention_norm/scale.weights", s + "input_layernorm.weight",
                   (hidden,), ("embedding",)),
        TensorSpec(p + "pre_ffw_norm/scale.weights", s + "pre_ff_layernorm.weight",
                   (hidden,), ("embedding",)),
    ]
    for spec in block_specs(p, s, config):
      if "/mlp/" in spec.label:
        old = next(k for k in _MLP_NAMES if spec.source.startswith(s + k))
        specs.append(dataclasses.replace(spec, source=spec.source.replace(old, _MLP_NAMES[old])))
      elif with_attention:
        specs.append(spec)
  return specs
