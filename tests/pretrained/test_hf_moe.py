"""Qwen3-MoE and Mixtral through `load_hf` and `export_hf`, against
transformers' own models on tiny random mixtures of experts (no downloads).

Each family's checks (issue 28, item 7): float32 logits within 1e-4 on
several sequences (the real error printed), KV-cache sampling equal to a
forward pass, a save_model round trip, export back to the Hub's per-expert
layout bit for bit, hostile configs refused before anything is built, and
each routing feature shown to bind (switched in the reference, the logits
move far beyond the tolerance). Also: transformers 5's fused in-memory
layout (``experts.gate_up_proj``) read as well as the Hub's, and the Hub's
own configs (Qwen3-30B-A3B, Mixtral-8x7B) shrunk.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from penzai import pz

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.pretrained import errors
from pz_persist.nn import mixture_of_experts as moe

_COMMON = {"hidden_size": 32, "num_attention_heads": 4, "vocab_size": 64,
           "num_key_value_heads": 2, "pad_token_id": 0}

CASES = {
    # 4 experts, top 2 not renormalised; head_dim 16 (not hidden / heads);
    # layer 1 dense (mlp_only_layers), layer 2 routed.
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, {
        "num_hidden_layers": 3, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "intermediate_size": 24, "mlp_only_layers": [1]}),
    # Renormalised top 3 of 6, every second layer routed (decoder_sparse_step),
    # a 3-token window on every layer, tied embeddings, attention biases.
    "qwen3_moe_norm": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, {
        "num_hidden_layers": 2, "num_experts": 6, "num_experts_per_tok": 3,
        "norm_topk_prob": True, "decoder_sparse_step": 2, "moe_intermediate_size": 8,
        "intermediate_size": 24, "use_sliding_window": True, "sliding_window": 3,
        "tie_word_embeddings": True, "attention_bias": True}),
    # Mixtral: 4 experts, top 2 renormalised.
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, {
        "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
        "intermediate_size": 24}),
    # A 3-token window, one key/value head, 5 experts top 1.
    "mixtral_window": (transformers.MixtralConfig, transformers.MixtralForCausalLM, {
        "num_hidden_layers": 2, "num_local_experts": 5, "num_experts_per_tok": 1,
        "intermediate_size": 16, "num_key_value_heads": 1, "sliding_window": 3}),
}


def _logits(model, tokens: np.ndarray = checks.SEQUENCES) -> np.ndarray:
  """`checks.penzai_logits`, compiled (a few times faster than eager calls
  for these models, which the suite's time budget needs)."""
  out = jax.jit(lambda m, t: m(t))(pz.freeze_params(model),
                                   pz.nx.wrap(jnp.asarray(tokens), "batch", "seq"))
  return np.asarray(out.untag("batch", "seq", "vocabulary").unwrap().astype(jnp.float32))


def _hf_model(case: str, **changes):
  config_cls, model_cls, fields = CASES[case]
  torch.manual_seed(0)
  return checks.randomized(model_cls(config_cls(**dict(_COMMON, **fields, **changes))))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """``{case: (folder, transformers model, reference float32 logits)}``."""
  result = {}
  for case in CASES:
    model = _hf_model(case)
    folder = tmp_path_factory.mktemp(case)
    model.save_pretrained(folder, safe_serialization=True)
    result[case] = (folder, model, checks.reference_logits(model))
  return result


@pytest.fixture(scope="module")
def loaded(saved):
  return {case: pzp.pretrained.load_hf(folder) for case, (folder, _, _) in saved.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_float32_logits_match_transformers(saved, loaded, case):
  _, _, reference = saved[case]
  logits = _logits(loaded[case])
  assert np.abs(reference).max() > 0.5
  np.testing.assert_allclose(logits, reference, **checks.TOLERANCE)
  print(f"{case}: float32 max abs error {np.abs(logits - reference).max():.2g}")


def test_the_hub_layout_is_read_per_expert(saved, loaded):
  """The folder holds one tensor per expert (the Hub's layout, which
  transformers 5 writes too); the model holds one parameter per projection
  with an ``experts`` axis, and treescope shows the axis."""
  names = checks.tensors(saved["mixtral"][0])
  assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
  params = {p.label: p.value for p in pz.unbind_params(loaded["mixtral"])[1]}
  gate = params["transformer/block_0/mlp/experts/gate.weights"]
  assert gate.named_shape == {"experts": 4, "neurons": 24, "embedding": 32}
  np.testing.assert_array_equal(
      np.asarray(gate.unwrap("experts", "neurons", "embedding"))[3],
      names["model.layers.0.block_sparse_moe.experts.3.w1.weight"])
  assert params["transformer/block_0/mlp/router.weights"].named_shape == {
      "experts": 4, "embedding": 32}
  assert len(pz.select(loaded["qwen3_moe"]).at_instances_of(moe.MixtureOfExperts)
             .get_sequence()) == 2  # Layers 0 and 2; layer 1 is dense.


def test_transformers_fused_layout_is_read_too(saved, loaded, tmp_path):
  """A folder holding transformers 5's in-memory layout (``gate_up_proj``
  ``[experts, 2 * neurons, embedding]``, ``down_proj``) gives the same model."""
  folder, _, reference = saved["qwen3_moe"]
  tensors = checks.tensors(folder)
  fused = {}
  for name, value in tensors.items():
    if ".experts." not in name:
      fused[name] = value
  for i in (0, 2):
    s = f"model.layers.{i}.mlp.experts."
    stack = {part: np.stack([tensors[f"{s}{e}.{part}.weight"] for e in range(4)])
             for part in ("gate_proj", "up_proj", "down_proj")}
    fused[s + "gate_up_proj"] = np.concatenate([stack["gate_proj"], stack["up_proj"]], axis=1)
    fused[s + "down_proj"] = stack["down_proj"]
  (tmp_path / "fused").mkdir()
  safetensors.numpy.save_file(fused, tmp_path / "fused" / "model.safetensors")
  (tmp_path / "fused" / "config.json").write_bytes((folder / "config.json").read_bytes())
  model = pzp.pretrained.load_hf(tmp_path / "fused")
  logits = _logits(model)
  np.testing.assert_array_equal(logits, _logits(loaded["qwen3_moe"]))
  np.testing.assert_allclose(logits, reference, **checks.TOLERANCE)


@pytest.mark.parametrize("case", ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow),
                                  pytest.param("mixtral_window", marks=pytest.mark.slow)])
