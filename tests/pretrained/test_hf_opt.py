"""OPT (``model_type`` ``opt``) through `load_hf` and `export_hf`, against
transformers, with the checks of `hf_family_harness`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
import treescope
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.nn.learned_positions import AddLearnedPositions


def _opt_config(intermediate_size: int, **fields):
  """transformers' OPTConfig from the harness's sizes (OPT names the MLP's
  width ``ffn_dim``; an ``intermediate_size`` would be an unknown field)."""
  return transformers.OPTConfig(ffn_dim=intermediate_size, **fields)


def _case(**fields) -> checks.Case:
  return checks.Case(_opt_config, transformers.OPTForCausalLM,
                     dict(max_position_embeddings=16, **fields))


CASES = {
    # opt-125m's layout: pre-norm, final LayerNorm, biases, ReLU, tied head.
    "opt": _case(),
    # opt-350m's: post-norm, no final norm, narrower embeddings with project_in / project_out.
    "opt_350m": _case(do_layer_norm_before=False, word_embed_proj_dim=16),
    # No biases, norms without weights, GELU, an untied head.
    "opt_plain": _case(enable_bias=False, layer_norm_elementwise_affine=False,
                       activation_function="gelu", tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


@pytest.mark.parametrize("case", ["opt", "opt_350m"])
def test_kv_cache_sampling_matches_the_forward_pass(saved, case):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved[case].folder))


@pytest.mark.parametrize("case", ["opt", "opt_350m"])
def test_greedy_kv_cache_generation_matches_transformers_generate(saved, case):
  checks.check_generate(saved[case], steps=8)


def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["opt"], "opt")


def test_a_bfloat16_folder_exports_bit_for_bit(tmp_path):
  checks.check_bfloat16_export(CASES["opt_350m"], tmp_path)


def test_positions_past_the_table_give_nan_not_another_row(saved):
  """16 positions are held (max_position_embeddings); the 17th has no row:
  NaN (which attention spreads to the whole call), never the last row reused (JAX's clamping gather)."""
  model = pzp.pretrained.load_hf(saved["opt"].folder)
  tokens = np.tile(checks.SEQUENCES[:1], (1, 2))[:, :17]
  assert np.isfinite(checks.penzai_logits(model, tokens[:, :16])).all()
  assert np.isnan(checks.penzai_logits(model, tokens)[:, 16]).all()


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["opt_350m"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "opt", same_fields=(
      "do_layer_norm_before", "word_embed_proj_dim", "enable_bias",
      "layer_norm_elementwise_affine", "activation_function", "tie_word_embeddings",
      "max_position_embeddings", "ffn_dim"))


@pytest.mark.parametrize("case, off", [
    ("opt", {"activation_function": "gelu"}),
    ("opt_plain", {"activation_function": "relu"}),
])
def test_each_feature_binds(saved, case, off):
  checks.check_feature_binds(saved[case], CASES[case], **off)


@pytest.mark.parametrize("case, off", [
    ("opt", {"do_layer_norm_before": False}),
    ("opt_350m", {"do_layer_norm_before": True}),
    ("opt", {"_remove_final_layer_norm": True}),
])
def test_each_norm_layout_binds(saved, case, off):
  """The norm layout flipped (the same weights; the final norm dropped, or
  added at its initial value): transformers' logits move."""
  model = CASES[case].model_cls(CASES[case].config(**off))
  model.load_state_dict(saved[case].hf_model.state_dict(), strict=False)
  changed = float(np.abs(checks.reference_logits(model.eval()) - saved[case].reference).max())
  print(f"with {off}: logits change by {changed:.3g}")
  assert changed > 100 * checks.TOLERANCE["atol"]


def test_the_position_offset_binds(saved):
  """Read at rows p instead of p + 2, transformers' logits move: a loader
  without OPT's offset would fail the float32 check."""
  model = pzp.pretrained.load_hf(saved["opt"].folder)
  shifted = (pz.select(model).at_instances_of(AddLearnedPositions)
             .apply(lambda layer: type(layer)(embeddings=layer.embeddings, offset=0)))
  changed = float(np.abs(checks.penzai_logits(shifted) - saved["opt"].reference).max())
  print(f"without the offset: logits change by {changed:.3g}")
  assert changed > 100 * checks.TOLERANCE["atol"]


def test_the_norm_weights_and_positions_bind(saved):
  """A norm's weight or the position table zeroed in transformers moves its logits."""
  def no_positions(model):
    with torch.no_grad():
      model.model.decoder.embed_positions.weight.zero_()
  checks.check_modules_bind(saved["opt"], CASES["opt"], "the learned positions", no_positions)


@pytest.mark.parametrize("changes, match", [
    ({"activation_function": "quick_gelu"}, "activation_function"),
    ({"do_layer_norm_before": "yes"}, "do_layer_norm_before"),
    ({"enable_bias": 1}, "enable_bias"),
    ({"word_embed_proj_dim": 0}, "word_embed_proj_dim"),
    ({"ffn_dim": 64.0}, "ffn_dim"),
    ({"num_attention_heads": 5}, "num_attention_heads"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"opt_new_feature": 1}, "opt_new_feature"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, changes, match,
                                                              monkeypatch):
  folder = checks.edited(saved["opt"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)


def test_a_position_table_of_the_wrong_size_is_refused(saved, tmp_path):
  """max_position_embeddings disagreeing with the stored table: refused, named."""
  folder = checks.edited(saved["opt"].folder, tmp_path, max_position_embeddings=32)
  with pytest.raises(pzp.errors.PzPersistError, match="embed_positions"):
    pzp.pretrained.load_hf(folder)


_OPT_125M = {  # facebook/opt-125m, shrunk.
    "_remove_final_layer_norm": False, "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 64,
    "hidden_size": 32, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 16,
    "model_type": "opt", "num_attention_heads": 4, "num_hidden_layers": 2, "pad_token_id": 1,
    "prefix": "</s>", "torch_dtype": "float16", "transformers_version": "4.21.0.dev0",
    "use_cache": True, "vocab_size": 64, "word_embed_proj_dim": 32}


def test_hub_config(tmp_path):
  checks.check_float32(checks.hub_saved(tmp_path, _OPT_125M), "opt-125m")


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  checks.check_cli_export_from_native(saved["opt_350m"], tmp_path)


def test_learned_positions_render_in_treescope(saved):
  text = treescope.render_to_text(pzp.pretrained.load_hf(saved["opt"].folder))
  assert "AddLearnedPositions" in text and "offset=2" in text
