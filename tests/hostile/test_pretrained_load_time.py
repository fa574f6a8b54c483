"""What a pretrained model's math and files need is checked when it loads.

A model `load_hf` returns can be called: RoPE settings each valid on their
own but breaking the math together (yarn with ``rope_theta: 1`` divided by
``log(1)`` on the first call) are refused while loading, naming
``config.json``. A safetensors header declaring what no array can be (rank
100, a zero-size tensor of astronomically many elements) is a
`SafetensorsFormatError` naming the file and tensor, from every reader. An
index entry that is not a plain file name is refused naming
``model.safetensors.index.json``. All before any tensor is read.
"""

from __future__ import annotations

import dataclasses
import json

import hypothesis
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python
from hypothesis import strategies as st
from penzai import pz

import pz_persist as pzp
from hostile.test_pretrained_hostile import CONFIG
from hostile.test_pretrained_hostile import hf_folder
from hostile.test_pretrained_hostile import no_reads  # noqa: F401  # pylint: disable=unused-import
from hostile.test_pretrained_hostile import raw_safetensors
from pz_persist.pretrained import errors
from pz_persist.pretrained import safetensors_io
from pz_persist.nn import scaled_rope

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
TOKENS = pz.nx.wrap(jnp.array([[1, 2, 3, 4, 5, 6, 7, 8] * 8])).tag("batch", "seq")

# --- RoPE: the math, at load time ---------------------------------------------

BROKEN_ROPE = {
    "yarn-theta-1": dict(CONFIG, rope_theta=1, rope_scaling=YARN),
    "yarn-theta-1-transformers-5": dict(
        {k: v for k, v in CONFIG.items() if k != "rope_theta"},
        rope_parameters=dict(YARN, rope_theta=1.0)),
    "yarn-huge-mscale": dict(CONFIG, rope_scaling=dict(YARN, mscale=1e300, mscale_all_dim=1e-300)),
    "theta-underflows-float32": dict(CONFIG, rope_theta=1e-300),
    "linear-factor-underflows": dict(CONFIG, rope_scaling={"rope_type": "linear", "factor": 1e-300}),
    "dynamic-factor-overflows": dict(
        CONFIG, rope_scaling={"rope_type": "dynamic", "factor": 1e300}),
}


@pytest.mark.parametrize("config", BROKEN_ROPE.values(), ids=BROKEN_ROPE)
def test_rope_that_cannot_be_computed_is_refused_at_load(tmp_path, no_reads, config):  # noqa: F811
  folder = hf_folder(tmp_path / "f", config)
  with pytest.raises(errors.UnsupportedConfigError,
                     match=r"config\.json: rope_theta=.*cannot be computed for a rotated head"
                           r" size of 4") as info:
    pzp.pretrained.load_hf(folder)
  assert str(folder) in str(info.value)


VALID_ROPE = {
    "yarn-theta-below-1": dict(CONFIG, rope_theta=0.5, rope_scaling=YARN),
    "yarn-theta-just-above-1": dict(CONFIG, rope_theta=1.0000001, rope_scaling=YARN),
    "yarn-mscale": dict(CONFIG, rope_scaling=dict(YARN, mscale=1.0, mscale_all_dim=0.5)),
    "theta-huge": dict(CONFIG, rope_theta=1e30),
    "dynamic": dict(CONFIG, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                    max_position_embeddings=16),
    "llama3": dict(CONFIG, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1e-30, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 32}),
}


@pytest.mark.parametrize("config", VALID_ROPE.values(), ids=VALID_ROPE)
def test_rope_near_the_edges_loads_and_computes(tmp_path, config):
  """What loads can be called, and gives finite logits (longer than
  ``max_position_embeddings``, so dynamic scaling takes effect)."""
  model = pzp.pretrained.load_hf(hf_folder(tmp_path / "f", config))
  logits = np.asarray(model(TOKENS).unwrap("batch", "seq", "vocabulary"))
  assert np.all(np.isfinite(logits))


