"""`load_gemma` on Gemma 4 checkpoints of the ``gemma`` library.

The library's ``gm.ckpts.save_params(params, path)`` is
``orbax.checkpoint.StandardCheckpointer().save(path, params)`` of the Flax
params as ``model.init`` nests them. The library needs Python 3.12 and
could not be installed here, so these checkpoints are NOT written by it:
they are written the same way from tiny random transformers Gemma 4 models,
laid out as the library's Gemma 4 modules declare their weights (read from
its source, ``gemma/gm/nn/gemma4/_modules.py``, ``_moe.py``, ``_layers.py``;
see `pz_persist.pretrained.gemma4_flax`). The loaded model must give
transformers' logits for the same weights, and be the model `load_hf`
builds (`export_hf` writes the Hugging Face tensors back bit for bit).
"""

from __future__ import annotations

import numpy as np
import pytest

import pz_persist as pzp
from pretrained import hf_family_harness as checks
from pretrained import test_hf_gemma4 as hf_cases
from pretrained.test_gemma3_flax import save_params
from pz_persist.pretrained import errors
from pz_persist.tools import cli


def library_params(model, rng: np.random.Generator | None = None) -> dict:
  """The params the gemma library's Gemma 4 holds for ``model``'s weights
  (layers reusing keys and values get the unused ``kv_einsum`` and
  ``key_norm`` the library still creates, filled from ``rng``)."""
  rng = rng or np.random.default_rng(0)
  sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  c = model.config
  embed, layers = c.hidden_size, c.num_hidden_layers
  first = layers - (c.num_kv_shared_layers or 0)

  def per_head(name: str, dim: int) -> np.ndarray:  # [n*dim, embed] -> [n, embed, dim]
    return sd[name].reshape(-1, dim, embed).transpose(0, 2, 1)

  embedder: dict = {"input_embedding": sd["model.embed_tokens.weight"]}
  if c.hidden_size_per_layer_input:
    width = c.hidden_size_per_layer_input
    embedder.update(
        per_layer_embeddings=sd["model.embed_tokens_per_layer.weight"].reshape(-1, layers, width),
        per_layer_model_projection={"w": sd["model.per_layer_model_projection.weight"].T.reshape(
            embed, layers, width)},
        per_layer_projection_norm={"scale": sd["model.per_layer_projection_norm.weight"]})
  tree: dict = {"embedder": embedder, "final_norm": {"scale": sd["model.norm.weight"]}}
  for i in range(layers):
    s = f"model.layers.{i}."
    dim = sd[s + "self_attn.q_norm.weight"].shape[0]
    attn: dict = {
        "q_einsum": {"w": per_head(s + "self_attn.q_proj.weight", dim)},
        "attn_vec_einsum": {"w": sd[s + "self_attn.o_proj.weight"].T.reshape(-1, dim, embed)},
        "query_norm": {"scale": sd[s + "self_attn.q_norm.weight"]}}
    if i >= first:  # Unused by the library's forward pass, but in its params.
      kv = c.num_key_value_heads
      attn["kv_einsum"] = {"w": rng.normal(size=(2, kv, embed, dim)).astype(np.float32)}
      attn["key_norm"] = {"scale": rng.normal(size=(dim,)).astype(np.float32)}
    else:
      attn["key_norm"] = {"scale": sd[s + "self_attn.k_norm.weight"]}
      keys = per_head(s + "self_attn.k_proj.weight", dim)
      if s + "self_attn.v_proj.weight" in sd:
        attn["kv_einsum"] = {"w": np.stack([keys, per_head(s + "self_attn.v_proj.weight", dim)])}
      else:
        attn["k_einsum"] = {"w": keys}
    dense = {"gating_einsum": np.stack([sd[s + "mlp.gate_proj.weight"],
                                        sd[s + "mlp.up_proj.weight"]]),
             "linear": sd[s + "mlp.down_proj.weight"].T}
    block: dict = {
        "attn": attn, "skip_scale": sd[s + "layer_scalar"],
        "pre_attention_norm": {"scale": sd[s + "input_layernorm.weight"]},
        "post_attention_norm": {"scale": sd[s + "post_attention_layernorm.weight"]},
        "post_ffw_norm": {"scale": sd[s + "post_feedforward_layernorm.weight"]}}
    if c.enable_moe_block:
      experts = c.num_experts
      block.update(
          mlp2=dense,
          pre_ffw2_norm={"scale": sd[s + "pre_feedforward_layernorm.weight"]},
          post_ffw2_norm={"scale": sd[s + "post_feedforward_layernorm_1.weight"]},
          pre_ffw_norm={"scale": sd[s + "pre_feedforward_layernorm_2.weight"]},
          post_ffw1_norm={"scale": sd[s + "post_feedforward_layernorm_2.weight"]},
          mlp={"router_logits": {"w": sd[s + "router.proj.weight"].T},
               "router_scale": sd[s + "router.scale"],
               "per_expert_scale": sd[s + "router.per_expert_scale"],
               "gating_einsum": {"w": sd[s + "experts.gate_up_proj"].reshape(
                   experts, 2, -1, embed)},
               "linear": {"w": sd[s + "experts.down_proj"].transpose(0, 2, 1)}})
    else:
      block.update(mlp=dense, pre_ffw_norm={"scale": sd[s + "pre_feedforward_layernorm.weight"]})
    if c.hidden_size_per_layer_input:
      block.update(
          per_layer_input_gate={"w": sd[s + "per_layer_input_gate.weight"].T},
          per_layer_projection={"w": sd[s + "per_layer_projection.weight"].T},
          post_per_layer_input_norm={"scale": sd[s + "post_per_layer_input_norm.weight"]})
    tree[f"layer_{i}"] = block
  return tree


