"""Hostile pretrained checkpoints: every loader of `pz_persist.pretrained` (and
``pz-persist convert``) refuses them with a `PzPersistError` naming the file,
before reading any tensor, never hanging, crashing or allocating what a few
bytes declare.

Hugging Face folders are written here with NumPy alone (a tiny Llama), so the
tests need neither torch nor transformers. Anything that could hang (FIFOs, a
huge ``num_hidden_layers``) or abort the interpreter (TensorStore allocating
a declared shape) runs in a subprocess with a timeout.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import run_python
from penzai import pz

import pz_persist as pzp
from pz_persist import errors
from pz_persist import safety
from pz_persist.pretrained import errors as pretrained_errors
from pz_persist.pretrained import safetensors_io
from pz_persist.pretrained.hf.families import MODEL_TYPES

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, LAYERS = 8, 2, 1, 4, 8, 16, 2

CONFIG = {
    "model_type": "llama", "hidden_size": HIDDEN, "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "intermediate_size": MLP,
    "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
}


def llama_tensors(layers: int = LAYERS) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  r = lambda *shape: rng.normal(size=shape).astype(np.float32)
  tensors = {"model.embed_tokens.weight": r(VOCAB, HIDDEN), "model.norm.weight": r(HIDDEN),
             "lm_head.weight": r(VOCAB, HIDDEN)}
  for i in range(layers):
    s = f"model.layers.{i}."
    tensors.update({
        s + "input_layernorm.weight": r(HIDDEN),
        s + "post_attention_layernorm.weight": r(HIDDEN),
        s + "mlp.gate_proj.weight": r(MLP, HIDDEN), s + "mlp.up_proj.weight": r(MLP, HIDDEN),
        s + "mlp.down_proj.weight": r(HIDDEN, MLP),
        s + "self_attn.q_proj.weight": r(HEADS * HEAD_DIM, HIDDEN),
        s + "self_attn.k_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
        s + "self_attn.v_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
        s + "self_attn.o_proj.weight": r(HIDDEN, HEADS * HEAD_DIM),
    })
  return tensors


def hf_folder(folder, config=None, tensors=None):
  """A tiny Llama checkpoint folder (``config.json`` + ``model.safetensors``)."""
  folder.mkdir(parents=True, exist_ok=True)
  text = config if isinstance(config, str) else json.dumps(CONFIG if config is None else config)
  (folder / "config.json").write_text(text)
  safetensors_io.write_safetensors(folder / "model.safetensors",
                                   llama_tensors() if tensors is None else tensors)
  return folder


def raw_safetensors(path, header: dict, data: bytes):
  """A safetensors file with exactly this header and data buffer."""
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
  return path


@pytest.fixture
def no_reads(monkeypatch):
  """Fails the test if any tensor is read (checks must come first)."""
  def refuse(self, name, *args, **kwargs):
    raise AssertionError(f"tensor {name!r} was read before the checks")
  monkeypatch.setattr(safetensors_io.SafetensorsFile, "get", refuse)
  monkeypatch.setattr(safetensors_io.SafetensorsFile, "read_into", refuse)


def test_the_tiny_folder_is_valid(tmp_path):
  """The baseline every hostile variant below is derived from loads."""
  model = pzp.pretrained.load_hf(hf_folder(tmp_path / "ok"))
  assert "transformer/block_1/attention/query.weights" in {
      p.label for p in pz.unbind_params(model)[1]}


# --- safetensors byte ranges -----------------------------------------------


def _aliased_header(count: int, n: int) -> dict:
  return {f"t{i}": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}
          for i in range(count)}


@pytest.mark.parametrize("header, data, match", [
    # 200 tensors aliasing one 64-byte range: a small file asking for 200x.
    (_aliased_header(200, 16), bytes(64), "invalid offset"),
    # Two tensors overlapping by half.
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, bytes(24), "invalid offset"),
    # A gap between tensors, listed out of order.
    ({"b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
      "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(24), "invalid offset"),
    # Not starting at zero.
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16), "invalid offset"),
    # Bytes after the last tensor.
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(64), "after its last"),
    # Out of the file.
    ({"a": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}}, bytes(8), "truncated"),
], ids=["aliased", "overlapping", "gap", "not_from_zero", "trailing_bytes", "out_of_file"])
def test_safetensors_ranges_must_tile_the_file(tmp_path, header, data, match):
  path = raw_safetensors(tmp_path / "x.safetensors", header, data)
  with pytest.raises(pretrained_errors.SafetensorsFormatError, match=match) as info:
    safetensors_io.SafetensorsFile(path)
  assert "x.safetensors" in str(info.value)
  # load_safetensors refuses it too (before its own metadata checks).
  with pytest.raises(pretrained_errors.SafetensorsFormatError, match=match):
    pzp.pretrained.load_safetensors(path)


@pytest.mark.parametrize("entry, data, match", [
    # Well-typed entries (parsed into compact tuples) with wrong values.
    ({"dtype": "F31", "shape": [2], "data_offsets": [0, 8]}, bytes(8), "has dtype 'F31'"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, bytes(8), "bytes of data"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, bytes(8), "invalid data offsets"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}, bytes(8), "invalid data offsets"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, bytes(4), "truncated"),
    ({"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}, bytes(4), "65 dimensions"),
    ({"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}, b"", "multiply"),
    # Ill-typed ones (left as JSON objects).
    ({"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}, bytes(8), "invalid shape"),
    ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, bytes(8), "invalid shape"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}, bytes(8), "invalid data offsets"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}, bytes(8), "invalid data offsets"),
    ({"dtype": "F32", "shape": [2], "offsets": [0, 8]}, bytes(8), "malformed header entry"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}, bytes(8), "malformed"),
    ({"dtype": 32, "shape": [2], "data_offsets": [0, 8]}, bytes(8), "has dtype 32"),
])
def test_safetensors_header_entries_are_checked(tmp_path, entry, data, match):
  """Each header entry is checked whether it is parsed into a compact tuple
  (well-typed) or left as a JSON object, and the error names the tensor."""
  header = {"ok": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "bad": {**entry, **({"data_offsets": [o + 4 for o in entry["data_offsets"]]}
                                if isinstance(entry.get("data_offsets"), list)
                                and all(type(o) is int for o in entry["data_offsets"]) else {})}}
  path = raw_safetensors(tmp_path / "x.safetensors", header, bytes(4) + data)
  with pytest.raises(pretrained_errors.SafetensorsFormatError, match=match) as info:
    safetensors_io.SafetensorsFile(path)
  assert "'bad'" in str(info.value)


def test_metadata_shaped_like_an_entry_is_refused(tmp_path):
  header = {"__metadata__": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
  with pytest.raises(pretrained_errors.SafetensorsFormatError, match="str-to-str"):
    safetensors_io.SafetensorsFile(raw_safetensors(tmp_path / "x.safetensors", header, bytes(4)))


def test_reference_safetensors_agrees_on_what_is_invalid(tmp_path):
  """The reference implementation refuses the aliased file too."""
  import safetensors.numpy  # pylint: disable=import-outside-toplevel

  path = raw_safetensors(tmp_path / "x.safetensors", _aliased_header(3, 4), bytes(16))
  with pytest.raises(Exception, match="(?i)offset"):
    safetensors.numpy.load_file(path)


def test_aliased_tensors_through_load_hf(tmp_path, no_reads):
  folder = hf_folder(tmp_path / "f")
  tensors = llama_tensors()
  header = {}
  for name, array in tensors.items():  # Every tensor aliases the start of the buffer.
    header[name] = {"dtype": "F32", "shape": list(array.shape),
                    "data_offsets": [0, array.nbytes]}
  raw_safetensors(folder / "model.safetensors", header,
                  bytes(max(a.nbytes for a in tensors.values())))
  with pytest.raises(pretrained_errors.SafetensorsFormatError, match="invalid offset.*|model.safetensors"):
    pzp.pretrained.load_hf(folder)


def test_header_length_beyond_the_limit(tmp_path):
  path = tmp_path / "x.safetensors"
  path.write_bytes((2**62).to_bytes(8, "little") + b"{}")
  with pytest.raises(pretrained_errors.SafetensorsFormatError, match="limit") as info:
    safetensors_io.SafetensorsFile(path)
  assert "x.safetensors" in str(info.value)


def test_deeply_nested_header_is_refused(tmp_path):
  path = tmp_path / "x.safetensors"
  raw = b"[" * 100_000 + b"]" * 100_000
  path.write_bytes(len(raw).to_bytes(8, "little") + raw)
  with pytest.raises(pretrained_errors.SafetensorsFormatError, match="deeper|JSON"):
    safetensors_io.SafetensorsFile(path)


def test_allocation_is_checked_before_reading(tmp_path, monkeypatch, no_reads):
  folder = hf_folder(tmp_path / "f")
  monkeypatch.setattr(safety, "MAX_ALLOCATION_BYTES", 1000)
  with pytest.raises(errors.UnsafeCheckpointError, match="1000-byte limit"):
    pzp.pretrained.load_hf(folder)
  out = tmp_path / "m.safetensors"
  monkeypatch.setattr(safety, "MAX_ALLOCATION_BYTES", None)
  pzp.export_safetensors([pz.Parameter(value=pz.nx.wrap(np.ones(1000, np.float32)), label="w")], out)
  monkeypatch.setattr(safety, "MAX_ALLOCATION_BYTES", 1000)
  with pytest.raises(errors.UnsafeCheckpointError, match="1000-byte limit"):
    pzp.pretrained.load_safetensors(out)


# --- load_safetensors' own metadata ------------------------------------------


def _exported(tmp_path, **entry_changes):
  """A one-tensor file in export_safetensors' format, its entry edited."""
  entry = {"label": "w", "axes": [None, "a"], "kind": "parameter", "metadata": {}}
  entry.update(entry_changes)
  meta = {"format_version": 1, "tensors": {"w": entry}}
  path = tmp_path / "e.safetensors"
  safetensors_io.write_safetensors(path, {"w": np.ones((2, 3), np.float32)},
                                   metadata={"pz_persist": json.dumps(meta)})
  return path