@pytest.mark.parametrize("layer, size, match", [
    (pz.nn.ApplyRoPE(embedding_axis="projection", max_wavelength=1e4, positions_input_name="p"),
     3, "must be even"),
    (pz.nn.ApplyRoPEToSubset(embedding_axis="projection", max_wavelength=1e4,
                             rope_subset_size=5, positions_input_name="p"), 8, "of 5: .*even"),
    (scaled_rope.ApplyScaledRoPE(embedding_axis="projection", max_wavelength=1e4,
                                 positions_input_name="p", rope_type="dynamic", factor=2.0,
                                 max_position_embeddings=16), 2, "dim / \\(dim - 2\\)"),
])
def test_rotated_sizes_the_math_cannot_take(layer, size, match):
  """Odd rotated sizes (rotated in halves) and dynamic scaling of 2 dimensions."""
  with pytest.raises(errors.UnsupportedConfigError, match=match):
    scaled_rope.check_computable(pz.nn.Sequential([layer]), {"projection": {size}}, "config.json")
  if isinstance(layer, pz.nn.ApplyRoPEToSubset):  # Its own size, whatever the head's.
    layer = dataclasses.replace(layer, rope_subset_size=4)
  scaled_rope.check_computable(pz.nn.Sequential([layer]), {"projection": {16}}, "config.json")


def test_cli_convert_refuses_rope_that_cannot_be_computed(tmp_path):
  folder = hf_folder(tmp_path / "f", BROKEN_ROPE["yarn-theta-1"])
  out = run_python(f"""
      import sys
      from pz_persist.tools import cli
      sys.stderr = sys.stdout
      print("EXIT", cli.main(["convert", "hf", {str(folder)!r}, {str(tmp_path / 'out')!r},
                              "--quiet"]))
      """, timeout=120)
  assert "EXIT 2" in out and "config.json: rope_theta=1" in out, out
  assert not (tmp_path / "out").exists()


# --- safetensors headers: what no array can be --------------------------------

IMPOSSIBLE_SHAPES = {
    "rank-100": [1] * 100,
    "rank-65": [1] * 65,
    "zero-size-huge": [0, 2**62, 2**62],
    "zero-size-one-huge-dim": [0, 2**63],
    "zero-size-past-int64": [2**64, 0],
}


def _zero_size(path, shape, extra: dict | None = None):
  header = {"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}
  return raw_safetensors(path, dict(header, **(extra or {})), b"")


@pytest.mark.parametrize("shape", IMPOSSIBLE_SHAPES.values(), ids=IMPOSSIBLE_SHAPES)
def test_impossible_shapes_in_a_safetensors_header(tmp_path, shape):
  path = _zero_size(tmp_path / "x.safetensors", shape if shape[0] == 1 else shape)
  if shape[0] == 1:  # Rank 100 of one element: give it its 4 bytes.
    header = {"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4]}}
    path = raw_safetensors(tmp_path / "x.safetensors", header, bytes(4))
  with pytest.raises(errors.SafetensorsFormatError, match=r"x\.safetensors, tensor 't',"):
    safetensors_io.SafetensorsFile(path)


@pytest.mark.parametrize("shape", IMPOSSIBLE_SHAPES.values(), ids=IMPOSSIBLE_SHAPES)
def test_impossible_shapes_through_load_safetensors(tmp_path, shape):
  """An export (pz_persist metadata and all) whose header was edited."""
  meta = {"format_version": 1, "tensors": {"t": {"label": "t", "axes": None,
                                                 "kind": "parameter"}}}
  nbytes = 4 if shape[0] == 1 else 0
  path = raw_safetensors(tmp_path / "x.safetensors", {
      "__metadata__": {"pz_persist": json.dumps(meta)},
      "t": {"dtype": "F32", "shape": shape, "data_offsets": [0, nbytes]}}, bytes(nbytes))
  with pytest.raises(errors.SafetensorsFormatError, match=r"x\.safetensors, tensor 't',"):
    pzp.pretrained.load_safetensors(path)


def test_impossible_shape_through_load_hf(tmp_path, no_reads):  # noqa: F811
  folder = hf_folder(tmp_path / "f")
  file = safetensors_io.SafetensorsFile(folder / "model.safetensors")
  header = {name: {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, end]}
            for name, (_, shape, begin, end) in file.entries.items()}
  header["extra"] = {"dtype": "F32", "shape": [0, 2**62, 2**62],
                     "data_offsets": [file.entries[next(iter(file.entries))][2]] * 2}
  data = (folder / "model.safetensors").read_bytes()[file._data_start:]  # pylint: disable=protected-access
  raw_safetensors(folder / "model.safetensors", header, data)
  with pytest.raises(errors.SafetensorsFormatError, match=r"model\.safetensors, tensor 'extra',"):
    pzp.pretrained.load_hf(folder)


# --- the index file: plain file names only ---------------------------------------

BAD_NAMES = ["..", ".", "", "/etc/passwd", "sub/model.safetensors", "..\\model.safetensors",
             "model.safetensors\0", 5, None, ["model.safetensors"]]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_index_entries_must_be_plain_file_names(tmp_path, no_reads, name):  # noqa: F811
  folder = hf_folder(tmp_path / "f")
  (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
      "model.embed_tokens.weight": "model.safetensors", "model.norm.weight": name}}))
  with pytest.raises(errors.SafetensorsFormatError,
                     match=r"model\.safetensors\.index\.json: tensor 'model\.norm\.weight' maps"
                           r" to .*not the name of a file"):
    pzp.pretrained.load_hf(folder)