def test_kv_cache_sampling_matches_a_forward_pass(loaded, case):
  checks.check_kv_cache_sampling(loaded[case])


def test_save_model_round_trip(saved, loaded, tmp_path):
  """`checks.check_save_model_round_trip`, with compiled logits."""
  model = loaded["qwen3_moe_norm"]
  pzp.save_model(tmp_path / "native", model)
  restored = pzp.load_model(tmp_path / "native")
  before = {p.label: p.value for p in pz.unbind_params(model)[1]}
  after = {p.label: p.value for p in pz.unbind_params(restored)[1]}
  assert before.keys() == after.keys()
  for label, value in before.items():
    np.testing.assert_array_equal(np.asarray(after[label].data_array),
                                  np.asarray(value.data_array), err_msg=label)
  assert isinstance(pz.select(restored).at_instances_of(moe.TopKRouter).get_sequence()[0],
                    moe.TopKRouter)
  np.testing.assert_allclose(_logits(restored), saved["qwen3_moe_norm"][2], **checks.TOLERANCE)


@pytest.mark.parametrize("case", list(CASES))
def test_export_gives_back_the_folder(saved, loaded, tmp_path, case):
  """With ``like`` and without (the structure says which family), the
  per-expert tensors written back under their own names, bit for bit."""
  folder = saved[case][0]
  checks.check_export_model(loaded[case], folder, tmp_path / "like")
  config = checks.check_export_model(loaded[case], folder, tmp_path / "alone", like=False)
  original = json.loads((folder / "config.json").read_text())
  for key in ("num_experts_per_tok", "norm_topk_prob", "sliding_window",
              "tie_word_embeddings", "attention_bias"):
    if key in original and key in config:
      assert config[key] == original[key], key


def _reference_with(case, **changes):
  """transformers' logits of the case's weights under a changed config."""
  _, model_cls, fields = CASES[case]
  model = _hf_model(case)
  config = model.config
  for key, value in changes.items():
    setattr(config, key, value)
  changed = model_cls(config)
  changed.load_state_dict(model.state_dict())
  return checks.reference_logits(changed.eval())