@pytest.mark.parametrize("changes, match", [
    (dict(label=5), "label"),
    (dict(label="other"), "label"),
    (dict(kind="module_to_import"), "kind"),
    (dict(axes="ab"), "axis names"),
    (dict(axes=[None, 3]), "axis names"),
    (dict(axes=["a", "a"]), "repeat"),
    (dict(metadata=[1, 2]), "metadata"),
    (dict(metadata={"x": json.loads("[" * 70 + "]" * 70)}), "deeper"),
])
def test_malformed_export_metadata(tmp_path, changes, match):
  path = _exported(tmp_path, **changes)
  with pytest.raises(pretrained_errors.SafetensorsFormatError, match=match) as info:
    pzp.pretrained.load_safetensors(path)
  assert "e.safetensors" in str(info.value)


@pytest.mark.parametrize("meta", ["[1, 2]", '{"format_version": 1, "tensors": [1]}',
                                  '{"format_version": 1, "tensors": {"w": 3}}', "{"])
def test_export_metadata_of_the_wrong_shape(tmp_path, meta):
  path = tmp_path / "e.safetensors"
  safetensors_io.write_safetensors(path, {"w": np.ones(2, np.float32)},
                                   metadata={"pz_persist": meta})
  with pytest.raises(pretrained_errors.SafetensorsFormatError, match="e.safetensors"):
    pzp.pretrained.load_safetensors(path)


