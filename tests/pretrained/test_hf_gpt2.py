"""GPT-2 (``model_type`` ``gpt2``) through `load_hf` and `export_hf`, against
transformers, with the checks of `hf_family_harness`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist import errors
from pz_persist.nn.learned_positions import AddLearnedPositions


def _config(**fields):
  """transformers' GPT-2 config from the harness's shared sizes (GPT-2's own
  names: ``intermediate_size`` is ``n_inner``, which transformers would
  otherwise keep as a field of its own); 16 positions; in-vocabulary ids."""
  fields.setdefault("n_inner", fields.pop("intermediate_size", None))
  return transformers.GPT2Config(**{"n_positions": 16, "bos_token_id": 1, "eos_token_id": 2,
                                    **fields})


def _case(**fields) -> checks.Case:
  return checks.Case(_config, transformers.GPT2LMHeadModel, fields)


CASES = {
    # transformers' defaults: tied head, gelu_new, n_inner = 4 * n_embd, 1/sqrt(d).
    "gpt2": _case(intermediate_size=None),
    # Scores further divided by the layer number, an untied head, exact GELU,
    # a larger epsilon, three layers.
    "gpt2_by_layer": _case(scale_attn_by_inverse_layer_idx=True, tie_word_embeddings=False,
                           activation_function="gelu", layer_norm_epsilon=1e-2,
                           num_hidden_layers=3, intermediate_size=48),
    # Unscaled scores, ReLU, the reordered float32 scores (the same math).
    "gpt2_unscaled": _case(scale_attn_weights=False, activation_function="relu",
                           reorder_and_upcast_attn=True),
}

_FIELDS = ("n_embd", "n_head", "n_layer", "n_inner", "n_positions", "activation_function",
           "layer_norm_epsilon", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
           "tie_word_embeddings")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return checks.saved_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


@pytest.mark.parametrize("case", ["gpt2", pytest.param("gpt2_by_layer", marks=pytest.mark.slow)])
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved, case):
  checks.check_bfloat16(saved[case], case)


@pytest.mark.parametrize("case", ["gpt2", "gpt2_by_layer"])
def test_kv_cache_matches_transformers_cache(saved, case):
  checks.check_kv_cache(pzp.pretrained.load_hf(saved[case].folder))
  checks.check_kv_cache_like_transformers(pzp.pretrained.load_hf(saved[case].folder),
                                          saved[case].hf_model)


@pytest.mark.parametrize("case", ["gpt2", "gpt2_by_layer"])
def test_greedy_generation_matches_generate(saved, case):
  """Penzai's KV-cache sampler, greedy from a 4-token prompt for 10 steps
  (to position 14 of 16), picks transformers' ``generate``'s tokens with
  its logits."""
  checks.check_greedy_generation(saved[case], steps=10)


@pytest.mark.parametrize("case", ["gpt2", "gpt2_by_layer"])
def test_save_model_round_trip(saved, tmp_path, case):
  checks.check_save_model(saved[case], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "gpt2", same_fields=_FIELDS)


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  checks.check_cli_export_from_native(saved["gpt2_by_layer"], tmp_path)


def test_scaling_by_the_layer_number_binds(saved):
  checks.check_feature_binds(saved["gpt2_by_layer"], CASES["gpt2_by_layer"],
                             scale_attn_by_inverse_layer_idx=False)


def test_scaling_by_the_head_size_binds(saved):
  checks.check_feature_binds(saved["gpt2"], CASES["gpt2"], scale_attn_weights=False)


def test_epsilon_and_activation_bind(saved):
  checks.check_feature_binds(saved["gpt2_by_layer"], CASES["gpt2_by_layer"],
                             layer_norm_epsilon=1e-5)
  checks.check_feature_binds(saved["gpt2_by_layer"], CASES["gpt2_by_layer"],
                             activation_function="relu")


def test_learned_positions_bind(saved):
  def without_positions(model):
    with torch.no_grad():
      model.transformer.wpe.weight.zero_()
  checks.check_modules_bind(saved["gpt2"], CASES["gpt2"], "wpe", without_positions)


def test_positions_come_from_the_table_in_sampling(saved):
  """The layer reads the ``token_positions`` side input: the same token at
  two positions gets two rows of the table."""
  model = pzp.pretrained.load_hf(saved["gpt2"].folder)
  layer = pz.select(model).at_instances_of(AddLearnedPositions).get_sequence()
  assert len(layer) == 1 and dict(layer[0].embeddings.value.named_shape) == {
      "positions": 16, "embedding": 32}
  zeros = pz.nx.zeros({"seq": 2, "embedding": 32})
  out = layer[0](zeros, token_positions=pz.nx.wrap(jnp.array([3, 7]), "seq"))
  wpe = saved["gpt2"].hf_model.transformer.wpe.weight.detach().numpy()
  np.testing.assert_array_equal(np.asarray(out.untag("seq", "embedding").unwrap()), wpe[[3, 7]])

  past = layer[0](zeros, token_positions=pz.nx.wrap(jnp.array([15, 16]), "seq"))
  rows = np.asarray(past.untag("seq", "embedding").unwrap())
  np.testing.assert_array_equal(rows[0], wpe[15])
  assert np.isnan(rows[1]).all()  # No row 16: NaN, never row 15 again.


def test_hub_names_without_the_transformer_prefix_load(saved, tmp_path):
  """The Hub's openai-community/gpt2 holds GPT2Model's names (``h.0.``,
  ``wte.weight``) and the causal masks as ``attn.bias`` buffers, with the
  Hub's config (``n_ctx``, the summary fields); transformers reads it, and so
  does `load_hf`."""
  source = saved["gpt2"]
  stored = checks.tensors(source.folder)
  bare = {name.removeprefix("transformer."): value for name, value in stored.items()}
  bare.update({f"h.{i}.attn.bias": np.tril(np.ones((1, 1, 16, 16), np.float32))
               for i in range(2)})
  folder = tmp_path / "hub"
  folder.mkdir()
  safetensors.numpy.save_file(bare, str(folder / "model.safetensors"), metadata={"format": "pt"})
  raw = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
         "attn_pdrop": 0.1, "bos_token_id": 1, "embd_pdrop": 0.1, "eos_token_id": 2,
         "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gpt2",
         "n_ctx": 16, "n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 16,
         "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1,
         "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
         "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
         "vocab_size": 64}
  (folder / "config.json").write_text(__import__("json").dumps(raw))
  hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
  np.testing.assert_array_equal(checks.reference_logits(hf), source.reference)
  checks.check_float32(checks.Saved(folder, hf, source.reference), "gpt2 hub names")
  out = tmp_path / "out"
  pzp.export_hf(pzp.pretrained.load_hf(folder), out, like=folder)
  checks.assert_same_tensors(checks.tensors(out), stored)


@pytest.mark.parametrize("changes, match", [
    ({"add_cross_attention": True}, "add_cross_attention"),
    ({"activation_function": "quick_gelu"}, "activation_function"),
    ({"n_head": 5}, "n_head"),
    ({"n_layer": 10**9}, "n_layer"),
    ({"n_inner": 0}, "n_inner"),
    ({"n_embd": 32.0}, "n_embd"),
    ({"layer_norm_epsilon": -1.0}, "layer_norm_epsilon"),
    ({"scale_attn_weights": "yes"}, "scale_attn_weights"),
    ({"hidden_size": 32}, "hidden_size"),
    ({"gpt2_new_feature": 1}, "gpt2_new_feature"),
])
def test_hostile_configs_are_refused(saved, tmp_path, changes, match, monkeypatch):
  folder = checks.edited(saved["gpt2"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)


def test_a_position_table_other_than_n_positions_is_refused(saved, tmp_path):
  folder = checks.edited(saved["gpt2"].folder, tmp_path, n_positions=32)
  with pytest.raises(errors.PzPersistError, match="wpe"):
    pzp.pretrained.load_hf(folder)
