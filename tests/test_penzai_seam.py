"""The contract of every private Penzai name pz_persist touches (`penzai_seam`).

Each test names the Penzai symbol it holds and says what pz_persist relies
on, so a failure after a Penzai upgrade reads as "Penzai changed X, which
pz_persist uses for Y" rather than as a failure somewhere in `load_gemma`.
That no other module touches a private Penzai name is held by
tests/test_layout.py.
"""

from __future__ import annotations

import dataclasses
import doctest
import pathlib
import tomllib

import numpy as np
import penzai
import pytest
from penzai.models.transformer.variants import gemma as pz_gemma
from penzai.models.transformer.variants import llamalike_common

from pz_persist import penzai_seam

PACKAGE = pathlib.Path(penzai_seam.__file__).parent


def _broken(symbol: str, relied_on: str) -> str:
  return (
      f"penzai {penzai.__version__} changed {symbol}, which pz_persist relies on"
      f" for {relied_on}: update pz_persist/penzai_seam.py (and the supported"
      " range in pyproject.toml)."
  )


def test_the_seam_supports_what_pyproject_declares():
  project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
  assert f"penzai{penzai_seam.SUPPORTED_PENZAI}" in project["dependencies"]


def test_the_docstring_examples_run():
  results = doctest.testmod(penzai_seam, raise_on_error=False)
  assert results.attempted >= 2 and results.failed == 0


def test_gemma_presets_are_config_keywords_by_name():
  """load_gemma infers, names and reports presets from this table."""
  relied_on = "load_gemma's presets (pretrained.gemma)"
  try:
    presets = penzai_seam.gemma_presets()
  except AttributeError as e:
    pytest.fail(f"{_broken('gemma._GEMMA_PRESETS', relied_on)}\n{e}")
  fields = {f.name for f in dataclasses.fields(llamalike_common.LlamalikeTransformerConfig)}
  assert {"gemma_2b", "gemma_7b", "gemma2_2b", "gemma2_9b", "gemma2_27b"} <= set(presets), (
      _broken("gemma._GEMMA_PRESETS (its names)", relied_on))
  for name, kwargs in presets.items():
    assert set(kwargs) <= fields, _broken(f"gemma._GEMMA_PRESETS[{name!r}]", relied_on)
    for key in ("num_decoder_blocks", "vocab_size", "num_kv_heads", "query_head_multiplier",
                "embedding_dim", "projection_dim", "mlp_hidden_dim"):
      assert isinstance(kwargs[key], int), _broken(f"gemma._GEMMA_PRESETS[{name!r}]", relied_on)


def test_the_seam_reads_penzai_tables_live_and_never_writes_them():
  """Tests (and users) add presets to Penzai's table; load_gemma sees them."""
  pz_gemma._GEMMA_PRESETS["seam_probe"] = {}  # pylint: disable=protected-access
  try:
    assert "seam_probe" in penzai_seam.gemma_presets()
  finally:
    del pz_gemma._GEMMA_PRESETS["seam_probe"]  # pylint: disable=protected-access
  with pytest.raises(TypeError):
    penzai_seam.gemma_presets()["x"] = {}  # type: ignore[index]


def test_gating_layouts_are_booleans_for_every_preset():
  """load_gemma takes a square MLP's gating layout from its ``like`` preset."""
  relied_on = "the gating layout of square MLPs (pretrained.gemma)"
  try:
    gating = penzai_seam.gemma_gating_transposed()
  except AttributeError as e:
    pytest.fail(f"{_broken('gemma._NEEDS_GATING_TRANSPOSE', relied_on)}\n{e}")
  assert set(gating) == set(penzai_seam.gemma_presets()), _broken(
      "gemma._NEEDS_GATING_TRANSPOSE (its names)", relied_on)
  assert all(isinstance(v, bool) for v in gating.values()), _broken(
      "gemma._NEEDS_GATING_TRANSPOSE (its values)", relied_on)
  assert gating["gemma2_9b"] and not gating["gemma2_2b"]


def test_the_converter_reads_its_presets_from_module_globals():
  """The custom-preset converter swaps the globals these names are read from."""
  names = pz_gemma.gemma_from_pretrained_checkpoint.__code__.co_names
  relied_on = "custom Gemma presets (pretrained.gemma)"
  assert "_GEMMA_PRESETS" in names, _broken("gemma_from_pretrained_checkpoint", relied_on)
  assert "_NEEDS_GATING_TRANSPOSE" in names, _broken(
      "gemma_from_pretrained_checkpoint", relied_on)


def _tiny_params(transposed: bool) -> dict[str, dict[str, np.ndarray]]:
  """The arrays of a one-layer Gemma 1 checkpoint, embedding 4, MLP 6."""
  rng = np.random.default_rng(0)

  def w(*shape):
    return rng.normal(size=shape).astype(np.float32)

  gating = w(2, 6, 4) if transposed else w(2, 4, 6)
  return {
      "transformer/embedder": {"input_embedding": w(8, 4)},
      "transformer/final_norm": {"scale": w(4)},
      "transformer/layer_0/attn/q_einsum": {"w": w(1, 4, 2)},
      "transformer/layer_0/attn/kv_einsum": {"w": w(2, 1, 4, 2)},
      "transformer/layer_0/attn/attn_vec_einsum": {"w": w(1, 2, 4)},
      "transformer/layer_0/mlp/gating_einsum": {"w": gating},
      "transformer/layer_0/mlp/linear": {"w": w(6, 4)},
      "transformer/layer_0/pre_attention_norm": {"scale": w(4)},
      "transformer/layer_0/pre_ffw_norm": {"scale": w(4)},
  }


@pytest.mark.parametrize("transposed", [False, True])
def test_a_converter_with_a_custom_preset_builds_it_and_writes_nothing(transposed):
  """load_gemma's custom presets (models of other sizes) go through this."""
  before = (dict(pz_gemma._GEMMA_PRESETS),  # pylint: disable=protected-access
            dict(pz_gemma._NEEDS_GATING_TRANSPOSE))  # pylint: disable=protected-access
  kwargs = {"num_decoder_blocks": 1, "vocab_size": 8, "num_kv_heads": 1,
            "query_head_multiplier": 1, "embedding_dim": 4, "projection_dim": 2,
            "mlp_hidden_dim": 6}
  convert = penzai_seam.gemma_converter_with_preset("seam_tiny", kwargs, transposed)
  model = convert(_tiny_params(transposed), preset_name="seam_tiny")
  after = (dict(pz_gemma._GEMMA_PRESETS),  # pylint: disable=protected-access
           dict(pz_gemma._NEEDS_GATING_TRANSPOSE))  # pylint: disable=protected-access
  assert after == before  # Nothing of Penzai's was written.
  shapes = {param.label: dict(param.value.named_shape)
            for param in penzai.pz.unbind_params(model)[1]}
  assert {"embedding": 4, "neurons": 6} in shapes.values()  # The preset's sizes.
  assert any(shape.get("vocabulary") == 8 for shape in shapes.values())
