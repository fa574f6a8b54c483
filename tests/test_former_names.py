"""The recorded table of former class names (`pz_persist.format.former_names`).

What the table promises by construction rests on what it holds: every
entry names an existing class of an allowed module under its current name,
no current name is itself a former name (one lookup reaches the end: no
chain, no loop), every former name is one no module defines today, and
every name is public. These tests hold each of those true as moves are
added.
"""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest
from penzai import pz

import pz_persist as pzp
import pz_persist.nn
from pz_persist.format import code_references
from pz_persist.format import former_names
from pz_persist.safety import allowlist


def test_each_current_name_is_the_class_itself_in_an_allowed_module():
  for former, (module, qualname) in former_names.FORMER_NAMES.items():
    cls = vars(importlib.import_module(module))[qualname]
    assert isinstance(cls, type) and issubclass(cls, pz.Struct), former
    assert (cls.__module__, cls.__qualname__) == (module, qualname), former
    assert allowlist.is_allowed(module) and allowlist.may_import(module), former
    assert code_references.class_reference(cls, where="t") == {
        "module": module, "qualname": qualname}


def test_no_current_name_is_a_former_name_so_nothing_chains():
  currents = set(former_names.FORMER_NAMES.values())
  assert not currents & set(former_names.FORMER_NAMES), "a move must point at the newest home"


def test_former_names_are_public_dotted_names_no_module_defines():
  for module, qualname in former_names.FORMER_NAMES:
    assert allowlist.DOTTED_NAME.match(module) and allowlist.DOTTED_NAME.match(qualname)
    assert code_references.private_part(qualname) is None
    assert allowlist.refused_part(module) is None
    with pytest.raises(ModuleNotFoundError):
      importlib.import_module(module)


def test_every_move_is_dated_and_names_its_release():
  for move in former_names.MOVES:
    assert move.qualnames and len(set(move.qualnames)) == len(move.qualnames), move
    assert move.release.count(".") == 2 and len(move.date) == 10, move


ADDED_AFTER_THE_MOVE = frozenset({
    ("pz_persist.nn.learned_positions", "AddLearnedPositions"),  # GPT-2 and OPT (issue 40).
    ("pz_persist.nn.clip_values", "ClipValues"),  # OLMoE's clip_qkv (issue 40).
    ("pz_persist.nn.mamba2", "Mamba2"),  # The state-space hybrids (issue 40).
    ("pz_persist.nn.mamba2", "CachingMamba2"),
    ("pz_persist.nn.short_conv", "ShortConv"),  # LFM2 (issue 40).
    ("pz_persist.nn.short_conv", "CachingShortConv"),
    ("pz_persist.nn.xielu", "XIELU"),  # Apertus (issue 40).
    ("pz_persist.nn.recurrent_state", "CachingRecurrent"),  # Stateful layers' sampling form.
    ("pz_persist.nn.recurrent_state", "Recurrent"),
    ("pz_persist.nn.longrope", "ApplyPhimoeLongRoPE"),  # Phi-3.5-MoE (issue 40).
    ("pz_persist.nn.mixture_of_experts", "SparseMixerRouter"),
    ("pz_persist.nn.mamba2", "FalconH1Mamba2"),  # Falcon-H1 (issue 40).
    ("pz_persist.nn.mixture_of_experts", "LatentMixtureOfExperts"),  # Nemotron-H (issue 40).
    ("pz_persist.nn.altup", "AltUpExpand"),  # Gemma 3n (issue 40).
    ("pz_persist.nn.altup", "AltUpCollapse"),
    ("pz_persist.nn.altup", "AltUpRouter"),
    ("pz_persist.nn.altup", "AltUpLayer"),
    ("pz_persist.nn.altup", "LaurelResidual"),
    ("pz_persist.nn.altup", "GaussianTopK"),
    ("pz_persist.nn.per_layer_inputs", "PerLayerInputsInTable"),
    ("pz_persist.nn.kimi_delta_attention", "KimiDeltaAttention"),  # Kimi-Linear (issue 40).
    ("pz_persist.nn.kimi_delta_attention", "CachingKimiDeltaAttention"),
    ("pz_persist.nn.sparse_attention", "AppendIndexKey"),  # DeepSeek-V3.2 (issue 40).
    ("pz_persist.nn.sparse_attention", "IndexedQuery"),
    ("pz_persist.nn.sparse_attention", "IndexerScores"),
    ("pz_persist.nn.sparse_attention", "SparseAttentionLogits"),
    ("pz_persist.nn.sparse_attention", "PublishingSparseAttentionLogits"),  # GLM-5 (issue 40).
    ("pz_persist.nn.sparse_attention", "SharedChoiceLogits"),
    ("pz_persist.nn.latent_attention", "SizedPick"),
    ("pz_persist.nn.mamba", "Mamba"),  # Jamba (issue 40).
    ("pz_persist.nn.mamba", "CachingMamba"),
})
"""Classes of ``pz_persist.nn`` born there, after the move: no former name."""


def test_the_layers_move_covers_every_public_class_of_nn():
  """Every class of ``pz_persist.nn`` that existed before the move has its
  former name recorded; a class added since is listed as such, and has none."""
  moved = {
      (now_module, qualname)
      for (former, qualname), (now_module, _) in former_names.FORMER_NAMES.items()
      if former.startswith("pz_persist.pretrained.layers.")
  }
  defined = set()
  for info in pkgutil.iter_modules(pz_persist.nn.__path__, prefix="pz_persist.nn."):
    for name, value in vars(importlib.import_module(info.name)).items():
      if isinstance(value, type) and value.__module__ == info.name and not name.startswith("_"):
        defined.add((info.name, value.__qualname__))
  assert defined - ADDED_AFTER_THE_MOVE == moved
  assert ADDED_AFTER_THE_MOVE <= defined and not ADDED_AFTER_THE_MOVE & moved


def test_the_table_is_read_only_and_only_translates_exact_names():
  assert isinstance(former_names.FORMER_NAMES, types.MappingProxyType)
  with pytest.raises(TypeError):
    former_names.FORMER_NAMES[("a", "b")] = ("c", "d")  # type: ignore[index]
  old = "pz_persist.pretrained.layers.constant_scale"
  assert former_names.current_name(old, "ConstantScale") == (
      "pz_persist.nn.constant_scale", "ConstantScale")
  for name in [(old, "ConstantScale.by"), (old, "constantscale"), (old + "s", "ConstantScale"),
               ("pz_persist.pretrained.layers", "ConstantScale"), (old, "NoSuch")]:
    assert former_names.current_name(*name) == name
    assert not former_names.is_former(*name)


def test_saving_writes_the_current_name(tmp_path):
  from pz_persist.nn.constant_scale import ConstantScale  # pylint: disable=import-outside-toplevel

  pzp.save_model(tmp_path / "m", pz.nn.Sequential([ConstantScale(by=2.0)]))
  text = next((tmp_path / "m").rglob("pz_persist.json")).read_text()
  assert "pz_persist.nn.constant_scale" in text and "pretrained" not in text
