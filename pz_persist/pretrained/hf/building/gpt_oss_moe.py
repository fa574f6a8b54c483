"""gpt-oss's mixture of experts: its config fields, its tensors (dense, or
MXFP4 as the Hub stores them), the layer in place of each block's MLP, and the
fields export writes back. (Shared code of the gpt_oss family: no ``RECORD``.)

Each block's MLP becomes a
`pz_persist.nn.mixture_of_experts.MixtureOfExperts`
(``transformer/block_{i}/moe/...``): a router ``Linear`` with a bias from
``embedding`` to ``experts``, the top ``num_experts_per_tok`` logits
softmaxed over the chosen (``softmax_of_chosen``), and the experts' SwiGLU
with biases and gpt-oss's clamp (``clamped_swiglu``: gate ``min(g, limit)``,
``g * sigmoid(alpha * g)``; value ``clip(u, -limit, limit) + 1``).

transformers keeps the gate and up projections of all experts in one tensor,
interleaved along its last dimension (``gate_up_proj[..., ::2]`` is the
gate, ``[..., 1::2]`` the up projection), ``[experts, hidden, 2 *
intermediate]``, and its bias ``[experts, 2 * intermediate]``: each is read
as two parameters by `TensorSpec.take` over a trailing pair dimension, and
written back interleaved.

MXFP4 folders (``quantization_config.quant_method`` ``"mxfp4"``, as
openai/gpt-oss-20b and -120b) store ``gate_up_proj`` and ``down_proj`` as
``*_blocks`` and ``*_scales``; each is declared a
`pz_persist.pretrained.hf.weights.decoded` view of them, decoded by
`pz_persist.pretrained.hf.quantized_mxfp4.dequantize` (checked against the
headers before anything is read), and `load_hf` warns that it dequantised
them; the model then holds the dense values, and `export_hf` writes them
dense, without ``quantization_config``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable
from typing import Any

import numpy as np
from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

from pz_persist.nn import mixture_of_experts as moe_lib
from pz_persist.pretrained.hf import quantized_mxfp4
from pz_persist.pretrained.hf import weights as weights_lib
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import number
from pz_persist.pretrained.hf.plan import TensorSpec

_QUANTIZATION_KEYS = {"quant_method", "modules_to_not_convert"}
_MXFP4 = "MXFP4 (FP4 E2M1 values in blocks of 32, E8M0 scales)"


@dataclasses.dataclass
class GptOssMoe:
  """gpt-oss's experts as a checkpoint's config describes them.

  Attributes:
    experts: ``num_local_experts``.
    top_k: ``num_experts_per_tok``.
    alpha: ``swiglu_alpha``.
    limit: ``swiglu_limit``.
    quantized: Whether the experts are stored in MXFP4 (a function of the
      layer's Hugging Face prefix: ``modules_to_not_convert`` may exempt some).
    views: The decoded views of the MXFP4 tensors, filled by `specs`.
    where: The folder (for messages).
    headers: ``{name: (dtype, shape)}`` of the stored tensors.
  """

  experts: int
  top_k: int
  alpha: float
  limit: float
  quantized: Callable[[str], bool]
  headers: dict[str, tuple[np.dtype, tuple[int, ...]]]
  where: str
  views: list[weights_lib.View] = dataclasses.field(default_factory=list)

  def specs(self, p: str, s: str, config: llamalike_common.LlamalikeTransformerConfig
            ) -> list[TensorSpec]:
    """Block ``p``'s router and experts, from layer ``s``."""
    e, h, n = self.experts, config.embedding_dim, config.mlp_hidden_dim
    m, q = s + "mlp.", p + "moe/"
    if self.quantized(s):
      self.views += [self._decoded(m + "experts.gate_up_proj", (e, h, 2 * n)),
                     self._decoded(m + "experts.down_proj", (e, n, h))]

    def pair(label: str, source: str, shape: tuple[int, ...], axes: tuple[str, ...],
             index: int) -> TensorSpec:
      return TensorSpec(label, source, (*shape, 2), axes, take=(len(shape), index),
                        stored=(*shape[:-1], 2 * shape[-1]))

    experts_axes = ("experts", "embedding", "neurons")
    return [
        TensorSpec(q + "router.weights", m + "router.weight", (e, h), ("experts", "embedding")),
        TensorSpec(q + "router_bias.bias", m + "router.bias", (e,), ("experts",)),
        pair(q + "experts/gate.weights", m + "experts.gate_up_proj", (e, h, n), experts_axes, 0),
        pair(q + "experts/up.weights", m + "experts.gate_up_proj", (e, h, n), experts_axes, 1),
        pair(q + "experts/gate_bias.bias", m + "experts.gate_up_proj_bias", (e, n),
             ("experts", "neurons"), 0),
        pair(q + "experts/up_bias.bias", m + "experts.gate_up_proj_bias", (e, n),
             ("experts", "neurons"), 1),
        TensorSpec(q + "experts/down.weights", m + "experts.down_proj", (e, n, h),
                   ("experts", "neurons", "embedding")),
        TensorSpec(q + "experts/down_bias.bias", m + "experts.down_proj_bias", (e, h),
                   ("experts", "embedding")),
    ]

  def _decoded(self, name: str, shape: tuple[int, int, int]) -> weights_lib.View:
    """The view decoding ``name`` from its MXFP4 blocks and scales, whose
    headers are checked here, before anything is read."""
    blocks, scales = name + "_blocks", name + "_scales"
    if shape[1] % quantized_mxfp4.BLOCK:
      raise _format_error(f"{self.where}: {name!r} has {shape[1]} columns, not a multiple of"
                          f" MXFP4's blocks of {quantized_mxfp4.BLOCK}; the config does not"
                          " fit an MXFP4 checkpoint.")
    for part, expected in zip((blocks, scales), quantized_mxfp4.blocks_shape(shape)):
      found = self.headers.get(part)
      if found is None:
        dense = " (the folder holds it dense: drop quantization_config)" if (
            name in self.headers) else ""
        raise _format_error(f"tensor {part!r} (MXFP4 storage of {name!r}) is in none of the"
                            f" checkpoint's files in {self.where}{dense}.")
      if found != (np.dtype(np.uint8), expected):
        raise _format_error(f"{self.where}: tensor {part!r} is {found[0]}{list(found[1])};"
                            f" MXFP4 storage of {name!r} {list(shape)} is"
                            f" uint8{list(expected)}.")

    def decode(parts: dict[str, np.ndarray]) -> np.ndarray:
      return quantized_mxfp4.dequantize(parts[blocks], parts[scales], f"{self.where}: {name!r}")

    return weights_lib.decoded(name, (blocks, scales), shape, np.float32, decode, _MXFP4,
                               quantized_mxfp4.working_bytes(shape))

  def edit(self, model: model_parts.TransformerLM,
           config: llamalike_common.LlamalikeTransformerConfig) -> model_parts.TransformerLM:
    """``model`` with each block's MLP replaced by its mixture of experts."""
    selected = pz.select(model).at_instances_of(model_parts.TransformerBlock)
    new = []
    for i, block in enumerate(selected.get_sequence()):
      layer = self.layer(f"transformer/block_{i}/moe", config)
      new.append(pz.select(block).at_instances_of(model_parts.TransformerFeedForward).apply(
          lambda _, layer=layer: model_parts.TransformerFeedForward([layer])))
    return selected.set_sequence(new)

  def layer(self, name: str, config: llamalike_common.LlamalikeTransformerConfig
            ) -> moe_lib.MixtureOfExperts:
    dtype = config.parameter_dtype
    router = moe_lib.TopKRouter(
        logits=moe_lib.router_linear(f"{name}/router", self.experts, config.embedding_dim,
                                     bias=True, dtype=dtype),
        num_experts=self.experts, top_k=self.top_k, score="softmax_of_chosen")
    experts = moe_lib.experts_mlp(f"{name}/experts", self.experts, config.embedding_dim,
                                  config.mlp_hidden_dim, activation="clamped_swiglu",
                                  biases=True, alpha=self.alpha, limit=self.limit, dtype=dtype)
    return moe_lib.MixtureOfExperts(router=router, experts=experts)


def _format_error(message: str) -> Exception:
  from pz_persist.pretrained import safetensors_io  # pylint: disable=import-outside-toplevel
  return safetensors_io.SafetensorsFormatError(message)


def read_config(cfg: Config, weights: weights_lib.Weights) -> GptOssMoe:
  """Reads (and checks) the experts' fields and ``quantization_config``."""
  experts = cfg.get("num_local_experts", 128)
  top_k = cfg.get("num_experts_per_tok", 4)
  legacy = cfg.get("experts_per_token")  # The Hub's configs repeat it; transformers ignores it.
  if legacy is not None and legacy != top_k:
    raise cfg.unsupported("experts_per_token", legacy, f"it differs from num_experts_per_tok="
                          f"{top_k}, which transformers uses; the config is inconsistent")
  if top_k > experts:
    raise cfg.unsupported("num_experts_per_tok", top_k,
                          f"at most num_local_experts={experts} experts can be chosen")
  quantized = _quantization(cfg)
  headers = {}
  if quantized is not _never:
    headers = {name: file.entries[name][:2] for name, file in weights.where.items()}
  return GptOssMoe(experts, top_k, float(cfg.get("swiglu_alpha", 1.702)),
                   float(cfg.get("swiglu_limit", 7.0)), quantized, headers, weights.path)


def _never(prefix: str) -> bool:
  del prefix
  return False


def _quantization(cfg: Config) -> Callable[[str], bool]:
  """Which layers' experts are MXFP4, as a function of the layer's prefix:
  all unless ``modules_to_not_convert`` exempts them; no quantization, none.
  Other methods, and unknown keys, are refused naming the field."""
  found = cfg.get("quantization_config")
  if found is None:
    return _never
  method = found.get("quant_method")
  if method != "mxfp4":
    raise cfg.unsupported("quantization_config.quant_method", method,
                          "gpt-oss is read dense or with MXFP4 experts ('mxfp4', as the Hub"
                          " holds it)")
  unknown = sorted(set(found) - _QUANTIZATION_KEYS)
  if unknown:
    raise cfg.unsupported(f"quantization_config.{unknown[0]}", found[unknown[0]],
                          f"the MXFP4 reader knows {sorted(_QUANTIZATION_KEYS)}")
  exempt = found.get("modules_to_not_convert") or []
  if not isinstance(exempt, list) or not all(isinstance(p, str) for p in exempt):
    raise cfg.invalid("quantization_config.modules_to_not_convert", exempt,
                      "a list of module name patterns")

  def quantized(prefix: str) -> bool:
    module = prefix + "mlp.experts"
    return not any(fnmatch.fnmatchcase(module, pattern) or module.startswith(pattern + ".")
                   for pattern in exempt)

  return quantized


def config_fields(model: pz.nn.Layer) -> dict[str, Any]:
  """The experts' fields of an exported model (from its first layer)."""
  layer = all_layers(model, moe_lib.MixtureOfExperts)[0]
  router = layer.router
  gates = all_layers(layer.experts, moe_lib.ClampedSwiGLUGate)
  down = all_layers(layer.experts, pz.nn.Linear)[-1].weights.value.named_shape
  return {"num_local_experts": router.num_experts, "num_experts_per_tok": router.top_k,
          "intermediate_size": down["neurons"], "swiglu_alpha": number(gates[0].alpha),
          "swiglu_limit": number(gates[0].limit)}
