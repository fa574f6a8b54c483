"""`load_gemma` on Gemma 3 checkpoints of the ``gemma`` library.

The library's ``gm.ckpts.save_params(params, path)`` is
``orbax.checkpoint.StandardCheckpointer().save(path, params)`` of the Flax
params as ``model.init`` nests them; the library itself needs Python 3.12
(and could not be installed here), so the checkpoints are written the same
way from a tiny random transformers Gemma 3, laid out as the library's
modules declare their weights (``gemma/gm/nn/_modules.py``): ``q_einsum``
``[heads, embed, head_dim]``, ``kv_einsum`` ``[2, kv_heads, embed,
head_dim]`` (``qkv_einsum`` ``[3, ...]`` when every head has its own key),
``attn_vec_einsum`` ``[heads, head_dim, embed]``, ``mlp/gating_einsum``
``[2, hidden, embed]`` and ``mlp/linear`` ``[hidden, embed]`` as bare
arrays, norms' ``scale`` used as ``1 + scale``. The loaded model must give
transformers' logits for the same weights.
"""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import transformers

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pz_persist.pretrained import errors


def _hf_model(**overrides) -> transformers.Gemma3ForCausalLM:
  torch.manual_seed(0)
  config = transformers.Gemma3TextConfig(**{
      "hidden_size": 32, "num_hidden_layers": 7, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "intermediate_size": 64,
      "query_pre_attn_scalar": 8, "sliding_window": 3, **overrides})
  return checks.randomized(transformers.Gemma3ForCausalLM(config), norm_center=0.0)


def library_params(model: transformers.Gemma3ForCausalLM) -> dict:
  """The params the gemma library's Gemma 3 holds for ``model``'s weights."""
  sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  c = model.config
  heads, kv, hd, embed = (c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                          c.hidden_size)

  def per_head(name: str, count: int) -> np.ndarray:  # [count*hd, embed] -> [count, embed, hd]
    return sd[name].reshape(count, hd, embed).transpose(0, 2, 1)

  tree = {"embedder": {"input_embedding": sd["model.embed_tokens.weight"]},
          "final_norm": {"scale": sd["model.norm.weight"]}}
  for i in range(c.num_hidden_layers):
    s = f"model.layers.{i}."
    q = per_head(s + "self_attn.q_proj.weight", heads)
    k = per_head(s + "self_attn.k_proj.weight", kv)
    v = per_head(s + "self_attn.v_proj.weight", kv)
    attn = {"attn_vec_einsum": {"w": sd[s + "self_attn.o_proj.weight"].T.reshape(heads, hd, embed)},
            "_query_norm": {"scale": sd[s + "self_attn.q_norm.weight"]},
            "_key_norm": {"scale": sd[s + "self_attn.k_norm.weight"]}}
    if kv == heads:
      attn["qkv_einsum"] = {"w": np.stack([q, k, v])}
    else:
      attn["q_einsum"], attn["kv_einsum"] = {"w": q}, {"w": np.stack([k, v])}
    tree[f"layer_{i}"] = {
        "attn": attn,
        "mlp": {"gating_einsum": np.stack([sd[s + "mlp.gate_proj.weight"],
                                           sd[s + "mlp.up_proj.weight"]]),
                "linear": sd[s + "mlp.down_proj.weight"].T},
        "pre_attention_norm": {"scale": sd[s + "input_layernorm.weight"]},
        "post_attention_norm": {"scale": sd[s + "post_attention_layernorm.weight"]},
        "pre_ffw_norm": {"scale": sd[s + "pre_feedforward_layernorm.weight"]},
        "post_ffw_norm": {"scale": sd[s + "post_feedforward_layernorm.weight"]},
    }
  return tree


def save_params(params: dict, path) -> None:
  """What ``gm.ckpts.save_params`` does."""
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, params)
  checkpointer.wait_until_finished()


CASES = {
    # Grouped-query attention (q_einsum + kv_einsum); 1B's settings, a 3-token window.
    "like_1b": ({}, {"like": "gemma3_1b", "sliding_window_size": 3}),
    # One key per head (qkv_einsum); 4B's linear scaling (8) of the global layer.
    "like_4b_qkv": ({"num_key_value_heads": 4, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}},
                    {"like": "gemma3_4b", "sliding_window_size": 3}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_library_checkpoint_gives_transformers_logits(tmp_path, case):
  overrides, preset = CASES[case]
  model = _hf_model(**overrides)
  save_params(library_params(model), tmp_path / "ckpt")
  loaded, report = pzp.pretrained.load_gemma(tmp_path / "ckpt", preset=preset, report=True)
  logits = checks.penzai_logits(loaded)
  reference = checks.reference_logits(model)
  np.testing.assert_allclose(logits, reference, **checks.TOLERANCE)
  print(f"{case}: float32 max abs error {np.abs(logits - reference).max():.2g}")
  assert report.settings["sliding_window_size"].source == "caller"
  assert report.settings["global_scale_factor"].source == "preset"
  assert report.settings["num_attention_heads"].value == 4
  # The structure load_hf builds: export_hf writes the Hugging Face tensors back.
  model.save_pretrained(tmp_path / "hf", safe_serialization=True)
  pzp.export_hf(loaded, tmp_path / "out", like=tmp_path / "hf")
  got, want = checks.tensors(tmp_path / "out"), checks.tensors(tmp_path / "hf")
  assert sorted(got) == sorted(want)
  assert all(got[name].tobytes() == want[name].tobytes() for name in want)


def test_unknown_sizes_need_a_preset_and_a_later_gemma_is_refused(tmp_path):
  params = library_params(_hf_model())
  save_params(params, tmp_path / "tiny")
  with pytest.raises(errors.GemmaCheckpointError, match="7 layers of width 32 matches none"):
    pzp.pretrained.load_gemma(tmp_path / "tiny")
  with pytest.raises(errors.GemmaCheckpointError, match="not Gemma 3's"):
    pzp.pretrained.load_gemma(tmp_path / "tiny", preset={"like": "gemma3_1b", "window": 3})
  params["layer_0"]["attn"]["kv_shared_cache"] = {"w": np.ones((2, 2), np.float32)}
  save_params(params, tmp_path / "later")
  with pytest.raises(errors.GemmaCheckpointError, match="later Gemma") as raised:
    pzp.pretrained.load_gemma(tmp_path / "later", preset="gemma3_1b")
  assert "is a Gemma 3 checkpoint" not in str(raised.value)