def test_a_valid_export_still_loads(tmp_path):
  values = pzp.pretrained.load_safetensors(_exported(tmp_path))
  assert values[0].label == "w" and values[0].value.named_shape == {"a": 3}


# --- config.json ---------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("hidden_size", 8.0),  # A float, even a whole one, is not silently truncated.
    ("hidden_size", 8.5),
    ("hidden_size", "8"),
    ("hidden_size", True),
    ("num_attention_heads", 0),
    ("num_key_value_heads", -1),
    ("intermediate_size", [8]),
    ("vocab_size", {"a": 1}),
    ("head_dim", 0),
    ("num_hidden_layers", 2.0),
    ("num_hidden_layers", 3),
    ("num_hidden_layers", 1),
    ("rms_norm_eps", "small"),
    ("rms_norm_eps", -1.0),
    ("rope_theta", "big"),
    ("tie_word_embeddings", "false"),
    ("hidden_act", ["silu"]),
    ("model_type", ["llama"]),
    ("rope_scaling", [1]),
    ("rope_parameters", {"rope_type": "default", "rope_theta": "x"}),
    ("rope_parameters", {"rope_type": ["default"]}),
])
def test_invalid_config_values(tmp_path, no_reads, field, value):
  folder = hf_folder(tmp_path / "f", dict(CONFIG, **{field: value}))
  with pytest.raises(errors.PzPersistError, match=field) as info:
    pzp.pretrained.load_hf(folder)
  assert "config.json" in str(info.value)


def test_layer_count_message_names_the_layers_held(tmp_path, no_reads):
  folder = hf_folder(tmp_path / "f", dict(CONFIG, num_hidden_layers=5))
  with pytest.raises(errors.UnsupportedConfigError, match=(
      r"config.json: num_hidden_layers must be a positive integer matching the"
      r" weights, got 5 but the safetensors hold layers 0..1")):
    pzp.pretrained.load_hf(folder)


@pytest.mark.parametrize("text", [
    "[1, 2, 3]", "not json", "\"llama\"", '{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"model_type": "llama", "rope_scaling": ' + "{\"a\": " * 70 + "1" + "}" * 70 + "}",
    json.dumps(CONFIG) + " " * (5 * 2**20),
    "\xff\xfe",
], ids=["list", "not_json", "string", "deep_lists", "deep_objects", "over_4MiB", "not_utf8"])
def test_malformed_config_files(tmp_path, no_reads, text):
  folder = hf_folder(tmp_path / "f", text)
  with pytest.raises(errors.PzPersistError, match="config.json"):
    pzp.pretrained.load_hf(folder)