_TINY = {"like": "gemma4_e2b", "sliding_window_size": 3, "global_every": 2,
         "local_base_frequency": 100.0, "global_base_frequency": 10_000.0,
         "global_rope_proportion": 0.5, "final_logit_softcap": None, "kv_shared_layers": 0}
PRESETS = {
    # E2B-like: per-layer inputs, the last two layers reusing keys and values
    # with the double-wide MLP, a final soft cap.
    "gemma4_text": dict(_TINY, kv_shared_layers=2, final_logit_softcap=30.0),
    # 31B-like: keys as values on the global layers.
    "gemma4_text_k_eq_v": dict(_TINY, like="gemma4_31b"),
    # 26B-A4B-like: experts beside the dense MLP.
    "gemma4_text_moe": dict(_TINY, like="gemma4_26b_a4b", top_k_experts=2),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """``{case: (library checkpoint, Hugging Face folder, reference logits)}``."""
  out = {}
  for case in PRESETS:
    model = hf_cases._text_model(case)  # pylint: disable=protected-access
    folder = tmp_path_factory.mktemp(case)
    save_params(library_params(model), folder / "ckpt")
    model.save_pretrained(folder / "hf", safe_serialization=True)
    out[case] = (folder / "ckpt", folder / "hf", checks.reference_logits(model))
  return out


@pytest.mark.parametrize("case", list(PRESETS))
def test_library_checkpoint_gives_transformers_logits(written, tmp_path, case):
  ckpt, hf, reference = written[case]
  loaded, report = pzp.pretrained.load_gemma(ckpt, preset=PRESETS[case], report=True)
  logits = checks.penzai_logits(loaded)
  np.testing.assert_allclose(logits, reference, **checks.TOLERANCE)
  print(f"{case}: float32 max abs error {np.abs(logits - reference).max():.2g}")
  assert report.settings["sliding_window_size"].source == "caller"
  assert report.settings["head_dim"].source == "checkpoint"
  # The same model load_hf builds from the Hugging Face folder, to the bit.
  np.testing.assert_array_equal(logits, checks.penzai_logits(pzp.pretrained.load_hf(hf)))
  # The structure load_hf builds: export_hf writes the Hugging Face tensors back.
  pzp.export_hf(loaded, tmp_path / "out", like=hf)
  got, want = checks.tensors(tmp_path / "out"), checks.tensors(hf)
  assert sorted(got) == sorted(want)
  assert all(got[name].tobytes() == want[name].tobytes() for name in want)


def test_settings_the_arrays_do_not_show_bind(written):
  """A wrong setting (window, RoPE, soft cap) changes the logits beyond the
  tolerance: they are read, not ignored; a wrong count of layers reusing
  keys and values contradicts their doubled MLPs and is refused."""
  ckpt, _, reference = written["gemma4_text"]
  for change in ({"sliding_window_size": 2}, {"global_rope_proportion": 1.0},
                 {"local_base_frequency": 10_000.0}, {"final_logit_softcap": None}):
    loaded = pzp.pretrained.load_gemma(ckpt, preset=dict(PRESETS["gemma4_text"], **change))
    assert np.abs(checks.penzai_logits(loaded) - reference).max() > 1e-2, change
  with pytest.raises(errors.GemmaCheckpointError, match="layer_2/mlp' is 128 wide, not 64"):
    pzp.pretrained.load_gemma(ckpt, preset=dict(PRESETS["gemma4_text"], kv_shared_layers=0))


def test_unknown_sizes_and_damaged_trees_are_refused(tmp_path, capsys):
  model = hf_cases._text_model("gemma4_text_k_eq_v")  # pylint: disable=protected-access
  params = library_params(model)
  save_params(params, tmp_path / "tiny")
  with pytest.raises(errors.GemmaCheckpointError, match="4 layers of width 32 matches none"):
    pzp.pretrained.load_gemma(tmp_path / "tiny")
  with pytest.raises(errors.GemmaCheckpointError, match=r"\['window'\] are not Gemma 4's"):
    pzp.pretrained.load_gemma(tmp_path / "tiny", preset={"like": "gemma4_31b", "window": 3})
  with pytest.raises(errors.GemmaCheckpointError, match="last of 4 layers is not global"):
    pzp.pretrained.load_gemma(tmp_path / "tiny", preset=dict(_TINY, global_every=3))
  damaged = {
      # A foreign array, named.
      "foreign": (lambda t: t["layer_1"]["attn"].update(v_einsum={"w": np.ones((2, 2))}),
                  "layer_1/attn/v_einsum"),
      # A wrong shape, named with the shape it should have.
      "shape": (lambda t: t["layer_2"]["attn"].update(
          q_einsum={"w": np.ones((4, 32, 16), np.float32)}), "layer_2/attn/q_einsum"),
      # A missing array.
      "missing": (lambda t: t["layer_3"].pop("post_ffw_norm"), "layer_3/post_ffw_norm"),
      # A block without its output scale.
      "skip": (lambda t: t["layer_2"].pop("skip_scale"), "skip_scale"),
  }
  for name, (damage, named) in damaged.items():
    tree = library_params(model)
    damage(tree)
    save_params(tree, tmp_path / name)
    with pytest.raises(errors.GemmaCheckpointError, match=named):
      pzp.pretrained.load_gemma(tmp_path / name, preset=PRESETS["gemma4_text_k_eq_v"])
  # The CLI's `convert gemma` goes through the same checks, and writes nothing.
  assert cli.main(["convert", "gemma", str(tmp_path / "foreign"), str(tmp_path / "out"),
                   "--preset-like", "gemma4_31b"]) == 2
  assert "layer_1/attn/v_einsum" in capsys.readouterr().err
  assert not (tmp_path / "out").exists()
  # Settings of the wrong kind are refused before anything is read.
  for bad in ({"global_rope_proportion": "half"}, {"global_every": 0},
              {"final_logit_softcap": True}):
    with pytest.raises(errors.GemmaCheckpointError, match=next(iter(bad))):
      pzp.pretrained.load_gemma(tmp_path / "tiny", preset=dict(_TINY, **bad))


def _library_shapes(layers: int, embed: int, heads: int, kv: int, global_kv: int | None,
                    every: int, shared: int, ple: int, experts: int = 0,
                    hidden: int = 0, double: bool = False) -> dict:
  """The flattened metadata `load_gemma` reads for a full-size library
  Gemma 4 (shapes only: nothing allocated), as its configs declare them."""
  import jax  # pylint: disable=import-outside-toplevel

  def a(*shape):
    return {"w": jax.ShapeDtypeStruct(shape, np.float32)}

  def n(size):
    return {"scale": jax.ShapeDtypeStruct((size,), np.float32)}

  vocab, stored = 262_144, {}
  stored["transformer/embedder"] = {"input_embedding": jax.ShapeDtypeStruct((vocab, embed),
                                                                             np.float32)}
  stored["transformer/final_norm"] = n(embed)
  if ple:
    stored.update({"transformer/embedder/per_layer_embeddings": a(vocab, layers, ple),
                   "transformer/embedder/per_layer_model_projection": a(embed, layers, ple),
                   "transformer/embedder/per_layer_projection_norm": n(ple)})
  for i in range(layers):
    p = f"transformer/layer_{i}/"
    full = (i + 1) % every == 0
    dim = 512 if full else 256
    width = hidden * (2 if double and i >= layers - shared else 1)
    stored.update({p + "skip_scale": a(1), p + "attn/q_einsum": a(heads, embed, dim),
                   p + "attn/attn_vec_einsum": a(heads, dim, embed),
                   p + "attn/query_norm": n(dim), p + "attn/key_norm": n(dim),
                   p + "pre_attention_norm": n(embed), p + "post_attention_norm": n(embed),
                   p + "pre_ffw_norm": n(embed), p + "post_ffw_norm": n(embed)})
    if full and global_kv:
      stored[p + "attn/k_einsum"] = a(global_kv, embed, dim)
    else:
      stored[p + "attn/kv_einsum"] = a(2, kv, embed, dim)
    dense = p + ("mlp2/" if experts else "mlp/")
    stored.update({dense + "gating_einsum": a(2, width, embed), dense + "linear": a(width, embed)})
    if ple:
      stored.update({p + "per_layer_input_gate": a(embed, ple),
                     p + "per_layer_projection": a(ple, embed),
                     p + "post_per_layer_input_norm": n(embed)})
    if experts:
      stored.update({p + k: n(embed) for k in ("pre_ffw2_norm", "post_ffw2_norm",
                                               "post_ffw1_norm")})
      stored.update({p + "mlp/router_logits": a(embed, experts), p + "mlp/router_scale": a(embed),
                     p + "mlp/per_expert_scale": a(experts),
                     p + "mlp/gating_einsum": a(experts, 2, 704, embed),
                     p + "mlp/linear": a(experts, 704, embed)})
  return stored


def test_auto_recognises_the_library_models_at_full_size():
  """`preset="auto"` on the library's E2B and 26B-A4B shapes (from its
  configs, gemma/gm/nn/gemma4/_gemma4.py): the settings the arrays do not
  show come from the right model, and the sizes from the arrays."""
  from pz_persist.pretrained import gemma4_flax  # pylint: disable=import-outside-toplevel

  e2b = _library_shapes(35, 1536, 8, 1, None, 5, 20, 256, hidden=6144, double=True)
  config, _, name, _ = gemma4_flax.config_of(e2b, "auto", "e2b")
  assert name == "gemma4_e2b"
  assert (config["num_kv_shared_layers"], config["use_double_wide_mlp"],
          config["hidden_size_per_layer_input"], config["sliding_window"]) == (20, True, 256, 512)
  assert config["layer_types"][4] == "full_attention" and config["global_head_dim"] == 512
  moe = _library_shapes(30, 2816, 16, 8, 2, 6, 0, 0, experts=128, hidden=2112)
  config, _, name, _ = gemma4_flax.config_of(moe, "auto", "26b")
  assert name == "gemma4_26b_a4b"
  assert (config["num_experts"], config["top_k_experts"], config["moe_intermediate_size"],
          config["num_global_key_value_heads"], config["attention_k_eq_v"]) == (128, 8, 704, 2, True)