@pytest.mark.parametrize("case, changes", [
    ("qwen3_moe_norm", {"norm_topk_prob": False}),  # Renormalisation binds.
    ("qwen3_moe", {"norm_topk_prob": True}),
    ("qwen3_moe", {"num_experts_per_tok": 3}),  # The k binds.
    ("mixtral", {"num_experts_per_tok": 1}),
])
def test_routing_features_bind(saved, case, changes):
  """Switched in the reference, each routing feature moves the logits far
  beyond the tolerance: a loader ignoring it would fail the match above."""
  reference = saved[case][2]
  assert np.abs(_reference_with(case, **changes) - reference).max() > 100 * checks.TOLERANCE[
      "atol"]


def test_window_binds(saved):
  """Mixtral's window (on every layer) changes transformers' logits."""
  reference = saved["mixtral_window"][2]
  unwindowed = _reference_with("mixtral_window", sliding_window=None)
  assert np.abs(unwindowed - reference).max() > 100 * checks.TOLERANCE["atol"]


def test_dense_layers_bind(saved, tmp_path):
  """``mlp_only_layers`` makes layer 1 dense: the folder holds its dense
  MLP, and a config calling it routed is refused for its missing experts."""
  folder = checks.edited(saved["qwen3_moe"][0], tmp_path, mlp_only_layers=[])
  with pytest.raises(errors.SafetensorsFormatError, match="layers.1.mlp.experts.0.gate_proj.weight"):
    pzp.pretrained.load_hf(folder)


QWEN3_30B_A3B_CONFIG = {
    # The Hub's config.json of Qwen/Qwen3-30B-A3B, only the sizes shrunk.
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
    "intermediate_size": 48, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 8,
    "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8,
    "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 64,
}

MIXTRAL_8X7B_CONFIG = {
    # The Hub's config.json of mistralai/Mixtral-8x7B-v0.1, only the sizes shrunk.
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
    "intermediate_size": 16, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 64,
}


@pytest.mark.parametrize("hub_config", [
    pytest.param(QWEN3_30B_A3B_CONFIG, id="Qwen3-30B-A3B"),
    pytest.param(MIXTRAL_8X7B_CONFIG, id="Mixtral-8x7B", marks=pytest.mark.slow)])
def test_the_hubs_configs(tmp_path, hub_config):
  model_cls = getattr(transformers, hub_config["architectures"][0])
  torch.manual_seed(0)
  model = checks.randomized(model_cls(transformers.AutoConfig.for_model(**hub_config)))
  model.save_pretrained(tmp_path, safe_serialization=True)
  (tmp_path / "config.json").write_text(json.dumps(hub_config))
  reference = checks.reference_logits(
      model_cls.from_pretrained(tmp_path, dtype=torch.float32).eval())
  logits = _logits(pzp.pretrained.load_hf(tmp_path))
  np.testing.assert_allclose(logits, reference, **checks.TOLERANCE)
  print(f"{hub_config['architectures'][0]} Hub config: float32 max abs error"
        f" {np.abs(logits - reference).max():.2g}")


@pytest.mark.parametrize("case, changes, match", [
    ("qwen3_moe", {"num_experts": 10**9, "num_local_experts": checks.DELETE}, "num_experts"),
    ("qwen3_moe", {"num_experts": 3}, "num_experts, num_local_experts"),  # Disagree.
    ("qwen3_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ("qwen3_moe", {"mlp_only_layers": [7]}, "mlp_only_layers"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("qwen3_moe", {"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ("qwen3_moe", {"shared_expert_intermediate_size": 8}, "shared_expert_intermediate_size"),
    ("qwen3_moe", {"mlp_bias": True}, "mlp_bias"),
    ("qwen3_moe", {"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ("mixtral", {"num_local_experts": 10**9}, "num_local_experts"),
    ("mixtral", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ("mixtral", {"attention_bias": True}, "attention_bias"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
])
def test_hostile_configs_are_refused_before_anything_is_built(saved, tmp_path, monkeypatch,
                                                              case, changes, match):
  from penzai.models.transformer.variants import llamalike_common  # pylint: disable=import-outside-toplevel

  def never(*args, **kwargs):
    raise AssertionError("the skeleton was built before the config was refused")

  monkeypatch.setattr(llamalike_common, "build_llamalike_transformer", never)
  folder = checks.edited(saved[case][0], tmp_path, **changes)
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    pzp.pretrained.load_hf(folder)