_GEMMA_FIELDS = {"hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True}
_FAMILY_FIELDS = {
    "gemma": _GEMMA_FIELDS, "gemma2": _GEMMA_FIELDS, "gemma3_text": _GEMMA_FIELDS,
    "gemma4_text": {**_GEMMA_FIELDS, "rope_theta": None},  # Keyed by layer type.
    "gemma3n_text": _GEMMA_FIELDS,
    "ministral3": {"rope_theta": None, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 4, "llama_4_scaling_beta": 0.1}},
    "gpt_neox": {"num_key_value_heads": None, "rms_norm_eps": None},
    "phi": {"rms_norm_eps": None},
    "stablelm": {"rms_norm_eps": None, "partial_rotary_factor": 0.5},  # Head width 4.
    "starcoder2": {"rms_norm_eps": None},
    "deepseek_v3": {"num_key_value_heads": None, "kv_lora_rank": 4, "qk_rope_head_dim": 4,
                    "qk_nope_head_dim": 4, "v_head_dim": 4},
    "kimi_linear": {"num_key_value_heads": HEADS, "kv_lora_rank": 4, "qk_rope_head_dim": 4,
                    "qk_nope_head_dim": 4, "v_head_dim": 4, "q_lora_rank": None,
                    "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 8,
                    "linear_num_heads": 2, "linear_head_dim": 4},
    "deepseek_v32": {"num_key_value_heads": None, "kv_lora_rank": 4, "qk_rope_head_dim": 4,
                     "qk_nope_head_dim": 4, "v_head_dim": 4, "q_lora_rank": 4,
                     "index_head_dim": 4, "index_n_heads": 2, "index_topk": 2},
    "glm_moe_dsa": {"num_key_value_heads": None, "kv_lora_rank": 4, "qk_rope_head_dim": 4,
                    "qk_nope_head_dim": 4, "v_head_dim": 4, "q_lora_rank": 4,
                    "index_head_dim": 4, "index_n_heads": 2, "index_topk": 2,
                    "indexer_types": None, "index_topk_freq": 2},
    "glm4_moe_lite": {"num_key_value_heads": None, "kv_lora_rank": 4, "qk_rope_head_dim": 4,
                      "qk_nope_head_dim": 4, "v_head_dim": 4, "q_lora_rank": None},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8},
    "qwen3_vl_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "cohere": {"rms_norm_eps": None}, "cohere2": {"rms_norm_eps": None},
    "falcon": {"num_key_value_heads": None, "intermediate_size": None, "rms_norm_eps": None,
               "hidden_act": None, "ffn_hidden_size": MLP},
    "minimax_m2": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "phimoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                  "shared_expert_intermediate_size": 8},
    "ernie4_5_moe": {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 8},
    "apertus": {"hidden_act": "xielu"},
    "lfm2": {"rms_norm_eps": None, "hidden_act": None},
    "lfm2_moe": {"rms_norm_eps": None, "hidden_act": None, "num_experts": 4,
                 "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                 "layer_types": ["full_attention"]},  # Refused as not one per layer.
    # The Mamba-2 hybrids: head counts dividing 2 * hidden_size (the default 128 does not).
    "bamba": {"mamba_n_heads": 2, "mamba_d_state": 4},
    # Nemotron-H's layer count is its pattern's: two layers, against 10**9.
    "nemotron_h": {"rms_norm_eps": None, "rope_theta": None, "hidden_act": None,
                   "hybrid_override_pattern": "M*", "mamba_num_heads": 2, "n_groups": 1,
                   "ssm_state_size": 4},
    "granitemoehybrid": {"mamba_n_heads": 2, "mamba_d_state": 4, "shared_intermediate_size": MLP},
    "falcon_h1": {"mamba_n_heads": 2, "mamba_d_state": 4},
    "jamba": {"rope_theta": None},  # No RoPE; transformers' 16 experts every other layer.
    "opt": {"num_key_value_heads": None, "intermediate_size": None, "rms_norm_eps": None,
            "rope_theta": None, "hidden_act": None, "ffn_dim": MLP},
    # GPT-2 spells its sizes its own way (n_layer for the layer count).
    "gpt2": {"hidden_size": None, "num_attention_heads": None, "num_key_value_heads": None,
             "intermediate_size": None, "num_hidden_layers": None, "rms_norm_eps": None,
             "rope_theta": None, "hidden_act": None, "n_embd": HIDDEN, "n_head": HEADS,
             "n_layer": 10**9},
}
"""Changes (None: remove the field) making `CONFIG` acceptable to a family
other than Llama's, so that only its layer count is wrong."""


