"""Stored tensors a Hugging Face folder holds that the model its config
describes never reads: `load_hf` refuses them (`UnreadTensorsError`, before
any tensor is read) unless the family declares them knowingly left out.

transformers only warns ("Some weights of the checkpoint were not used") and
drops them, so a ``q_proj.bias`` the config turns off, a layer past
``num_hidden_layers`` or a misspelled name gives a model other than the
files describe. Each class of case goes through every entry point that loads
a Hugging Face folder: ``pzp.pretrained.load_hf``, ``pzp.load_hf`` and
``pz-persist convert hf``; what a family declares left out (the vision tower
of a vision-language folder, rotary ``inv_freq`` buffers) still loads, and the
towers are reported. Folders are written with NumPy alone (the tiny Llama of
test_pretrained_hostile).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from penzai import pz

import pz_persist as pzp
from hostile.test_pretrained_hostile import CONFIG
from hostile.test_pretrained_hostile import HEAD_DIM
from hostile.test_pretrained_hostile import HEADS
from hostile.test_pretrained_hostile import HIDDEN
from hostile.test_pretrained_hostile import KV_HEADS
from hostile.test_pretrained_hostile import hf_folder
from hostile.test_pretrained_hostile import llama_tensors
from hostile.test_pretrained_hostile import no_reads  # noqa: F401  # pylint: disable=unused-import
from pz_persist import errors
from pz_persist.pretrained import errors as pretrained_errors
from pz_persist.pretrained.hf import unread
from pz_persist.tools import cli

_Q = HEADS * HEAD_DIM


def _with(**extra: np.ndarray) -> dict[str, np.ndarray]:
  return {**llama_tensors(), **extra}


def _zeros(*shape: int) -> np.ndarray:
  return np.zeros(shape, np.float32)


# Each class of unread tensor: (tensors, config changes, what the message must say).
REFUSED = {
    # attention_bias is false (absent): a bias stored anyway would be dropped.
    "extra_bias": (_with(**{"model.layers.0.self_attn.q_proj.bias": _zeros(_Q)}), {},
                   r"model\.layers\.0\.self_attn\.q_proj\.bias.*attention_bias"),
    "extra_mlp_bias": (_with(**{"model.layers.1.mlp.down_proj.bias": _zeros(HIDDEN)}), {},
                       r"mlp\.down_proj\.bias.*mlp_bias"),
    # A misspelled name beside the right one.
    "misspelled": (_with(**{"model.layers.0.self_attn.q_prj.weight": _zeros(_Q, HIDDEN)}), {},
                   r"'model\.layers\.0\.self_attn\.q_prj\.weight'"),
    # Another model's tensor, outside every prefix the family reads.
    "unknown_top_level": (_with(**{"score.weight": _zeros(2, HIDDEN)}), {}, r"'score\.weight'"),
    # A layer under a prefix the family does not count layers under.
    "extra_layer_elsewhere": (_with(**{"model.layer.2.mlp.up_proj.weight": _zeros(8, HIDDEN)}),
                              {}, r"'model\.layer\.2\.mlp\.up_proj\.weight'"),
    # Many: the first few named, and how many in all.
    "many": (_with(**{f"extra.{i}.weight": _zeros(2) for i in range(9)}), {},
             r"9 stored tensors.*'extra\.0\.weight'.*\(and 4 more\)"),
}


def _load_pretrained(path):
  return pzp.pretrained.load_hf(path)


def _load_top_level(path):
  return pzp.load_hf(path)


def _load_cli(path):
  """``pz-persist convert hf``: exit 2 and the message on stderr, nothing
  written; raised again as the error class the library raised."""
  out = path.parent / f"{path.name}-native"
  with pytest.raises(pretrained_errors.UnreadTensorsError) as info:
    pzp.pretrained.load_hf(path)
  import contextlib  # pylint: disable=import-outside-toplevel
  import io  # pylint: disable=import-outside-toplevel

  stderr = io.StringIO()
  with contextlib.redirect_stderr(stderr):
    code = cli.main(["convert", "hf", str(path), str(out), "--quiet"])
  assert code == 2 and not out.exists()
  assert str(info.value) in stderr.getvalue()
  raise info.value


ENTRY_POINTS = {"pretrained.load_hf": _load_pretrained, "pzp.load_hf": _load_top_level,
                "cli_convert": _load_cli}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_unread_tensor_is_refused_before_any_read(tmp_path, case, entry, no_reads):  # noqa: F811
  tensors, changes, match = REFUSED[case]
  folder = hf_folder(tmp_path / case, {**CONFIG, **changes}, tensors)
  with pytest.raises(pretrained_errors.UnreadTensorsError, match=match) as info:
    ENTRY_POINTS[entry](folder)
  message = str(info.value)
  assert isinstance(info.value, errors.PzPersistError)
  assert str(folder) in message and "config.json" in message
  assert "'llama' model" in message  # The model type whose model reads none of them.


def test_the_message_says_how_to_proceed(tmp_path):
  tensors, _, _ = REFUSED["extra_bias"]
  with pytest.raises(pretrained_errors.UnreadTensorsError) as info:
    pzp.pretrained.load_hf(hf_folder(tmp_path / "f", CONFIG, tensors))
  message = str(info.value)
  assert "1 stored tensor is read by no part" in message
  assert "set the field to what the files hold" in message
  assert "remove or rename them" in message
  assert "allow_unread=True" in message and "--allow-unread" in message


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_allow_unread_loads_without_them_and_names_them(tmp_path, case, caplog):
  """The user's way past the refusal (a Hub folder holding extras the
  family does not declare): the model the config describes, as if the
  tensors were absent, with a warning naming them; by the library and the
  CLI alike."""
  tensors, changes, _ = REFUSED[case]
  folder = hf_folder(tmp_path / case, {**CONFIG, **changes}, tensors)
  plain = pzp.pretrained.load_hf(hf_folder(tmp_path / "plain", {**CONFIG, **changes}))
  with caplog.at_level(logging.WARNING, "pz_persist.pretrained.hf"):
    model = pzp.load_hf(folder, allow_unread=True)
  said = " ".join(r.getMessage() for r in caplog.records)
  unread_names = sorted(set(tensors) - set(llama_tensors()))
  assert repr(unread_names[0]) in said and "as allow_unread=True asks" in said
  tokens = pz.nx.wrap(np.array([[1, 2, 3]]), "batch", "seq")
  np.testing.assert_array_equal(np.asarray(model(tokens).unwrap("batch", "seq", "vocabulary")),
                                np.asarray(plain(tokens).unwrap("batch", "seq", "vocabulary")))
  out = tmp_path / f"{case}-native"
  assert cli.main(["convert", "hf", str(folder), str(out), "--allow-unread", "--quiet"]) == 0
  assert out.exists()


def test_the_same_bias_with_a_config_that_says_so_loads(tmp_path):
  """The control: a config agreeing with the files (``attention_bias``)."""
  biases = {f"model.layers.{i}.self_attn.{p}_proj.bias": _zeros(n)
            for i in range(2) for p, n in (("q", _Q), ("k", KV_HEADS * HEAD_DIM),
                                           ("v", KV_HEADS * HEAD_DIM), ("o", HIDDEN))}
  config = {**CONFIG, "attention_bias": True}
  model = pzp.pretrained.load_hf(hf_folder(tmp_path / "f", config, _with(**biases)))
  labels = {p.label for p in pz.unbind_params(model)[1]}
  assert len([label for label in labels if label.endswith(".bias")]) == len(biases)


def test_a_layer_past_num_hidden_layers_is_refused(tmp_path, no_reads):  # noqa: F811
  """Under the prefix the family counts layers under, the count check says
  ``num_hidden_layers`` disagrees with the files (before this rule)."""
  extra = {name.replace("layers.1.", "layers.2."): value
           for name, value in llama_tensors().items() if ".layers.1." in name}
  folder = hf_folder(tmp_path / "f", CONFIG, _with(**extra))
  for entry in (_load_pretrained, _load_top_level):
    with pytest.raises(errors.UnsupportedConfigError, match="num_hidden_layers.*layers 0..2"):
      entry(folder)


@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.rotary_emb.inv_freq", "model.rotary_emb.inv_freq",
    "model.rotary_emb.original_inv_freq", "model.position_ids",
    "model.layers.0.norm.num_batches_tracked"])
def test_buffers_transformers_ignores_for_every_model_load(tmp_path, name, caplog):
  """Left out by every family (`unread.ANY_FAMILY`), silently as transformers."""
  plain = pzp.pretrained.load_hf(hf_folder(tmp_path / "plain"))
  with caplog.at_level(logging.WARNING, "pz_persist.pretrained.hf"):
    model = pzp.pretrained.load_hf(hf_folder(tmp_path / "f", CONFIG, _with(**{name: _zeros(2)})))
  assert not caplog.records
  tokens = pz.nx.wrap(np.array([[1, 2, 3]]), "batch", "seq")
  np.testing.assert_array_equal(np.asarray(model(tokens).unwrap("batch", "seq", "vocabulary")),
                                np.asarray(plain(tokens).unwrap("batch", "seq", "vocabulary")))


# --- a vision-language folder: the tower is declared left out -----------------


def _qwen2_vl(folder, extra=None):
  """A Qwen2-VL folder (transformers 5's names): the tiny Llama as its text
  model (with Qwen2's query/key/value biases) and a one-tensor vision tower."""
  text = {name.replace("model.", "model.language_model.", 1): value
          for name, value in llama_tensors().items()}
  for i in range(2):
    for p, n in (("q", _Q), ("k", KV_HEADS * HEAD_DIM), ("v", KV_HEADS * HEAD_DIM)):
      text[f"model.language_model.layers.{i}.self_attn.{p}_proj.bias"] = _zeros(n)
  text["model.visual.patch_embed.proj.weight"] = _zeros(4, 3)
  text["model.visual.merger.mlp.0.weight"] = _zeros(4, 4)
  config = {"model_type": "qwen2_vl", "tie_word_embeddings": False, "vision_config": {},
            "text_config": {**{k: v for k, v in CONFIG.items() if k != "model_type"},
                            "model_type": "qwen2_vl_text"}}
  return hf_folder(folder, config, {**text, **(extra or {})})


def test_a_declared_tower_loads_and_is_reported(tmp_path, caplog):
  with caplog.at_level(logging.WARNING, "pz_persist.pretrained.hf"):
    pzp.pretrained.load_hf(_qwen2_vl(tmp_path / "vl"))
  said = " ".join(r.getMessage() for r in caplog.records)
  assert "2 tensors of the vision tower and projector (model.visual.*) are not read" in said


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_an_unread_text_tensor_beside_a_declared_tower_is_refused(
    tmp_path, entry, no_reads):  # noqa: F811
  """The tower's declaration covers the tower only: a bias in the text model
  that its config turns off is refused (it was dropped silently before)."""
  folder = _qwen2_vl(tmp_path / "vl", {
      "model.language_model.layers.0.mlp.down_proj.bias": _zeros(HIDDEN)})
  with pytest.raises(pretrained_errors.UnreadTensorsError,
                     match=r"1 stored tensor is.*language_model\.layers\.0\.mlp\.down_proj\.bias"):
    ENTRY_POINTS[entry](folder)


# --- property: any name outside the plan and the declarations is refused -------

_PART = st.text("abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(_PART, min_size=1, max_size=5))
def test_any_extra_name_is_refused_unless_declared(tmp_path_factory, parts):
  """A generated name added to the tiny Llama folder: refused, naming it,
  unless the plan reads it or `unread.ANY_FAMILY` covers it (then the load
  gives the model without it)."""
  name = ".".join(parts)
  stored = llama_tensors()
  if name in stored:
    return
  folder = hf_folder(tmp_path_factory.mktemp("p"), CONFIG, {**stored, name: _zeros(2)})
  if any(left_out.covers(name) for left_out in unread.ANY_FAMILY):
    pzp.pretrained.load_hf(folder)
    return
  with pytest.raises(pretrained_errors.UnreadTensorsError) as info:
    pzp.pretrained.load_hf(folder)
  assert repr(name) in str(info.value)
