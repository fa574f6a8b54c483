"""Apertus (``model_type`` ``apertus``) through `load_hf` and `export_hf`,
against transformers, with the checks of `hf_family_harness`: a non-gated
xIELU MLP (`pz_persist.nn.xielu.XIELU`), per-head query/key norms, llama3
RoPE by default; each shown to bind."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.nn.xielu import XIELU

_SIZES = {"num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2,
          "max_position_embeddings": 64}

CASES = {
    # transformers' defaults: llama3 RoPE (base 12e6, factor 8, original 8192).
    "apertus": checks.Case(transformers.ApertusConfig, transformers.ApertusForCausalLM, _SIZES),
    # Attention biases, tied embeddings, plain RoPE, multi-head attention.
    "apertus_bias_tied": checks.Case(
        transformers.ApertusConfig, transformers.ApertusForCausalLM,
        {**_SIZES, "num_key_value_heads": 4, "attention_bias": True, "tie_word_embeddings": True,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}}),
}


def _with_own_beta_and_eps(model):
  """transformers keeps ``beta`` / ``eps`` as buffers (not redrawn by the
  harness): set to other values, so reading them is checked too. (xIELU
  jumps by about ``alpha_n * |eps|`` at zero, so a larger ``eps`` would turn
  float32 rounding of an input near zero into a visible difference.)"""
  with torch.no_grad():
    for i, layer in enumerate(model.model.layers):
      layer.mlp.act_fn.beta.fill_(0.4 + 0.1 * i)
      layer.mlp.act_fn.eps.fill_(-1e-5)
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  result = {}
  for name, case in CASES.items():
    model = _with_own_beta_and_eps(case.make())
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder, safe_serialization=True)
    result[name] = checks.Saved(folder, model, checks.reference_logits(model))
  return result


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(saved, case):
  checks.check_float32(saved[case], case)


def test_bfloat16_is_as_close_as_transformers_bfloat16(saved):
  checks.check_bfloat16(saved["apertus"], "apertus")


@pytest.mark.parametrize("case", CASES)
def test_kv_cache_and_greedy_generation_match_generate(saved, case):
  model = pzp.pretrained.load_hf(saved[case].folder)
  checks.check_kv_cache(model)
  checks.check_generate(saved[case], steps=6)


def test_save_model_round_trip(saved, tmp_path):
  checks.check_save_model(saved["apertus"], tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_export_hf_round_trip(saved, tmp_path, case):
  checks.check_export(saved[case], tmp_path, "apertus",
                      same_fields=("hidden_act", "attention_bias", "tie_word_embeddings",
                                   "rope_parameters", "num_key_value_heads"))


def test_cli_export_from_a_native_checkpoint(saved, tmp_path):
  checks.check_cli_export_from_native(saved["apertus"], tmp_path)


def test_the_activation_holds_each_layers_own_values(saved):
  model = pzp.pretrained.load_hf(saved["apertus"].folder)
  layers = pz.select(model).at_instances_of(XIELU).get_sequence()
  assert len(layers) == 2
  for i, (layer, theirs) in enumerate(zip(layers, saved["apertus"].hf_model.model.layers)):
    assert float(layer.alpha_p.value.unwrap()) == float(theirs.mlp.act_fn.alpha_p[0])
    assert float(layer.alpha_n.value.unwrap()) == float(theirs.mlp.act_fn.alpha_n[0])
    assert float(layer.beta.value.unwrap()) == pytest.approx(0.4 + 0.1 * i)
    x = np.linspace(-4, 4, 33, dtype=np.float32)
    ours = np.asarray(layer(pz.nx.wrap(jnp.asarray(x), "neurons")).unwrap("neurons"))
    with torch.no_grad():
      want = theirs.mlp.act_fn(torch.tensor(x)).numpy()
    np.testing.assert_allclose(ours, want, atol=1e-6, rtol=1e-6)


def _edit(what):
  def edit(model):
    with torch.no_grad():
      for layer in model.model.layers:
        if what == "alpha":
          layer.mlp.act_fn.alpha_p.add_(0.5)
        elif what == "beta":
          layer.mlp.act_fn.beta.fill_(0.5)
        else:
          layer.self_attn.q_norm = torch.nn.Identity()
          layer.self_attn.k_norm = torch.nn.Identity()
  return edit


@pytest.mark.parametrize("what", ["alpha", "beta", "qk_norm"])
def test_each_feature_binds(saved, what):
  def run(model):
    _with_own_beta_and_eps(model)
    _edit(what)(model)
  checks.check_modules_bind(saved["apertus"], CASES["apertus"], what, run)


def test_a_file_without_rope_fields_loads_transformers_default_rope(saved, tmp_path):
  """``ApertusConfig`` gives a file without RoPE fields llama3 RoPE (base
  12e6, factor 8...); the saved case is that default, and the base binds."""
  assert checks.config(saved["apertus"].folder)["rope_parameters"]["rope_type"] == "llama3"
  folder = checks.edited(saved["apertus"].folder, tmp_path, rope_parameters=checks.DELETE)
  checks.float32_error(folder, saved["apertus"].reference)
  checks.check_feature_binds(saved["apertus"], CASES["apertus"],
                             rope_parameters={"rope_type": "default", "rope_theta": 1e4})


@pytest.mark.parametrize("changes,match", [
    ({"hidden_act": "relu2"}, "hidden_act"),
    ({"hidden_act": "silu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers|layers"),
    ({"rope_parameters": {"rope_type": "longrope"}}, "rope_type"),
    ({"qk_norm": False}, "qk_norm"),
])
def test_hostile_configs_refused_before_building(saved, tmp_path, monkeypatch, changes, match):
  folder = checks.edited(saved["apertus"].folder, tmp_path, **changes)
  checks.check_refused_before_building(folder, match, monkeypatch)


def test_surgery_lora_an_inserted_layer_and_treescope_around_xielu(saved, tmp_path):
  """Issue 40 §3: the xIELU activation is a Penzai layer others can edit
  around. LoRA on the MLP's projections (zero-initialised: nothing changes),
  a layer inserted after each activation (the logits move), treescope showing
  its parameters, and ``save_model`` bringing the edited model back exactly."""
  import jax
  import treescope
  from penzai.toolshed import lora

  model = pzp.pretrained.load_hf(saved["apertus"].folder)
  reference = checks.penzai_logits(model)
  adapted = lora.loraify_linears_in_selection(
      pz.select(model).at_instances_of(pz.nn.Linear).where(
          lambda layer: "mlp" in str(layer.weights.label)),
      rank=2, init_base_rng=jax.random.key(3))
  assert pz.select(adapted).at_instances_of(lora.LowRankAdapter).count() == 4
  np.testing.assert_allclose(checks.penzai_logits(adapted), reference, atol=1e-6)
  inserted = pz.select(adapted).at_instances_of(XIELU).apply(
      lambda activation: pz.nn.Sequential([activation, pz.nn.ConstantRescale(by=0.5)]))
  assert float(np.abs(checks.penzai_logits(inserted) - reference).max()) > 1e-2
  text = treescope.render_to_text(pz.select(inserted).at_instances_of(XIELU).get_sequence()[0])
  assert "XIELU" in text and "alpha_p" in text and "beta" in text
  checks.check_save_model_round_trip(inserted, tmp_path / "edited",
                                     checks.penzai_logits(inserted))