_TEXT_MODEL = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "gemma3n": "gemma3n_text", "llama4": "llama4_text",
               "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "mistral3": "mistral"}
"""Multimodal folders: the text model of each, in a nested ``text_config``."""


def huge_config(model_type: str) -> dict:
  """`CONFIG` made ``model_type``'s (`_FAMILY_FIELDS`), asking for 10**9 layers."""
  text_type = _TEXT_MODEL.get(model_type)
  config = {**CONFIG, "model_type": text_type or model_type, "num_hidden_layers": 10**9,
            **_FAMILY_FIELDS.get(text_type or model_type, {})}
  config = {k: v for k, v in config.items() if v is not None}
  return config if text_type is None else {"model_type": model_type, "text_config": config}


def huge_tensors(model_type: str) -> dict[str, np.ndarray]:
  """`llama_tensors`, under Mistral 3's prefix for its folders (which are
  refused, as they should be, when the text model's tensors are elsewhere)."""
  tensors = llama_tensors()
  if model_type != "mistral3":
    return tensors
  return {name.replace("model.", "model.language_model.", 1): value
          for name, value in tensors.items()}


def test_huge_layer_count_fails_fast(tmp_path):
  """A 200-byte config asking for 10**9 layers used to build the skeleton for
  hours (or, in Gemma 2, a list of 10**9 attention types); every family of
  `load_hf` must refuse it before building anything per layer."""
  folders = [
      str(hf_folder(tmp_path / name, huge_config(name), huge_tensors(name)))
      for name in sorted(MODEL_TYPES)]
  out = run_python(f"""
      import pz_persist as pzp
      from pz_persist import errors
      for folder in {folders!r}:
        try:
          pzp.pretrained.load_hf(folder)
        except errors.PzPersistError as e:
          print("REFUSED", e)
      """, timeout=120)
  refusals = [line for line in out.splitlines() if line.startswith("REFUSED")]
  assert len(refusals) == len(folders), out
  assert all(("num_hidden_layers" in r or "n_layer" in r) and "1000000000" in r
             for r in refusals), out


def test_missing_tensor_is_found_before_reading(tmp_path, no_reads):
  tensors = llama_tensors()
  del tensors["model.layers.1.self_attn.k_proj.weight"]
  folder = hf_folder(tmp_path / "f", tensors=tensors)
  with pytest.raises(pretrained_errors.SafetensorsFormatError,
                     match="model.layers.1.self_attn.k_proj.weight"):
    pzp.pretrained.load_hf(folder)


def test_wrong_shape_is_found_before_reading(tmp_path, no_reads):
  tensors = llama_tensors()
  tensors["model.layers.0.mlp.up_proj.weight"] = np.ones((MLP, HIDDEN + 1), np.float32)
  folder = hf_folder(tmp_path / "f", tensors=tensors)
  with pytest.raises(pretrained_errors.SafetensorsFormatError, match="up_proj.*does not fit"):
    pzp.pretrained.load_hf(folder)


def test_sizes_larger_than_the_weights_are_refused_before_building(tmp_path, no_reads, monkeypatch):
  """A config declaring a huge vocabulary is refused by the tensor check, not
  by building a skeleton of that size."""
  from penzai.models.transformer.variants import llamalike_common  # pylint: disable=import-outside-toplevel

  def no_build(*args, **kwargs):
    raise AssertionError("the skeleton was built before the checks")
  monkeypatch.setattr(llamalike_common, "build_llamalike_transformer", no_build)
  folder = hf_folder(tmp_path / "f", dict(CONFIG, vocab_size=10**12))
  with pytest.raises(pretrained_errors.SafetensorsFormatError, match="does not fit"):
    pzp.pretrained.load_hf(folder)


# --- files of an HF folder: containment, FIFOs, the hub cache ------------------


def _hub_snapshot(root, name="models--org--tiny", sub=""):
  """A huggingface_hub cache entry: snapshot files are relative symlinks
  into ../../blobs, as ``snapshot_download`` leaves them (``sub``: the model
  is in a subfolder of the snapshot)."""
  source = hf_folder(root / "source")
  entry = root / "hub" / name
  (entry / "blobs").mkdir(parents=True)
  snapshot = entry / "snapshots" / "0123abcd" / sub
  snapshot.mkdir(parents=True)
  up = "../" * (2 + bool(sub))
  for i, file in enumerate(("config.json", "model.safetensors")):
    os.replace(source / file, entry / "blobs" / f"blob{i}")
    os.symlink(f"{up}blobs/blob{i}", snapshot / file)
  return snapshot


