"""The pretrained loaders never guess a setting the files do not show.

A wrong guess loads without error and computes other logits, the worst
failure a loader can have. For `load_gemma` the class is a custom preset's
settings no array shows: the gating layout of a square MLP follows the
``like`` preset (or must be given), for every preset; Gemma 2's extra norms
follow the arrays. For `load_hf` it is Qwen2's window fields, each checked
for its type before use.
"""

from __future__ import annotations

import numpy as np
import pytest
from penzai.models.transformer.variants import gemma as pz_gemma
from pretrained import test_gemma

import pz_persist as pzp
from hostile.test_pretrained_hostile import CONFIG
from hostile.test_pretrained_hostile import hf_folder
from pz_persist.pretrained import errors


@pytest.mark.parametrize("like", sorted(pz_gemma._NEEDS_GATING_TRANSPOSE))
def test_square_mlp_gating_layout_is_the_like_presets(tmp_path, like):
  gemma2 = like.startswith("gemma2")
  transposed = pz_gemma._NEEDS_GATING_TRANSPOSE[like]
  square = dict(test_gemma.GEMMA2, mlp_hidden_dim=test_gemma.GEMMA2["embedding_dim"])
  params = test_gemma.official_params(square, gemma2=gemma2, transposed_gating=transposed)
  path = test_gemma.write(tmp_path / "ckpt", params)
  model = pzp.pretrained.load_gemma(path, preset={"like": like})
  if "query_scaling_factor" in pz_gemma._GEMMA_PRESETS[like]:  # 27b: from the sizes.
    heads = square["num_kv_heads"] * square["query_head_multiplier"]
    square["query_scaling_factor"] = (square["embedding_dim"] // heads) ** -0.5
  expected = test_gemma.reference(params, square, like, transposed)
  np.testing.assert_array_equal(test_gemma.logits(model), test_gemma.logits(expected))
  sizes_only = {k: square[k] for k in test_gemma.GEMMA2}
  with pytest.raises(errors.GemmaCheckpointError, match="square.*needs_gating_transpose"):
    pzp.pretrained.load_gemma(path, preset=sizes_only)


@pytest.mark.parametrize("field, value", [
    ("use_sliding_window", "true"),
    ("sliding_window", 0),
    ("sliding_window", 3.0),
    ("max_window_layers", 1.5),
    ("max_window_layers", -1),
    ("layer_types", "full_attention"),
    ("layer_types", [1, 2]),
    ("layer_types", ["full_attention"] * 10**4),  # The message shows a few, not all.
    ("use_mrope", "false"),
])
def test_invalid_qwen2_config_values(tmp_path, field, value):
  folder = hf_folder(tmp_path / "f", dict(CONFIG, model_type="qwen2", **{field: value}))
  with pytest.raises(errors.UnsupportedConfigError, match=field) as info:
    pzp.pretrained.load_hf(folder)
  assert "config.json" in str(info.value) and len(str(info.value)) < 1000
