"""The hints of a checkpoint that does not fit the model, exactly as shown.

A ``rename=`` is suggested only when one change of label prefix explains
most of the mismatch (it is then followed, to check it works); a checkpoint
sharing none or few labels with the model is asked about instead (is it
this model's?), with how many labels each has, never given a rename guessed
from a few similar endings.
"""

from __future__ import annotations

import jax.numpy as jnp
import model_zoo
import pytest
from penzai import pz

import pz_persist as pzp
from pz_persist import errors

_ASK = (" and no one change of label prefix explains the difference: is this the checkpoint"
        " of this model? `pz-persist inspect PATH` lists its labels and the class it was"
        " saved from.")


def _params(*labels):
  return [pz.Parameter(value=pz.nx.wrap(jnp.arange(2.0)).tag("x"), label=label)
          for label in labels]


def _hints(tmp_path, saved, model, **options):
  pzp.save(tmp_path / "ck", [p.freeze() for p in _params(*saved)], overwrite=True)
  with pytest.raises(errors.BindingError) as raised:
    pzp.load_into(tmp_path / "ck", _params(*model), **options)
  return [line for line in str(raised.value).splitlines() if line.startswith("hint:")]


def test_another_models_checkpoint_is_asked_about_not_renamed(tmp_path):
  pzp.save_model(tmp_path / "llama", model_zoo.llamalike_transformer())
  with pytest.raises(errors.BindingError) as raised:
    pzp.load_into(tmp_path / "llama", model_zoo.mlp())
  message = str(raised.value)
  assert "rename=" not in message
  assert message.splitlines()[-1] == (
      "hint: the checkpoint has 21 label(s) and the model 4, none of them in both," + _ASK)


def test_few_labels_in_common_are_asked_about(tmp_path):
  assert _hints(tmp_path, ["a/w", "b/x", "c/y", "d/z"], ["a/w", "q/1", "r/2", "s/3"]) == [
      "hint: the checkpoint has 4 label(s) and the model 4, only 1 of them in both," + _ASK]


def test_a_prefix_change_explaining_a_minority_is_not_suggested(tmp_path):
  assert _hints(tmp_path, ["x/a", "p/1", "p/2", "p/3"], ["y/a", "q/9", "r/8", "s/7"]) == [
      "hint: the checkpoint has 4 label(s) and the model 4, none of them in both," + _ASK]


def test_a_prefix_change_explaining_most_is_suggested_and_works(tmp_path):
  saved, model = ["x/a", "x/b", "x/c", "p/1"], ["y/a", "y/b", "y/c", "p/1", "q/9"]
  assert _hints(tmp_path, saved, model) == [
      "hint: 3 label(s) not in the model match missing ones once their prefix 'x/' becomes"
      " 'y/': load_into(path, model, rename={'^x/': 'y/'})"]
  loaded, report = pzp.load_into(tmp_path / "ck", _params(*model), rename={"^x/": "y/"},
                                 strict=False)
  assert set(report.loaded) == {"y/a", "y/b", "y/c", "p/1"} and report.missing == ("q/9",)
  assert len(loaded) == 5


def test_an_overlay_sharing_nothing_is_asked_about(tmp_path):
  assert _hints(tmp_path, ["a/1", "a/2"], ["b/1", "c/1"], overlay=True) == [
      "hint: the checkpoint has 2 label(s), none of them in the model," + _ASK]


def test_a_near_fit_gets_no_hint(tmp_path):
  assert _hints(tmp_path, ["a", "b", "c", "d"], ["a", "b", "c", "e"]) == []