@pytest.mark.parametrize("sub", ["", "text_model"])
def test_hub_cache_snapshot_loads(tmp_path, sub):
  """Symlinks into the cache's blobs are followed, to the very tensors: the
  snapshot loads the same model as a plain folder of the same files."""
  snapshot = _hub_snapshot(tmp_path, sub=sub)
  from_cache = pz.unbind_params(pzp.load_hf(snapshot), freeze=True)[1]
  plain = pz.unbind_params(pzp.load_hf(hf_folder(tmp_path / "plain")), freeze=True)[1]
  assert [p.label for p in from_cache] == [p.label for p in plain]
  assert "transformer/block_1/attention/query.weights" in {p.label for p in from_cache}
  for cached, direct in zip(from_cache, plain):
    assert cached.value.named_shape == direct.value.named_shape, cached.label
    np.testing.assert_array_equal(
        np.asarray(cached.value.unwrap(*cached.value.named_shape)),
        np.asarray(direct.value.unwrap(*direct.value.named_shape)), err_msg=cached.label,
    )


def test_symlink_out_of_the_folder_is_refused(tmp_path):
  outside = hf_folder(tmp_path / "outside")
  for name in ("config.json", "model.safetensors"):
    folder = hf_folder(tmp_path / f"f_{name}")
    os.unlink(folder / name)
    os.symlink(outside / name, folder / name)
    with pytest.raises(errors.UnsafeCheckpointError, match=f"{name} is a symlink") as info:
      pzp.pretrained.load_hf(folder)
    assert str(outside) in str(info.value)


def test_snapshot_link_out_of_its_cache_entry_is_refused(tmp_path):
  snapshot = _hub_snapshot(tmp_path)
  other = hf_folder(tmp_path / "elsewhere")
  os.unlink(snapshot / "model.safetensors")
  os.symlink(other / "model.safetensors", snapshot / "model.safetensors")
  with pytest.raises(errors.UnsafeCheckpointError, match="outside the checkpoint folder"):
    pzp.pretrained.load_hf(snapshot)


def test_index_naming_a_directory_or_outside_file_is_refused(tmp_path):
  folder = hf_folder(tmp_path / "f")
  (folder / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {"model.norm.weight": ".."}}))
  with pytest.raises(errors.PzPersistError, match="index.json|not a regular file"):
    pzp.pretrained.load_hf(folder)
  (folder / "model.safetensors.index.json").write_text("[" * 100_000)
  with pytest.raises(pretrained_errors.SafetensorsFormatError, match="index.json"):
    pzp.pretrained.load_hf(folder)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_fifo_in_the_folder_is_refused_without_blocking(tmp_path, name):
  folder = hf_folder(tmp_path / "f")
  os.unlink(folder / name)
  os.mkfifo(folder / name)
  out = run_python(f"""
      import pz_persist as pzp
      from pz_persist import errors
      try:
        pzp.pretrained.load_hf({str(folder)!r})
      except errors.UnsafeCheckpointError as e:
        print("REFUSED", e)
      """, timeout=120)
  assert "REFUSED" in out and "FIFO" in out and name in out


def test_fifo_or_device_given_to_load_safetensors(tmp_path):
  fifo = tmp_path / "x.safetensors"
  os.mkfifo(fifo)
  out = run_python(f"""
      import pz_persist as pzp
      from pz_persist import errors
      for path in ({str(fifo)!r}, "/dev/zero"):
        try:
          pzp.pretrained.load_safetensors(path)
        except errors.PzPersistError as e:
          print("REFUSED", e)
      """, timeout=120)
  assert out.count("REFUSED") == 2 and "FIFO" in out and "character device" in out


# --- the CLI ---------------------------------------------------------------------


def test_convert_hf_refuses_a_hostile_folder(tmp_path):
  folder = hf_folder(tmp_path / "f", dict(CONFIG, num_hidden_layers=10**9))
  out = run_python(f"""
      import sys
      from pz_persist.tools import cli
      sys.stderr = sys.stdout
      code = cli.main(["convert", "hf", {str(folder)!r}, {str(tmp_path / 'out')!r}, "--quiet"])
      print("EXIT", code)
      """, timeout=120)
  assert "EXIT 2" in out and "num_hidden_layers" in out
  assert not (tmp_path / "out").exists()


# --- Gemma (Orbax) -----------------------------------------------------------


def _gemma(path):
  """A tiny Gemma 1 checkpoint in the official flat layout."""
  from pretrained import test_gemma  # pylint: disable=import-outside-toplevel

  return test_gemma.write(path, test_gemma.official_params(test_gemma.GEMMA1, gemma2=False))


_SET_SHAPE = """
import json, tensorstore as ts
def set_shape(path, shape, field="shape"):
  kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
  key = next(k for k in kv.list().result()
             if b"input_embedding" in k and k.endswith(b"/.zarray"))
  meta = json.loads(kv.read(key).result().value)
  meta[field] = shape
  kv.write(key, json.dumps(meta).encode()).result()
"""


