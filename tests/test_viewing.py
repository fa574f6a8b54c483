"""Looking at checkpoints and models with treescope."""

from __future__ import annotations

import model_zoo
import treescope

import pz_persist as pzp


def test_inspect_renders_labels_axes_shapes_dtypes(ckpt):
  pzp.save_model(ckpt, model_zoo.gemma_style_transformer())
  text = treescope.render_to_text(pzp.inspect(ckpt))
  assert "label='gemma/block_0/attention/query.weights'" in text
  assert "bfloat16(| embedding:32, heads:2, query_heads:2, projection:8)" in text or (
      "embedding:32" in text and "bfloat16" in text
  )
  assert "ShapeDtypeStruct" in text


def test_render_html_of_a_model_and_of_a_checkpoint(ckpt, tmp_path):
  model = model_zoo.mlp()
  pzp.save_model(ckpt, model)
  out = pzp.render_html(model, tmp_path / "model.html")
  assert out.exists() and "mlp/Affine_0/Linear.weights" in out.read_text()
  with_arrays = pzp.render_html(ckpt, tmp_path / "ckpt.html").read_text()
  without = pzp.render_html(str(ckpt), tmp_path / "abstract.html", arrays=False).read_text()
  assert "ShapeDtypeStruct" in without and "ShapeDtypeStruct" not in with_arrays
