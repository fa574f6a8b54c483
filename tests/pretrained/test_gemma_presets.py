"""load_gemma with ``preset={"like": ...}``: settings the checkpoint cannot
show (the gating layout of a square MLP, attention windows, soft caps) are
never guessed silently; those taken from the preset are logged and reported
(`GemmaReport`)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from penzai.models.transformer.variants import llamalike_common

from pretrained.test_gemma import GEMMA1
from pretrained.test_gemma import GEMMA2
from pretrained.test_gemma import logits
from pretrained.test_gemma import official_params
from pretrained.test_gemma import reference
from pretrained.test_gemma import values
from pretrained.test_gemma import write
from pz_persist.pretrained import GemmaReport
from pz_persist.pretrained import errors
from pz_persist.pretrained import load_gemma

# embedding_dim == mlp_hidden_dim: the gating array's shape does not show
# whether it is stored transposed (as gemma2_9b and gemma2_27b store it).
SQUARE = dict(GEMMA2, mlp_hidden_dim=GEMMA2["embedding_dim"])
LOGGER = "pz_persist.pretrained.gemma"


@pytest.fixture(scope="module")
def square_transposed(tmp_path_factory):
  params = official_params(SQUARE, gemma2=True, transposed_gating=True)
  return params, write(tmp_path_factory.mktemp("square") / "ckpt", params)


def test_square_mlp_follows_the_like_presets_gating_layout(square_transposed, caplog):
  """Was: the layout was guessed "not transposed" and logits were off."""
  params, path = square_transposed
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    model, report = load_gemma(path, preset={"like": "gemma2_9b"}, report=True)
  np.testing.assert_array_equal(logits(model), logits(reference(params, SQUARE, "gemma2_9b", True)))
  setting = report.settings["needs_gating_transpose"]
  assert (setting.value, setting.source) == (True, "preset")
  assert "needs_gating_transpose=True" in caplog.text


def test_square_mlp_without_a_preset_to_follow_is_refused(square_transposed):
  params, path = square_transposed
  settings = dict(SQUARE.items())  # Every size, no "like".
  with pytest.raises(errors.GemmaCheckpointError, match="needs_gating_transpose") as info:
    load_gemma(path, preset=settings)
  assert "square" in str(info.value)
  model = load_gemma(path, preset={**settings, "needs_gating_transpose": True})
  norms = dict(SQUARE, use_post_attn_norm=True, use_post_ffw_norm=True)  # Penzai's defaults else.
  np.testing.assert_array_equal(logits(model), logits(reference(params, norms, "gemma_2b", True)))


def test_gating_layout_contradicting_the_shapes_is_refused(tmp_path):
  path = write(tmp_path / "ckpt", official_params(GEMMA2, gemma2=True, transposed_gating=True))
  with pytest.raises(errors.GemmaCheckpointError, match="needs_gating_transpose=False"):
    load_gemma(path, preset={"like": "gemma2_9b", "needs_gating_transpose": False})
  with pytest.raises(errors.GemmaCheckpointError, match="needs_gating_transpose.*True or False"):
    load_gemma(path, preset={"like": "gemma2_9b", "needs_gating_transpose": "yes"})


def test_settings_taken_from_the_preset_are_logged_and_reported(tmp_path, caplog):
  path = write(tmp_path / "ckpt", official_params(GEMMA2, gemma2=True))
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    _, report = load_gemma(path, preset={"like": "gemma2_2b"}, report=True)
  assert isinstance(report, GemmaReport)
  window = llamalike_common.AttentionTypeSlidingWindowCausal(4096)
  assert report.from_preset["attention_type"][0] == window
  assert report.from_preset["final_logit_softcap"] == 30.0
  assert report.from_preset["attn_logits_soft_cap"] == 50.0
  assert report.settings["embedding_dim"].source == "checkpoint"
  assert report.settings["needs_gating_transpose"].source == "checkpoint"  # 16 != 24.
  for line in ("attention_type", "4096", "final_logit_softcap=30.0", "attn_logits_soft_cap=50.0",
               "gemma2_2b"):
    assert line in caplog.text, line
  assert "attention_type" in str(report) and "preset" in str(report)


def test_a_setting_given_by_the_caller_is_not_from_the_preset(tmp_path, caplog):
  """A checkpoint with another window: correct only with the window given,
  which is then reported as the caller's."""
  params = official_params(GEMMA2, gemma2=True)
  path = write(tmp_path / "ckpt", params)
  pattern = (llamalike_common.AttentionTypeSlidingWindowCausal(2),
             llamalike_common.AttentionTypeGlobalCausal())
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    model, report = load_gemma(path, preset={"like": "gemma2_2b", "attention_type": pattern},
                               report=True)
  expected = reference(params, dict(GEMMA2, attention_type=pattern), "gemma2_2b")
  np.testing.assert_array_equal(logits(model), logits(expected))
  assert report.settings["attention_type"].source == "caller"
  assert "attention_type" not in report.from_preset
  assert "attention_type" not in caplog.text and "final_logit_softcap" in caplog.text
  # The preset's window would have given other logits: the report matters.
  assert not np.array_equal(logits(load_gemma(path, preset={"like": "gemma2_2b"})),
                            logits(expected))


def test_settings_given_by_the_caller_log_nothing(tmp_path, caplog):
  path = write(tmp_path / "ckpt", official_params(GEMMA1, gemma2=False))
  given = {"attention_type": llamalike_common.AttentionTypeGlobalCausal(),
           "final_logit_softcap": None, "attn_logits_soft_cap": None,
           "query_scaling_factor": "default"}
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    model = load_gemma(path, preset=given)
  assert caplog.text == "" and not isinstance(model, tuple)
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    _, report = load_gemma(path, preset={}, report=True)  # Penzai's defaults, said so.
  assert report.preset == "custom" and set(report.from_preset) == set(given)
  assert "final_logit_softcap=None (from Penzai's default)" in caplog.text


def test_post_norms_come_from_the_checkpoint(tmp_path):
  """A Gemma 2 checkpoint "like" a Gemma 1 preset: its post-norm arrays are
  used (they were silently dropped), the rest is the preset's."""
  params = official_params(GEMMA2, gemma2=True)
  path = write(tmp_path / "ckpt", params)
  model, report = load_gemma(path, preset={"like": "gemma_2b"}, report=True)
  assert report.settings["use_post_ffw_norm"].source == "checkpoint"
  assert sum("post_ffw_norm" in label for label in values(model)) == GEMMA2["num_decoder_blocks"]
  with_norms = dict(GEMMA2, use_post_attn_norm=True, use_post_ffw_norm=True)
  np.testing.assert_array_equal(logits(model), logits(reference(params, with_norms, "gemma_2b")))
  with pytest.raises(errors.GemmaCheckpointError, match="use_post_ffw_norm"):
    load_gemma(path, preset={"like": "gemma2_2b", "use_post_ffw_norm": False})