@pytest.mark.parametrize("entry, field", [("load_gemma", "shape"), ("cli", "shape"),
                                          ("load_gemma", "chunks")])
def test_gemma_huge_declared_shape_is_refused_not_aborted(tmp_path, entry, field):
  """[2**20, 2**20] declared in TensorStore's metadata of a tiny checkpoint,
  as the array's shape or as its storage chunks (decoded whole): a
  PzPersistError, never SIGABRT, even with a bounded address space."""
  path = _gemma(tmp_path / "g")
  call = (f"pzp.pretrained.load_gemma({path!r}, preset={{'like': 'gemma_2b'}})"
          if entry == "load_gemma" else
          f"print('EXIT', cli.main(['convert', 'gemma', {path!r}, {str(tmp_path / 'o')!r},"
          " '--preset-like', 'gemma_2b', '--quiet']))")
  out = run_python(_SET_SHAPE + f"""
import resource, sys
import jax, pz_persist as pzp
from pz_persist import errors
from pz_persist.tools import cli
set_shape({path!r}, [2**20, 2**20], {field!r})
jax.devices()
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (vm + 8 * 2**30, resource.RLIM_INFINITY))
sys.stderr = sys.stdout
try:
  {call}
except errors.PzPersistError as e:
  print("REFUSED", e)
""", timeout=300)
  assert ("REFUSED" in out or "EXIT 2" in out) and "allocate" in out


def test_gemma_array_directory_linked_outside_is_refused(tmp_path):
  path = _gemma(tmp_path / "g")
  elsewhere = tmp_path / "elsewhere"
  os.rename(os.path.join(path, "d"), elsewhere)
  os.symlink(elsewhere, os.path.join(path, "d"))
  with pytest.raises(errors.UnsafeCheckpointError, match="outside the checkpoint"):
    pzp.pretrained.load_gemma(path, preset={"like": "gemma_2b"})


@pytest.mark.parametrize("metadata", ["[1, 2]", "{", '{"tree_metadata": 5}', "[" * 100_000],
                         ids=["list", "not_json", "tree_not_object", "deep"])
def test_gemma_malformed_orbax_metadata(tmp_path, metadata):
  path = _gemma(tmp_path / "g")
  with open(os.path.join(path, "_METADATA"), "w") as f:
    f.write(metadata)
  with pytest.raises(errors.PzPersistError, match="_METADATA") as info:
    pzp.pretrained.load_gemma(path, preset={"like": "gemma_2b"})
  assert str(path) in str(info.value)


def test_gemma_fifo_is_refused_without_blocking(tmp_path):
  path = _gemma(tmp_path / "g")
  os.unlink(os.path.join(path, "_METADATA"))
  os.mkfifo(os.path.join(path, "_METADATA"))
  out = run_python(f"""
      import pz_persist as pzp
      from pz_persist import errors
      try:
        pzp.pretrained.load_gemma({path!r}, preset={{"like": "gemma_2b"}})
      except errors.UnsafeCheckpointError as e:
        print("REFUSED", e)
      """, timeout=120)
  assert "REFUSED" in out and "FIFO" in out


@pytest.mark.parametrize("entry", [
    {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [1], "data_offsets": [0, "4"]},
    {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]},
    {"dtype": "F32", "shape": {"a": 1}, "data_offsets": [0, 4]},
    [1, 2],
])
def test_malformed_header_entries(tmp_path, entry):
  path = raw_safetensors(tmp_path / "x.safetensors", {"t": entry}, bytes(4))
  with pytest.raises(pretrained_errors.SafetensorsFormatError, match="x.safetensors.*'t'"):
    safetensors_io.SafetensorsFile(path)


def test_gemma_zero_sizes_are_refused(tmp_path):
  """Orbax will not save a zero-size array, but its metadata can declare one:
  a vocabulary of zero is a damaged checkpoint, said so, not a model."""
  path = _gemma(tmp_path / "g")
  namespace: dict = {}
  exec(_SET_SHAPE, namespace)  # pylint: disable=exec-used
  namespace["set_shape"](path, [0, 16])
  with pytest.raises(pzp.pretrained.gemma.GemmaCheckpointError, match="vocab_size") as info:
    pzp.pretrained.load_gemma(path, preset={"like": "gemma_2b"})
  assert str(path) in str(info.value)


