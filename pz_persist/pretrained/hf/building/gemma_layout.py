"""What Gemma 2's layout shares with Gemma 3 and 4: the activation check
(`check_activation`) and the fields written back from a model (the query
scaling, the soft caps)."""

from __future__ import annotations

from typing import Any

import numpy as np
from penzai import pz

from pz_persist.pretrained.hf.config import TANH_GELU
from pz_persist.pretrained.hf.config import Config
from pz_persist.pretrained.hf.config_from_model import all_layers
from pz_persist.pretrained.hf.config_from_model import attention
from pz_persist.pretrained.hf.config_from_model import first_layer
from pz_persist.pretrained.hf.config_from_model import number


def check_activation(cfg: Config) -> None:
  """Refuses an MLP activation other than the tanh GELU.

  transformers reads ``hidden_activation`` for Gemma 2 (and for Gemma
  before version 5), ``hidden_act`` for Gemma since version 5, where its
  value "gelu" is the legacy name of the tanh GELU that the Gemma releases
  carry. Both are checked, so no version of transformers would compute
  another activation for this config.
  """
  why = "; Penzai's Gemma MLP is GeGLU with the tanh approximation of GELU"
  cfg.expect("hidden_act", TANH_GELU | {"gelu"}, "gelu_pytorch_tanh", why=why)
  cfg.expect("hidden_activation", TANH_GELU, "gelu_pytorch_tanh", why=why)


def query_pre_attn_scalar(model: pz.nn.Layer) -> int | float:
  """Gemma 2 and 3 scale queries by ``query_pre_attn_scalar ** -0.5``."""
  rescale = first_layer(attention(model).input_to_query, pz.nn.ConstantRescale, "query scaling")
  scalar = float(np.asarray(rescale.by, np.float64)) ** -2
  return round(scalar) if abs(scalar - round(scalar)) < 1e-3 * scalar else scalar


def soft_cap_fields(model: pz.nn.Layer) -> dict[str, Any]:
  """Gemma 2's soft caps, written when absent too: a null cap is "off", an
  absent one a default."""
  caps = all_layers(attention(model), pz.nn.TanhSoftCap)
  top = [layer for layer in model.body.sublayers if isinstance(layer, pz.nn.TanhSoftCap)]
  return {"attn_logit_softcapping": number(caps[0].soft_cap) if caps else None,
          "final_logit_softcapping": number(top[-1].soft_cap) if top else None}
