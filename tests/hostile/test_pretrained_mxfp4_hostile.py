"""Hostile MXFP4 storage (gpt-oss's experts as the Hub holds them): every
damaged or forged variant is refused with a `PzPersistError` naming the
tensor, through `load_hf` and ``pz-persist convert hf``, before any tensor is
read when the headers show it (a NaN scale, which only the data shows, is
refused when read, and nothing is returned).

The folders are written with NumPy alone (a one-layer gpt-oss of width 32,
whose experts are MXFP4 blocks and scales), so no torch is needed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_python

import pz_persist as pzp
from pz_persist.pretrained import errors
from pz_persist.pretrained import safetensors_io
from pz_persist.pretrained.hf import quantized_mxfp4

H, N, E, HEADS, KV, D, VOCAB = 32, 32, 2, 2, 1, 8, 16

CONFIG = {
    "model_type": "gpt_oss", "hidden_size": H, "intermediate_size": N, "num_hidden_layers": 1,
    "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": D, "vocab_size": VOCAB,
    "num_local_experts": E, "num_experts_per_tok": 1, "layer_types": ["full_attention"],
    "quantization_config": {"quant_method": "mxfp4",
                            "modules_to_not_convert": ["model.layers.*.self_attn"]},
}


def tensors() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  r = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
  s = "model.layers.0."
  out = {"model.embed_tokens.weight": r(VOCAB, H), "model.norm.weight": r(H),
         "lm_head.weight": r(VOCAB, H), s + "input_layernorm.weight": r(H),
         s + "post_attention_layernorm.weight": r(H), s + "self_attn.sinks": r(HEADS),
         s + "mlp.router.weight": r(E, H), s + "mlp.router.bias": r(E),
         s + "mlp.experts.gate_up_proj_bias": r(E, 2 * N),
         s + "mlp.experts.down_proj_bias": r(E, H)}
  for name, rows in (("q_proj", HEADS * D), ("k_proj", KV * D), ("v_proj", KV * D)):
    out[s + f"self_attn.{name}.weight"], out[s + f"self_attn.{name}.bias"] = r(rows, H), r(rows)
  out[s + "self_attn.o_proj.weight"], out[s + "self_attn.o_proj.bias"] = r(H, HEADS * D), r(H)
  for name, shape in (("gate_up_proj", (E, H, 2 * N)), ("down_proj", (E, N, H))):
    blocks, scales = quantized_mxfp4.quantize(r(*shape))
    out[s + f"mlp.experts.{name}_blocks"], out[s + f"mlp.experts.{name}_scales"] = blocks, scales
  return out


def folder(path, config=None, stored=None):
  path.mkdir(parents=True)
  (path / "config.json").write_text(json.dumps(CONFIG if config is None else config))
  safetensors_io.write_safetensors(path / "model.safetensors",
                                   tensors() if stored is None else stored)
  return path


@pytest.fixture
def no_reads(monkeypatch):
  def refuse(self, name, dtype=None, **kwargs):
    raise AssertionError(f"tensor {name!r} was read before the checks")
  monkeypatch.setattr(safetensors_io.SafetensorsFile, "get", refuse)


def test_the_quantised_folder_loads(tmp_path):
  with pytest.warns(errors.DequantizedWeightsWarning, match="MXFP4"):
    pzp.pretrained.load_hf(folder(tmp_path / "ok"))


_GATE = "model.layers.0.mlp.experts.gate_up_proj"
_DOWN = "model.layers.0.mlp.experts.down_proj"


def _changed(**changes):
  stored = tensors()
  for name, value in changes.items():
    if value is None:
      stored.pop(name)
    else:
      stored[name] = value
  return stored


@pytest.mark.parametrize("stored, match", [
    (_changed(**{_DOWN + "_scales": None}), "down_proj_scales"),
    (_changed(**{_GATE + "_blocks": np.zeros((E, 2 * N, 1, 8), np.uint8)}), "gate_up_proj_blocks"),
    (_changed(**{_GATE + "_blocks": np.zeros((E, 2 * N, 1, 16), np.int8)}), "gate_up_proj_blocks"),
    (_changed(**{_GATE + "_scales": np.zeros((E, 2 * N, 1), np.float32)}), "gate_up_proj_scales"),
    (_changed(**{_GATE + "_scales": np.zeros((E, 2 * N, 10**4), np.uint8)}), "gate_up_proj_scales"),
    (_changed(**{_GATE: np.zeros((E, H, 2 * N), np.float32)}), "one layout or the other"),
])
def test_forged_storage_is_refused_before_reading(tmp_path, no_reads, stored, match):
  with pytest.raises(errors.PzPersistError, match=match):
    pzp.pretrained.load_hf(folder(tmp_path / "f", stored=stored))


@pytest.mark.parametrize("config, match", [
    (dict(CONFIG, quantization_config={"quant_method": "fp8"}), "quant_method"),
    (dict(CONFIG, quantization_config={"quant_method": "mxfp4", "block_size": 16}),
     "block_size"),
    (dict(CONFIG, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [1]}),
     "modules_to_not_convert"),
    (dict(CONFIG, quantization_config="mxfp4"), "quantization_config"),
])
def test_unsupported_quantization_configs_are_refused(tmp_path, no_reads, config, match):
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder(tmp_path / "f", config=config))


def test_a_nan_scale_is_refused_when_read(tmp_path):
  stored = tensors()
  stored[_DOWN + "_scales"] = np.full_like(stored[_DOWN + "_scales"], 255)
  with pytest.raises(errors.SafetensorsFormatError, match=r"255.*NaN"):
    pzp.pretrained.load_hf(folder(tmp_path / "f", stored=stored))


def test_convert_hf_refuses_forged_storage(tmp_path):
  path = folder(tmp_path / "f", stored=_changed(**{_DOWN + "_scales": None}))
  out = run_python(f"""
      import sys
      from pz_persist.tools import cli
      sys.stderr = sys.stdout
      code = cli.main(["convert", "hf", {str(path)!r}, {str(tmp_path / 'out')!r}, "--quiet"])
      print("EXIT", code)
      """, timeout=120)
  assert "EXIT 2" in out and "down_proj_scales" in out
  assert not (tmp_path / "out").exists()