def test_same_size_but_other_shape_is_refused(tmp_path, no_reads):
  """A tensor with the right number of elements in another layout would be
  reshaped into a silently different model: the exact shape is checked."""
  tensors = llama_tensors()
  tensors["model.layers.0.self_attn.q_proj.weight"] = np.ones((HIDDEN // 2, HEADS * HEAD_DIM * 2),
                                                               np.float32)
  folder = hf_folder(tmp_path / "f", tensors=tensors)
  with pytest.raises(pretrained_errors.SafetensorsFormatError, match="q_proj.*does not fit"):
    pzp.pretrained.load_hf(folder)


# --- mixtures of experts: per-expert tensors stacked by a view -------------

EXPERTS = 4
MIXTRAL = dict(CONFIG, model_type="mixtral", num_local_experts=EXPERTS, num_experts_per_tok=2)


def mixtral_tensors() -> dict[str, np.ndarray]:
  """`llama_tensors` with each layer's MLP replaced by Mixtral's experts."""
  rng = np.random.default_rng(1)
  tensors = {k: v for k, v in llama_tensors().items() if ".mlp." not in k}
  for i in range(LAYERS):
    s = f"model.layers.{i}.block_sparse_moe."
    tensors[s + "gate.weight"] = rng.normal(size=(EXPERTS, HIDDEN)).astype(np.float32)
    for e in range(EXPERTS):
      for part, shape in (("w1", (MLP, HIDDEN)), ("w3", (MLP, HIDDEN)), ("w2", (HIDDEN, MLP))):
        tensors[f"{s}experts.{e}.{part}.weight"] = rng.normal(size=shape).astype(np.float32)
  return tensors


def test_the_tiny_mixtral_is_valid(tmp_path):
  model = pzp.pretrained.load_hf(hf_folder(tmp_path / "ok", MIXTRAL, mixtral_tensors()))
  params = {p.label: p.value for p in pz.unbind_params(model)[1]}
  assert params["transformer/block_1/mlp/experts/down.weights"].named_shape == {
      "experts": EXPERTS, "embedding": HIDDEN, "neurons": MLP}


_EXPERT = "model.layers.1.block_sparse_moe.experts.2.w3.weight"


@pytest.mark.parametrize("change, match", [
    ("missing", f"{_EXPERT}' .a part of"),
    ("shape", f"{_EXPERT}.*must have one dtype and shape"),
    ("dtype", f"{_EXPERT}.*must have one dtype and shape"),
    ("both_layouts", "one layout or the other"),
    ("extra_expert", "num_local_experts.*experts \\[0, 1, 2, 3, 7\\]"),
])
def test_expert_tensors_are_checked_before_reading(tmp_path, no_reads, change, match):
  """Every part of a stacked view is checked against the headers (present,
  one dtype and shape, the folder holding one layout) and the expert count
  against the weights, before anything is built or read."""
  tensors = mixtral_tensors()
  if change == "missing":
    del tensors[_EXPERT]
  elif change == "shape":
    tensors[_EXPERT] = np.zeros((MLP + 1, HIDDEN), np.float32)
  elif change == "dtype":
    tensors[_EXPERT] = tensors[_EXPERT].astype(np.float16)
  elif change == "both_layouts":
    tensors["model.layers.0.block_sparse_moe.experts.w1.weight"] = np.zeros(
        (EXPERTS, MLP, HIDDEN), np.float32)
  else:
    tensors["model.layers.0.block_sparse_moe.experts.7.w1.weight"] = np.zeros(
        (MLP, HIDDEN), np.float32)
  folder = hf_folder(tmp_path / change, MIXTRAL, tensors)
  with pytest.raises(errors.PzPersistError, match=match):
    pzp.pretrained.load_hf(folder)


def test_huge_expert_count_fails_fast(tmp_path):
  """A config asking for 10**9 experts (per layer, per projection: the
  stacked views list every part) is refused from the weights' names before
  any list of parts is built."""
  qwen = {k.replace("block_sparse_moe", "mlp").replace(".w1.", ".gate_proj.").replace(
      ".w3.", ".up_proj.").replace(".w2.", ".down_proj."): v for k, v in mixtral_tensors().items()}
  folders = [str(hf_folder(tmp_path / name, config, tensors)) for name, config, tensors in (
      ("mixtral", dict(MIXTRAL, num_local_experts=10**9), mixtral_tensors()),
      ("qwen3_moe", dict(CONFIG, model_type="qwen3_moe", num_experts=10**9,
                         num_experts_per_tok=2, moe_intermediate_size=MLP), qwen))]
  out = run_python(f"""
      import pz_persist as pzp
      from pz_persist import errors
      for folder in {folders!r}:
        try:
          pzp.pretrained.load_hf(folder)
        except errors.PzPersistError as e:
          print("REFUSED", e)
      """, timeout=120)
  refusals = [line for line in out.splitlines() if line.startswith("REFUSED")]
  assert len(refusals) == 2, out
  assert all("1000000000" in r for r in refusals), out