@pytest.mark.parametrize("first", [True, False], ids=["first_mention", "later_mention"])
def test_index_must_put_each_tensor_where_it_is(tmp_path, no_reads, first):  # noqa: F811
  """A tensor the index puts in a file that does not hold it is refused,
  whether it is that file's first mention (the file is opened then) or a
  later one (the file already open)."""
  folder = hf_folder(tmp_path / "f")
  weight_map = {"model.embed_tokens.weight": "model.safetensors",
                "model.layers.99.mlp.up_proj.weight": "model.safetensors"}
  if first:
    weight_map = dict(reversed(list(weight_map.items())))
  (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  with pytest.raises(errors.SafetensorsFormatError,
                     match=r"index\.json puts tensor 'model\.layers\.99\.mlp\.up_proj\.weight'"
                           r" in .*model\.safetensors, which does not hold it"):
    pzp.pretrained.load_hf(folder)


def test_cli_convert_names_the_index(tmp_path):
  folder = hf_folder(tmp_path / "f")
  (folder / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {"model.norm.weight": ".."}}))
  out = run_python(f"""
      import sys
      from pz_persist.tools import cli
      sys.stderr = sys.stdout
      print("EXIT", cli.main(["convert", "hf", {str(folder)!r}, {str(tmp_path / 'out')!r},
                              "--quiet"]))
      """, timeout=120)
  assert "EXIT 2" in out and "model.safetensors.index.json" in out, out


EXTREMES = [1e-300, 1e-30, 0.5, 1, 1.0000001, 2.0, 32.0, 1e4, 1e19, 1e30, 1e39, 1e300]


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(
    rope_type=st.sampled_from(["default", "linear", "dynamic", "llama3", "yarn"]),
    theta=st.sampled_from(EXTREMES), factor=st.sampled_from(EXTREMES),
    extra=st.fixed_dictionaries({}, optional={
        "attention_factor": st.sampled_from(EXTREMES), "beta_fast": st.sampled_from(EXTREMES),
        "beta_slow": st.sampled_from(EXTREMES), "mscale": st.sampled_from(EXTREMES),
        "mscale_all_dim": st.sampled_from(EXTREMES)}),
    low=st.sampled_from(EXTREMES), high=st.sampled_from(EXTREMES),
)
def test_whatever_loads_can_be_called(tmp_path_factory, rope_type, theta, factor, extra, low,
                                      high):
  """Any RoPE settings the schema admits: refused at load, or finite logits."""
  scaling = {"rope_type": rope_type, "factor": factor}
  if rope_type in ("llama3", "yarn"):
    scaling["original_max_position_embeddings"] = 16
  if rope_type == "llama3":
    scaling.update(low_freq_factor=low, high_freq_factor=high)
  if rope_type == "yarn":
    scaling.update(extra)
  config = dict(CONFIG, rope_theta=theta, max_position_embeddings=32)
  if rope_type != "default":
    config["rope_scaling"] = scaling
  folder = hf_folder(tmp_path_factory.mktemp("f"), config)
  try:
    model = pzp.pretrained.load_hf(folder)
  except errors.UnsupportedConfigError:
    return
  logits = np.asarray(model(TOKENS).unwrap("batch", "seq", "vocabulary"))
  assert np.all(np.isfinite(logits)), config
